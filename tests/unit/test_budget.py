"""ddtree.budget: the per-round choice (against a brute-force argmax), truncation, the cost model,
its measurement and profile files, and SpecConfig's auto budget (ids, validation, flags)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.budget import (
    RoundCostCalibration,
    VerifyCostModel,
    choose_budget,
    default_node_counts,
    default_row_counts,
    measure_verify_cost,
    truncate_trees,
)
from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError
from ddtree.tree import build_trees, compile_trees, follow_trees


# -- the choice ----------------------------------------------------------------------------------
def brute_force(log_probs: list[list[float]], costs: list[float]) -> list[float]:
    """theta(b) for b = 1..B in float64: sum over rows of (1 + the first b path probabilities) / cost."""
    out = []
    for b in range(1, len(costs) + 1):
        tokens = sum(1.0 + sum(math.exp(x) for x in row[:b]) for row in log_probs)
        out.append(tokens / costs[b - 1])
    return out


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[list[float]], list[float]]:
    bs = draw(st.integers(1, 4))
    width = draw(st.integers(1, 12))
    rows = []
    for _ in range(bs):
        n = draw(st.integers(0, width))  # real nodes; the rest is padding (-inf)
        scores = sorted(draw(st.lists(st.floats(-12.0, 0.0), min_size=n, max_size=n)), reverse=True)
        rows.append(scores + [float("-inf")] * (width - n))
    costs = draw(st.lists(st.floats(1e-3, 10.0), min_size=width, max_size=width))
    return rows, costs


@settings(max_examples=200, deadline=None)
@given(rounds())
def test_choice_is_the_brute_force_argmax(case: tuple[list[list[float]], list[float]]) -> None:
    log_probs, costs = case
    theta = brute_force(log_probs, costs)
    b = int(choose_budget(torch.tensor(log_probs, dtype=torch.float32), torch.tensor(costs)))
    assert 1 <= b <= len(costs)
    best = max(theta)
    assert theta[b - 1] >= best * (1 - 1e-5), f"chose b={b} (theta {theta[b - 1]}), best is {best} at {theta.index(best) + 1}"
    # a clear winner (beyond float32 noise) is found exactly
    clear = [i for i, t in enumerate(theta) if t >= best * (1 - 1e-4)]
    if len(clear) == 1:
        assert b == clear[0] + 1


def test_ties_pick_the_smaller_tree() -> None:
    log_probs = torch.tensor([[0.0, float("-inf"), float("-inf")]])  # one node, then padding: no gain past b=1
    assert int(choose_budget(log_probs, torch.ones(3))) == 1


def test_padding_rows_do_not_count() -> None:
    """A graphed round's padding rows (live False) hold garbage trees: the choice is that of the live rows."""
    live_rows = torch.log(torch.tensor([[0.9, 0.05, 0.01, 0.01]] * 2))
    garbage = torch.zeros(2, 4)  # probability 1 everywhere: would pull the choice to the cap
    costs = torch.tensor([1.0, 1.2, 1.4, 1.6])
    padded = torch.cat([live_rows, garbage])
    live = torch.tensor([True, True, False, False])
    assert int(choose_budget(padded, costs, live)) == int(choose_budget(live_rows, costs)) == 1
    assert int(choose_budget(padded, costs)) == 4


def _model(verify_per_node: float, fixed: float = 1e-3) -> VerifyCostModel:
    nodes = (2, 5, 9, 17, 33)
    return VerifyCostModel((1, 8), nodes, tuple(tuple(fixed + verify_per_node * n * r for n in nodes) for r in (1, 8)),
                           (fixed, fixed))


def test_steep_cost_picks_one_node_and_flat_cost_picks_the_cap() -> None:
    log_probs = torch.log(torch.tensor([[0.9, 0.8, 0.5, 0.4, 0.2, 0.1, 0.05, 0.01]] * 3))  # [3, 8]
    steep = _model(verify_per_node=1.0).round_costs(3, 8)
    flat = _model(verify_per_node=0.0).round_costs(3, 8)
    assert int(choose_budget(log_probs, steep)) == 1
    assert int(choose_budget(log_probs, flat)) == 8


