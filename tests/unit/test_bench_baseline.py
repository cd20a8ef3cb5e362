"""Baseline comparison on synthetic result folders: verdicts, noise, gates, missing cells, latest."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from ddtree.bench.baseline import (
    MAD_TO_SIGMA,
    NOISE_SIGMAS,
    baseline_record,
    compare_runs,
    read_baseline_record,
    resolve_baseline,
    run_noise,
    write_baseline_record,
)
from ddtree.bench.comparison_md import render_comparison
from ddtree.bench.metrics import summarize_cell
from ddtree.bench.report import write_sweep_summary
from ddtree.bench.results import CellResult, write_cell
from ddtree.config import SpecConfig

DEFAULT = "b8-k4-w2048-bs8"
CONFIGS = (DEFAULT, "b4-k4-w2048-bs8", "dflash-w2048-bs8", "ar")


def make_cell(config_id: str, context: int, concurrency: int, tps: list[float], accept: list[float] | None = None,
              *, gpu: str | None = None, commit: str = "aaa", started_at: str = "2026-11-30T02:00:00+00:00",
              ) -> CellResult:
    """A cell whose repeats measured `tps` tok/s (and `accept` tokens per step) through summarize_cell."""
    accept = accept or [None] * len(tps)  # type: ignore[list-item]
    per_repeat = [{"output_throughput": t, "accept_length": a, "completed": 4, "failed": 0,
                   "total_output_tokens": 128, "median_tpot_ms": 1000.0 / t} for t, a in zip(tps, accept)]
    metrics = summarize_cell(per_repeat)
    metrics["accept_length"] = None if accept[0] is None else sorted(accept)[len(accept) // 2]
    return CellResult(config_id=config_id, spec=SpecConfig.from_id(config_id).to_dict(), context=context,
                      concurrency=concurrency, repeats=len(tps), metrics=metrics, per_repeat=per_repeat,
                      gpu=gpu, commit=commit, backend="local", started_at=started_at, finished_at=started_at)


def write_run(folder: Path, cells: list[CellResult], gates: dict[str, dict] | None = None) -> Path:
    for c in cells:
        write_cell(folder, c)
    for config_id, record in (gates or {}).items():
        (folder / "quality").mkdir(parents=True, exist_ok=True)
        (folder / "quality" / f"{config_id}.json").write_text(json.dumps({"config_id": config_id, **record}))
    return folder


def quiet_run(scale: float = 1.0, **kw: object) -> list[CellResult]:
    """Four configs x 2 concurrencies with repeats within +-1% (a quiet machine)."""
    return [make_cell(cid, 60, conc, [scale * base * 0.99, scale * base * 1.01], [2.0, 2.2], **kw)  # type: ignore[arg-type]
            for i, cid in enumerate(CONFIGS) for conc in (1, 4) for base in [100.0 * (i + 1) * conc]]


def test_a_20_percent_drop_beyond_noise_regresses_and_says_why(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run())
    now = quiet_run()
    now[0] = make_cell(DEFAULT, 60, 1, [79.2, 80.8], [2.0, 2.2])  # 100 -> 80 tok/s, repeats +-1%
    comparison = compare_runs(write_run(tmp_path / "now", now), base)
    assert not comparison.ok
    assert [d.key for d in comparison.regressed] == [(DEFAULT, 60, 1, 0.0)]
    (failure,) = comparison.failures()
    # measured, baseline, ratio, tolerance and both spreads
    assert "b8-k4-w2048-bs8 @ ctx60 c1: regressed: output tok/s 80.0 [" in failure
    assert "vs baseline 100.0 [" in failure and "ratio 0.80" in failure and "tolerance 10%" in failure
    assert "spreads do not overlap" in failure and "now: repeats 79.2-80.8" in failure
    assert "baseline: repeats 99-101" in failure
    assert any(line.startswith("REGRESSED b8-k4-w2048-bs8 @ ctx60 c1") for line in comparison.moved())


def test_the_same_drop_inside_the_noise_passes(tmp_path: Path) -> None:
    noisy = [make_cell(c.config_id, c.context, c.concurrency, [c.metrics["output_throughput"] * f for f in (0.8, 1.2)],
                       [2.0, 2.2]) for c in quiet_run()]  # repeats +-20%
    base = write_run(tmp_path / "base", noisy)
    now = list(noisy)
    now[0] = make_cell(DEFAULT, 60, 1, [64.0, 96.0], [2.0, 2.2])  # median 80: the same 20% drop
    comparison = compare_runs(write_run(tmp_path / "now", now), base)
    delta = comparison.cells[(DEFAULT, 60, 1, 0.0)].of("output_throughput")
    assert delta is not None and delta.ratio == pytest.approx(0.8) and delta.overlap
    assert comparison.ok and comparison.regressed == []


def test_tight_repeats_in_a_noisy_run_are_widened_to_the_run_s_noise(tmp_path: Path) -> None:
    """One cell whose two repeats agreed by luck is as noisy as the baseline's typical cell."""
    noisy = [make_cell(c.config_id, c.context, c.concurrency, [c.metrics["output_throughput"] * f for f in (0.85, 1.15)],
                       [2.0, 2.2]) for c in quiet_run()]
    noisy[0] = make_cell(DEFAULT, 60, 1, [99.5, 100.5], [2.0, 2.2])
    base = write_run(tmp_path / "base", noisy)
    noise = run_noise(noisy, "output_throughput")
    assert noise == pytest.approx(MAD_TO_SIGMA * 0.15)
    now = list(noisy)
    now[0] = make_cell(DEFAULT, 60, 1, [79.5, 80.5], [2.0, 2.2])
    comparison = compare_runs(write_run(tmp_path / "now", now), base)
    delta = comparison.cells[(DEFAULT, 60, 1, 0.0)].of("output_throughput")
    assert delta is not None and delta.overlap and comparison.ok
    assert delta.baseline.lo == pytest.approx(100.0 / math.exp(NOISE_SIGMAS * noise))
    assert "widened to the pair's noise" in delta.text()


