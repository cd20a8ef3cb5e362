"""Trend across runs, and the offline baseline comparison's plot (PNG via matplotlib's Agg canvas).

    ddtree sweep-report --trend results/night-*  --out trend/     # trend.md + trend_ctx<C>_c<N>.png (_r<R>: a rate)
    ddtree sweep-report --compare OLD NEW                          # NEW/vs_baseline.md + NEW/plots/vs_baseline.png

Trend: the runs are ordered by when they started (their earliest cell's started_at). For each
(context, load) one PNG with two panels, output tok/s (median, the repeats' range as an
error bar) and acceptance length, against the run's date, one line per config; and a markdown
table beside it, a row per config and a column per run. Reads result files only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddtree.bench.arrivals import load_label
from ddtree.bench.baseline import Comparison, run_identity, run_time
from ddtree.bench.cell_keys import key_load, key_order
from ddtree.bench.results import CellResult, atomic_write_text, read_cells

TREND_MD = "trend.md"


@dataclass(frozen=True)
class Run:
    """One results directory on the trend: when it started, its commit, its cells."""

    path: Path
    started_at: str  # ISO 8601
    commit: str
    gpu: str
    cells: list[CellResult]

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.started_at)

    @property
    def label(self) -> str:
        return f"{self.when:%Y-%m-%d %H:%M} {self.commit[:7]}"


def load_runs(dirs: Sequence[Path]) -> list[Run]:
    """The runs in `dirs` (each a results directory with cells), oldest first."""
    runs = []
    for d in dirs:
        cells = read_cells(d)
        if not cells:
            raise ValueError(f"--trend: {d} has no cell files (cells/*.json)")
        identity = run_identity(cells)
        runs.append(Run(Path(d), run_time(Path(d)), identity["commit"], identity["gpu"], cells))
    return sorted(runs, key=lambda r: (r.when, str(r.path)))


def _key(cell: CellResult) -> tuple[int, bool, int, float]:
    """(context, is a rate cell, concurrency, rate): a cell's place in a trend; concurrency levels sort first."""
    return (cell.context, cell.request_rate is not None, cell.concurrency, cell.request_rate or 0.0)


def _title(key: tuple[int, bool, int, float]) -> str:
    return f"context {key[0]}, " + (f"{key[3]:g} requests/s" if key[1] else f"concurrency {key[2]}")


def _series(runs: Sequence[Run], key: tuple[int, bool, int, float],
            metric: str) -> dict[str, list[tuple[datetime, float, float, float]]]:
    """config id -> [(date, median, lo, hi)] for one (context, load) and metric."""
    out: dict[str, list[tuple[datetime, float, float, float]]] = defaultdict(list)
    for run in runs:
        for c in run.cells:
            value = c.metrics.get(metric)
            if _key(c) != key or not isinstance(value, (int, float)):
                continue
            repeats = [float(r[metric]) for r in c.per_repeat if isinstance(r.get(metric), (int, float))]
            lo, hi = (min(repeats), max(repeats)) if repeats else (value, value)
            out[c.config_id].append((run.when, float(value), lo, hi))
    return out


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_trend(runs: Sequence[Run], key: tuple[int, bool, int, float], path: Path) -> Path:
    fig = Figure(figsize=(9, 7), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    configs = sorted({c.config_id for run in runs for c in run.cells})
    color = {config_id: f"C{i % 10}" for i, config_id in enumerate(configs)}  # the same in both panels
    for ax, metric, label in ((axes[0], "output_throughput", "output tok/s (median, repeats' range)"),
                              (axes[1], "accept_length", "acceptance length (tokens / step)")):
        for config_id, points in sorted(_series(runs, key, metric).items()):
            dates = [p[0] for p in points]
            values = [p[1] for p in points]
            errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
            ax.errorbar(dates, values, yerr=errors, marker="o", capsize=3, label=config_id, color=color[config_id])
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[1].set_xlabel("run start (UTC)")
    fig.autofmt_xdate()
    fig.suptitle(f"{_title(key)}: {len(runs)} runs")
    return _save(fig, path)


def render_trend(runs: Sequence[Run], pngs: dict[tuple[int, bool, int, float], Path]) -> str:
    lines = ["# Trend", "", f"{len(runs)} runs, oldest first:", ""]
    lines += [f"{i + 1}. {run.label}: `{run.path}` (GPU {run.gpu})" for i, run in enumerate(runs)]
    lines.append("")
    for key in sorted(pngs):
        lines += [f"## {_title(key)}", "", f"![trend]({pngs[key].name})", "",
                  "output tok/s (acceptance length) per run:", "",
                  "| config | " + " | ".join(str(i + 1) for i in range(len(runs))) + " |",
                  "|---|" + "---|" * len(runs)]
        table: dict[str, list[str]] = defaultdict(lambda: ["-"] * len(runs))
        for i, run in enumerate(runs):
            for c in run.cells:
                if _key(c) == key:
                    tps, acc = c.metrics.get("output_throughput"), c.metrics.get("accept_length")
                    table[c.config_id][i] = ("-" if tps is None else f"{tps:.1f}") + (
                        "" if acc is None else f" ({acc:.2f})")
        lines += [f"| {config_id} | " + " | ".join(values) + " |" for config_id, values in sorted(table.items())]
        lines.append("")
    return "\n".join(lines)


def write_trend(dirs: Sequence[Path], out: Path) -> list[Path]:
    """trend.md and one trend_ctx<C>_c<N>.png (_r<R>.png: a rate) per (context, load) under `out`."""
    runs = load_runs(dirs)
    keys = sorted({_key(c) for run in runs for c in run.cells})
    pngs = {key: plot_trend(runs, key, out / f"trend_ctx{key[0]}_{load_label(key[2], key[3] if key[1] else None)}.png")
            for key in keys}
    md = out / TREND_MD
    atomic_write_text(md, render_trend(runs, pngs))
    return [md, *pngs.values()]


def plot_comparison(comparison: Comparison, path: Path) -> Path:
    """Bars of now / baseline tok/s per cell, the tolerance band shaded, regressions in red."""
    deltas = sorted(comparison.cells.values(), key=lambda d: key_order(d.key))
    rows = [(d, d.of("output_throughput")) for d in deltas]
    rows = [(d, m) for d, m in rows if m is not None]
    fig = Figure(figsize=(9, max(3.0, 0.3 * len(rows) + 1.5)), layout="constrained")
    ax = fig.subplots()
    colors = {"regressed": "tab:red", "improved": "tab:green", "same": "tab:gray"}
    ax.barh(range(len(rows)), [m.ratio for _, m in rows], color=[colors[d.verdict] for d, _ in rows])
    ax.set_yticks(range(len(rows)), [f"{d.key[0]} ctx{d.key[1]} {key_load(d.key)}" for d, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvspan(1 - comparison.tolerance, 1 + comparison.tolerance, color="tab:blue", alpha=0.1,
               label=f"tolerance ±{comparison.tolerance:.0%}")
    for shift in comparison.shifts[:1]:  # all cells: where the whole run moved
        ax.axvline(shift.ratio, color=colors[shift.verdict], linestyle="--", linewidth=1.5,
                   label=f"median ratio, all cells: {shift.ratio:.2f} ({shift.verdict})")
    ax.set_xlabel("output tok/s, now / baseline (red: regressed, green: improved)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"vs baseline {comparison.baseline_path}", fontsize=9)
    return _save(fig, path)
