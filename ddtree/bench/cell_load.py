"""A sweep cell's load and what it adds to the plain numbers: closed loop or arrival rate, SLOs.

The cell test (tests/perf/test_sweep.py) sends each repeat with `send_repeat`: `concurrency` requests in
flight (closed loop), or, for a rate cell, each request at its Poisson arrival time (open loop; the
arrivals of repeat i come from the grid's arrival_seed + i, so every config meets the same ones). What
a repeat adds to summarize_repeat's numbers (`repeat_extras`: its SLO counts, a rate cell's rates and
queue) and what the cell adds to summarize_cell's (`cell_extras`) live here, beside the client
settings a cell file records about them (`client_extras`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddtree.bench.arrivals import arrival_stats, poisson_offsets, summarize_arrivals
from ddtree.bench.loadgen import RequestRecord, run_arrivals, run_load
from ddtree.bench.slo import judge_repeat, summarize_slo
from ddtree.grid import Cell, Grid


def warmup_concurrency(cell: Cell) -> int:
    """Warm-up requests run closed loop: at the cell's concurrency, one at a time for a rate cell."""
    return max(cell.concurrency, 1)


def send_repeat(base_url: str, prompts: Sequence[Sequence[int]], cell: Cell, grid: Grid, repeat: int,
                load: Mapping[str, Any]) -> list[RequestRecord]:
    """One repeat's requests; `load` holds run_load's keyword arguments (a rate cell uses one client process)."""
    if cell.request_rate is None:
        return run_load(base_url, prompts, cell.concurrency, **load)
    offsets = poisson_offsets(cell.request_rate, len(prompts), grid.arrival_seed + repeat)
    settings = {k: v for k, v in load.items() if k != "processes"}
    return run_arrivals(base_url, prompts, offsets, **settings)


def repeat_extras(records: Sequence[RequestRecord], duration_s: float, cell: Cell, grid: Grid) -> dict[str, Any]:
    """The repeat's SLO counts (with an SLO) and a rate cell's rates, queue and keeps_up."""
    extras = judge_repeat(records, duration_s, grid.slo)
    if cell.request_rate is not None:
        extras.update(arrival_stats(records, cell.request_rate))
    return extras


def cell_extras(repeats: Sequence[Mapping[str, Any]], grid: Grid) -> dict[str, Any]:
    """The cell's slo_attainment, request_goodput and rate numbers, from its repeats."""
    return {**summarize_slo(repeats, grid.slo), **summarize_arrivals(repeats)}


def client_extras(cell: Cell, grid: Grid) -> dict[str, Any]:
    """What the cell file's `client` records about them: the SLOs judged and a rate cell's seed."""
    return {"slo": grid.slo.to_dict() if grid.slo else None,
            "arrival_seed": grid.arrival_seed if cell.request_rate is not None else None}
