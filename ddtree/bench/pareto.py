"""The Pareto frontier of a context: output tok/s per user against aggregate output tok/s.

Every cell of a context (config x load) is a point: aggregate = its output tok/s, per user = 1000 /
its median TPOT (the rate one request's tokens arrive at). A point is dominated when another is at
least as good on both axes and better on one; the frontier is every point that is not. A cell without
a median TPOT (a service that does not stream) has no point.

"Nearest" measures on axes scaled by the context's largest value each, so a tok/s per user and a tok/s
in aggregate weigh alike: a distance of 0.1 is a tenth of the axes' range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ddtree.bench.results import CellResult


@dataclass(frozen=True)
class Point:
    config_id: str
    load: str  # c<N> or r<R>
    aggregate: float  # output tok/s, all requests together
    per_user: float  # output tok/s of one request: 1000 / median TPOT

    @property
    def label(self) -> str:
        return f"{self.config_id} {self.load}"


def points(cells: Sequence[CellResult]) -> list[Point]:
    """One point per cell with both numbers (cells of one context)."""
    out = []
    for c in cells:
        tps, tpot = c.metrics.get("output_throughput"), c.metrics.get("median_tpot_ms")
        if isinstance(tps, int | float) and isinstance(tpot, int | float) and tpot > 0:
            out.append(Point(c.config_id, c.load, float(tps), 1000.0 / float(tpot)))
    return out


def dominates(a: Point, b: Point) -> bool:
    """a is at least as good as b on both axes and better on one."""
    return a.aggregate >= b.aggregate and a.per_user >= b.per_user and (a.aggregate > b.aggregate or a.per_user > b.per_user)


def frontier(pts: Sequence[Point]) -> list[Point]:
    """The points no other point dominates, by aggregate tok/s (ascending), so per user descends."""
    return sorted((p for p in pts if not any(dominates(q, p) for q in pts)), key=lambda p: (p.aggregate, -p.per_user))


def distance(a: Point, b: Point, scale: tuple[float, float]) -> float:
    return math.hypot((a.aggregate - b.aggregate) / scale[0], (a.per_user - b.per_user) / scale[1])


def nearest(pts: Sequence[Point], config_id: str, load: str | None) -> tuple[Point, Point, float] | None:
    """(the config's point, the frontier point nearest it, their distance); the config's points are
    its cell at `load`, or all its loads when load is None (the closest pair wins). None without points."""
    front = frontier(pts)
    own = [p for p in pts if p.config_id == config_id and (load is None or p.load == load)]
    if not front or not own:
        return None
    scale = (max(p.aggregate for p in pts) or 1.0, max(p.per_user for p in pts) or 1.0)
    return min(((o, f, distance(o, f, scale)) for o in own for f in front), key=lambda t: t[2])


def pareto_lines(cells: Sequence[CellResult], recommended: dict[int, tuple[str, str | None]]) -> list[str]:
    """The summary's frontier part: per context the frontier's points, and where the recommended sits.

    `recommended`: context -> (config id, load or None for every load of it).
    """
    lines = ["## Pareto frontier (output tok/s per user vs aggregate)", ""]
    for context in sorted({c.context for c in cells}):
        pts = points([c for c in cells if c.context == context])
        if not pts:
            lines += [f"- context {context}: no cell has a median TPOT (the service did not stream), no frontier."]
            continue
        front = frontier(pts)
        listed = ", ".join(f"{p.label} ({p.aggregate:.1f} tok/s, {p.per_user:.1f} tok/s/user)" for p in front)
        lines.append(f"- context {context} (plots/pareto_ctx{context}.png): {len(front)} of {len(pts)} points on the "
                     f"frontier: {listed}.")
        if context not in recommended:
            continue
        config_id, load = recommended[context]
        near = nearest(pts, config_id, load)
        what = f"{config_id}{' ' + load if load else ''}"
        if near is None:
            lines.append(f"  The recommended {what} has no point here.")
        elif near[2] == 0.0:
            lines.append(f"  The recommended {what} is on the frontier{'' if load else f' (at {near[0].load})'}.")
        else:
            lines.append(f"  The recommended {what} sits nearest {near[1].label} on the frontier "
                         f"({near[2]:.2f} of the axes' range away, from {near[0].label}).")
    return [*lines, ""]
