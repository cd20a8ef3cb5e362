"""Pace-normalised throughput: tok/s divided by the machine's pace around each repeat.

A cell's repeats each carry the pace measured either side of them (ddtree.suite.pace); the cell's
`pace_normalized_throughput` is the median over repeats of tok/s / pace. Comparisons between runs
(floors, baselines) use it where both sides were measured by the same probe, so that a machine
40% slower this hour does not read as a 40% regression, nor a faster one hide a real one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ddtree.bench.metrics import mad, median
from ddtree.bench.results import CellResult

NORMALISED_KEY = "pace_normalized_throughput"
# What tok/s (and the speed-up over AR) is judged on: per unit of the machine's pace where the pace tracks the
# served throughput (a shared VM), as measured where the machine is steadier than the probe (docs/results.md)
BASES = ("pace", "absolute")
DEFAULT_BASIS = "pace"


def throughput_label(basis: str) -> str:
    return "pace-normalised tok/s" if basis == "pace" else "absolute tok/s"


def add_pace(per_repeat: list[dict[str, Any]], metrics: dict[str, Any], pace: dict[str, Any] | None) -> None:
    """Put each repeat's pace into its summary, and the cell's pace-normalised tok/s (median and MAD)
    into `metrics`; nothing when the cell has no pace."""
    if pace is None or len(pace.get("per_repeat") or []) != len(per_repeat):
        return
    values = []
    for summary, score in zip(per_repeat, pace["per_repeat"]):
        summary["pace"] = score
        tps = summary.get("output_throughput")
        if isinstance(tps, (int, float)) and score > 0:
            summary[NORMALISED_KEY] = tps / score
            values.append(tps / score)
    if values:
        metrics[NORMALISED_KEY] = median(values)
        metrics[f"{NORMALISED_KEY}_mad"] = mad(values)


def probe_of(cell: CellResult) -> str | None:
    return (cell.pace or {}).get("probe") if cell.metrics.get(NORMALISED_KEY) else None


def comparable(cells: Sequence[CellResult], others: Sequence[CellResult]) -> str | None:
    """The one probe every cell of both runs was normalised by, or None when they cannot be compared so."""
    probes = {probe_of(c) for c in [*cells, *others]}
    return next(iter(probes)) if len(probes) == 1 and None not in probes else None


def normalised(cell: CellResult) -> CellResult:
    """The cell with its tok/s (median, MAD, per repeat) replaced by the pace-normalised ones."""
    metrics = {**cell.metrics, "output_throughput": cell.metrics[NORMALISED_KEY],
               "output_throughput_mad": cell.metrics.get(f"{NORMALISED_KEY}_mad")}
    per_repeat = [{**r, "output_throughput": r[NORMALISED_KEY]} if NORMALISED_KEY in r else r for r in cell.per_repeat]
    return dataclasses.replace(cell, metrics=metrics, per_repeat=per_repeat)