def test_an_improvement_passes_and_is_reported(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run())
    now = quiet_run()
    now[3] = make_cell("b4-k4-w2048-bs8", 60, 4, [1030.0, 1050.0], [2.0, 2.2])  # 800 -> 1040
    comparison = compare_runs(write_run(tmp_path / "now", now), base)
    assert comparison.ok
    assert [d.key for d in comparison.improved] == [("b4-k4-w2048-bs8", 60, 4, 0.0)]
    assert [line for line in comparison.moved() if line.startswith("improved")] == [
        "improved " + comparison.improved[0].text("improved")]
    assert "ratio 1.30" in comparison.moved()[0]


def test_an_acceptance_drop_regresses_whatever_the_speed(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run())
    now = quiet_run()
    now[0] = make_cell(DEFAULT, 60, 1, [99.0, 101.0], [1.5, 1.6])
    comparison = compare_runs(write_run(tmp_path / "now", now), base)
    (failure,) = comparison.failures()
    assert "accept length 1.60 [1.50, 1.60] vs baseline 2.20 [2.00, 2.20]" in failure
    assert "output tok/s" not in failure  # only the metric that moved is named


def rate_cell(config_id: str, rate: float, tps: list[float]) -> CellResult:
    cell = make_cell(config_id, 60, 0, tps)
    cell.request_rate = rate  # an open-loop cell: concurrency 0, its load is the rate
    return cell


def test_rate_cells_are_compared_each_with_its_own_rate(tmp_path: Path) -> None:
    """Two rate cells of one config and context differ only in their rate: each meets its own baseline."""
    base = write_run(tmp_path / "base", [rate_cell(DEFAULT, 2.0, [100.0, 101.0]), rate_cell(DEFAULT, 8.0, [300.0, 301.0])])
    now = write_run(tmp_path / "now", [rate_cell(DEFAULT, 2.0, [100.0, 101.0]), rate_cell(DEFAULT, 8.0, [150.0, 151.0])])
    comparison = compare_runs(now, base)
    assert sorted(comparison.cells) == [(DEFAULT, 60, 0, 2.0), (DEFAULT, 60, 0, 8.0)]
    assert [d.key for d in comparison.regressed] == [(DEFAULT, 60, 0, 8.0)]
    assert any(line.startswith(f"REGRESSED {DEFAULT} @ ctx60 r8") for line in comparison.moved())
    text = render_comparison(comparison, "now")
    assert "## context 60, 2 requests/s" in text and "## context 60, 8 requests/s" in text


def test_missing_cells_are_listed_on_both_sides(tmp_path: Path) -> None:
    base_cells = quiet_run()
    now_cells = [c for c in quiet_run() if c.config_id != "ar"] + [make_cell(DEFAULT, 512, 1, [50.0, 51.0])]
    comparison = compare_runs(write_run(tmp_path / "now", now_cells), write_run(tmp_path / "base", base_cells))
    assert comparison.only_baseline == [("ar", 60, 1, 0.0), ("ar", 60, 4, 0.0)]
    assert comparison.only_current == [(DEFAULT, 512, 1, 0.0)]
    moved = comparison.moved()
    assert "missing now (2): ar @ ctx60 c1, ar @ ctx60 c4" in moved
    assert "new, no baseline (1): b8-k4-w2048-bs8 @ ctx512 c1" in moved
    assert comparison.ok  # listed, not failed
    gates = compare_runs(write_run(tmp_path / "g-now", quiet_run(), {DEFAULT: {"pass_at_k": 1.0}}),
                         write_run(tmp_path / "g-base", quiet_run()))
    assert gates.ok and "coding gate on one side only (1): b8-k4-w2048-bs8" in gates.moved()


