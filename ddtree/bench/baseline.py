"""Comparing a run with a baseline run: per-cell verdicts that respect noise, gates, what moved.

Reads result files only (two results directories), like report.py. The pytest side
(`--baseline DIR|latest`, ddtree.suite.baseline) and `ddtree sweep-report --compare OLD NEW` both
end up in `compare_runs`.

A cell is the same (config id, context, concurrency) on both sides. For each judged metric
(output tok/s and acceptance length, both higher-is-better) the verdict is:

    regressed  ratio of medians < 1 - tolerance  and the two spreads do not overlap
    improved   ratio of medians > 1 + tolerance  and the two spreads do not overlap
    same       otherwise (inside the tolerance, or inside the noise)

A side's spread is the range of its repeats (median ± MAD when the per-repeat values are gone).
For tok/s it is widened to at least median x/÷ exp(NOISE_SIGMAS x the pair's noise), the larger of
two estimates of one side's relative sigma (of log tok/s):

    within   the baseline's typical repeat-to-repeat noise: 1.4826 x the median over its cells of
             MAD / median (the normal-consistent sigma of a MAD)
    between  the scatter of the cells' tok/s ratios: 1.4826 x the MAD over the compared cells of
             log(ratio), divided by sqrt(2) (the ratio carries both sides' noise); needs
             MIN_SCATTER_CELLS cells. A machine shared with other work slows some cells of a run
             and not others; that shows here and not in a cell's own repeats. A change that slows
             every cell alike moves the ratios' median, not their scatter, and is caught by:

Shifts: over all compared cells, and over each config's cells (MIN_SHIFT_CELLS or more), the median tok/s ratio with a
band of ± 2 standard errors (1.2533 x sqrt(2) x the pair's sigma / sqrt(cells)): regressed when
the median < 1 - tolerance and the whole band is below 1 (improved: the mirror image). Forty
noisy cells that each stay inside their spreads still fail together when they all moved down.

Acceptance length does not depend on the machine's load (same prompts, same tokens at
temperature 0), so its spread is its repeats' own range. A coding gate that passed in the
baseline and fails now is a regression whatever the speed.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ddtree.bench.cell_keys import Key, cell_key, key_order, key_text
from ddtree.bench.normalise import DEFAULT_BASIS, comparable, normalised
from ddtree.bench.results import CELLS_DIR, CellResult, atomic_write_text, now_iso, read_cells, read_quality
from ddtree.bench.verdicts import read_verdicts
from ddtree.errors import ConfigError

BASELINE_JSON = "baseline.json"
COMPARE_MD = "vs_baseline.md"
DEFAULT_TOLERANCE = 0.10
LATEST = "latest"

MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma / MAD
# Each side of a tok/s comparison spans at least +-2 sigmas of the pair's noise, so a cell's two
# medians must differ by about 2.8 sigmas of their difference before the spreads part.
NOISE_SIGMAS = 2.0
MIN_SCATTER_CELLS = 4  # fewer compared cells say too little about the scatter between runs
SHIFT_SIGMAS = 2.0  # a shift's band: median ratio +- 2 standard errors
MIN_SHIFT_CELLS = 3  # a group's median moves only when most of its cells do: one cell is the cell's own verdict

# (metric key, label, digits, widened by the machine's noise): judged, higher is better.
JUDGED = (("output_throughput", "output tok/s", 1, True), ("accept_length", "accept length", 2, False))
def check_tolerance(value: Any, where: str) -> float:
    """A tolerance as a float: a number in [0, 1); ConfigError naming `where` (the flag, key or file) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{where}: {value!r} is not a fraction in [0, 1)")
    return float(value)


# -- finding the baseline -----------------------------------------------------------------------

def is_results_dir(path: Path) -> bool:
    return (path / CELLS_DIR).is_dir()


def run_time(results_dir: Path) -> str:
    """When a run started: its earliest cell start (ISO 8601), else the cells folder's mtime."""
    stamps = [c.started_at or c.finished_at for c in read_cells(results_dir)]
    stamps = [s for s in stamps if s]
    if stamps:
        return min(stamps)
    mtime = (results_dir / CELLS_DIR).stat().st_mtime
    return datetime.fromtimestamp(mtime, UTC).isoformat(timespec="seconds")


