"""The suite with --server-dialect: a sweep against the fake speaking each built-in dialect, and
grids the dialect cannot run refused before anything starts (inner pytest runs, see test_suite_plugin)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddtree.service.dialects import DIALECTS_DIR
from tests.unit.test_suite_plugin import GRID, run, suite_dir, write_grid  # noqa: F401 - suite_dir is a fixture

CHAIN_GRID = {**GRID, "default": {"algorithm": "DFLASH", "block_size": 8, "draft_window": 2048},
              "configs": [{"draft_window": "none"}, {"algorithm": "NONE"}]}


@pytest.mark.parametrize(("dialect", "grid", "deploys", "log_lines"), [
    pytest.param("ddtree", GRID, "ar, b4-k4-w2048-bs8", [
        "Initialized DDTree worker. block_size=8, tree_budget=4, topk=4, draft_window_size=2048, compact_cache=True"],
        id="ddtree"),
    pytest.param("sglang-ddtree", GRID, "ar, b4-k4-w2048-bs8", [
        "=== ddtree service start b4-k4-w2048-bs8: SGLANG_DDTREE_MAX_TOPK=4 *--speculative-ddtree-budget 4*",
        "Initialized DFLASH draft runner. *block_size=8, draft_window_size=2048, compact_cache=True",
        "Initialized DDTree worker. block_size=8, tree_budget=4, max_tree_nodes=5"], id="sglang-ddtree"),
    pytest.param("sglang-dflash", CHAIN_GRID, "ar, dflash-wnone-bs8", [
        "Initialized DFLASH draft runner. *block_size=8, draft_window_size=None, compact_cache=False"],
        id="sglang-dflash"),
])
def test_a_sweep_against_the_fake_speaking_each_dialect_deploys_verifies_and_restores(
        suite_dir: pytest.Pytester, dialect: str, grid: dict, deploys: str, log_lines: list[str]) -> None:  # noqa: F811
    write_grid(suite_dir, grid)
    result = run(suite_dir, "-m", "perf", "--server-dialect", dialect)
    result.assert_outcomes(passed=4)
    default = "dflash-w2048-bs8" if grid is CHAIN_GRID else "b8-k4-w2048-bs8"
    result.stdout.fnmatch_lines([f"deploys: 2 ({deploys})",
                                 f"restore: default {default} restored and verified (settings*ok*init log line*ok*"])
    logs = "".join(p.read_text() for p in (suite_dir.path / "results" / "service-logs").iterdir())
    pytest.LineMatcher(logs.splitlines()).fnmatch_lines(log_lines, consecutive=False)


@pytest.mark.parametrize(("dialect", "configs", "message"), [
    ("sglang-dflash", [{"algorithm": "DFLASH"}],
     "*cannot run on dialect sglang-dflash (--server-dialect): default b8-k4-w2048-bs8: knob algorithm DDTREE: "
     "dialect sglang-dflash does not support it (supported: NONE, DFLASH)*"),
    ("sglang-ddtree", [{"budget": "auto"}],
     "*cannot run on dialect sglang-ddtree*config bauto-k4-w2048-bs8: knob budget ('auto'): dialect sglang-ddtree "
     "takes a fixed budget only*"),
], ids=["stock-sglang-has-no-tree", "the-fork-has-no-auto-budget"])
def test_a_grid_with_a_knob_the_dialect_cannot_set_fails_at_collection_naming_both(
        suite_dir: pytest.Pytester, dialect: str, configs: list, message: str) -> None:  # noqa: F811
    write_grid(suite_dir, {**GRID, "configs": configs})
    result = run(suite_dir, "-m", "perf", "--server-dialect", dialect, "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert not (suite_dir.path / "results").exists()


def test_a_users_dialect_file_is_used_and_checked(suite_dir: pytest.Pytester, tmp_path: Path,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    data = yaml.safe_load((DIALECTS_DIR / "sglang-ddtree.yaml").read_text())
    data |= {"name": "my-fork"}
    data["knobs"]["topk"] = "unsupported"
    path = tmp_path / "my-fork.yaml"
    path.write_text(yaml.safe_dump(data))
    refused = run(suite_dir, "-m", "perf", "--server-dialect", str(path), "--collect-only")
    refused.stderr.fnmatch_lines(["ERROR: *cannot run on dialect my-fork*knob topk (4): dialect my-fork cannot set it*"])
    write_grid(suite_dir, CHAIN_GRID)
    monkeypatch.setenv("DDTREE_FAKE_DIALECT", "sglang-ddtree")  # the fork's personality speaks it
    result = run(suite_dir, "-m", "perf", "--server-dialect", str(path))
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["restore: default dflash-w2048-bs8 restored and verified*"])
