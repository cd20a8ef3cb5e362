"""The sweep: one test per grid cell (config x context x concurrency), measured against its floor.

    pytest -m perf --config-grid smoke        # ids like b8-k4-w2048-bs8-ctx60-c1

Per cell: warm-up requests (not counted), then `repeats` rounds of `requests_per_cell` prompts of
exactly `context` tokens at the cell's concurrency (ignore_eos, fixed max_new_tokens). The cell
file is written atomically before any floor check, so an interrupted or failing sweep keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddtree.bench.loadgen import client_pool, run_load
from ddtree.bench.metrics import records_duration_s, summarize_repeat
from ddtree.bench.results import CellResult, now_iso, write_cell
from ddtree.grid import Cell
from ddtree.service.manager import ServiceManager
from ddtree.suite.fixtures import cell_progress
from ddtree.suite.floors import check_cell
from ddtree.suite.options import SuiteOptions
from ddtree.suite.state import suite_state

pytestmark = pytest.mark.perf


def test_sweep(
    request: pytest.FixtureRequest,
    cell: Cell,
    resume_skip: None,
    deployed: ServiceManager,
    suite: SuiteOptions,
    prompt_maker: Callable[[int, int], list[list[int]]],
) -> None:
    grid = suite.grid
    base_url = deployed.backend.base_url
    per_repeat_count = grid.requests_per_cell
    prompts = prompt_maker(cell.context, grid.warmup_requests + grid.repeats * per_repeat_count)
    stream = deployed.backend.name != "fake"  # the model-free fake server answers in one piece
    load = dict(max_new_tokens=grid.max_new_tokens, temperature=0.0, ignore_eos=True, stream=stream,
                processes=suite.client_processes)
    if suite.client_processes > 1:
        client_pool(suite.client_processes)  # up before anything is timed (once per session)
    started = now_iso()

    if grid.warmup_requests:  # compiles, caches and allocator growth stay out of the numbers
        warm = run_load(base_url, prompts[: grid.warmup_requests], cell.concurrency, **load)
        failed = [r.error for r in warm if not r.ok]
        assert not failed, f"{cell.id}: warm-up requests failed: {failed[:3]}"

    repeats = []
    for i in range(grid.repeats):
        start = grid.warmup_requests + i * per_repeat_count
        records = run_load(base_url, prompts[start : start + per_repeat_count], cell.concurrency, **load)
        errors = [r.error for r in records if not r.ok]
        if errors:  # a cell with failed requests is an error, never a number
            raise AssertionError(f"{cell.id}: {len(errors)}/{len(records)} requests failed in repeat {i + 1}: "
                                 f"{errors[:3]}")
        repeats.append(summarize_repeat(records, records_duration_s(records)))

    result = CellResult.build(
        config_id=cell.config_id, spec=cell.spec.to_dict(), context=cell.context, concurrency=cell.concurrency,
        per_repeat=repeats, backend=deployed.backend.name, started_at=started,
        client={"max_new_tokens": grid.max_new_tokens, "requests_per_cell": per_repeat_count,
                "warmup_requests": grid.warmup_requests, "ignore_eos": True, "temperature": 0.0,
                "client_processes": suite.client_processes},
    )
    write_cell(suite.results_dir, result)
    metrics = result.metrics
    cell_progress(request.config, cell, metrics)

    measured = {"output_throughput": metrics["output_throughput"]}
    if metrics.get("accept_length") is not None:
        measured["accept_length"] = metrics["accept_length"]
    state = suite_state(request.config)
    if suite.update_floors:
        state.floor_updates.setdefault(cell.config_id, {})[cell.key] = {k: round(v, 2) for k, v in measured.items()}
    floor = suite.floors.floor_for(cell.config_id, cell.key)
    if floor is None:
        state.no_floor.append(cell.id)
        return
    failures = check_cell(measured, floor, suite.tolerance, cell.config_id, cell.context, cell.concurrency)
    assert not failures, "; ".join(failures)
