"""The Pareto frontier: dominated points are never on it, every point off it is dominated, and nearest."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddtree.bench.pareto import Point, dominates, frontier, nearest, pareto_lines, points
from ddtree.bench.results import CellResult

coords = st.floats(min_value=0.1, max_value=1e4, allow_nan=False)
point_lists = st.lists(st.builds(Point, st.sampled_from(["a", "b", "c"]), st.sampled_from(["c1", "c8", "r2"]),
                                 coords, coords), min_size=1, max_size=40)


@given(point_lists)
def test_no_dominated_point_is_on_the_frontier(pts: list[Point]) -> None:
    front = frontier(pts)
    assert front, "a non-empty set always has a frontier"
    for p in front:
        assert not any(dominates(q, p) for q in pts), p


@given(point_lists)
def test_every_point_off_the_frontier_is_dominated_by_one_on_it(pts: list[Point]) -> None:
    front = frontier(pts)
    for p in pts:
        if p not in front:
            assert any(dominates(f, p) for f in front), p


@given(point_lists)
def test_the_frontier_trades_one_axis_for_the_other(pts: list[Point]) -> None:
    front = frontier(pts)
    for a, b in zip(front, front[1:]):  # by aggregate ascending, so per user cannot rise
        assert a.aggregate <= b.aggregate and a.per_user >= b.per_user


def test_a_small_case_by_hand() -> None:
    pts = [Point("ar", "c1", 100, 50), Point("ar", "c8", 400, 20), Point("b8", "c1", 120, 60),
           Point("b8", "c8", 380, 25), Point("b4", "c8", 300, 10)]
    assert [p.label for p in frontier(pts)] == ["b8 c1", "b8 c8", "ar c8"]
    # ar c1 is dominated by b8 c1 (more of both); b4 c8 by b8 c8
    assert dominates(pts[2], pts[0]) and dominates(pts[3], pts[4]) and not dominates(pts[1], pts[3])
    own, near, distance = nearest(pts, "ar", "c1") or (None, None, None)
    assert (own.label, near.label) == ("ar c1", "b8 c1") and distance == pytest.approx(((20 / 400) ** 2 + (10 / 60) ** 2) ** 0.5)
    assert nearest(pts, "b8", None)[2] == 0.0  # a config on the frontier at some load
    assert nearest(pts, "missing", None) is None


def cell(config_id: str, concurrency: int, tps: float, tpot: float | None, context: int = 60) -> CellResult:
    return CellResult(config_id=config_id, spec={}, context=context, concurrency=concurrency, repeats=1,
                      metrics={"output_throughput": tps, "median_tpot_ms": tpot}, per_repeat=[])


def test_cells_become_points_and_the_summary_lists_the_frontier() -> None:
    cells = [cell("ar", 1, 100.0, 20.0), cell("ar", 8, 400.0, 50.0), cell("b8", 1, 90.0, 25.0),
             cell("b8", 8, 150.0, None)]
    assert [(p.label, p.per_user) for p in points(cells)] == [("ar c1", 50.0), ("ar c8", 20.0), ("b8 c1", 40.0)]
    text = "\n".join(pareto_lines(cells + [cell("ar", 1, 10.0, None, context=512)], {60: ("b8", None)}))
    assert "context 60 (plots/pareto_ctx60.png): 2 of 3 points on the frontier: ar c1 (100.0 tok/s, 50.0 tok/s/user), " \
           "ar c8 (400.0 tok/s, 20.0 tok/s/user)." in text
    assert "The recommended b8 sits nearest ar c1 on the frontier" in text
    assert "context 512: no cell has a median TPOT" in text