def resolve_baseline(arg: str, results_dir: Path) -> Path:
    """DIR as given, or `latest`: the newest other results directory beside `results_dir`.

    Raises ValueError naming what was looked at when there is nothing to compare with.
    """
    if arg != LATEST:
        path = Path(arg)
        if not is_results_dir(path):
            raise ValueError(f"--baseline: {path} is not a results directory (it has no {CELLS_DIR}/ folder)")
        return path.resolve()
    parent = results_dir.resolve().parent
    own = results_dir.resolve()
    runs = [p for p in sorted(parent.iterdir()) if p.is_dir() and p.resolve() != own and is_results_dir(p)
            and any((p / CELLS_DIR).glob("*.json"))] if parent.is_dir() else []
    if not runs:
        raise ValueError(f"--baseline latest: no earlier results directory (with {CELLS_DIR}/*.json) "
                         f"beside {results_dir} in {parent}")
    return max(runs, key=lambda p: (run_time(p), p.name)).resolve()


def _one(values: Sequence[str | None], none: str) -> str:
    distinct = sorted({v or none for v in values})
    return ", ".join(distinct) if distinct else none


def run_identity(cells: Sequence[CellResult]) -> dict[str, str]:
    """The commit(s), GPU(s) and backend(s) of a run's cells, as one string each."""
    return {"commit": _one([c.commit for c in cells], "unknown"),
            "gpu": _one([c.gpu for c in cells], "none (CPU)"),
            "backend": _one([c.backend for c in cells], "unknown")}


def baseline_record(baseline_dir: Path, requested: str, tolerance: float) -> dict[str, Any]:
    """What the run keeps about its baseline in baseline.json (see docs/results.md)."""
    cells = read_cells(baseline_dir)
    return {"path": str(baseline_dir), "requested": requested, "tolerance": tolerance,
            "started_at": run_time(baseline_dir), "cells": len(cells), **run_identity(cells),
            "recorded_at": now_iso()}


def write_baseline_record(results_dir: Path, record: dict[str, Any]) -> Path:
    path = results_dir / BASELINE_JSON
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def read_baseline_record(results_dir: Path) -> dict[str, Any] | None:
    path = results_dir / BASELINE_JSON
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "path" not in data:
        raise ValueError(f"{path}: expected a JSON object with a 'path' key")
    return data


# -- spreads and verdicts -----------------------------------------------------------------------

@dataclass(frozen=True)
class Spread:
    """A side's median and the interval its noise allows; `how` says where the interval came from."""

    median: float
    lo: float
    hi: float
    how: str  # "repeats a-b", "MAD", "run noise"

    def text(self, digits: int) -> str:
        return f"{self.median:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def _repeat_values(cell: CellResult, metric: str) -> list[float]:
    values = [r.get(metric) for r in cell.per_repeat]
    return [float(v) for v in values if isinstance(v, (int, float))]


def run_noise(cells: Sequence[CellResult], metric: str) -> float:
    """The run's typical relative sigma of `metric`: 1.4826 x the median over cells of MAD / median."""
    rel = []
    for c in cells:
        median, mad = c.metrics.get(metric), c.metrics.get(f"{metric}_mad")
        if c.repeats >= 2 and isinstance(median, (int, float)) and median > 0 and isinstance(mad, (int, float)):
            rel.append(mad / median)
    return MAD_TO_SIGMA * statistics.median(rel) if rel else 0.0


def spread_of(cell: CellResult, metric: str, noise: float) -> Spread | None:
    median = cell.metrics.get(metric)
    if not isinstance(median, (int, float)):
        return None
    median = float(median)
    values = _repeat_values(cell, metric)
    if len(values) >= 2:
        lo, hi, how = min(values), max(values), f"repeats {min(values):.4g}-{max(values):.4g}"
    else:
        mad = float(cell.metrics.get(f"{metric}_mad") or 0.0)
        lo, hi, how = median - mad, median + mad, f"MAD {mad:.3g}"
    # the noise is a relative sigma of log(tok/s) (speed varies by factors), so the interval it allows is a
    # factor either way: with a sigma of 50% (a loaded machine), 1 - 2 sigma would reach zero and let a 1000x
    # drop overlap
    factor = math.exp(NOISE_SIGMAS * noise)
    if median / factor < lo or median * factor > hi:
        lo, hi = min(lo, median / factor), max(hi, median * factor)
        how += f", widened to the pair's noise x/÷{factor:.2f}"
    return Spread(median, lo, hi, how)


def _mad(values: Sequence[float]) -> float:
    center = statistics.median(values)
    return statistics.median(abs(v - center) for v in values)


