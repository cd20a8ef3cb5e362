"""ddtree.profiling stands apart from the rest of the package: nothing else imports it, and its tools share one
module of flags (ddtree.profiling.flags), each tool's parser built from it."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.profiling import flags

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ddtree"
PROFILING = PACKAGE / "profiling"


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module `path` (a file under `root`) imports, at the top or inside a function, as dotted names."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from ddtree import profiling`
    return found


def tool_names() -> list[str]:
    """The modules of ddtree/profiling/ that run as `python -m`: those with a __main__ block."""
    return sorted(p.stem for p in PROFILING.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


TOOLS = tool_names()


def test_nothing_outside_the_profiling_package_imports_it() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PROFILING in path.parents:
            continue
        hits = sorted(m for m in imported_modules(path) if m == "ddtree.profiling" or m.startswith("ddtree.profiling."))
        if hits:
            offenders.append(f"{path.relative_to(REPO)}: {', '.join(hits)}")
    assert not offenders, "the sweep and the engine must not import the profiling tools:\n" + "\n".join(offenders)


def test_the_import_scan_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    probe = tmp_path / "ddtree" / "suite" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import os\n\ndef f():\n    from ddtree.profiling.flags import tool_parser\n\n"
                     "def g():\n    from .. import profiling\n")
    found = imported_modules(probe, root=tmp_path)
    assert {"os", "ddtree.profiling.flags", "ddtree.profiling"} <= found


def test_the_package_docstring_lists_every_tool_once() -> None:
    import ddtree.profiling

    listed = re.findall(r"^    (\w+) {2,}", ddtree.profiling.__doc__ or "", flags=re.MULTILINE)
    assert sorted(listed) == TOOLS, f"ddtree/profiling/__init__.py lists {sorted(listed)}; the tools are {TOOLS}"


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_builds_its_parser_from_the_common_flags(tool: str) -> None:
    module = importlib.import_module(f"ddtree.profiling.{tool}")
    assert "ddtree.profiling.flags" in imported_modules(Path(module.__file__)), f"{tool} does not use flags.py"
    parser = module.build_parser()
    assert isinstance(parser, flags.ToolParser), f"{tool}: build_parser() is not flags.tool_parser's"
    assert parser.prog == f"python -m ddtree.profiling.{tool}"
    defaults = vars(parser.parse_args([]))
    one_default = {"device": "auto", "dtype": "auto", "target": flags.FIXTURE_TARGET, "drafter": flags.FIXTURE_DRAFTER}
    differing = {k: defaults[k] for k in one_default if k in defaults and defaults[k] != one_default[k]}
    assert not differing, f"{tool}: {differing} differ from flags.py's defaults {one_default}"
    assert parser.format_help().startswith(f"usage: python -m ddtree.profiling.{tool}")


def test_a_tool_runs_as_a_module_with_help() -> None:
    out = subprocess.run([sys.executable, "-m", "ddtree.profiling.burst", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m ddtree.profiling.burst") and "--spacing-ms" in out.stdout


def test_a_bad_value_is_reported_under_the_tool_name(capsys: pytest.CaptureFixture[str]) -> None:
    from ddtree.profiling import burst

    assert burst.main(["--engine", "zero", "--holds", "1-4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ddtree.profiling.burst: error: --holds:"), err


def test_the_package_lists_its_tools_and_the_old_bench_command_says_where_it_went() -> None:
    listing = subprocess.run([sys.executable, "-m", "ddtree.profiling"], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert all(f"    {tool} " in listing.stdout for tool in TOOLS)
    old = subprocess.run([sys.executable, "-m", "ddtree.bench"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert old.returncode == 1
    assert "python -m ddtree.profiling.engine_bench" in old.stderr and "python -m ddtree.profiling" in old.stderr
