"""A cell's verdict against its floor (ddtree.suite.verdict), the floors file's keys, pace normalisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddtree.bench.baseline import compare_runs
from ddtree.bench.normalise import NORMALISED_KEY, add_pace
from ddtree.bench.verdicts import write_verdicts
from ddtree.errors import ConfigError
from ddtree.suite.floors import Floors, load_floors, write_floors
from ddtree.suite.verdict import Tolerances, floor_entry, judge_cell, judge_config, speedup_over_ar
from tests.unit.test_bench_baseline import make_cell, write_run

TOL = Tolerances(throughput=0.15, accept=0.05, speedup=0.15, config=0.15)
FLOOR = {"output_throughput": 100.0, "pace": 1.0, "accept_length": 2.0, "speedup_vs_ar": 1.2}
WHERE = "b8-k4-w2048-bs8 @ ctx60 c1"


def measured(tps: float, pace: float, accept: float = 2.0, speedup: float = 1.2, probe: str = "cpu-v1") -> dict:
    return {"output_throughput": tps, NORMALISED_KEY: tps / pace, "pace": pace, "probe": probe,
            "accept_length": accept, "speedup_vs_ar": speedup}


@pytest.mark.parametrize(("tps", "pace"), [pytest.param(100.0, 1.0, id="same-machine"),
                                           pytest.param(50.0, 0.5, id="half-as-fast-an-hour"),
                                           pytest.param(150.0, 1.5, id="a-fast-hour"),
                                           pytest.param(86.0, 1.0, id="inside-tolerance")])
def test_a_machine_slower_or_faster_today_passes(tps: float, pace: float) -> None:
    verdict = judge_cell(measured(tps, pace), FLOOR, TOL, "cpu-v1", WHERE)
    assert verdict.ok and not verdict.notes, verdict.failures


@pytest.mark.parametrize(("tps", "pace"), [pytest.param(62.5, 1.0, id="forward-60pct-slower"),
                                           pytest.param(97.5, 1.5, id="regression-hidden-by-a-fast-hour"),
                                           pytest.param(40.0, 0.5, id="regression-on-a-slow-hour")])
def test_a_real_regression_fails_whatever_the_machine(tps: float, pace: float) -> None:
    verdict = judge_cell(measured(tps, pace), FLOOR, TOL, "cpu-v1", WHERE)
    assert len(verdict.failures) == 1
    assert verdict.failures[0].startswith(f"{tps / pace:.1f} tok/s per unit pace ({tps:.1f} tok/s at pace {pace:.3f}) "
                                          f"< floor 100.0 (100.0 tok/s at pace 1.000) x (1-0.15), {WHERE}")


def test_a_ten_percent_drop_in_acceptance_fails_and_three_percent_passes() -> None:
    assert judge_cell(measured(100.0, 1.0, accept=1.94), FLOOR, TOL, "cpu-v1", WHERE).ok
    failures = judge_cell(measured(100.0, 1.0, accept=1.8), FLOOR, TOL, "cpu-v1", WHERE).failures
    assert failures == [f"accept_length 1.80 accepted tokens/step < floor 2.00 accepted tokens/step x (1-0.05), {WHERE}"]


def test_a_cell_is_judged_on_tok_s_and_acceptance_and_its_config_on_the_medians() -> None:
    slow_speedup = measured(100.0, 1.0, speedup=0.9)
    assert judge_cell(slow_speedup, FLOOR, TOL, "cpu-v1", WHERE).ok  # one cell's speed-up is its config's to judge
    no_accept = judge_cell({**measured(100.0, 1.0), "accept_length": None}, FLOOR, TOL, "cpu-v1", WHERE).failures
    assert no_accept == [f"accept_length was not measured, floor 2.00 accepted tokens/step, {WHERE}"]


def cells(*ratios: tuple[float, float]) -> list[tuple[str, dict, dict]]:
    """Cells whose pace-normalised tok/s and speed-up are the given fractions of their floors'."""
    return [(f"cell{i}", measured(100.0 * tps, 1.0, speedup=1.2 * speedup), FLOOR) for i, (tps, speedup) in enumerate(ratios)]


