"""The sweep's answer end to end through pytester: --plan starts nothing, --slo is checked before any start,
and a grid with an slo block and request rates (in a folder with a space) gives every new file and field."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.unit.suite_copy import copy_suite

REPO = Path(__file__).resolve().parents[2]
FAKE = ["-p", "no:cacheprovider", "--service", "fake", "--device", "cpu", "--startup-timeout", "30"]
GRID = {
    "default": {"budget": 8, "topk": 4, "draft_window": 2048, "block_size": 8},
    "configs": [{}, {"algorithm": "NONE"}],
    "client": {"contexts": [8], "concurrency": [2], "request_rates": [40, 0.5], "max_new_tokens": 4,
               "requests_per_cell": 4, "repeats": 1, "warmup_requests": 0},
    "slo": {"e2el_p90_ms": 5000, "ttft_p99_ms": 2000, "attainment_target": 0.9},
}


@pytest.fixture
def suite_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """The real root conftest and sweep test, and the grid at `my grids/slo grid.yaml`."""
    copy_suite(pytester, monkeypatch)
    grid = pytester.path / "my grids" / "slo grid.yaml"
    grid.parent.mkdir()
    grid.write_text(yaml.safe_dump(GRID))
    return pytester


def run(pytester: pytest.Pytester, *args: str, results: str = "results") -> pytest.RunResult:
    return pytester.runpytest_subprocess(*FAKE, "-m", "perf", "--config-grid", "my grids/slo grid.yaml",
                                         "--results-dir", results, *args, timeout=120)


def test_a_grid_with_slos_and_rates_gives_the_answer_and_every_file(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir)
    result.assert_outcomes(passed=6)  # SLOs never fail a cell
    result.stdout.fnmatch_lines(["ddtree SLO: ttft_p99_ms <= 2000, e2el_p90_ms <= 5000; attainment target 0.9*",
                                 "*ar-ctx8-r0.5: *rate 0.5/s: sent *, SLO met by 100.0%*"])
    out = suite_dir.path / "results"
    names = sorted(p.name for p in (out / "cells").iterdir())
    assert names == ["ar__ctx8__c2.json", "ar__ctx8__r0.5.json", "ar__ctx8__r40.json", "b8-k4-w2048-bs8__ctx8__c2.json",
                     "b8-k4-w2048-bs8__ctx8__r0.5.json", "b8-k4-w2048-bs8__ctx8__r40.json"]
    rate_cell = json.loads((out / "cells/ar__ctx8__r0.5.json").read_text())
    assert rate_cell["request_rate"] == 0.5 and rate_cell["concurrency"] == 0
    assert rate_cell["client"]["slo"] == GRID["slo"] and rate_cell["client"]["arrival_seed"] == 0
    m = rate_cell["metrics"]
    assert m["slo_attainment"] == 1.0 and m["request_goodput"] > 0 and m["offered_request_rate"] == 0.5
    assert m["achieved_request_rate"] > 0 and m["max_in_flight"] >= 1 and "keeps_up" in m
    assert m["slo_unjudged"] == {"ttft_p99_ms": 4}  # the fake does not stream: no TTFT, and it says so
    rows = list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
    assert {r["request_rate"] for r in rows} == {"", "0.5", "40.0"}
    assert all(r["slo_attainment"] == "1.0" and float(r["request_goodput"]) > 0 for r in rows)
    deploys = json.loads((out / "deploys.json").read_text())
    assert [d["config_id"] for d in deploys] == ["ar", "b8-k4-w2048-bs8"]
    assert all(d["ok"] and 0 < d["ready_s"] <= d["verified_s"] == d["cold_start_s"] for d in deploys)
    summary = (out / "sweep_summary.md").read_text()
    assert summary.index("## SLO answer") < summary.index("## Recommendation")
    # closed loop at c2 the fake serves far more requests a second than either rate offers
    assert re.search(r"^\| 8 \| \*\*(ar|b8-k4-w2048-bs8)\*\*( \(default\))? \| c2 \| ", summary, re.MULTILINE), summary
    assert "## Deploys" in summary and "Total: 2 deploys (2 restarts)" in summary
    assert "## context 8, 0.5 requests/s (open loop)" in summary


def test_slo_flag_overrides_the_grid_and_misses_are_reported_not_failed(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir, "-k", "ar-ctx8-c2", "--slo", "e2el_p90_ms=0.001")
    result.assert_outcomes(passed=1, deselected=5)
    result.stdout.fnmatch_lines(["*ar-ctx8-c2: *SLO met by 0.0%, goodput 0.00 req/s (below target)*"])
    cell = json.loads((suite_dir.path / "results/cells/ar__ctx8__c2.json").read_text())
    assert cell["client"]["slo"]["e2el_p90_ms"] == 0.001 and cell["client"]["slo"]["ttft_p99_ms"] == 2000
    assert cell["metrics"]["slo_missed_by"] == {"e2el_p90_ms": 4} and cell["metrics"]["slo_attained"] is False
    assert "none meets the target" in (suite_dir.path / "results/sweep_summary.md").read_text()


@pytest.mark.parametrize("value, message", [
    ("ttft_p98_ms=10", "--slo: unknown key(s) [[]'ttft_p98_ms'[]]; allowed: ttft_median_ms, *, attainment_target"),
    ("tpot_p90_ms=-1", "--slo.tpot_p90_ms: -1 is out of range (allowed > 0 and <= 1e+07)"),
    ("attainment_target=2", "--slo.attainment_target: 2 is out of range (allowed > 0 and <= 1)"),
])
def test_a_bad_slo_is_a_usage_error_before_anything_starts(suite_dir: pytest.Pytester, value: str, message: str) -> None:
    result = run(suite_dir, "--slo", value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])
    assert "deploying" not in result.stdout.str() and not (suite_dir.path / "results").exists()


def test_plan_prints_the_order_and_starts_nothing(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir, "--plan")
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "ddtree plan: grid slo grid (*my grids/slo grid.yaml), service fake: 2 configs, 6 cells (0 removed as impossible)",
        "deploy order:", "    1. ar               3 cells", "    2. b8-k4-w2048-bs8  3 cells",
        "deploys: 2 (2 configs); cells: 6",
        "estimated wall time: none (no previous run*",
        "SLO: ttft_p99_ms <= 2000, e2el_p90_ms <= 5000; attainment target 0.9"])
    assert "deploying" not in result.stdout.str() and not (suite_dir.path / "results").exists()
    # after a run, --baseline gives the estimate its deploy and cell times
    run(suite_dir, "-k", "c2").assert_outcomes(passed=2, deselected=4)
    planned = run(suite_dir, "--plan", "--baseline", "results", results="next")
    assert planned.ret == 0
    planned.stdout.fnmatch_lines(["estimated wall time: * from *results", "  deploys: 2 of 2 by their config's cold start*",
                                  "  cells: 2 by id, 4 by context"])
    assert "deploying" not in planned.stdout.str() and not (suite_dir.path / "next").exists()


def test_plan_on_the_full_grid_with_the_local_service_is_quick_and_starts_no_server(pytester: pytest.Pytester) -> None:
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "perf", "--config-grid", "full", "--service",
                                           "local", "--device", "cpu", "--results-dir", "results", "--plan", timeout=120)
    elapsed = time.monotonic() - started
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["ddtree plan: grid full (*full.yaml), service local: 9 configs, * cells*",
                                 "deploys: 10 (9 configs + the restore of the default); cells: *"])
    assert "deploying" not in result.stdout.str() and not (pytester.path / "results").exists()
    assert elapsed < 60, f"--plan took {elapsed:.1f} s"
