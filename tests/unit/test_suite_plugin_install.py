"""The suite as an installed pytest11 plugin: options and paths from anywhere, inert elsewhere.

Inner pytest runs (subprocesses, so the entry point loads as it does for a user) in a project that
is not this one, and in a copy of this repository's layout with the grid and results outside it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import yaml

from tests.unit.test_suite_plugin import GRID, REPO

OTHER_PROJECT = '''
import pytest


@pytest.mark.perf
def test_their_perf():
    pass


def test_plain():
    pass


def test_wants_a_cell(cell):
    pass


def test_wants_a_service(service):
    pass


def test_no_suite_hook_is_registered(pytestconfig):
    names = {name for name, _ in pytestconfig.pluginmanager.list_name_plugin()}
    assert not {"ddtree-session", "ddtree-baseline", "ddtree-plan", "ddtree.suite.fixtures"} & names
'''


def test_the_plugin_is_an_installed_pytest11_entry_point() -> None:
    points = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "ddtree"]
    assert [e.value for e in points] == ["ddtree.suite.plugin"]


def test_in_another_projects_run_it_requires_nothing_deselects_nothing_and_does_nothing(
        pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    perf: their own perf marker\n")
    pytester.makepyfile(test_theirs=OTHER_PROJECT)
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)  # their perf test runs; nothing deselected; no session
    out = result.stdout.str()
    assert "deselected" not in out and "ddtree grid" not in out and "ddtree sweep" not in out
    result.stdout.fnmatch_lines(["plugins:*ddtree-*", "*fixture 'cell' not found*", "*fixture 'service' not found*"])
    names = [line.split("::")[1].split()[0] for line in result.stdout.lines if "test_theirs.py::" in line][:4]
    assert names == ["test_their_perf", "test_plain", "test_wants_a_cell", "test_wants_a_service"]  # order kept
    assert not (pytester.path / "results").exists()
    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    assert "--config-grid=NAME|PATH" in help_text and "--server-dialect=NAME|PATH" in help_text
    off = pytester.runpytest_subprocess("-p", "no:ddtree", "-p", "no:cacheprovider", "--config-grid", "smoke")
    assert off.ret == pytest.ExitCode.USAGE_ERROR  # -p no:ddtree turns it off, options included


@pytest.fixture
def repo_copy(pytester: pytest.Pytester) -> pytest.Pytester:
    """This repository's layout: pyproject ini (testpaths, ddtree_suite), root conftest, the sweep."""
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
                               'addopts = "-p no:cacheprovider"\nddtree_suite = true\n')
    pytester.makeconftest((REPO / "conftest.py").read_text())
    perf = pytester.mkdir("tests") / "perf"
    perf.mkdir()
    (perf / "test_sweep.py").write_text((REPO / "tests/perf/test_sweep.py").read_text())
    pytester.makepyfile(test_elsewhere="def test_not_collected():\n    pass\n")  # outside testpaths
    return pytester


@pytest.mark.parametrize("form", ["two-words", "equals"])
def test_absolute_paths_outside_the_repository_keep_its_rootdir_and_ini(
        repo_copy: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory, form: str) -> None:
    outside = tmp_path_factory.mktemp("home-me")
    grid = outside / "grids" / "mine.yaml"
    grid.parent.mkdir()
    grid.write_text(yaml.safe_dump(GRID))
    results = outside / "existing-results"
    results.mkdir()
    if form == "two-words":
        args = ["--config-grid", str(grid), "--results-dir", str(results)]
    else:
        args = [f"--config-grid={grid}", f"--results-dir={results}"]
    result = repo_copy.runpytest_subprocess("-m", "perf", *args, "--service", "fake", "--startup-timeout", "30")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([f"ddtree grid: mine ({grid}): 2 configs, 4 cells*",
                                 f"rootdir: {repo_copy.path}", "configfile: pyproject.toml", "testpaths: tests",
                                 "restore: default b8-k4-w2048-bs8 restored and verified*"])
    assert len(list((results / "cells").iterdir())) == 4
    assert not Path(repo_copy.path / "results").exists()
