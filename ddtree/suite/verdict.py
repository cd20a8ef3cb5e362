"""Verdicts against the floors: each cell's, and each config's over its cells.

Per cell (test_sweep):
    throughput   measured tok/s / the pace around the cell  >=  floor tok/s / the floor's pace x (1 - tolerance)
    acceptance   accept_length  >=  floor x (1 - accept_tolerance)
Per config, over its cells with floors (test_config_floors, after the config's last cell):
    throughput   median over the cells of (tok/s / pace) / (floor tok/s / floor pace)  >=  1 - config_tolerance
    speed-up     median over the cells of speedup_vs_ar / its floor  >=  1 - speedup_tolerance, where
                 speedup_vs_ar = (tok/s / pace) / (AR's tok/s / AR's pace), AR at the same context and
                 load in this run

The pace is the pace probe's score (ddtree.bench.pace) measured around each repeat; a cell's
pace-normalised tok/s is the median over its repeats of tok/s / that repeat's pace, so a machine
that is 40% slower this hour moves the expected throughput with it. What the pace leaves over is
each cell's own noise (a short cell on a shared VM moves by a third either way), so a cell's tok/s
tolerance is wide and catches a cell that broke; a change that slows a whole config moves the median
of its cells, whose noise is a fraction of one cell's, and the config tolerance is tight. A floor
without a pace (or a pace from another probe) is judged in absolute tok/s, and the verdict says so.
A floors file with `basis: absolute` judges tok/s and the speed-up as measured, pace left out: for a
machine that is steadier than the probe's readings of it (docs/results.md says when).
Acceptance at temperature 0 does not depend on the machine, so its tolerance is tight. The speed-up
is what a DDTree user tunes for: both sides come from the same run and machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddtree.bench.normalise import DEFAULT_BASIS, throughput_label
from ddtree.suite.floors import FLOOR_METRICS, Floors

AR_CONFIG_ID = "ar"
MIN_CONFIG_CELLS = 2  # a config's median needs more than one cell to be more than that cell's verdict


@dataclass(frozen=True)
class Tolerances:
    throughput: float  # one cell's pace-normalised tok/s
    accept: float
    speedup: float  # the config's median speed-up over AR
    config: float  # the config's median pace-normalised tok/s
    basis: str = DEFAULT_BASIS  # what the tok/s tolerances apply to: tok/s per unit of pace, or absolute tok/s

    @classmethod
    def of(cls, floors: Floors, throughput: float | None = None) -> Tolerances:
        """The floors file's tolerances; `throughput` (--floor-tolerance) overrides the cell's."""
        tps = floors.tolerance if throughput is None else throughput
        return cls(tps, floors.accept_tolerance, floors.speedup_tolerance, floors.config_tolerance, floors.basis)

    @property
    def throughput_label(self) -> str:
        return throughput_label(self.basis)


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the cell was judged where it was not the usual way

    @property
    def ok(self) -> bool:
        return not self.failures


def _fmt(metric: str, value: float) -> str:
    unit, digits = FLOOR_METRICS[metric]
    return f"{value:.{digits}f} {unit}"


def judge_cell(measured: Mapping[str, Any], floor: Mapping[str, float], tolerances: Tolerances,
               floors_probe: str | None, where: str) -> Verdict:
    """`measured`: output_throughput, pace_normalized_throughput, pace, probe, accept_length,
    speedup_vs_ar (absent or None when not measured); `floor`: the floors file's entry."""
    verdict = Verdict()
    if "output_throughput" in floor:
        _judge_throughput(measured, floor, tolerances, floors_probe, where, verdict)
    if "accept_length" in floor:
        value, floor_value = measured.get("accept_length"), float(floor["accept_length"])
        if value is None:
            verdict.failures.append(f"accept_length was not measured, floor {_fmt('accept_length', floor_value)}, {where}")
        elif value < floor_value * (1.0 - tolerances.accept):
            verdict.failures.append(f"accept_length {_fmt('accept_length', value)} < floor "
                                    f"{_fmt('accept_length', floor_value)} x (1-{tolerances.accept:g}), {where}")
    return verdict


