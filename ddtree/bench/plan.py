"""A sweep's plan before it runs: the deploy order, deploys and cells, and what it will cost in wall time.

Each config with cells is deployed once, in the grid's deploy order, and the default is deployed again at
the end unless it was the last one (the restore). A backend that only observes (url) restarts nothing.

The estimate comes from a previous run's results directory: each deploy takes its config's median
cold start there (deploys.json; a config it never deployed: the median of all its deploys), each cell
the time of the same cell there, else of the cells at the same context and load, else at the same
context, else of any cell, scaled by the requests it sends (warm-up + repeats x requests per cell).
A cell's time is its file's finished_at - started_at (at least its repeats' summed duration). Without a
previous run the plan says that it has no estimate; it never guesses.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ddtree.bench.deploys import DEPLOYS_JSON, cold_starts, read_deploys
from ddtree.bench.results import CellResult, read_cells
from ddtree.grid import Cell, Grid


@dataclass
class Step:
    """One deploy and the cells measured on it."""

    config_id: str
    purpose: str  # sweep | restore
    cells: list[Cell] = field(default_factory=list)
    deploy_s: float | None = None
    cells_s: float | None = None


@dataclass
class Plan:
    steps: list[Step]
    restarts: bool  # False: the backend only observes, nothing is started
    source: Path | None = None  # the previous run the estimate comes from
    notes: list[str] = field(default_factory=list)  # how the estimate was matched

    @property
    def cells(self) -> int:
        return sum(len(s.cells) for s in self.steps)

    @property
    def deploys(self) -> int:
        return len(self.steps) if self.restarts else 0

    def total_s(self) -> tuple[float | None, float | None]:
        """(deploys' seconds, cells' seconds); None where there is no estimate."""
        deploy = [s.deploy_s for s in self.steps]
        cells = [s.cells_s for s in self.steps if s.cells]
        return (sum(d for d in deploy if d is not None) if all(d is not None for d in deploy) else None,
                sum(c for c in cells if c is not None) if all(c is not None for c in cells) else None)


def deploy_steps(cells: Sequence[Cell], default_id: str) -> list[Step]:
    """Deploys in order: each config's cells (the cells come in deploy order), then the restore."""
    steps: list[Step] = []
    for cell in cells:
        if not steps or steps[-1].config_id != cell.config_id:
            steps.append(Step(cell.config_id, "sweep"))
        steps[-1].cells.append(cell)
    if not steps or steps[-1].config_id != default_id:
        steps.append(Step(default_id, "restore"))
    return steps


def _seconds(cell: CellResult) -> float | None:
    try:
        wall = (datetime.fromisoformat(cell.finished_at) - datetime.fromisoformat(cell.started_at)).total_seconds()
    except ValueError:
        wall = 0.0
    measured = sum(float(r.get("duration_s") or 0.0) for r in cell.per_repeat)
    best = max(wall, measured)
    return best if best > 0 else None


def _requests(repeats: int, per_cell: int, warmup: int) -> int:
    return warmup + repeats * per_cell


def _per_request_times(previous: Sequence[CellResult]) -> dict[tuple[str, int, str], float]:
    times = {}
    for c in previous:
        seconds = _seconds(c)
        sent = _requests(c.repeats, int(c.client.get("requests_per_cell") or 0), int(c.client.get("warmup_requests") or 0))
        if seconds is not None and sent > 0:
            times[(c.config_id, c.context, c.load)] = seconds / sent
    return times


