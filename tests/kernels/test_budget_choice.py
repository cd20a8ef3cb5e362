"""choose_budget_triton: budget auto's one-launch choice against the torch reference and a float64 check.

The kernel sums in another order than torch, so the two may disagree only where two budgets' ratios
are equal to float32 rounding; every case checks that the kernel's b* is within that of the best ratio
(worked out in float64), and equal to the reference's when the best is clear. On machines without CUDA
the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.budget import choose_budget, choose_budget_reference
from ddtree.kernels.budget_choice import choose_budget_triton
from tests.kernels.kernel_asserts import assert_close, interpreter_off_but_installed, run_triton_cases_in_child, triton_runtime

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)

# (rows, budget, live rows or None, graphed: +inf cost on sizes that have no captured graph)
CASES = [(1, 4, None, False), (3, 12, [1, 1, 0], True), (32, 32, None, True), (40, 255, [i % 3 for i in range(40)], False),
         (8, 1, None, False), (64, 16, [0] * 64, False)]


def make_inputs(rows: int, budget: int, live: list[int] | None, graphed: bool, seed: int = 0) -> tuple:
    """Best-first path log-probs (non-increasing per row, -inf padding past a random node count), a cost
    per size that grows with it, and the live mask."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.rand(rows, budget, generator=gen) * 0.8  # each node a little less likely than the last
    log_probs = -steps.cumsum(dim=1)
    counts = torch.randint(0, budget + 1, (rows,), generator=gen)
    log_probs[torch.arange(budget)[None] >= counts[:, None]] = float("-inf")
    costs = 1.0 + torch.arange(1, budget + 1, dtype=torch.float32) * torch.rand((), generator=gen) * 0.2
    if graphed:
        sizes = [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192) if b < budget] + [budget]
        costs[[b - 1 for b in range(1, budget + 1) if b not in sizes]] = float("inf")
    mask = None if live is None else torch.tensor([bool(i) for i in live], dtype=torch.bool)
    return log_probs.to(DEVICE), costs.to(DEVICE), None if mask is None else mask.to(DEVICE)