def _judge_throughput(measured: Mapping[str, Any], floor: Mapping[str, float], tolerances: Tolerances,
                      floors_probe: str | None, where: str, verdict: Verdict) -> None:
    tolerance = tolerances.throughput
    tps, floor_tps = measured.get("output_throughput"), float(floor["output_throughput"])
    if tps is None:
        verdict.failures.append(f"output_throughput was not measured, floor {_fmt('output_throughput', floor_tps)}, "
                                f"{where}")
        return
    normalised, pace, probe = measured.get("pace_normalized_throughput"), measured.get("pace"), measured.get("probe")
    floor_pace = floor.get("pace")
    absolute_basis = tolerances.basis == "absolute"  # the floors file's choice: the usual way for it, no note
    why_absolute = None if absolute_basis else (
        "the floor has no pace (re-record it with --update-floors)" if not floor_pace
        else "this run has no pace reading" if normalised is None or not pace
        else f"the floor's pace comes from probe {floors_probe}, this run's from {probe}"
        if floors_probe and probe and floors_probe != probe else None
    )
    if absolute_basis or why_absolute:
        if why_absolute:
            verdict.notes.append(f"tok/s judged in absolute terms: {why_absolute}")
        if tps < floor_tps * (1.0 - tolerance):
            # with basis absolute the paces still tell a slower host from a slower engine: say them
            paces = (f"; pace {float(pace):.3f} here, {float(floor_pace):.3f} at the floor"
                     if absolute_basis and pace and floor_pace else "")
            verdict.failures.append(f"{tps:.1f} tok/s < floor {floor_tps:.1f} x (1-{tolerance:g}) (absolute{paces}), "
                                    f"{where}")
        return
    expected = floor_tps / float(floor_pace)  # tok/s per unit of pace when the floor was recorded
    if normalised < expected * (1.0 - tolerance):
        verdict.failures.append(
            f"{normalised:.1f} tok/s per unit pace ({tps:.1f} tok/s at pace {pace:.3f}) < floor {expected:.1f} "
            f"({floor_tps:.1f} tok/s at pace {float(floor_pace):.3f}) x (1-{tolerance:g}), {where}")


def throughput_ratio(measured: Mapping[str, Any], floor: Mapping[str, float], floors_probe: str | None,
                     basis: str = DEFAULT_BASIS) -> float | None:
    """The cell's tok/s against its floor's: pace-normalised where both sides have one probe's pace and the
    basis is pace."""
    tps, floor_tps = measured.get("output_throughput"), floor.get("output_throughput")
    if not tps or not floor_tps:
        return None
    normalised, probe, floor_pace = measured.get("pace_normalized_throughput"), measured.get("probe"), floor.get("pace")
    if basis == "pace" and normalised and floor_pace and not (floors_probe and probe and floors_probe != probe):
        return float(normalised) / (float(floor_tps) / float(floor_pace))
    return float(tps) / float(floor_tps)


def judge_config(cells: Sequence[tuple[str, Mapping[str, Any], Mapping[str, float]]], tolerances: Tolerances,
                 floors_probe: str | None, config_id: str) -> Verdict:
    """`cells`: (cell id, measured, floor) for each of the config's cells that has a floor. The medians of
    the cells' tok/s ratios and speed-up ratios against their floors, each against its tolerance."""
    verdict = Verdict()
    tps = {cid: r for cid, m, f in cells if (r := throughput_ratio(m, f, floors_probe, tolerances.basis)) is not None}
    speedups = {cid: float(m["speedup_vs_ar"]) / float(f["speedup_vs_ar"]) for cid, m, f in cells
                if m.get("speedup_vs_ar") and f.get("speedup_vs_ar")}
    for what, ratios, tolerance in ((tolerances.throughput_label, tps, tolerances.config),
                                    ("speed-up over AR", speedups, tolerances.speedup)):
        if len(ratios) < MIN_CONFIG_CELLS:
            if ratios or what == tolerances.throughput_label:
                verdict.notes.append(f"{what} of {config_id} not judged over its cells: {len(ratios)} cell(s) with "
                                     f"a floor in this run, {MIN_CONFIG_CELLS} needed")
            continue
        median = statistics.median(ratios.values())
        if median < 1.0 - tolerance:
            each = ", ".join(f"{cid} {r:.2f}" for cid, r in sorted(ratios.items()))
            verdict.failures.append(f"{config_id}: median {what} / floor {median:.2f} over {len(ratios)} cells < "
                                    f"1 - {tolerance:g} ({each})")
    return verdict


def speedup_over_ar(metrics: Mapping[str, Any], ar_metrics: Mapping[str, Any] | None,
                    basis: str = DEFAULT_BASIS) -> float | None:
    """Pace-normalised tok/s over AR's (raw tok/s when either side has no pace or the basis is absolute);
    None without AR."""
    if ar_metrics is None:
        return None
    key = "pace_normalized_throughput"
    if basis == "pace" and metrics.get(key) and ar_metrics.get(key):
        return float(metrics[key]) / float(ar_metrics[key])
    tps, ar_tps = metrics.get("output_throughput"), ar_metrics.get("output_throughput")
    return float(tps) / float(ar_tps) if tps and ar_tps else None


def floor_entry(measured: Mapping[str, Any]) -> dict[str, float]:
    """What --update-floors records for a cell: every floor metric this cell measured."""
    return {k: round(float(measured[k]), FLOOR_METRICS[k][1] + 1) for k in FLOOR_METRICS
            if measured.get(k) is not None}