@pytest.mark.parametrize(("before", "after", "verdict"), [
    pytest.param({"pass_at_k": 1.0, "threshold": 0.8}, {"pass_at_k": 0.5, "threshold": 0.8}, "regressed", id="flips"),
    pytest.param({"pass_at_k": 1.0, "passed": True}, {"pass_at_k": 1.0, "passed": False}, "regressed",
                 id="flips-on-accept-floor"),
    pytest.param({"pass_at_k": 1.0}, {"pass_at_k": 0.67}, "regressed", id="drops-without-threshold"),
    pytest.param({"pass_at_k": 1.0, "threshold": 0.5}, {"pass_at_k": 0.67, "threshold": 0.5}, "same",
                 id="drops-but-still-passes"),
    pytest.param({"pass_at_k": 0.3, "threshold": 0.8}, {"pass_at_k": 0.9, "threshold": 0.8}, "improved", id="recovers"),
])
def test_a_coding_gate_that_flips_fails(tmp_path: Path, before: dict, after: dict, verdict: str) -> None:
    base = write_run(tmp_path / "base", quiet_run(), {DEFAULT: before})
    comparison = compare_runs(write_run(tmp_path / "now", quiet_run(), {DEFAULT: after}), base)
    (gate,) = comparison.gates
    assert gate.verdict == verdict
    assert comparison.ok is (verdict != "regressed")
    if verdict == "regressed":
        assert comparison.failures() == [gate.text()]
        assert gate.text().startswith("coding gate b8-k4-w2048-bs8: regressed: now pass@k")


def test_a_threshold_from_the_grid_judges_records_without_one(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run(), {DEFAULT: {"pass_at_k": 0.9}})
    now = write_run(tmp_path / "now", quiet_run(), {DEFAULT: {"pass_at_k": 0.85}})
    assert compare_runs(now, base, gate_threshold=0.8).ok
    assert not compare_runs(now, base, gate_threshold=0.88).ok


def test_another_gpu_is_compared_anyway_and_said(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run(gpu="NVIDIA H100 80GB HBM3", commit="aaa"))
    comparison = compare_runs(write_run(tmp_path / "now", quiet_run(gpu="NVIDIA H200", commit="bbb")), base)
    assert comparison.ok and len(comparison.cells) == 8
    assert comparison.differences() == [
        "GPU differs: baseline NVIDIA H100 80GB HBM3, now NVIDIA H200 (compared anyway)",
        "commit differs: baseline aaa, now bbb",
        "tok/s compared in absolute terms (the two runs' cells do not all carry one probe's pace)"]


def test_latest_is_the_newest_other_run_beside_the_results_dir(tmp_path: Path) -> None:
    runs = tmp_path / "results"
    write_run(runs / "b-older", quiet_run(started_at="2026-11-28T02:00:00+00:00"))
    write_run(runs / "a-newer", quiet_run(started_at="2026-11-30T02:00:00+00:00"))
    (runs / "empty" / "cells").mkdir(parents=True)  # an interrupted run with no cell is no baseline
    write_run(runs / "now", quiet_run(started_at="2026-12-01T02:00:00+00:00"))  # this run itself: never
    assert resolve_baseline("latest", runs / "now") == (runs / "a-newer").resolve()
    assert resolve_baseline(str(runs / "b-older"), runs / "now") == (runs / "b-older").resolve()
    with pytest.raises(ValueError, match=r"--baseline latest: no earlier results directory .* beside"):
        resolve_baseline("latest", tmp_path / "elsewhere" / "now")
    with pytest.raises(ValueError, match=r"--baseline: .*nowhere is not a results directory"):
        resolve_baseline(str(tmp_path / "nowhere"), runs / "now")


