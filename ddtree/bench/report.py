"""The sweep summary: tables per (context, concurrency), a winner per objective, a recommendation.

Reads result files only (never a live service), so `ddtree sweep-report RESULTS_DIR` rebuilds the
CSV, this summary and the plots from a finished or interrupted sweep.

Objectives, each over a slice of cells:
    latency     concurrency = the lowest measured (1 in a normal grid), every context; lowest median TPOT
    throughput  concurrency = the highest measured, every context; highest output tok/s
    long_ctx    context = the longest measured, every concurrency; highest output tok/s
Within a slice a config scores the mean over its (context, concurrency) keys of its value relative to
the best value at that key (1.0 = best everywhere), so a slice with several keys is scale-free. A
cell with failed requests is not eligible, and only configs measured at the most keys of the slice
compete. The recommended default wins the most objectives; ties go to the current default, then to
the higher total score, then to the id. The objectives read closed-loop cells (a concurrency); rate
cells count in the SLO answer (answer.py), which leads the summary when the sweep ran under SLOs,
and in the Pareto frontier (pareto.py). A table of deploys (deploys.py) follows.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.bench.answer import recommended_points, slo_answer
from ddtree.bench.baseline import (
    COMPARE_MD,
    DEFAULT_TOLERANCE,
    Comparison,
    check_tolerance,
    compare_runs,
    is_results_dir,
    read_baseline_record,
)
from ddtree.bench.cell_keys import cell_key
from ddtree.bench.comparison_md import render_comparison, render_header
from ddtree.bench.deploys import deploy_table, read_deploys
from ddtree.bench.normalise import BASES
from ddtree.bench.pareto import pareto_lines
from ddtree.bench.results import (
    CellResult,
    atomic_write_text,
    read_cells,
    read_quality,
    read_restore,
    write_restore,
    write_summary_csv,
)
from ddtree.bench.verdicts import pace_lines, read_verdicts, verdict_lines
from ddtree.config import DEFAULT_SPEC

SUMMARY_MD = "sweep_summary.md"


@dataclass(frozen=True)
class Objective:
    name: str
    title: str
    metric: str
    higher_is_better: bool
    where: str  # the slice, in words
    select: Callable[[Sequence[CellResult]], list[CellResult]]


@dataclass(frozen=True)
class Winner:
    objective: Objective
    config_id: str | None  # None when no cell was eligible
    value: float | None  # the winner's mean metric over the slice
    scores: dict[str, float]  # config id -> relative score (1.0 = best at every key)


def _at_concurrency(pick: Callable[[Sequence[int]], int]) -> Callable[[Sequence[CellResult]], list[CellResult]]:
    def select(cells: Sequence[CellResult]) -> list[CellResult]:
        if not cells:
            return []
        level = pick([c.concurrency for c in cells])
        return [c for c in cells if c.concurrency == level]
    return select


def _longest_context(cells: Sequence[CellResult]) -> list[CellResult]:
    if not cells:
        return []
    longest = max(c.context for c in cells)
    return [c for c in cells if c.context == longest]


OBJECTIVES = (
    Objective("latency", "Single-request latency", "median_tpot_ms", False,
              "lowest concurrency, lowest median TPOT", _at_concurrency(min)),
    Objective("throughput", "Aggregate throughput", "output_throughput", True,
              "highest concurrency, highest output tok/s", _at_concurrency(max)),
    Objective("long_context", "Long context", "output_throughput", True,
              "longest context, highest output tok/s", _longest_context),
)


def _eligible(cell: CellResult, metric: str) -> bool:
    value = cell.metrics.get(metric)
    return int(cell.metrics.get("failed") or 0) == 0 and isinstance(value, (int, float)) and value > 0


def pick_winner(objective: Objective, cells: Sequence[CellResult], default_id: str) -> Winner:
    chosen = [c for c in objective.select(cells) if _eligible(c, objective.metric)]
    by_key: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for c in chosen:
        by_key[(c.context, c.concurrency)][c.config_id] = float(c.metrics[objective.metric])
    per_config: dict[str, list[float]] = defaultdict(list)  # relative scores
    raw: dict[str, list[float]] = defaultdict(list)
    for values in by_key.values():
        best = max(values.values()) if objective.higher_is_better else min(values.values())
        for config_id, value in values.items():
            rel = value / best if objective.higher_is_better else best / value
            per_config[config_id].append(rel)
            raw[config_id].append(value)
    if not per_config:
        return Winner(objective, None, None, {})
    most = max(len(v) for v in per_config.values())
    scores = {k: sum(v) / len(v) for k, v in per_config.items() if len(v) == most}
    top = max(scores.values())
    # Exact ties (e.g. identical numbers) prefer the current default, then the id order.
    tied = sorted(k for k, s in scores.items() if s >= top - 1e-12)
    winner = default_id if default_id in tied else tied[0]
    return Winner(objective, winner, sum(raw[winner]) / len(raw[winner]), scores)


def recommend(winners: Sequence[Winner], default_id: str) -> str | None:
    wins: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for w in winners:
        if w.config_id is not None:
            wins[w.config_id] += 1
        for config_id, score in w.scores.items():
            total[config_id] += score
    if not wins:
        return None
    most = max(wins.values())
    tied = [k for k, n in wins.items() if n == most]
    if default_id in tied:
        return default_id
    return sorted(tied, key=lambda k: (-total[k], k))[0]


# -- markdown ----------------------------------------------------------------------------------

def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pm(metrics: dict[str, Any], key: str, digits: int = 1) -> str:
    value, spread = metrics.get(key), metrics.get(f"{key}_mad")
    if value is None:
        return "-"
    return f"{value:.{digits}f} ± {spread:.{digits}f}" if spread is not None else f"{value:.{digits}f}"


def _quality(cell: CellResult) -> str:
    q = cell.quality
    if not q or q.get("pass_at_k") is None:
        return "-"
    unsafe = ", best-effort isolation: --unsafe-exec" if q.get("isolation") == "best-effort" else ""
    return f"{q['pass_at_k']:.3f} (k={q.get('k')}, n={q.get('n')}{unsafe})"


def _table(cells: Sequence[CellResult], default_id: str, comparison: Comparison | None = None) -> list[str]:
    extra = (" vs baseline |", "---|") if comparison else ("", "")
    lines = [
        "| config | output tok/s (median ± MAD) | pace | tok/s / pace | x AR | TPOT ms | TTFT ms | accept len "
        "| coding pass@k | failed |" + extra[0],
        "|---|---|---|---|---|---|---|---|---|---|" + extra[1],
    ]
    ranked = sorted(cells, key=lambda c: (-(c.metrics.get("output_throughput") or 0.0), c.config_id))
    for c in ranked:
        name = f"**{c.config_id}** (default)" if c.config_id == default_id else c.config_id
        m = c.metrics
        lines.append(
            f"| {name} | {_pm(m, 'output_throughput')} | {_num((c.pace or {}).get('score'), 3)} | "
            f"{_num(m.get('pace_normalized_throughput'))} | {_num(m.get('speedup_vs_ar'), 2)} | "
            f"{_pm(m, 'median_tpot_ms', 2)} | "
            f"{_pm(m, 'median_ttft_ms')} | {_num(m.get('accept_length'), 2)} | {_quality(c)} | "
            f"{m.get('failed', 0)}/{(m.get('completed') or 0) + (m.get('failed') or 0)} |"
            + (f" {comparison.column(cell_key(c))} |" if comparison else "")
        )
    return lines


def restore_line(restore: dict[str, Any] | None) -> str:
    """`restore` = {"ok"/"verified": bool, "config_id": str, "checks": [str] | str, "error": str}."""
    if restore is None:
        return "Restore: not recorded (no restore outcome was given or found in restore.json)."
    ok = bool(restore.get("ok", restore.get("verified", False)))
    config_id = restore.get("config_id", "?")
    checks = restore.get("checks") or []
    checked = ", ".join(checks) if isinstance(checks, list) else str(checks)
    if ok:
        return f"Restore: default {config_id} **verified** (checked: {checked or 'nothing recorded'})."
    error = restore.get("error") or "no detail recorded"
    return f"Restore: default {config_id} **FAILED**: {error} (checked: {checked or 'nothing'})."


def render_summary(cells: Sequence[CellResult], default_id: str, restore: dict[str, Any] | None,
                   comparison: Comparison | None = None, baseline: dict[str, Any] | None = None,
                   verdicts: Sequence[str] = (), deploys: Sequence[dict[str, Any]] | None = None) -> str:
    """The summary; with a `comparison` (and its baseline.json `baseline`) a vs-baseline part too;
    `verdicts`: the "Pace and verdicts" lines (ddtree.bench.verdicts); `deploys` (deploys.json's entries):
    their table."""
    lines = ["# Sweep summary", ""]
    if not cells:
        return "\n".join([*lines, "No cells were measured.", "", restore_line(restore), "",
                          *_baseline_part(comparison, baseline)])
    commits = sorted({c.commit for c in cells})
    gpus = sorted({c.gpu or "none (CPU)" for c in cells})
    backends = sorted({c.backend for c in cells})
    lines += [
        f"{len(cells)} cells, {len({c.config_id for c in cells})} configs; current default "
        f"`{default_id}`; commit {', '.join(commits)}; GPU {', '.join(gpus)}; "
        f"backend {', '.join(backends)}.",
        "",
    ]
    lines += slo_answer(cells, default_id)
    closed_loop = [c for c in cells if c.request_rate is None]
    winners = [pick_winner(o, closed_loop, default_id) for o in OBJECTIVES]
    recommended = recommend(winners, default_id)
    lines += ["## Recommendation", ""]
    for w in winners:
        o = w.objective
        if w.config_id is None:
            lines.append(f"- {o.title} ({o.where}): no eligible cell (all failed or missing).")
            continue
        unit = "ms TPOT" if o.metric == "median_tpot_ms" else "tok/s"
        lines.append(f"- {o.title} ({o.where}): **{w.config_id}** ({_num(w.value, 2)} {unit})")
    if recommended is None:
        lines.append("- Recommended default: none (no eligible cell).")
    else:
        note = "keep the current default" if recommended == default_id else f"replaces {default_id}"
        lines.append(f"- Recommended default: **{recommended}** ({note})")
    lines += ["", restore_line(restore), ""]
    if verdicts:
        lines += ["## Pace and verdicts", "", *verdicts, ""]
    lines += _baseline_part(comparison, baseline)
    lines += pareto_lines(cells, recommended_points(cells, default_id, recommended))
    lines += deploy_table(deploys) if deploys is not None else []
    groups: dict[tuple[int, str], list[CellResult]] = defaultdict(list)
    for c in sorted(cells, key=lambda c: (c.context, c.request_rate is not None, c.concurrency, c.request_rate or 0.0)):
        groups[(c.context, c.load)].append(c)  # concurrency levels first, then rates
    for (context, load), group in groups.items():
        title = f"concurrency {load[1:]}" if load.startswith("c") else f"{load[1:]} requests/s (open loop)"
        lines += [f"## context {context}, {title}", ""]
        lines += _table(group, default_id, comparison)
        lines.append("")
    return "\n".join(lines)


def with_quality(results_dir: str | Path, cells: Sequence[CellResult]) -> list[CellResult]:
    """Attach the coding gate's result (quality/<config id>.json, written per config) to its cells."""
    gates = read_quality(results_dir)
    return [c if c.quality or c.config_id not in gates else dataclasses.replace(c, quality=gates[c.config_id])
            for c in cells]


def _baseline_part(comparison: Comparison | None, baseline: dict[str, Any] | None) -> list[str]:
    if baseline is None:
        return []
    if comparison is None:
        return ["## vs baseline", "", f"Baseline `{baseline.get('path')}` is not readable any more: "
                f"{baseline.get('error', 'no cells')}.", ""]
    return ["## vs baseline", "", *render_header(comparison, baseline)]


def baseline_comparison(results_dir: Path) -> tuple[Comparison | None, dict[str, Any] | None]:
    """The run's baseline.json and the comparison with it (None, record) when the baseline is gone."""
    record = read_baseline_record(results_dir)
    if record is None:
        return None, None
    baseline_dir = Path(record["path"])
    if not is_results_dir(baseline_dir):
        return None, {**record, "error": f"{baseline_dir} has no cells/ folder"}
    tolerance = float(record.get("tolerance", DEFAULT_TOLERANCE))
    return compare_runs(results_dir, baseline_dir, tolerance, record.get("gate_threshold")), record


def write_sweep_summary(results_dir: str | Path, default_config_id: str,
                        restore: dict[str, Any] | None) -> Path:
    """Write sweep_summary.md from the cell files; a given `restore` is also kept in restore.json.

    With a baseline.json in the folder (a run with --baseline), the tables get a "vs baseline"
    column and the summary a "what moved" list.
    """
    if restore is not None:
        write_restore(results_dir, restore)
    comparison, record = baseline_comparison(Path(results_dir))
    cells = with_quality(results_dir, read_cells(results_dir))
    verdicts = pace_lines(cells, results_dir) + verdict_lines(read_verdicts(results_dir))
    text = render_summary(cells, default_config_id, restore, comparison, record, verdicts, read_deploys(results_dir))
    path = Path(results_dir) / SUMMARY_MD
    atomic_write_text(path, text)
    return path


def _compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--compare OLD NEW: NEW/vs_baseline.md (and its plot); exit 1 when something regressed."""
    old, new = args.compare
    for where, path in (("OLD", old), ("NEW", new)):
        if not is_results_dir(path):
            parser.error(f"--compare {where}: {path} has no cells/ directory")
    try:
        tolerance = check_tolerance(args.tolerance, "--tolerance")
    except ValueError as err:
        parser.error(str(err))
    comparison = compare_runs(new, old, tolerance, args.gate_threshold, args.basis)
    out = args.out or new
    written = [out / COMPARE_MD]
    atomic_write_text(written[0], render_comparison(comparison, str(new)))
    if not args.no_plots:
        from ddtree.bench.trend import plot_comparison  # matplotlib only when plotting

        written.append(plot_comparison(comparison, out / "plots" / "vs_baseline.png"))
    for path in written:
        print(path)
    for line in comparison.differences():
        print(f"note: {line}")
    for line in comparison.failures():
        print(f"REGRESSED {line}", file=sys.stderr)
    print(f"verdict: {'no regression' if comparison.ok else 'REGRESSION'} ({len(comparison.cells)} cells compared, "
          f"{len(comparison.improved)} improved, {len(comparison.only_baseline)} missing now)")
    return 0 if comparison.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`ddtree sweep-report RESULTS_DIR | --compare OLD NEW | --trend DIR...` (see --help)."""
    parser = argparse.ArgumentParser(
        prog="ddtree sweep-report",
        description="Rebuild summary.csv, sweep_summary.md and plots/ from a results directory; or compare a "
                    "run with a baseline run (--compare, exit 1 on a regression); or plot a trend over runs.")
    parser.add_argument("results_dir", type=Path, nargs="?")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"),
                        help="judge NEW's cells against OLD's: writes NEW/vs_baseline.md and NEW/plots/vs_baseline.png")
    parser.add_argument("--trend", nargs="+", type=Path, metavar="DIR",
                        help="runs to plot by date: writes OUT/trend.md and OUT/trend_ctx<C>_c<N>.png")
    parser.add_argument("--out", type=Path, default=None,
                        help="where --compare and --trend write (default: NEW for --compare, ./trend for --trend)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"--compare: fraction a median may drop before it can regress (default {DEFAULT_TOLERANCE:g})")
    parser.add_argument("--basis", choices=BASES, default=None,
                        help="--compare: tok/s per unit of pace or as measured (default: what NEW's "
                             "floors judged by, from its verdicts.json; pace without one)")
    parser.add_argument("--gate-threshold", type=float, default=None,
                        help="--compare: pass@k threshold for gate records that carry none")
    parser.add_argument("--default", dest="default_id", default=None,
                        help="the current default config id (default: restore.json's, else "
                             f"{DEFAULT_SPEC.id})")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    modes = [m for m in ("results_dir", "compare", "trend") if getattr(args, m)]
    if len(modes) != 1:
        parser.error("give one of RESULTS_DIR, --compare OLD NEW or --trend DIR...")
    if args.compare:
        return _compare(parser, args)
    if args.trend:
        from ddtree.bench.trend import write_trend  # matplotlib only when plotting

        try:
            written = write_trend(args.trend, args.out or Path("trend"))
        except ValueError as err:
            parser.error(str(err))
        for path in written:
            print(path)
        return 0
    if not (args.results_dir / "cells").is_dir():
        parser.error(f"results_dir: {args.results_dir} has no cells/ directory")
    restore = read_restore(args.results_dir)
    default_id = args.default_id or (restore or {}).get("config_id") or DEFAULT_SPEC.id
    csv_path = write_summary_csv(args.results_dir)
    md_path = write_sweep_summary(args.results_dir, default_id, restore)
    written = [csv_path, md_path]
    if not args.no_plots:
        from ddtree.bench.plots import write_plots  # matplotlib only when plotting

        written += write_plots(args.results_dir)
    for path in written:
        print(path)
    return 0