def test_a_config_whose_cells_all_slowed_a_little_fails_on_the_median() -> None:
    """Each cell inside a wide cell tolerance, the config's median 20% down: the median says it."""
    verdict = judge_config(cells((0.82, 1.0), (0.78, 1.0), (0.85, 1.0), (0.75, 1.0)), TOL, "cpu-v1", "ar")
    assert verdict.failures == ["ar: median pace-normalised tok/s / floor 0.80 over 4 cells < 1 - 0.15 "
                                "(cell0 0.82, cell1 0.78, cell2 0.85, cell3 0.75)"]


def test_one_noisy_cell_does_not_fail_its_config() -> None:
    assert judge_config(cells((0.55, 1.0), (1.05, 1.0), (0.98, 1.0), (1.2, 1.0)), TOL, "cpu-v1", "b8").ok


def test_a_config_whose_speedup_over_ar_fell_fails() -> None:
    verdict = judge_config(cells((1.0, 0.8), (1.0, 0.75), (1.0, 0.9)), TOL, "cpu-v1", "b8-k4-w2048-bs8")
    assert verdict.failures == ["b8-k4-w2048-bs8: median speed-up over AR / floor 0.80 over 3 cells < 1 - 0.15 "
                                "(cell0 0.80, cell1 0.75, cell2 0.90)"]


def test_a_config_with_one_judged_cell_says_it_was_not_judged() -> None:
    verdict = judge_config(cells((0.5, 0.5)), TOL, "cpu-v1", "ar")
    assert verdict.ok and verdict.notes == [
        "pace-normalised tok/s of ar not judged over its cells: 1 cell(s) with a floor in this run, 2 needed",
        "speed-up over AR of ar not judged over its cells: 1 cell(s) with a floor in this run, 2 needed"]


@pytest.mark.parametrize(("floor", "run", "floors_probe", "why"), [
    pytest.param({"output_throughput": 100.0}, measured(90.0, 0.5), "cpu-v1", "the floor has no pace", id="no-floor-pace"),
    pytest.param(FLOOR, {**measured(90.0, 0.5), NORMALISED_KEY: None, "pace": None}, "cpu-v1",
                 "this run has no pace reading", id="no-run-pace"),
    pytest.param(FLOOR, measured(90.0, 0.5, probe="cuda-v1"), "cpu-v1",
                 "the floor's pace comes from probe cpu-v1, this run's from cuda-v1", id="another-probe"),
])
def test_without_comparable_paces_tok_s_is_judged_absolutely_and_says_why(floor, run, floors_probe, why) -> None:
    verdict = judge_cell(run, floor, TOL, floors_probe, WHERE)
    assert verdict.ok and verdict.notes == [f"tok/s judged in absolute terms: {why}" + (
        " (re-record it with --update-floors)" if why == "the floor has no pace" else "")]
    low = judge_cell({**run, "output_throughput": 80.0}, floor, TOL, floors_probe, WHERE)
    assert low.failures == [f"80.0 tok/s < floor 100.0 x (1-0.15) (absolute), {WHERE}"]


def test_the_speedup_is_pace_normalised_when_both_sides_have_a_pace() -> None:
    ar = {"output_throughput": 100.0, NORMALISED_KEY: 200.0}  # measured at pace 0.5
    assert speedup_over_ar({"output_throughput": 120.0, NORMALISED_KEY: 120.0}, ar) == pytest.approx(0.6)
    assert speedup_over_ar({"output_throughput": 120.0}, ar) == pytest.approx(1.2)  # raw when one side has none
    assert speedup_over_ar({"output_throughput": 120.0}, None) is None


ABSOLUTE = Tolerances(throughput=0.15, accept=0.05, speedup=0.15, config=0.15, basis="absolute")


