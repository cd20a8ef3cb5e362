"""One sweep cell, measured and judged: `run_cell` is what tests/perf/test_sweep.py runs for every grid cell.

Per cell: warm-up requests (not counted), then `repeats` rounds of `requests_per_cell` prompts of
exactly `context` tokens at the cell's concurrency, or at Poisson arrival times for a rate cell
(ignore_eos, fixed max_new_tokens; ddtree.bench.cell_load), with a pace reading before the first
repeat and after each. Each repeat is judged against the grid's SLOs (reported, never failed). The
cell file is written atomically before any verdict, so an interrupted or failing sweep keeps it. The
verdicts (ddtree.suite.verdict) compare pace-normalised tok/s and acceptance with the cell's floor,
then, with a config's last cell, the medians over its cells of tok/s and speed-up over AR with theirs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from ddtree.bench.cell_load import cell_extras, client_extras, repeat_extras, send_repeat, warmup_concurrency
from ddtree.bench.loadgen import client_pool, run_load
from ddtree.bench.metrics import records_duration_s, summarize_repeat
from ddtree.bench.normalise import add_pace
from ddtree.bench.results import CELLS_DIR, CellResult, cell_filename, now_iso, write_cell
from ddtree.grid import Cell
from ddtree.service.manager import ServiceManager
from ddtree.suite.fixtures import cell_progress
from ddtree.suite.options import SuiteOptions
from ddtree.suite.pace import PaceLog, cell_pace
from ddtree.suite.state import SuiteState, suite_state
from ddtree.suite.verdict import AR_CONFIG_ID, Tolerances, floor_entry, judge_cell, judge_config, speedup_over_ar


def run_cell(config: pytest.Config, cell: Cell, deployed: ServiceManager, suite: SuiteOptions,
             prompt_maker: Callable[[int, int], list[list[int]]], pace: PaceLog) -> CellResult:
    """The sweep test's whole body: measure the cell, write its file, then judge it (AssertionError on a failure)."""
    result = measure_cell(cell, deployed, suite, prompt_maker, pace)
    judge(config, suite, cell, result)
    return result


def measure_cell(cell: Cell, deployed: ServiceManager, suite: SuiteOptions,
                 prompt_maker: Callable[[int, int], list[list[int]]], pace: PaceLog) -> CellResult:
    """Run the cell's load against the deployed service and write its result file."""
    grid = suite.grid
    base_url = deployed.backend.base_url
    per_repeat_count = grid.requests_per_cell
    prompts = prompt_maker(cell.context, grid.warmup_requests + grid.repeats * per_repeat_count)
    stream = deployed.backend.name != "fake"  # the model-free fake server answers in one piece
    load: dict[str, Any] = dict(max_new_tokens=grid.max_new_tokens, temperature=0.0, ignore_eos=True, stream=stream,
                                processes=suite.client_processes)
    if suite.client_processes > 1:
        client_pool(suite.client_processes)  # up before anything is timed (once per session)
    started = now_iso()

    if grid.warmup_requests:  # compiles, caches and allocator growth stay out of the numbers
        warm = run_load(base_url, prompts[: grid.warmup_requests], warmup_concurrency(cell), **load)
        failed = [r.error for r in warm if not r.ok]
        assert not failed, f"{cell.id}: warm-up requests failed: {failed[:3]}"

    readings = [pace.read(f"{cell.id} before repeat 1")]
    repeats = []
    for i in range(grid.repeats):
        start = grid.warmup_requests + i * per_repeat_count
        records = send_repeat(base_url, prompts[start : start + per_repeat_count], cell, grid, i, load)
        errors = [r.error for r in records if not r.ok]
        if errors:  # a cell with failed requests is an error, never a number
            raise AssertionError(f"{cell.id}: {len(errors)}/{len(records)} requests failed in repeat {i + 1}: "
                                 f"{errors[:3]}")
        duration = records_duration_s(records)
        repeats.append({**summarize_repeat(records, duration), **repeat_extras(records, duration, cell, grid)})
        readings.append(pace.read(f"{cell.id} after repeat {i + 1}"))

    pace_record = cell_pace(readings, loaded=cell.concurrency != 1)  # rate cells: loaded too
    result = CellResult.build(
        config_id=cell.config_id, spec=cell.spec.to_dict(), context=cell.context, concurrency=cell.concurrency,
        per_repeat=repeats, backend=deployed.backend.name, started_at=started, pace=pace_record,
        client={"max_new_tokens": grid.max_new_tokens, "requests_per_cell": per_repeat_count,
                "warmup_requests": grid.warmup_requests, "ignore_eos": True, "temperature": 0.0,
                "client_processes": suite.client_processes, **client_extras(cell, grid)},
        request_rate=cell.request_rate,
    )
    result.metrics.update(cell_extras(repeats, grid))
    add_pace(result.per_repeat, result.metrics, pace_record)
    if cell.config_id != AR_CONFIG_ID:
        speedup = speedup_over_ar(result.metrics, ar_metrics(suite, cell), suite.floors.basis)
        if speedup is not None:
            result.metrics["speedup_vs_ar"] = speedup
    write_cell(suite.results_dir, result)
    return result


