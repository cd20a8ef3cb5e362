"""The package's shape: no import circles, small modules, no reach into another module's private names,
no pointer to a document outside the repository.

Each rule is checked by a function that takes the package's sources, so the tests below also show each
check catching a made-up offender.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ddtree"
MAX_LINES = 500
EXEMPT_FROM_SIZE = ("kernels",)  # Triton kernels keep a kernel beside its torch reference


def sources(package: Path = PACKAGE) -> dict[str, str]:
    """Dotted module name -> source, for every module under `package`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path.read_text()
    return found


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_statements(tree: ast.Module) -> Iterable[ast.stmt]:
    """Statements run at import time, minus `if TYPE_CHECKING:` blocks (never run)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" in test:
                pending.extend(node.orelse)
                continue
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        else:
            yield node


def import_graph(modules: Mapping[str, str], at_import_time: bool = True) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at import time only, by default)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        tree = ast.parse(source)
        nodes = _top_level_statements(tree) if at_import_time else ast.walk(tree)
        is_package = any(other.startswith(name + ".") for other in modules)
        for node in nodes:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, is_package)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def oversized(modules: Mapping[str, str], limit: int = MAX_LINES) -> list[str]:
    return [f"{name}: {source.count(chr(10))} lines" for name, source in modules.items()
            if source.count("\n") > limit and not any(part in EXEMPT_FROM_SIZE for part in name.split("."))]


def _private_names_defined(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, assignments and `self._x = ...` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reach_ins(modules: Mapping[str, str]) -> list[str]:
    """Uses of an underscore name that another of the package's modules defines and this one does not.

    `from m import _x`, `m._x` and `obj._x` all count; a name the module defines itself (its own class's
    `self._x`) does not, nor third-party internals (not defined anywhere in the package).
    """
    trees = {name: ast.parse(source) for name, source in modules.items()}
    defined = {name: _private_names_defined(tree) for name, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for name, names in defined.items():
        for private in names:
            owners.setdefault(private, set()).add(name)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            used: list[str] = []
            if isinstance(node, ast.ImportFrom):
                used = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                used = [node.attr]
            for private in used:
                others = owners.get(private, set()) - {name}
                if others and private not in defined[name]:
                    found.append(f"{name}:{node.lineno} uses {private} (defined in {', '.join(sorted(others))})")
    return found


# The repository stands alone (docs/architecture.md, "The house rules"): a document it names is in it, and
# no relative path climbs out of it. Generic rules, so this file names no outside document itself.
DOC_NAME = re.compile(r"\b[A-Z][A-Z0-9_]+\.md\b")  # a document by its conventional name (README.md)
CLIMB = re.compile(r"(?:\.\./)+[\w.-]+")  # ../x, ../../y/z
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ""}
SKIP_PARTS = {".git", ".venv", "results", "__pycache__", ".whl", ".dev", "node_modules"}


def text_files(root: Path) -> list[Path]:
    """The repository's text files, without virtual environments, results and caches."""
    return [path for path in sorted(root.rglob("*"))
            if path.is_file() and path.suffix in TEXT_SUFFIXES
            and not any(part in SKIP_PARTS or part.endswith(".egg-info") for part in path.relative_to(root).parts)]


def outside_references(root: Path) -> list[str]:
    """Lines that name a document the repository does not hold, or a relative path that leaves it."""
    files = text_files(root)
    names = {path.name for path in root.rglob("*.md")}
    found = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            missing = [name for name in DOC_NAME.findall(line) if name not in names]
            leaving = [climb for climb in CLIMB.findall(line)
                       if not (path.parent / climb).resolve().is_relative_to(root.resolve())]
            if missing or leaving:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:100]}")
    return found


def test_no_import_circles() -> None:
    """Not at import time, nor through the imports inside functions that keep heavy modules lazy."""
    for at_import_time in (True, False):
        found = circles(import_graph(sources(), at_import_time))
        assert not found, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_over_500_lines_outside_kernels() -> None:
    assert not oversized(sources()), "split by idea: " + "; ".join(oversized(sources()))


