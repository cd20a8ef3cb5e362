"""The sweep's answer under SLOs: per context, the config and load with the most goodput where attainment holds.

Reads cell results only. A cell can be the answer when its attainment (ddtree.bench.slo) reaches the
SLOs' attainment target, none of its requests failed, and, for a rate cell, the service was seen to
keep up with the arrivals (a queue that grows through the run is no load to deploy at, and a burst too
short to tell is no evidence that it is one). Among those the highest
request goodput wins; ties go to the current default, then to the higher output tok/s, then to the
id. A context where no cell qualifies says so and names the closest (highest attainment) cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddtree.bench.results import CellResult
from ddtree.bench.slo import spec_of

MAX_LISTED = 12  # cells named in the summary's "not eligible" line; the rest are counted
KEPT_UP = {True: "", False: " (FELL BEHIND)", None: " (too short to tell whether it kept up)"}


@dataclass(frozen=True)
class Choice:
    """The answer for one context: `cell` (None when no cell qualifies) and the closest cell otherwise."""

    context: int
    cell: CellResult | None
    closest: CellResult | None


def _f(cell: CellResult, key: str) -> float:
    value = cell.metrics.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def qualifies(cell: CellResult) -> bool:
    m = cell.metrics
    kept_up = cell.request_rate is None or m.get("keeps_up") is True
    return bool(m.get("slo_attained")) and int(m.get("failed") or 0) == 0 and kept_up


def judged(cells: Sequence[CellResult]) -> list[CellResult]:
    """The cells measured under an SLO (those that carry an attainment)."""
    return [c for c in cells if c.metrics.get("slo_attainment") is not None]


def choose(cells: Sequence[CellResult], default_id: str) -> dict[int, Choice]:
    """context -> the answer there, over the cells measured under an SLO."""
    answers = {}
    for context in sorted({c.context for c in judged(cells)}):
        here = [c for c in judged(cells) if c.context == context]
        good = [c for c in here if qualifies(c)]
        best = min(good, key=lambda c: (-_f(c, "request_goodput"), c.config_id != default_id,
                                        -_f(c, "output_throughput"), c.config_id, c.load), default=None)
        closest = None if best else max(here, key=lambda c: (_f(c, "slo_attainment"), _f(c, "request_goodput")))
        answers[context] = Choice(context, best, closest)
    return answers


def _pct(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def _n(value: Any, digits: int = 1) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.{digits}f}"


def _misses(cell: CellResult) -> str:
    missed: Mapping[str, int] = cell.metrics.get("slo_missed_by") or {}
    return ", ".join(f"{k} {n}" for k, n in sorted(missed.items(), key=lambda kv: -kv[1])) or "failed requests"


def slo_answer(cells: Sequence[CellResult], default_id: str) -> list[str]:
    """The summary's lead when the sweep ran under SLOs; [] otherwise."""
    under = judged(cells)
    if not under:
        return []
    specs = {spec.describe() for c in under if (spec := spec_of(c.client)) is not None}
    lines = ["## SLO answer", "",
             f"SLOs: {'; '.join(sorted(specs)) or 'not recorded'} (per request; a miss is reported, never failed).",
             "", "| context | config | load | goodput req/s | attainment | output tok/s | p90 TPOT ms | p99 TTFT ms |",
             "|---|---|---|---|---|---|---|---|"]
    for context, choice in choose(cells, default_id).items():
        c = choice.cell
        if c is None:
            near = choice.closest
            closest = f"closest: {near.config_id} {near.load}, attainment {_pct(near.metrics.get('slo_attainment'))}" \
                if near is not None else "no cell"
            lines.append(f"| {context} | none meets the target | - | - | - | - | - | - ({closest}) |")
            continue
        m = c.metrics
        name = f"**{c.config_id}**" + (" (default)" if c.config_id == default_id else "")
        lines.append(f"| {context} | {name} | {c.load} | {_n(m.get('request_goodput'), 2)} | "
                     f"{_pct(m.get('slo_attainment'))} | {_n(m.get('output_throughput'))} | "
                     f"{_n(m.get('p90_tpot_ms'), 2)} | {_n(m.get('p99_ttft_ms'))} |")
    lines.append("")
    below = [c for c in under if not qualifies(c)]
    if below:
        listed = "; ".join(f"{c.config_id}-ctx{c.context}-{c.load} {_pct(c.metrics.get('slo_attainment'))} ({_why(c)})"
                           for c in below[:MAX_LISTED])
        more = f"; and {len(below) - MAX_LISTED} more (summary.csv: slo_attained)" if len(below) > MAX_LISTED else ""
        lines.append(f"Not eligible ({len(below)} of {len(under)} cells): {listed}{more}.")
    unjudged: dict[str, int] = {}
    for c in under:
        for key in c.metrics.get("slo_unjudged") or {}:
            unjudged[key] = unjudged.get(key, 0) + 1
    if unjudged:
        lines.append("Not judged for want of a value (no streaming, or a single token): " + ", ".join(
            f"{k} in {n} cells" for k, n in sorted(unjudged.items())) + ".")
    lines += rate_lines(cells)
    return [*lines, ""]