def test_more_rows_shrink_the_choice() -> None:
    """Verify cost ~ rows x nodes on top of a fixed cost: a big batch chooses a smaller tree than batch 1."""
    nodes = (2, 5, 9, 17, 33)
    model = VerifyCostModel((1, 32), nodes, ((1.0,) * 5, tuple(1.0 + 0.05 * n for n in nodes)), (0.5, 0.5))
    probs = torch.tensor([0.9 ** i for i in range(1, 33)])
    one = int(choose_budget(probs.log()[None], model.round_costs(1, 32)))
    many = int(choose_budget(probs.log()[None].expand(32, -1), model.round_costs(32, 32)))
    assert many < one == 32


# -- truncation ----------------------------------------------------------------------------------
def test_truncation_is_the_smaller_build_and_a_valid_tree() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 50, generator=gen) * 2  # [bs, L, V]; continuous: no exact ties
    full = build_trees(logits, 24, 4)
    for b in (1, 2, 5, 11, 24):
        cut = truncate_trees(full, b)
        small = build_trees(logits, b, 4)
        assert cut.budget == b
        for name in ("tokens", "parents", "depths", "log_probs", "num_nodes"):
            assert torch.equal(getattr(cut, name), getattr(small, name)), f"b={b}: {name}"
        idx = torch.arange(1, b + 1)
        assert bool((cut.parents < idx).all()), "a parent comes before its child"
        compiled = compile_trees(cut, torch.zeros(3, dtype=torch.long), torch.full((3,), 10))
        assert compiled.input_ids.shape == (3, b + 1)
        targets = torch.randint(50, (3, b + 1), generator=gen)
        _, lens, _ = follow_trees(cut, targets)
        assert bool((lens >= 1).all())
    with pytest.raises(ConfigError, match="budget"):
        truncate_trees(full, 25)


# -- the cost model ------------------------------------------------------------------------------
def test_cost_model_interpolates_monotone_and_extrapolates() -> None:
    noisy = VerifyCostModel((1, 4), (2, 9, 33), ((1.0, 0.8, 2.0), (2.0, 3.0, 4.0)), (0.5, 0.4))
    widths = [noisy.verify_cost(1, n) for n in range(2, 40)]
    assert all(a <= b for a, b in zip(widths, widths[1:])), "a wider verify never costs less"
    assert noisy.verify_cost(1, 9) == 1.0  # the dip at 9 is lifted to the running max
    assert noisy.verify_cost(2, 2) == pytest.approx(1.0 + (2.0 - 1.0) / 3)
    assert noisy.verify_cost(8, 33) > noisy.verify_cost(4, 33), "more rows than measured extrapolate upward"
    assert noisy.draft_cost(4) == 0.5
    costs = noisy.round_costs(2, 40)
    assert costs.shape == (40,) and bool((costs[1:] >= costs[:-1]).all())


def test_profile_round_trips_and_bad_files_name_the_problem(tmp_path: Path) -> None:
    model = _model(0.01)
    path = tmp_path / "profile.json"
    model.save(path)
    assert VerifyCostModel.load(path) == model
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match="cost profile"):
        VerifyCostModel.load(path)
    with pytest.raises(ConfigError, match="cost-profile"):
        VerifyCostModel.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="verify_s"):
        VerifyCostModel((1,), (2, 3), ((1.0,),), (0.1,))
    with pytest.raises(ConfigError, match="increasing"):
        VerifyCostModel((2, 1), (2,), ((1.0,), (1.0,)), (0.1, 0.1))


def test_default_measurement_sizes() -> None:
    assert default_row_counts(1) == [1]
    assert default_row_counts(8) == [1, 2, 4, 8]
    assert len(default_row_counts(32)) == 4 and default_row_counts(32)[-1] == 32
    assert default_node_counts(32) == [2, 3, 5, 9, 17, 33]
    assert default_node_counts(1) == [2]
    assert default_node_counts(12)[-1] == 13


