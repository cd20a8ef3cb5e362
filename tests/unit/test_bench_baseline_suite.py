"""`--baseline` end to end: the smoke grid swept twice through the suite against the fake service.

The first sweep is the baseline of the second (`--baseline latest`); then the first run's tok/s
(raw and pace-normalised) are doctored up a thousandfold and a third sweep against it must fail (exit status 1, every cell
named in the "ddtree baseline" section) although each cell's own test passed. The
fake service's tok/s swing a lot on a shared machine, so these runs use a wide tolerance: the
verdict rule itself is tested on synthetic folders in test_bench_baseline.py; this checks the
plumbing (options, latest, the run's verdict, baseline.json, the summary, the terminal section).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.suite.baseline import SECTION
from tests.unit.suite_copy import copy_suite

REPO = Path(__file__).resolve().parents[2]
FAKE = ["-p", "no:cacheprovider", "--service", "fake", "--device", "cpu", "--startup-timeout", "30",
        "--config-grid", "smoke", "--baseline-tolerance", "0.9"]
SMOKE_CELLS = 16  # fixtures/grids/smoke.yaml: 4 configs x 2 contexts x 2 concurrencies
NO_FLOORS = "no-floors.yaml"


@pytest.fixture
def suite_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A directory with the real root conftest and the real sweep test, and a floors file with no cells: the
    fake's numbers say nothing of the fixture model's floors (its speed-up over AR is noise, so against
    cpu-fixture a config's speed-up verdict failed now and then), and this test is about the baseline."""
    copy_suite(pytester, monkeypatch)
    (pytester.path / NO_FLOORS).write_text("floors: {}\n")
    return pytester


def sweep(pytester: pytest.Pytester, results: str, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*FAKE, "--floors", str(pytester.path / NO_FLOORS), "--results-dir", results,
                                         *args, timeout=240)


def doctor(results: Path, factor: float) -> None:
    """Multiply every tok/s of a run (median, MAD, each repeat) by `factor`, as if it had been faster."""
    for path in (results / "cells").glob("*.json"):
        data = json.loads(path.read_text())
        for key in ("output_throughput", "output_throughput_mad", "pace_normalized_throughput",
                    "pace_normalized_throughput_mad"):
            if key in data["metrics"]:
                data["metrics"][key] *= factor
        for repeat in data["per_repeat"]:
            for key in ("output_throughput", "pace_normalized_throughput"):
                if key in repeat:
                    repeat[key] *= factor
        path.write_text(json.dumps(data))


def test_a_second_smoke_sweep_is_judged_against_the_first(suite_dir: pytest.Pytester) -> None:
    first = sweep(suite_dir, "runs/1-first")
    first.assert_outcomes(passed=SMOKE_CELLS)

    second = sweep(suite_dir, "runs/2-second", "--baseline", "latest")
    second.assert_outcomes(passed=SMOKE_CELLS)
    runs = suite_dir.path / "runs"
    second.stdout.fnmatch_lines([f"ddtree baseline: {runs / '1-first'} (latest): {SMOKE_CELLS} cells, commit *",
                                 f"*{SECTION}*", "verdict: no regression (16 cells compared, pair noise sigma *)"])
    record = json.loads((runs / "2-second" / "baseline.json").read_text())
    assert record["path"] == str(runs / "1-first") and record["requested"] == "latest"
    assert record["gpu"] == "none (CPU)" and record["backend"] == "fake" and record["tolerance"] == 0.9
    summary = (runs / "2-second" / "sweep_summary.md").read_text()
    assert "| vs baseline |" in summary and "### What moved" in summary and "**no regression**" in summary

    doctor(runs / "1-first", 1000.0)
    third = sweep(suite_dir, "runs/3-third", "--baseline", str(runs / "1-first"))
    assert third.ret == pytest.ExitCode.TESTS_FAILED  # every cell's test passed; the run fails on the verdict
    # ratios 0.0?: a thousandfold baseline over a fake whose tok/s swing up to 8x between runs on a busy machine
    third.stdout.fnmatch_lines([
        f"*{SECTION}*",
        "REGRESSED all cells: regressed: median tok/s ratio 0.0? over 16 cells (band *), tolerance 90%; "
        "cells below 0.10: ar @ ctx60 c1 0.0?, *",
        "REGRESSED ar: regressed: median tok/s ratio 0.0? over 4 cells *",
        # each cell: measured, baseline, ratio, tolerance and both spreads
        "REGRESSED b8-k4-w2048-bs8 @ ctx60 c1: regressed: output tok/s * vs baseline *: ratio 0.0?, tolerance 90%, "
        "spreads do not overlap (now: repeats *; baseline: repeats *)",
        "verdict: REGRESSION: the run fails (16 cells compared, pair noise sigma *)",
        f"*{SMOKE_CELLS} passed*",
    ])
    regressed = {line.split(":")[0] for line in third.outlines if line.startswith("REGRESSED") and " @ " in line.split(":")[0]}
    assert len(regressed) == SMOKE_CELLS, regressed
    assert "REGRESSED" in (runs / "3-third" / "sweep_summary.md").read_text()


def test_latest_without_an_earlier_run_is_a_usage_error(suite_dir: pytest.Pytester) -> None:
    result = sweep(suite_dir, "runs/only", "--baseline", "latest")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --baseline: --baseline latest: no earlier results directory *"])


@pytest.mark.parametrize("value", ["1.5", "ten"])
def test_a_bad_tolerance_is_a_usage_error(suite_dir: pytest.Pytester, value: str) -> None:
    (suite_dir.path / "runs" / "old" / "cells").mkdir(parents=True)
    result = suite_dir.runpytest_subprocess(*FAKE[:-2], "--baseline-tolerance", value, "--baseline",
                                            str(suite_dir.path / "runs" / "old"), "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --baseline-tolerance: '{value}' is not valid; expected a fraction in [0, 1)*"])