def _why(cell: CellResult) -> str:
    if int(cell.metrics.get("failed") or 0):
        return f"{cell.metrics.get('failed')} failed requests"
    if not cell.metrics.get("slo_attained"):
        return f"missed: {_misses(cell)}"
    if cell.metrics.get("keeps_up") is False:
        return "could not keep up with the arrivals"
    return "too short to tell whether the service kept up (a burst: more requests_per_cell)"


def rate_lines(cells: Sequence[CellResult]) -> list[str]:
    """Rate cells the service could not keep up with, with the numbers that show it."""
    behind = [c for c in cells if c.request_rate is not None and c.metrics.get("keeps_up") is False]
    if not behind:
        return []
    return ["Rates the service could not keep up with: " + "; ".join(
        f"{c.config_id}-ctx{c.context}-{c.load}: offered {c.request_rate:g}, sent {_n(c.metrics.get('achieved_request_rate'), 2)}, "
        f"served {_n(c.metrics.get('served_request_rate'), 2)} req/s, up to {c.metrics.get('max_in_flight')} in flight "
        f"(repeats that kept up: {c.metrics.get('keeps_up_repeats')})" for c in behind) + "."]


def answer_progress(metrics: Mapping[str, Any]) -> str:
    """What a cell's progress line adds: its SLO attainment and goodput, a rate cell's rates and queue."""
    text = ""
    if metrics.get("offered_request_rate") is not None:
        text += (f", rate {metrics['offered_request_rate']:g}/s: sent {_n(metrics.get('achieved_request_rate'), 2)}, "
                 f"served {_n(metrics.get('served_request_rate'), 2)}, up to {metrics.get('max_in_flight')} in flight"
                 + KEPT_UP[metrics.get("keeps_up")])
    if metrics.get("slo_attainment") is not None:
        text += (f", SLO met by {_pct(metrics['slo_attainment'])}, goodput {_n(metrics.get('request_goodput'), 2)} req/s"
                 + ("" if metrics.get("slo_attained") else " (below target)"))
    return text


def recommended_points(cells: Sequence[CellResult], default_id: str,
                       recommended: str | None) -> dict[int, tuple[str, str | None]]:
    """context -> what the summary recommends there: the SLO answer's (config, load) where there is one,
    else the recommended default config at every load."""
    picks: dict[int, tuple[str, str | None]] = {}
    answers = choose(cells, default_id)
    for context in sorted({c.context for c in cells}):
        chosen = answers.get(context)
        if chosen is not None and chosen.cell is not None:
            picks[context] = (chosen.cell.config_id, chosen.cell.load)
        elif recommended is not None:
            picks[context] = (recommended, None)
    return picks