def scatter_noise(pairs: Sequence[tuple[CellResult, CellResult]], metric: str) -> float:
    """One side's relative sigma as the compared cells' ratios scatter (0 below MIN_SCATTER_CELLS)."""
    logs = []
    for now, before in pairs:
        a, b = now.metrics.get(metric), before.metrics.get(metric)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
            logs.append(math.log(a / b))
    if len(logs) < MIN_SCATTER_CELLS:
        return 0.0
    return MAD_TO_SIGMA * _mad(logs) / math.sqrt(2)


@dataclass(frozen=True)
class Shift:
    """The median tok/s ratio over a group of cells (all, or one config's) and its band."""

    name: str  # "all cells" or a config id
    cells: int
    ratio: float  # median of the cells' ratios
    lo: float  # the band: ratio x exp(-+ SHIFT_SIGMAS standard errors)
    hi: float
    tolerance: float
    below: tuple[tuple[Key, float], ...] = ()  # the group's cells below 1 - tolerance, with their ratios

    @property
    def verdict(self) -> str:
        if self.ratio < 1 - self.tolerance and self.hi < 1:
            return "regressed"
        if self.ratio > 1 + self.tolerance and self.lo > 1:
            return "improved"
        return "same"

    def text(self) -> str:
        below = ", ".join(f"{key_text(k)} {r:.2f}" for k, r in self.below)
        return (f"{self.name}: {self.verdict}: median tok/s ratio {self.ratio:.2f} over {self.cells} cells "
                f"(band {self.lo:.2f}-{self.hi:.2f}), tolerance {self.tolerance:.0%}"
                + (f"; cells below {1 - self.tolerance:.2f}: {below}" if below and self.verdict == "regressed" else ""))


def shift_of(name: str, ratios: dict[Key, float], sigma: float, tolerance: float) -> Shift:
    """The group's shift; `sigma` is one side's relative sigma (the pair's noise)."""
    center = statistics.median(math.log(r) for r in ratios.values())
    # the standard error of a median is ~1.2533 x that of a mean; a ratio carries both sides' noise
    half = SHIFT_SIGMAS * 1.2533 * math.sqrt(2) * sigma / math.sqrt(len(ratios))
    below = tuple((k, r) for k, r in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))
                  if r < 1 - tolerance)
    return Shift(name, len(ratios), math.exp(center), math.exp(center - half), math.exp(center + half),
                 tolerance, below)


@dataclass(frozen=True)
class MetricDelta:
    metric: str
    label: str
    digits: int
    current: Spread
    baseline: Spread
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.current.median / self.baseline.median if self.baseline.median else float("inf")

    @property
    def overlap(self) -> bool:
        return self.current.lo <= self.baseline.hi and self.baseline.lo <= self.current.hi

    @property
    def verdict(self) -> str:
        if self.ratio < 1 - self.tolerance and not self.overlap:
            return "regressed"
        if self.ratio > 1 + self.tolerance and not self.overlap:
            return "improved"
        return "same"

    def text(self) -> str:
        """measured, baseline, ratio, tolerance and both spreads, in one line."""
        d = self.digits
        noise = "spreads overlap" if self.overlap else "spreads do not overlap"
        return (f"{self.label} {self.current.text(d)} vs baseline {self.baseline.text(d)}: "
                f"ratio {self.ratio:.2f}, tolerance {self.tolerance:.0%}, {noise} "
                f"(now: {self.current.how}; baseline: {self.baseline.how})")


@dataclass(frozen=True)
class CellDelta:
    key: Key
    deltas: tuple[MetricDelta, ...]

    def of(self, metric: str) -> MetricDelta | None:
        return next((d for d in self.deltas if d.metric == metric), None)

    @property
    def verdict(self) -> str:
        verdicts = {d.verdict for d in self.deltas}
        return "regressed" if "regressed" in verdicts else "improved" if "improved" in verdicts else "same"

    def text(self, verdict: str) -> str:
        parts = "; ".join(d.text() for d in self.deltas if d.verdict == verdict)
        return f"{key_text(self.key)}: {verdict}: {parts}"