def ratios64(log_probs: torch.Tensor, costs: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """Expected tokens per second of every prefix size, in float64."""
    p = log_probs.double().exp().cpu()
    if live is not None:
        p = p[live.cpu()]
    return (p.cumsum(dim=1).sum(dim=0) + p.shape[0]) / costs.double().cpu()


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-b{c[1]}-live{c[2] is not None}-graphed{c[3]}")
def test_triton_picks_the_best_ratio(case: tuple) -> None:
    for seed in range(3):
        log_probs, costs, live = make_inputs(*case, seed=seed)
        got = choose_budget_triton(log_probs, costs, live)
        want = choose_budget_reference(log_probs, costs, live)
        assert got.shape == () and got.dtype == torch.long and got.device == log_probs.device
        r = ratios64(log_probs, costs, live)
        best = float(r.max())
        assert float(r[int(got) - 1]) >= best * (1 - 1e-5), f"seed {seed}: b* {int(got)} is not the best ratio"
        top2 = r.topk(min(2, r.numel())).values
        if top2.numel() < 2 or float(top2[0] - top2[1]) > 1e-4 * best:  # a clear best: both must name it
            assert int(got) == int(want), f"seed {seed}: kernel {int(got)}, reference {int(want)}"


@needs_triton
def test_triton_ties_go_to_the_smaller_budget_and_views_work() -> None:
    """No probability mass and equal costs: every size ties, b* = 1; a strided view of a wider buffer reads
    the same values as a contiguous copy."""
    zeros = torch.full((4, 8), float("-inf"), device=DEVICE)
    assert int(choose_budget_triton(zeros, torch.ones(8, device=DEVICE))) == 1
    log_probs, costs, live = make_inputs(6, 12, None, False, seed=5)
    wide = torch.cat([log_probs, log_probs], dim=1)[:, :12]  # row stride 24
    assert int(choose_budget_triton(wide, costs)) == int(choose_budget_triton(log_probs.contiguous(), costs))
    assert int(choose_budget(log_probs, costs, backend="triton")) == int(choose_budget_triton(log_probs, costs))


@needs_triton
@pytest.mark.parametrize("case", [(1, 32, None, True), (5, 12, [1, 0, 1, 1, 0], False)], ids=["rows1-b32", "rows5-b12"])
def test_triton_running_mean_follows_the_reference(case: tuple) -> None:
    """Over several rounds the kernel's running mean of per-row gains tracks the reference's (float32 sums in
    another order), and each round's b* is the best of the smoothed ratios."""
    got_buf = torch.full((case[1],), -1.0, device=DEVICE)
    want_buf = got_buf.clone()
    for seed in range(6):
        log_probs, costs, live = make_inputs(*case, seed=seed)
        got = choose_budget_triton(log_probs, costs, live, smoothed=got_buf, alpha=0.3)
        want = choose_budget_reference(log_probs, costs, live, smoothed=want_buf, alpha=0.3)
        assert_close(got_buf, want_buf, what=f"running mean after round {seed}")
        r = (1.0 + want_buf.double().cpu()) / costs.double().cpu()
        assert float(r[int(got) - 1]) >= float(r.max()) * (1 - 1e-5), f"round {seed}: b* {int(got)} vs {int(want)}"


def test_reference_running_mean_starts_updates_and_skips_empty_batches() -> None:
    """The first round's per-row gains seed the mean, later ones move it by alpha, a round with no live row
    leaves it; the choice is the best (1 + mean) / cost."""
    buf = torch.full((3,), -1.0)
    one = torch.tensor([[0.0, float("-inf"), float("-inf")], [0.0, 0.0, 0.0]])  # per-row gains [1, 1.5, 2]
    costs = torch.tensor([1.0, 1.2, 2.0])
    b = choose_budget_reference(one, costs, smoothed=buf, alpha=0.5)
    assert buf.tolist() == pytest.approx([1.0, 1.5, 2.0]) and int(b) == 2  # 2/1, 2.5/1.2, 3/2
    zero = torch.full((2, 3), float("-inf"))
    choose_budget_reference(zero, costs, smoothed=buf, alpha=0.5)  # gains 0: halfway down
    assert buf.tolist() == pytest.approx([0.5, 0.75, 1.0])
    choose_budget_reference(one, costs, torch.tensor([False, False]), smoothed=buf, alpha=0.5)
    assert buf.tolist() == pytest.approx([0.5, 0.75, 1.0])  # no live row: nothing learned
    with pytest.raises(ValueError, match=r"alpha 0 is out of range"):
        choose_budget(one, costs, smoothed=buf, alpha=0)
    with pytest.raises(ValueError, match=r"smoothed must be \[B=3\] contiguous float32"):
        choose_budget(one, costs, smoothed=torch.zeros(4))


def test_reference_counts_live_rows_only() -> None:
    """Padding rows (live False) add neither their bonus nor their nodes."""
    log_probs = torch.tensor([[0.0, 0.0, 0.0], [-30.0, -30.0, -30.0]])
    costs = torch.tensor([1.0, 1.5, 2.0])
    # row 0 alone: (1 + b) / cost = 2, 2, 2 -> a tie -> 1; both rows: (2 + b) / cost = 3, 2.67, 2.5 -> 1
    assert int(choose_budget_reference(log_probs, costs, torch.tensor([True, False]))) == 1
    flat = torch.tensor([1.0, 1.0, 1.0])
    assert int(choose_budget_reference(log_probs, flat, torch.tensor([True, False]))) == 3
    assert int(choose_budget_reference(log_probs, flat, torch.tensor([False, False]))) == 1  # nothing live


def test_rejects_bad_shapes_before_any_work() -> None:
    log_probs = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"costs must be \[B=4\]"):
        choose_budget(log_probs, torch.ones(3))
    with pytest.raises(ValueError, match=r"log_probs must be \[bs, B\] float"):
        choose_budget(torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match=r"live must be \[bs=2\] bool"):
        choose_budget(log_probs, torch.ones(4), torch.ones(2))
    with pytest.raises(Exception, match="backend"):
        choose_budget(log_probs, torch.ones(4), backend="cuda")


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")
