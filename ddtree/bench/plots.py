"""Sweep plots (PNG, matplotlib's Agg canvas; no display, no pyplot global state).

Per context:
    budget_ctx<C>.png    output tok/s (top row) and acceptance length (bottom row) against the tree
                         budget, one column per concurrency, one line per (topk, window, block)
                         family; DFLASH / AR baselines as dashed horizontal lines
    latency_ctx<C>.png   median TPOT against output tok/s, one line per config through its
                         concurrency levels (the latency/throughput trade-off)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

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


def plot_budget(cells: Sequence[CellResult], context: int, path: Path) -> Path:
    levels = sorted({c.concurrency for c in cells})
    fig = Figure(figsize=(4.5 * len(levels), 7), layout="constrained")
    axes = fig.subplots(2, len(levels), squeeze=False)
    for col, level in enumerate(levels):
        at = [c for c in cells if c.concurrency == level]
        _budget_panel(axes[0][col], at, "output_throughput", "output tok/s")
        _budget_panel(axes[1][col], at, "accept_length", "acceptance length")
        axes[0][col].set_title(f"concurrency {level}")
    fig.suptitle(f"context {context}: throughput and acceptance vs budget")
    return _save(fig, path)


def plot_latency(cells: Sequence[CellResult], context: int, path: Path) -> Path:
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    by_config: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for c in cells:
        tps, tpot = c.metrics.get("output_throughput"), c.metrics.get("median_tpot_ms")
        if tps is not None and tpot is not None:
            by_config[c.config_id].append((float(tps), float(tpot), c.concurrency))
    for config_id, points in sorted(by_config.items()):
        points.sort(key=lambda p: p[2])
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config_id)
        for tps, tpot, level in points:
            ax.annotate(f"c{level}", (tps, tpot), fontsize=6, textcoords="offset points",
                        xytext=(3, 3))
    ax.set_xlabel("output tok/s")
    ax.set_ylabel("median TPOT (ms)")
    ax.set_title(f"context {context}: latency vs throughput")
    ax.grid(True, alpha=0.3)
    if by_config:
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
    return written
