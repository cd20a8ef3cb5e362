"""Sweep plots (PNG, matplotlib's Agg canvas; no display, no pyplot global state).

Per context:
    budget_ctx<C>.png    output tok/s (top row) and acceptance length (bottom row) against the tree
                         budget, one column per load (concurrency, then request rate), one line per (topk, window, block)
                         family; DFLASH / AR baselines as dashed horizontal lines
    latency_ctx<C>.png   median TPOT against output tok/s, one line per config through its
                         loads (the latency/throughput trade-off)
    pareto_ctx<C>.png    output tok/s per user (1000 / median TPOT) against aggregate output tok/s,
                         one point per config x load, the Pareto frontier marked (pareto.py); only
                         when some cell has a median TPOT (a streaming service)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddtree.bench import pareto
from ddtree.bench.results import CellResult, read_cells

PLOTS_DIR = "plots"


def _family(cell: CellResult) -> str | None:
    """The (topk, window, block) family of a DDTREE cell; None for baselines."""
    spec = cell.spec
    if spec.get("algorithm") != "DDTREE":
        return None
    window = spec.get("draft_window") or "none"
    return f"k{spec.get('topk')}-w{window}-bs{spec.get('block_size')}"


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def _budget_panel(ax: Axes, cells: Sequence[CellResult], metric: str, label: str) -> None:
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for c in cells:
        value = c.metrics.get(metric)
        if value is None:
            continue
        family = _family(c)
        if family is None:
            ax.axhline(value, linestyle="--", linewidth=1, color="gray")
            ax.annotate(c.config_id, (0.01, value), xycoords=("axes fraction", "data"),
                        fontsize=7, color="gray", va="bottom")
        else:
            lines[family].append((int(c.spec["budget"]), float(value)))
    for family, points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=family)
    ax.set_xlabel("budget (tree nodes)")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize=7)


def _load_order(cell: CellResult) -> tuple[bool, int, float]:
    """Concurrency levels first, then request rates."""
    return (cell.request_rate is not None, cell.concurrency, cell.request_rate or 0.0)


def _load_title(load: str) -> str:
    return f"concurrency {load[1:]}" if load.startswith("c") else f"{load[1:]} requests/s"


def plot_budget(cells: Sequence[CellResult], context: int, path: Path) -> Path:
    levels = list(dict.fromkeys(c.load for c in sorted(cells, key=_load_order)))
    fig = Figure(figsize=(4.5 * len(levels), 7), layout="constrained")
    axes = fig.subplots(2, len(levels), squeeze=False)
    for col, level in enumerate(levels):
        at = [c for c in cells if c.load == level]
        _budget_panel(axes[0][col], at, "output_throughput", "output tok/s")
        _budget_panel(axes[1][col], at, "accept_length", "acceptance length")
        axes[0][col].set_title(_load_title(level))
    fig.suptitle(f"context {context}: throughput and acceptance vs budget")
    return _save(fig, path)


def plot_latency(cells: Sequence[CellResult], context: int, path: Path) -> Path:
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    by_config: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for c in sorted(cells, key=_load_order):  # each config's line runs through its loads in order
        tps, tpot = c.metrics.get("output_throughput"), c.metrics.get("median_tpot_ms")
        if tps is not None and tpot is not None:
            by_config[c.config_id].append((float(tps), float(tpot), c.load))
    for config_id, line in sorted(by_config.items()):
        ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", label=config_id)
        for tps, tpot, load in line:
            ax.annotate(load, (tps, tpot), fontsize=6, textcoords="offset points",
                        xytext=(3, 3))
    ax.set_xlabel("output tok/s")
    ax.set_ylabel("median TPOT (ms)")
    ax.set_title(f"context {context}: latency vs throughput")
    ax.grid(True, alpha=0.3)
    if by_config:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_pareto(cells: Sequence[CellResult], context: int, path: Path) -> Path:
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    pts = pareto.points(cells)
    by_config: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for p in pts:
        by_config[p.config_id].append((p.aggregate, p.per_user, p.load))
    for config_id, group in sorted(by_config.items()):
        ax.plot([g[0] for g in group], [g[1] for g in group], marker="o", linestyle="none", label=config_id)
        for x, y, load in group:
            ax.annotate(load, (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
    front = pareto.frontier(pts)
    ax.plot([p.aggregate for p in front], [p.per_user for p in front], linestyle="--", color="black", linewidth=1,
            marker="o", markersize=11, markerfacecolor="none", label="Pareto frontier")
    ax.set_xlabel("aggregate output tok/s")
    ax.set_ylabel("output tok/s per user (1000 / median TPOT)")
    ax.set_title(f"context {context}: per-user vs aggregate throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def write_plots(results_dir: str | Path, cells: Sequence[CellResult] | None = None) -> list[Path]:
    """Write every plot for the cells (read from results_dir when not given); returns the paths."""
    cells = read_cells(results_dir) if cells is None else list(cells)
    out = Path(results_dir) / PLOTS_DIR
    written = []
    for context in sorted({c.context for c in cells}):
        at = [c for c in cells if c.context == context]
        written.append(plot_budget(at, context, out / f"budget_ctx{context}.png"))
        written.append(plot_latency(at, context, out / f"latency_ctx{context}.png"))
        if pareto.points(at):
            written.append(plot_pareto(at, context, out / f"pareto_ctx{context}.png"))
    return written