def test_the_summary_gets_a_vs_baseline_column_and_what_moved(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", quiet_run(gpu="NVIDIA H100"))
    now_cells = quiet_run(gpu="NVIDIA H200")
    now_cells[0] = make_cell(DEFAULT, 60, 1, [79.2, 80.8], [2.0, 2.2], gpu="NVIDIA H200")
    now = write_run(tmp_path / "now", now_cells)
    write_baseline_record(now, {**baseline_record(base, "latest", 0.1), "gate_threshold": 0.8})
    record = read_baseline_record(now)
    assert record is not None and record["path"] == str(base) and record["gpu"] == "NVIDIA H100"
    assert record["commit"] == "aaa" and record["requested"] == "latest" and record["cells"] == 8
    text = write_sweep_summary(now, DEFAULT, None).read_text()
    assert "| coding pass@k | failed | vs baseline |" in text
    assert "| **b8-k4-w2048-bs8** (default) | 80.0 ± 0.8 |" in text and "| 0.80x **REGRESSED** |" in text
    assert "| 1.00x same |" in text
    assert "- Note: GPU differs: baseline NVIDIA H100, now NVIDIA H200 (compared anyway)" in text
    assert "### What moved" in text and "- REGRESSED b8-k4-w2048-bs8 @ ctx60 c1: regressed: output tok/s" in text
    # a summary without baseline.json has no such column
    assert "vs baseline" not in write_sweep_summary(base, DEFAULT, None).read_text()


def test_a_baseline_that_is_gone_is_said_in_the_summary(tmp_path: Path) -> None:
    now = write_run(tmp_path / "now", quiet_run())
    write_baseline_record(now, {"path": str(tmp_path / "deleted"), "tolerance": 0.1})
    text = write_sweep_summary(now, DEFAULT, None).read_text()
    assert f"Baseline `{tmp_path / 'deleted'}` is not readable any more" in text
    assert os.path.exists(now / "sweep_summary.md")


def noisy_run(factors: list[float] | None = None, spread: float = 0.15) -> list[CellResult]:
    """quiet_run's cells with repeats at +-`spread`, cell i scaled by factors[i]."""
    factors = factors or [1.0] * 8
    return [make_cell(c.config_id, c.context, c.concurrency,
                      [f * c.metrics["output_throughput"] * (1 + s) for s in (-spread, spread)], [2.0, 2.2])
            for c, f in zip(quiet_run(), factors)]


def test_every_cell_slower_inside_its_own_noise_fails_as_a_shift_naming_the_cells(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", noisy_run())
    slower = [0.75, 0.78, 0.72, 0.76, 0.74, 0.77, 0.75, 0.73]
    comparison = compare_runs(write_run(tmp_path / "now", noisy_run(slower)), base)
    assert comparison.regressed == []  # no single cell leaves its spread (+-15% repeats, widened x/÷1.38)
    shift = comparison.shifts[0]
    assert shift.name == "all cells" and shift.verdict == "regressed" and shift.ratio == pytest.approx(0.75, abs=0.01)
    assert not comparison.ok
    failure = comparison.failures()[0]
    assert failure.startswith("all cells: regressed: median tok/s ratio 0.75 over 8 cells (band 0.")
    assert "cells below 0.90: ar @ ctx60 c1 0.75, b4-k4-w2048-bs8 @ ctx60 c1 0.72, b8-k4-w2048-bs8 @ ctx60 c1 0.75," in failure
    assert [x.name for x in comparison.shift_regressions] == ["all cells"]  # 2 cells per config: no config shift


def test_cells_scattered_both_ways_widen_the_spreads_and_pass(tmp_path: Path) -> None:
    """A shared machine: some cells of the new run got 40% less CPU, others 40% more; no trend."""
    base = write_run(tmp_path / "base", noisy_run(spread=0.02))
    scattered = [0.6, 1.4, 1.0, 0.6, 1.4, 1.0, 0.62, 1.38]
    comparison = compare_runs(write_run(tmp_path / "now", noisy_run(scattered, spread=0.02)), base)
    assert comparison.noise > 0.2  # the ratios' scatter, not the repeats' 2%
    assert comparison.ok and comparison.regressed == []
    assert comparison.shifts[0].verdict == "same"
    # the same cells with quiet neighbours (no scatter) do regress
    quiet = [0.6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    alone = compare_runs(write_run(tmp_path / "alone", noisy_run(quiet, spread=0.02)), base)
    assert [d.key for d in alone.regressed] == [(DEFAULT, 60, 1, 0.0)]


def test_a_thousandfold_drop_regresses_each_cell_even_in_a_run_as_noisy_as_a_loaded_machine(tmp_path: Path) -> None:
    """Repeats +-60% apart (a sigma near 0.9): the widened spreads are factors either way, so they never
    reach zero and every cell of a 1000x slower run leaves its spread (1 - 2 sigma would have let them overlap)."""
    base = write_run(tmp_path / "base", noisy_run(spread=0.6))
    now = write_run(tmp_path / "now", noisy_run([0.001] * 8, spread=0.6))
    comparison = compare_runs(now, base)
    assert comparison.noise > 0.5
    assert len(comparison.regressed) == 8 and not comparison.ok
    assert "spreads do not overlap" in comparison.regressed[0].of("output_throughput").text()
