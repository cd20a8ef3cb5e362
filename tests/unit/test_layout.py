"""No folder that pytest puts on sys.path offers a module or package named like an installed one.

pytest's default import mode (prepend) inserts, for each test module and conftest, the first folder
above it that has no __init__.py. Every regular package or module in that folder then comes before
site-packages: a test folder `kernels/` there once shadowed the `kernels` distribution that
transformers imports. So every test folder is a package under `tests`, and this checks that what
the inserted folders offer is not an installed distribution's import name.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = "ddtree"  # the project's own package sits in the rootdir by design


def sys_path_dirs(root: Path) -> set[Path]:
    """The folders pytest's prepend mode inserts for `root`'s conftest and the test modules under root/tests."""
    modules = [p for p in (root / "tests").rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"]
    modules += list(root.glob("conftest.py"))
    dirs = set()
    for module in modules:
        folder = module.parent
        while (folder / "__init__.py").is_file():
            folder = folder.parent
        dirs.add(folder)
    return dirs


def importable_names(folder: Path) -> set[str]:
    """Names a folder on sys.path wins with: regular packages and modules (a namespace folder defers)."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return names


def shadowed(root: Path, installed: Mapping[str, Iterable[str]], own: str = PROJECT) -> list[str]:
    """'name (folder) shadows dist' for each installed import name that a test-run folder offers too."""
    found = []
    for folder in sorted(sys_path_dirs(root)):
        for name in sorted(importable_names(folder)):
            dists = [d for d in installed.get(name, ()) if d.lower() != own]
            if dists:
                found.append(f"{name} ({folder / name}) shadows the installed {', '.join(dists)}")
    return found


def test_no_test_folder_shadows_an_installed_distribution() -> None:
    clashes = shadowed(REPO, importlib.metadata.packages_distributions())
    assert not clashes, ("pytest puts these folders first on sys.path, ahead of site-packages; make the test "
                         "folder a package under tests/ (add __init__.py) or rename it: " + "; ".join(clashes))


def test_every_test_folder_is_a_package_under_tests() -> None:
    """The only folder the tests put on sys.path is the rootdir, which offers `tests`, `conftest` and the project."""
    assert sys_path_dirs(REPO) == {REPO}


def test_a_test_folder_outside_the_tests_package_is_caught(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("")
    kernels = tmp_path / "tests" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "__init__.py").write_text("")
    (kernels / "test_a.py").write_text("")
    installed = {"kernels": ["kernels"], "ddtree": ["ddtree"]}
    assert shadowed(tmp_path, installed) == [f"kernels ({kernels}) shadows the installed kernels"]
    (tmp_path / "tests" / "__init__.py").write_text("")
    assert shadowed(tmp_path, installed) == []