def estimate(plan: Plan, grid: Grid, previous_dir: Path) -> Plan:
    """Fill the plan's deploy and cell times from `previous_dir` (a results directory)."""
    plan.source = previous_dir
    entries = read_deploys(previous_dir)
    starts = cold_starts(entries)
    if not plan.restarts:
        for step in plan.steps:
            step.deploy_s = 0.0
        plan.notes.append("deploys: none restart (the backend only observes)")
    elif starts:
        overall = statistics.median(starts.values())
        for step in plan.steps:
            step.deploy_s = starts.get(step.config_id, overall)
        known = sum(1 for s in plan.steps if s.config_id in starts)
        plan.notes.append(f"deploys: {known} of {len(plan.steps)} by their config's cold start, the rest at the "
                          f"median {overall:.1f} s")
    else:
        plan.notes.append(f"deploys: no estimate (no successful restart in {previous_dir / DEPLOYS_JSON})")
    per_request = _per_request_times(read_cells(previous_dir))
    if not per_request:
        plan.notes.append(f"cells: no estimate (no timed cell in {previous_dir})")
        return plan
    sent = _requests(grid.repeats, grid.requests_per_cell, grid.warmup_requests)
    levels = {"by id": 0, "by context and load": 0, "by context": 0, "by any cell": 0}
    for step in plan.steps:
        total = 0.0
        for cell in step.cells:
            exact = per_request.get((cell.config_id, cell.context, cell.load))
            same_load = [t for (_, ctx, load), t in per_request.items() if (ctx, load) == (cell.context, cell.load)]
            same_ctx = [t for (_, ctx, _), t in per_request.items() if ctx == cell.context]
            for level, value in (("by id", exact), ("by context and load", same_load), ("by context", same_ctx),
                                 ("by any cell", list(per_request.values()))):
                if value:
                    total += sent * (value if isinstance(value, float) else statistics.median(value))
                    levels[level] += 1
                    break
        step.cells_s = total
    plan.notes.append("cells: " + ", ".join(f"{n} {level}" for level, n in levels.items() if n))
    return plan


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{int(minutes // 60)} h {minutes % 60:.0f} min"


def render_plan(plan: Plan, grid: Grid, service: str, removed: int) -> list[str]:
    """The lines `--plan` prints."""
    sweep = [s for s in plan.steps if s.purpose == "sweep"]
    lines = [f"ddtree plan: grid {grid.name} ({grid.path}), service {service}: {len(sweep)} configs, "
             f"{plan.cells} cells ({removed} removed as impossible)", "deploy order:"]
    width = max((len(s.config_id) for s in plan.steps), default=0)
    for i, step in enumerate(plan.steps, 1):
        what = f"{len(step.cells)} cells" if step.purpose == "sweep" else "restore the default"
        times = ""
        if step.deploy_s is not None:
            times += f"   deploy ~{_duration(step.deploy_s)}"
        if step.cells and step.cells_s is not None:
            times += f", cells ~{_duration(step.cells_s)}"
        lines.append(f"  {i:>3}. {step.config_id:<{width}}  {what}{times}")
    restores = len(plan.steps) - len(sweep)
    if plan.restarts:
        lines.append(f"deploys: {plan.deploys} ({len(sweep)} configs"
                     f"{' + the restore of the default' if restores else ''}); cells: {plan.cells}")
    else:
        lines.append(f"deploys: 0 (service {service} only observes: each config is checked, none restarted); "
                     f"cells: {plan.cells}")
    deploy_s, cells_s = plan.total_s()
    if plan.source is None:
        lines.append("estimated wall time: none (no previous run to take deploy and cell times from; give "
                     "--baseline DIR|latest, or a --results-dir that holds an earlier run)")
    elif deploy_s is not None and cells_s is not None:
        lines.append(f"estimated wall time: {_duration(deploy_s + cells_s)} (deploys {_duration(deploy_s)}, "
                     f"cells {_duration(cells_s)}) from {plan.source}")
    else:
        known = "; ".join(f"{name} {_duration(v)}" for name, v in (("deploys", deploy_s), ("cells", cells_s))
                          if v is not None)
        lines.append(f"estimated wall time: incomplete ({known or 'nothing timed'}) from {plan.source}")
    lines += [f"  {note}" for note in plan.notes]
    return lines