@pytest.mark.parametrize(("tps", "pace", "ok"), [
    pytest.param(100.0, 0.6, True, id="the-probe-read-slow-the-machine-was-not"),
    pytest.param(86.0, 1.4, True, id="inside-tolerance-the-probe-read-fast"),
    pytest.param(80.0, 0.6, False, id="a-regression-the-probe-would-have-hidden"),
    pytest.param(80.0, 1.0, False, id="a-regression"),
])
def test_with_basis_absolute_the_pace_is_left_out_of_tok_s(tps: float, pace: float, ok: bool) -> None:
    """A machine steadier than its probe: the floors judge tok/s as measured, without a note per cell."""
    verdict = judge_cell(measured(tps, pace), FLOOR, ABSOLUTE, "cuda-v2", WHERE)
    assert not verdict.notes
    assert verdict.failures == ([] if ok else [f"{tps:.1f} tok/s < floor 100.0 x (1-0.15) (absolute; pace {pace:.3f} "
                                               f"here, 1.000 at the floor), {WHERE}"])


def test_with_basis_absolute_a_config_is_judged_on_its_absolute_medians() -> None:
    # the probe read 0.6 in every cell: pace-normalised, a 20% slower config looks 33% faster
    slowed = [(f"cell{i}", measured(80.0, 0.6), FLOOR) for i in range(3)]
    assert judge_config(slowed, TOL, "cpu-v1", "b8").ok
    verdict = judge_config(slowed, ABSOLUTE, "cpu-v1", "b8")
    assert verdict.failures == ["b8: median absolute tok/s / floor 0.80 over 3 cells < 1 - 0.15 "
                                "(cell0 0.80, cell1 0.80, cell2 0.80)"]


def test_with_basis_absolute_the_speedup_is_raw() -> None:
    ar = {"output_throughput": 100.0, NORMALISED_KEY: 200.0}
    assert speedup_over_ar({"output_throughput": 120.0, NORMALISED_KEY: 120.0}, ar, "absolute") == pytest.approx(1.2)


def test_the_basis_is_read_checked_and_kept_when_recording(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"probe": "cuda-v2", "basis": "absolute", "floors": {}}))
    floors = load_floors(path)
    assert floors.basis == "absolute" and Tolerances.of(floors).basis == "absolute"
    write_floors(floors, {"ar": {"ctx60-c1": {"output_throughput": 10.0, "pace": 0.5}}}, probe="cuda-v2")
    assert load_floors(path).basis == "absolute"
    path.write_text(yaml.safe_dump({"basis": "raw"}))
    with pytest.raises(ConfigError, match="basis: 'raw' is not valid; expected one of pace, absolute"):
        load_floors(path)
    path.write_text(yaml.safe_dump({"floors": {}}))
    assert load_floors(path).basis == "pace"


def test_a_baseline_comparison_follows_the_basis(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", [paced_cell(c, [99.0, 101.0], [1.0, 1.0]) for c in CONFIG_IDS])
    # the same tok/s, the probe reading 40% slow: pace-normalised that is a 40% gain, absolute no change
    same = write_run(tmp_path / "same", [paced_cell(c, [99.0, 101.0], [0.6, 0.6]) for c in CONFIG_IDS])
    assert compare_runs(same, base).improved
    absolute = compare_runs(same, base, basis="absolute")
    assert absolute.ok and not absolute.improved and absolute.pace_probe is None
    assert "tok/s compared in absolute terms (basis absolute, as the run's floors judge it)" in absolute.differences()
    write_verdicts(same, {"tolerances": {"basis": "absolute"}})  # what the run's floors judged by
    assert not compare_runs(same, base).improved


def test_a_recorded_floor_holds_every_measured_floor_metric() -> None:
    entry = floor_entry({**measured(123.456, 0.98765, accept=1.777, speedup=0.66666), "median_tpot_ms": 5.0})
    assert entry == {"output_throughput": 123.46, "pace": 0.9877, "accept_length": 1.777, "speedup_vs_ar": 0.6667}
    assert floor_entry({"output_throughput": 50.0, "accept_length": None}) == {"output_throughput": 50.0}


def test_tolerances_come_from_the_file_and_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"probe": "cpu-v1", "tolerance": 0.4, "accept_tolerance": 0.03, "floors": {}}))
    floors = load_floors(path)
    assert Tolerances.of(floors) == Tolerances(0.4, 0.03, 0.15, 0.15)  # the medians' tolerances default to 0.15
    assert Tolerances.of(floors, throughput=0.3) == Tolerances(0.3, 0.03, 0.15, 0.15)
    path.write_text(yaml.safe_dump({"tolerance": 0.4, "speedup_tolerance": 0.12, "config_tolerance": 0.1, "floors": {}}))
    assert Tolerances.of(load_floors(path)) == Tolerances(0.4, 0.05, 0.12, 0.1)


