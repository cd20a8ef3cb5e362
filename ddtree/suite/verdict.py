"""A cell's verdict against its floor: pace-normalised throughput, acceptance, speed-up over AR.

    throughput   measured tok/s / the pace around the cell  >=  floor tok/s / the floor's pace x (1 - tolerance)
    acceptance   accept_length  >=  floor x (1 - accept_tolerance)
    speed-up     (tok/s / pace) / (AR's tok/s / AR's pace), AR at the same context and concurrency in
                 this run  >=  floor x (1 - speedup_tolerance)

The pace is the pace probe's score (ddtree.bench.pace) measured around each repeat; a cell's
pace-normalised tok/s is the median over its repeats of tok/s / that repeat's pace, so a machine
that is 40% slower this hour moves the expected throughput with it. A floor without a pace (or a
pace from another probe) is judged in absolute tok/s, and the verdict says so. Acceptance at
temperature 0 does not depend on the machine, so its tolerance is tight. The speed-up is what a
DDTree user tunes for: both sides come from the same run and machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddtree.suite.floors import FLOOR_METRICS, Floors

AR_CONFIG_ID = "ar"


@dataclass(frozen=True)
class Tolerances:
    throughput: float
    accept: float
    speedup: float

    @classmethod
    def of(cls, floors: Floors, throughput: float | None = None) -> Tolerances:
        """The floors file's tolerances; `throughput` (--floor-tolerance) overrides tok/s and speed-up
        where the file sets no speed-up tolerance of its own."""
        tps = floors.tolerance if throughput is None else throughput
        speedup = floors.speedup_tolerance if floors.speedup_tolerance is not None else tps
        return cls(tps, floors.accept_tolerance, speedup)


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
        _judge_throughput(measured, floor, tolerances.throughput, floors_probe, where, verdict)
    for metric, tolerance in (("accept_length", tolerances.accept), ("speedup_vs_ar", tolerances.speedup)):
        if metric not in floor:
            continue
        value, floor_value = measured.get(metric), float(floor[metric])
        if value is None and metric == "speedup_vs_ar":  # AR not in this run (-k, --resume order, another worker)
            verdict.notes.append("speed-up over AR not judged: no AR cell at its context and concurrency before it")
        elif value is None:
            verdict.failures.append(f"{metric} was not measured, floor {_fmt(metric, floor_value)}, {where}")
        elif value < floor_value * (1.0 - tolerance):
            verdict.failures.append(f"{metric} {_fmt(metric, value)} < floor {_fmt(metric, floor_value)} "
                                    f"x (1-{tolerance:g}), {where}")
    return verdict


def _judge_throughput(measured: Mapping[str, Any], floor: Mapping[str, float], tolerance: float,
                      floors_probe: str | None, where: str, verdict: Verdict) -> None:
    tps, floor_tps = measured.get("output_throughput"), float(floor["output_throughput"])
    if tps is None:
        verdict.failures.append(f"output_throughput was not measured, floor {_fmt('output_throughput', floor_tps)}, "
                                f"{where}")
        return
    normalised, pace, probe = measured.get("pace_normalized_throughput"), measured.get("pace"), measured.get("probe")
    floor_pace = floor.get("pace")
    why_absolute = (
        "the floor has no pace (re-record it with --update-floors)" if not floor_pace
        else "this run has no pace reading" if normalised is None or not pace
        else f"the floor's pace comes from probe {floors_probe}, this run's from {probe}"
        if floors_probe and probe and floors_probe != probe else None
    )
    if why_absolute:
        verdict.notes.append(f"tok/s judged in absolute terms: {why_absolute}")
        if tps < floor_tps * (1.0 - tolerance):
            verdict.failures.append(f"{tps:.1f} tok/s < floor {floor_tps:.1f} x (1-{tolerance:g}) (absolute), {where}")
        return
    expected = floor_tps / float(floor_pace)  # tok/s per unit of pace when the floor was recorded
    if normalised < expected * (1.0 - tolerance):
        verdict.failures.append(
            f"{normalised:.1f} tok/s per unit pace ({tps:.1f} tok/s at pace {pace:.3f}) < floor {expected:.1f} "
            f"({floor_tps:.1f} tok/s at pace {float(floor_pace):.3f}) x (1-{tolerance:g}), {where}")


def ar_reference(cells_by_key: Mapping[tuple[str, int, int], Mapping[str, Any]], context: int,
                 concurrency: int) -> Mapping[str, Any] | None:
    """AR's metrics at (context, concurrency) from this run's cells, or None when AR was not measured there."""
    return cells_by_key.get((AR_CONFIG_ID, context, concurrency))


def speedup_over_ar(metrics: Mapping[str, Any], ar_metrics: Mapping[str, Any] | None) -> float | None:
    """Pace-normalised tok/s over AR's (raw tok/s when either side has no pace); None without AR."""
    if ar_metrics is None:
        return None
    key = "pace_normalized_throughput"
    if metrics.get(key) and ar_metrics.get(key):
        return float(metrics[key]) / float(ar_metrics[key])
    tps, ar_tps = metrics.get("output_throughput"), ar_metrics.get("output_throughput")
    return float(tps) / float(ar_tps) if tps and ar_tps else None


def floor_entry(measured: Mapping[str, Any]) -> dict[str, float]:
    """What --update-floors records for a cell: every floor metric this cell measured."""
    return {k: round(float(measured[k]), FLOOR_METRICS[k][1] + 1) for k in FLOOR_METRICS
            if measured.get(k) is not None}