@dataclass(frozen=True)
class GateDelta:
    """The coding gate of one config on both sides; `passed` None = unknown."""

    config_id: str
    current: float | None  # pass@k
    baseline: float | None
    current_passed: bool | None
    baseline_passed: bool | None

    @property
    def verdict(self) -> str:
        if self.current is None or self.baseline is None:
            return "missing"
        if self.baseline_passed and self.current_passed is False:
            return "regressed"
        if self.baseline_passed is None and self.current < self.baseline:  # no threshold known
            return "regressed"
        if self.baseline_passed is False and self.current_passed:
            return "improved"
        return "same"

    def text(self) -> str:
        def side(value: float | None, passed: bool | None) -> str:
            state = {True: "passed", False: "FAILED", None: "no threshold"}[passed]
            return "not run" if value is None else f"pass@k {value:.3f} ({state})"
        return (f"coding gate {self.config_id}: {self.verdict}: now {side(self.current, self.current_passed)}, "
                f"baseline {side(self.baseline, self.baseline_passed)}")


def gate_passed(record: dict[str, Any], threshold: float | None) -> bool | None:
    """A gate record's own `passed`, else pass@k against its `threshold` (or the given one)."""
    if isinstance(record.get("passed"), bool):
        return bool(record["passed"])
    limit = record.get("threshold", threshold)
    if limit is None or record.get("pass_at_k") is None:
        return None
    floor = record.get("accept_floor")
    accept = record.get("accept_length")
    accept_ok = floor is None or accept is None or accept >= floor
    return bool(record["pass_at_k"] >= limit and accept_ok)


# -- the comparison -----------------------------------------------------------------------------

@dataclass
class Comparison:
    """Every cell and gate of a run against its baseline, and what differs between the two runs."""

    tolerance: float
    baseline_path: str
    baseline: dict[str, str]  # run_identity of the baseline
    current: dict[str, str]
    cells: dict[Key, CellDelta] = field(default_factory=dict)
    only_current: list[Key] = field(default_factory=list)  # new cells, no baseline
    only_baseline: list[Key] = field(default_factory=list)  # measured before, missing now
    gates: list[GateDelta] = field(default_factory=list)
    shifts: list[Shift] = field(default_factory=list)  # all cells first, then per config
    noise: float = 0.0  # one side's relative tok/s sigma used for the spreads
    pace_probe: str | None = None  # tok/s compared pace-normalised by this probe's readings (None: absolute)
    basis: str = DEFAULT_BASIS  # "absolute": the run's floors judge tok/s as measured, and so does the comparison

    @property
    def shift_regressions(self) -> list[Shift]:
        return [x for x in self.shifts if x.verdict == "regressed"]

    @property
    def regressed(self) -> list[CellDelta]:
        return [d for d in self.cells.values() if d.verdict == "regressed"]

    @property
    def improved(self) -> list[CellDelta]:
        return [d for d in self.cells.values() if d.verdict == "improved"]

    @property
    def gate_regressions(self) -> list[GateDelta]:
        return [g for g in self.gates if g.verdict == "regressed"]

    @property
    def ok(self) -> bool:
        return not self.regressed and not self.gate_regressions and not self.shift_regressions

    def differences(self) -> list[str]:
        """Sentences on what differs between the runs besides the numbers (another GPU, commit)."""
        notes = []
        for what, name in (("gpu", "GPU"), ("backend", "backend"), ("commit", "commit")):
            if self.baseline.get(what) != self.current.get(what):
                notes.append(f"{name} differs: baseline {self.baseline.get(what)}, now {self.current.get(what)}"
                             + (" (compared anyway)" if what == "gpu" else ""))
        notes.append(f"tok/s compared pace-normalised (tok/s / pace, probe {self.pace_probe})" if self.pace_probe
                     else "tok/s compared in absolute terms (basis absolute, as the run's floors judge it)"
                     if self.basis == "absolute"
                     else "tok/s compared in absolute terms (the two runs' cells do not all carry one probe's pace)")
        return notes

    def failures(self) -> list[str]:
        return ([x.text() for x in self.shift_regressions] + [d.text("regressed") for d in self.regressed]
                + [g.text() for g in self.gate_regressions])

    def moved(self) -> list[str]:
        """The short "what moved" list: regressions, improvements, flipped gates, missing cells."""
        lines = [f"REGRESSED {line}" for line in self.failures()]
        lines += [f"improved {x.text()}" for x in self.shifts if x.verdict == "improved"]
        lines += [f"improved {d.text('improved')}" for d in self.improved]
        lines += [f"improved {g.text()}" for g in self.gates if g.verdict == "improved"]
        if self.only_baseline:
            lines.append(f"missing now ({len(self.only_baseline)}): "
                         + ", ".join(key_text(k) for k in self.only_baseline))
        if self.only_current:
            lines.append(f"new, no baseline ({len(self.only_current)}): "
                         + ", ".join(key_text(k) for k in self.only_current))
        one_sided = [g.config_id for g in self.gates if g.verdict == "missing"]
        if one_sided:
            lines.append(f"coding gate on one side only ({len(one_sided)}): " + ", ".join(one_sided))
        return lines

    def column(self, key: Key) -> str:
        """The summary table's "vs baseline" cell: tok/s ratio and verdict."""
        delta = self.cells.get(key)
        if delta is None:
            return "new"
        tps = delta.of("output_throughput")
        ratio = f"{tps.ratio:.2f}x" if tps else "-"
        verdict = delta.verdict
        return f"{ratio} **{verdict.upper()}**" if verdict == "regressed" else f"{ratio} {verdict}"