@pytest.mark.parametrize(("data", "message"), [
    pytest.param({"accept_tolerance": 1.5}, "accept_tolerance: 1.5 is not a fraction in [0, 1)", id="accept-tolerance"),
    pytest.param({"speedup_tolerance": -0.1}, "speedup_tolerance: -0.1 is not a fraction in [0, 1)", id="speedup"),
    pytest.param({"config_tolerance": 1}, "config_tolerance: 1 is not a fraction in [0, 1)", id="config"),
    pytest.param({"probe": 3}, "probe: 3 is not a probe id", id="probe"),
    pytest.param({"basis": "tps"}, "basis: 'tps' is not valid; expected one of pace, absolute", id="basis"),
    pytest.param({"floors": {"ar": {"ctx60-c1": {"pase": 1.0}}}}, "unknown metric 'pase'", id="metric"),
    pytest.param({"tolerence": 0.1}, "unknown key(s) ['tolerence']", id="key"),
])
def test_a_bad_floors_file_names_the_field(tmp_path: Path, data: dict, message: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_floors(path)
    assert message in str(err.value)


def test_recording_with_another_probe_drops_the_old_entries(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("# header kept\n" + yaml.safe_dump({"probe": "cpu-v0", "floors": {"ar": {"ctx1-c1": {"pace": 1.0}}}}))
    floors = load_floors(path)
    write_floors(floors, {"ar": {"ctx60-c1": {"output_throughput": 10.0, "pace": 0.5}}}, probe="cpu-v1",
                 recorded={"date": "2026-12-05"})
    again = load_floors(path)
    assert again.probe == "cpu-v1" and again.table == {"ar": {"ctx60-c1": {"output_throughput": 10.0, "pace": 0.5}}}
    assert again.recorded == {"date": "2026-12-05"} and path.read_text().startswith("# header kept\n")
    same = Floors(path=path, probe="cpu-v1", table=again.table)
    write_floors(same, {"ar": {"ctx512-c1": {"output_throughput": 5.0}}}, probe="cpu-v1")
    assert set(load_floors(path).table["ar"]) == {"ctx60-c1", "ctx512-c1"}


def paced_cell(config_id: str, tps: list[float], paces: list[float]):
    cell = make_cell(config_id, 60, 1, tps, [2.0] * len(tps))
    pace = {"probe": "cpu-v1", "score": sum(paces) / len(paces), "per_repeat": paces}
    add_pace(cell.per_repeat, cell.metrics, pace)
    cell.pace = pace
    return cell


CONFIG_IDS = ("ar", "b8-k4-w2048-bs8", "b4-k4-w2048-bs8", "dflash-w2048-bs8")


def test_a_baseline_on_a_slower_hour_is_compared_pace_normalised(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", [paced_cell(c, [99.0, 101.0], [1.0, 1.0]) for c in CONFIG_IDS])
    slow_hour = write_run(tmp_path / "slow", [paced_cell(c, [49.5, 50.5], [0.5, 0.5]) for c in CONFIG_IDS])
    comparison = compare_runs(slow_hour, base)
    assert comparison.ok and comparison.pace_probe == "cpu-v1"
    assert "tok/s compared pace-normalised (tok/s / pace, probe cpu-v1)" in comparison.differences()
    # a 30% regression on a 40% faster hour: the raw tok/s look the same, the pace says otherwise
    hidden = write_run(tmp_path / "hidden", [paced_cell(c, [97.0, 99.0], [1.4, 1.4]) for c in CONFIG_IDS])
    assert not compare_runs(hidden, base).ok
