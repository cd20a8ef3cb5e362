"""The plan: deploy order with the restore, and the wall-time estimate from an earlier run or none."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.bench.deploys import write_deploys
from ddtree.bench.plan import Plan, deploy_steps, estimate, render_plan
from ddtree.bench.results import CellResult, write_cell
from ddtree.grid import cells, parse_grid

GRID = parse_grid({
    "default": {"budget": 8, "topk": 4, "draft_window": 2048, "block_size": 8},
    "configs": [{"budget": 4}, {"algorithm": "NONE"}, {}],
    "client": {"contexts": [60], "concurrency": [1, 4], "request_rates": [2], "requests_per_cell": 4, "repeats": 2,
               "warmup_requests": 0},
}, name="g")


def plan_of(grid=GRID, restarts: bool = True) -> Plan:
    return Plan(deploy_steps(cells(grid, None)[0], grid.default.id), restarts=restarts)


def test_each_config_is_one_deploy_in_order_and_the_default_comes_back_last() -> None:
    plan = plan_of()
    assert [(s.config_id, s.purpose, len(s.cells)) for s in plan.steps] == [
        ("ar", "sweep", 3), ("b8-k4-w2048-bs8", "sweep", 3), ("b4-k4-w2048-bs8", "sweep", 3),
        ("b8-k4-w2048-bs8", "restore", 0)]
    assert (plan.deploys, plan.cells) == (4, 9)
    only_default = parse_grid({"configs": [{}], "client": {"concurrency": [1]}})
    assert [s.purpose for s in plan_of(only_default).steps] == ["sweep"]  # the default is already there
    assert plan_of(restarts=False).deploys == 0


def test_without_an_earlier_run_the_plan_says_it_has_no_estimate() -> None:
    lines = render_plan(plan_of(), GRID, "local", removed=0)
    assert lines[0] == "ddtree plan: grid g (None), service local: 3 configs, 9 cells (0 removed as impossible)"
    assert "    4. b8-k4-w2048-bs8  restore the default" in lines
    assert "deploys: 4 (3 configs + the restore of the default); cells: 9" in lines
    assert any(line.startswith("estimated wall time: none (no previous run") for line in lines)


def previous_cell(tmp_path: Path, config_id: str, concurrency: int, seconds: int, rate: float | None = None) -> None:
    write_cell(tmp_path, CellResult(
        config_id=config_id, spec={}, context=60, concurrency=concurrency, repeats=1, metrics={}, per_repeat=[],
        started_at="2026-01-01T00:00:00+00:00", finished_at=f"2026-01-01T00:00:{seconds:02d}+00:00",
        client={"requests_per_cell": 4, "warmup_requests": 0}, request_rate=rate))


def test_the_estimate_takes_an_earlier_runs_deploys_and_cells(tmp_path: Path) -> None:
    entry = {"purpose": "sweep", "restarted": True, "ok": True}
    write_deploys(tmp_path, [{**entry, "config_id": "ar", "cold_start_s": 100.0},
                             {**entry, "config_id": "b8-k4-w2048-bs8", "cold_start_s": 300.0}])
    previous_cell(tmp_path, "ar", 1, 8)  # 8 s for 4 requests: 2 s a request
    previous_cell(tmp_path, "ar", 4, 4)
    previous_cell(tmp_path, "b8-k4-w2048-bs8", 1, 12)
    plan = estimate(plan_of(), GRID, tmp_path)
    ar, b8, b4, restore = plan.steps
    # the plan's cells send 2 repeats x 4 requests: twice what the earlier cells sent
    assert ar.deploy_s == 100.0 and ar.cells_s == pytest.approx(16 + 8 + 16)  # r2: the median at ctx60 (2 s/req)
    assert b8.deploy_s == 300.0 and b8.cells_s == pytest.approx(24 + 8 + 16)  # c4 and r2: the context's median
    assert b4.deploy_s == 200.0 and restore.deploy_s == 300.0  # an unseen config: the median cold start
    assert b4.cells_s == pytest.approx(20 + 8 + 16)  # c1: the median of ar's and b8's (2.5 s/req)
    deploy_s, cells_s = plan.total_s()
    assert deploy_s == pytest.approx(900.0) and cells_s == pytest.approx(40 + 48 + 44)
    lines = render_plan(plan, GRID, "local", removed=0)
    assert f"estimated wall time: 17 min (deploys 15 min, cells 2 min) from {tmp_path}" in lines
    assert "  deploys: 3 of 4 by their config's cold start, the rest at the median 200.0 s" in lines
    assert "  cells: 3 by id, 3 by context and load, 3 by context" in lines
    assert "    1. ar               3 cells   deploy ~100 s, cells ~40 s" in lines


def test_an_earlier_run_without_deploys_json_estimates_cells_only(tmp_path: Path) -> None:
    previous_cell(tmp_path, "ar", 1, 8)
    lines = render_plan(estimate(plan_of(), GRID, tmp_path), GRID, "local", removed=0)
    assert f"estimated wall time: incomplete (cells 2 min) from {tmp_path}" in lines  # 9 cells x 8 requests x 2 s
    assert any("deploys: no estimate (no successful restart in" in line for line in lines)