def test_measure_times_the_engine() -> None:
    from tests.unit.test_engine import make_engine

    engine = make_engine()
    model = measure_verify_cost(engine, [1, 2], [2, 5], context=64, block_size=8, topk=4, repeats=1)
    assert model.rows == (1, 2) and model.nodes == (2, 5)
    assert all(t > 0 for row in model.verify_s for t in row) and all(t > 0 for t in model.draft_s)
    assert model.meta["context"] == 64


# -- SpecConfig's auto budget --------------------------------------------------------------------
@pytest.mark.parametrize("config_id", ["bauto-k4-w2048-bs8", "bauto16-k2-wnone-bs16", "bauto1-k1-w64-bs8"])
def test_auto_ids_round_trip(config_id: str) -> None:
    spec = SpecConfig.from_id(config_id)
    assert spec.auto_budget and spec.id == config_id
    assert SpecConfig.from_id(spec.id) == spec
    assert SpecConfig.from_dict(spec.to_dict()) == spec
    assert spec.max_nodes == spec.max_budget + 1


def test_auto_config_fields_and_flags() -> None:
    spec = SpecConfig(budget="AUTO")
    assert spec.budget == "auto" and spec.max_budget == 32 and spec.budget_cap == 32
    assert spec.id == "bauto-k4-w2048-bs8"
    args = spec.server_args()
    assert args[args.index("--speculative-ddtree-budget") + 1] == "auto"
    assert "--speculative-ddtree-max-budget" not in args
    capped = SpecConfig(budget="auto", max_budget=12).server_args()
    assert capped[capped.index("--speculative-ddtree-max-budget") + 1] == "12"
    fixed = SpecConfig(budget=8, max_budget=12)
    assert fixed == SpecConfig(budget=8) and fixed.max_nodes == 9 and "max_budget" not in fixed.to_dict()
    assert SpecConfig(Algorithm.DFLASH, budget="auto").budget == 7


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(dict(budget="auto", max_budget=0), "max_budget: 0 is out of range", id="cap-zero"),
        pytest.param(dict(budget="auto", max_budget=64), "max_budget: 64 is out of range", id="cap-past-bitmask"),
        pytest.param(dict(budget="sometimes"), "budget: 'sometimes'", id="bad-word"),
    ],
)
def test_bad_auto_configs_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


def test_calibration_shifts_every_size_by_the_median_gap() -> None:
    """Every size moves by the median (EMA - table) gap of the sizes with >= min_samples rounds: the
    differences between sizes stay the table's (a size that ran is not held at its own mean)."""
    cal = RoundCostCalibration(alpha=0.5, min_samples=2)
    table = [1.0, 1.1, 1.2, 1.3]
    assert cal.corrected(1, table) == table  # nothing measured: the table
    cal.observe(1, 2, 2.0)
    assert cal.measured(1) == {} and cal.corrected(1, table) == table  # one round is not enough
    cal.observe(1, 2, 3.0)  # EMA: 2.0 + 0.5 * (3.0 - 2.0)
    cal.observe(4, 2, 9.0)  # another row count: kept apart
    cal.observe(4, 2, 9.0)
    assert cal.measured(1) == {2: pytest.approx(2.5)} and cal.measured(4) == {2: pytest.approx(9.0)}
    gap = 2.5 - 1.1
    assert cal.corrected(1, table) == pytest.approx([t + gap for t in table])
    cal.observe(1, 4, 1.5)
    cal.observe(1, 4, 1.5)  # a second measured size: the median gap of the two
    gap = ((2.5 - 1.1) + (1.5 - 1.3)) / 2
    assert cal.corrected(1, table) == pytest.approx([t + gap for t in table])
    assert cal.corrected(1, table[:3]) == pytest.approx([t + 1.4 for t in table[:3]])  # sizes past the table: ignored
    inf = float("inf")
    assert cal.corrected(1, [1.0, inf, 1.2, 1.3])[1] == inf  # a size with no graph stays out of reach


@pytest.mark.parametrize(("kwargs", "message"), [({"alpha": 0.0}, r"alpha: 0.0 is out of range"),
                                                 ({"min_samples": 0}, r"min_samples: 0 is out of range")])
def test_calibration_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RoundCostCalibration(**kwargs)