def compare_cells(current: Sequence[CellResult], baseline: Sequence[CellResult], tolerance: float,
                  *, baseline_path: str = "", current_gates: dict[str, dict[str, Any]] | None = None,
                  baseline_gates: dict[str, dict[str, Any]] | None = None,
                  gate_threshold: float | None = None, basis: str = DEFAULT_BASIS) -> Comparison:
    """Compare two runs' cells (and gate records) cell by cell; see the module docstring. `basis`
    "absolute" compares tok/s as measured even where both runs carry one probe's pace."""
    check_tolerance(tolerance, "baseline")
    out = Comparison(tolerance, baseline_path, run_identity(baseline), run_identity(current), basis=basis)
    out.pace_probe = comparable(current, baseline) if basis == "pace" else None
    if out.pace_probe:  # the machine's pace out of the ratio: both sides in tok/s per unit of pace
        current, baseline = [normalised(c) for c in current], [normalised(c) for c in baseline]
    base = {cell_key(c): c for c in baseline}
    cur = {cell_key(c): c for c in current}
    pairs = [(cur[k], base[k]) for k in cur if k in base]
    noise = {m: max(run_noise(baseline, m), scatter_noise(pairs, m)) if widen else 0.0
             for m, _, _, widen in JUDGED}
    out.noise = noise["output_throughput"]
    for key in sorted(cur, key=key_order):
        if key not in base:
            out.only_current.append(key)
            continue
        deltas = []
        for metric, label, digits, _ in JUDGED:
            now, before = spread_of(cur[key], metric, noise[metric]), spread_of(base[key], metric, noise[metric])
            if now is not None and before is not None:
                deltas.append(MetricDelta(metric, label, digits, now, before, tolerance))
        out.cells[key] = CellDelta(key, tuple(deltas))
    ratios: dict[str, dict[Key, float]] = {}
    for key, delta in out.cells.items():
        tps = delta.of("output_throughput")
        if tps is not None and tps.current.median > 0 and tps.baseline.median > 0:
            ratios.setdefault(key[0], {})[key] = tps.ratio
    every = {k: r for rs in ratios.values() for k, r in rs.items()}
    if len(every) >= MIN_SHIFT_CELLS:
        out.shifts.append(shift_of("all cells", every, out.noise, tolerance))
    if len(ratios) > 1:
        out.shifts += [shift_of(config_id, rs, out.noise, tolerance) for config_id, rs in sorted(ratios.items())
                       if len(rs) >= MIN_SHIFT_CELLS]
    out.only_baseline = sorted((k for k in base if k not in cur), key=key_order)
    cur_g, base_g = current_gates or {}, baseline_gates or {}
    for config_id in sorted(set(cur_g) | set(base_g)):
        now_r, before_r = cur_g.get(config_id, {}), base_g.get(config_id, {})
        out.gates.append(GateDelta(config_id, now_r.get("pass_at_k"), before_r.get("pass_at_k"),
                                   gate_passed(now_r, gate_threshold) if now_r else None,
                                   gate_passed(before_r, gate_threshold) if before_r else None))
    return out


def compare_runs(current_dir: Path, baseline_dir: Path, tolerance: float = DEFAULT_TOLERANCE,
                 gate_threshold: float | None = None, basis: str | None = None) -> Comparison:
    """compare_cells on two results directories; `basis` None: the one the current run's floors judged by
    (its verdicts.json), pace where it has none."""
    if basis is None:
        basis = str((read_verdicts(current_dir) or {}).get("tolerances", {}).get("basis") or DEFAULT_BASIS)
    return compare_cells(read_cells(current_dir), read_cells(baseline_dir), tolerance,
                         baseline_path=str(baseline_dir), current_gates=read_quality(current_dir),
                         baseline_gates=read_quality(baseline_dir), gate_threshold=gate_threshold, basis=basis)
