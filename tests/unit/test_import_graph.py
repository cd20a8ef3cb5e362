"""No import circles in the ddtree package: an AST walk over every import, wherever it stands.

An import inside a function or under `if TYPE_CHECKING:` counts like one at the top: each is a module a
reader must hold to read this one, and a circle of them is a knot in the layout even when Python
resolves it at run time (an engine that imports the budget module that imports the engine).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ddtree"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package rooted at `root` (a package's own: its __init__)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` (at `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y / from .. import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import a.b.c of a module a.b (c: a name in it)
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def import_circle(root: Path) -> list[str] | None:
    """One circle of imports among the package's modules (as a path a -> b -> ... -> a), or None."""
    try:
        graphlib.TopologicalSorter(import_graph(root)).prepare()
    except graphlib.CycleError as err:
        return list(reversed(err.args[1]))
    return None


def test_ddtree_has_no_import_circle() -> None:
    graph = import_graph(PACKAGE)
    assert "ddtree.engine" in graph and "ddtree.decode" in graph["ddtree.engine"], "the walk missed the engine"
    circle = import_circle(PACKAGE)
    assert circle is None, f"import circle: {' -> '.join(circle or [])}"


@pytest.mark.parametrize(("importer", "line"), [
    pytest.param("a.py", "from pkg.b import B\n", id="top-level"),
    pytest.param("a.py", "def f():\n    from pkg import b\n", id="inside-a-function"),
    pytest.param("a.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n", id="type-only"),
    pytest.param("a.py", "from . import b\n", id="relative"),
    pytest.param("a.py", "import pkg.b\n", id="plain-import"),
])
def test_a_circle_is_found_wherever_its_import_stands(tmp_path: Path, importer: str, line: str) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "b.py").write_text("from pkg.a import A\nB = 1\n")
    (pkg / "c.py").write_text("from pkg.b import B\n")  # not in the circle
    (pkg / importer).write_text(line + "A = 1\n")
    circle = import_circle(pkg)
    assert circle is not None and set(circle) == {"pkg.a", "pkg.b"}, f"found {circle}"
    (pkg / importer).write_text("A = 1\n")
    assert import_circle(pkg) is None