def test_no_module_uses_another_modules_private_names() -> None:
    found = private_reach_ins(sources())
    assert not found, "give the name a public spelling or move the code: " + "; ".join(found)


def test_no_test_module_uses_another_test_modules_private_names() -> None:
    """Helpers shared between test files have public names. (A test may look inside the module it tests.)"""
    modules = sources()
    for path in sorted((REPO / "tests").rglob("*.py")):
        modules["tests." + ".".join(path.relative_to(REPO / "tests").with_suffix("").parts)] = path.read_text()
    found = [f for f in private_reach_ins(modules)
             if f.startswith("tests.") and f.split("(defined in ")[1].startswith("tests.")]
    assert not found, "give the shared helper a public name: " + "; ".join(found)


def test_nothing_points_at_a_document_outside_the_repository() -> None:
    found = outside_references(REPO)
    assert not found, "the repository stands alone; put what the code relies on in docs/: " + "; ".join(found)


COMMAND = re.compile(r"python -m (ddtree(?:\.[a-z_]+)+)")


def missing_commands(root: Path) -> list[str]:
    """`python -m ddtree.<module>` commands in the README and docs/ whose module is not in the package."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for module in sorted(set(COMMAND.findall(path.read_text()))):
            file = root / Path(*module.split("."))
            if not (file.with_suffix(".py").is_file() or (file / "__main__.py").is_file()):
                found.append(f"{path.relative_to(root)}: python -m {module}")
    return found


def test_every_command_the_docs_name_is_a_module_of_the_package() -> None:
    found = missing_commands(REPO)
    assert not found, "the docs name modules that are not there: " + "; ".join(found)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    fake = {
        "pkg": "",
        "pkg.a": "from pkg.b import helper\n",
        "pkg.b": "import pkg.a\n\ndef helper():\n    pass\n",
        "pkg.c": "from pkg.d import _hidden\nimport pkg.d\nx = pkg.d._other\n",
        "pkg.d": "def _hidden():\n    pass\n_other = 1\n",
        "pkg.e": "class E:\n    def __init__(self):\n        self._mine = 1\n    def f(self, o):\n"
                 "        return self._mine + o._own + o._rootpath\n",
        "pkg.f": "class F:\n    def __init__(self):\n        self._own = 1\n",
        "pkg.g": "if TYPE_CHECKING:\n    import pkg.h\n",
        "pkg.h": "import pkg.g\n",
        "pkg.big": "x = 1\n" * 501,
        "pkg.kernels.big": "x = 1\n" * 501,
    }
    assert circles(import_graph(fake)) == [["pkg.a", "pkg.b"]]
    assert circles(import_graph(fake, at_import_time=False)) == [["pkg.a", "pkg.b"], ["pkg.g", "pkg.h"]]
    reach = private_reach_ins(fake)
    assert [r.split(" ")[0:3] for r in reach] == [["pkg.c:1", "uses", "_hidden"], ["pkg.c:3", "uses", "_other"],
                                                  ["pkg.e:5", "uses", "_own"]]
    assert oversized(fake) == ["pkg.big: 501 lines"]
    (tmp_path / "docs").mkdir()
    absent, climb = "see NOTES" + ".md", "see ..//../notes/x".replace("//", "/")  # built so this file passes its own check
    (tmp_path / "docs" / "a.md").write_text(f"see README.md and ../README.md\n{absent}\n{climb}\n")
    (tmp_path / "README.md").write_text("")
    assert outside_references(tmp_path) == [f"docs/a.md:2: {absent}", f"docs/a.md:3: {climb}"]
    (tmp_path / "README.md").write_text("run `python -m ddtree.bench` or `python -m ddtree.pkg.tool --x`\n")
    (tmp_path / "ddtree" / "pkg").mkdir(parents=True)
    (tmp_path / "ddtree" / "pkg" / "tool.py").write_text("")
    assert missing_commands(tmp_path) == ["README.md: python -m ddtree.bench"]