def ar_metrics(suite: SuiteOptions, cell: Cell) -> dict[str, Any] | None:
    """AR's metrics at the cell's context and load in this run (AR deploys first), or None."""
    path = suite.results_dir / CELLS_DIR / cell_filename(AR_CONFIG_ID, cell.context, cell.concurrency, cell.request_rate)
    if not path.is_file():
        return None
    return dict(json.loads(path.read_text(encoding="utf-8")).get("metrics") or {})


def judge(config: pytest.Config, suite: SuiteOptions, cell: Cell, result: CellResult) -> None:
    """Record floors (--update-floors), then fail the cell when it is below its floor, has none under
    --require-floors, or is its config's last cell in this run and the config's medians fall short."""
    metrics = result.metrics
    pace = result.pace or {}
    cell_progress(config, cell, metrics, pace.get("score"))
    measured = {**metrics, "pace": pace.get("score"), "probe": pace.get("probe")}
    state = suite_state(config)
    state.cells_seen[cell.config_id] = state.cells_seen.get(cell.config_id, 0) + 1
    if suite.update_floors:
        state.floor_updates.setdefault(cell.config_id, {})[cell.key] = floor_entry(measured)
        if pace.get("probe"):
            state.floor_probe = str(pace["probe"])
    tolerances = Tolerances.of(suite.floors, suite.tolerance)
    failures = []
    floor = suite.floors.floor_for(cell.config_id, cell.key)
    if floor is None:
        state.no_floor.append(cell.id)
        if suite.require_floors and not suite.update_floors:
            failures.append(f"{cell.id}: no floor in {suite.floors.profile} ({suite.floors.path}) and --require-floors "
                            f"is set; record one with --update-floors")
    else:
        where = f"{cell.config_id} @ ctx{cell.context} {cell.load}"
        state.config_cells.setdefault(cell.config_id, []).append((cell.id, measured, floor))
        verdict = judge_cell(measured, floor, tolerances, suite.floors.probe, where)
        _note(state, verdict.notes, cell.id)
        failures += verdict.failures
    if state.cells_seen[cell.config_id] == state.selected_cells.get(cell.config_id):  # the config's last cell
        judged = state.config_cells.get(cell.config_id, [])
        if judged:
            verdict = judge_config(judged, tolerances, suite.floors.probe, cell.config_id)
            _note(state, verdict.notes, cell.config_id)
            failures += verdict.failures
    assert not failures, "; ".join(failures)


def _note(state: SuiteState, notes: list[str], name: str) -> None:
    for note in notes:
        state.verdict_notes.setdefault(note, []).append(name)
