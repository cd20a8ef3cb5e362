"""Budget auto's per-round choice in one launch: b* = argmax_b (live rows + sum_rows cumsum_b p) / cost(b).

With a `smoothed` buffer the gains are a running mean (EMA) of the per-row gains over rounds instead of this
round's alone: b* = argmax_b (1 + smoothed[b]) / cost(b), the buffer updated in place (ddtree.budget says why).

ddtree.budget.choose_budget_reference does it in torch: a cast, a mask, an exp, a cumsum, two sums, an add, a
divide, an argmax and an add: about ten launches of a microsecond or two each, inside every graphed auto
round (a fixture round is ~0.5 ms). One program here sums the live rows' node probabilities tile by tile,
then takes the cumulative sum, the ratio and the argmax in registers.

Sums run in another order than torch's, so the two may differ in the last bits of a ratio; an exact tie
still goes to the smaller budget (tl.argmax and torch.argmax both take the first maximum).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU machines use the torch reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_BUDGET = 1024  # nodes one program holds in registers (trees are at most 255 nodes wide)


def check_choice_inputs(log_probs: torch.Tensor, costs: torch.Tensor, live: torch.Tensor | None,
                        smoothed: torch.Tensor | None = None, alpha: float = 1.0) -> None:
    """What both implementations need: log_probs[bs, B] float, costs[B], live[bs] bool, smoothed[B] float32
    (contiguous: it is written in place), 0 < alpha <= 1."""
    if log_probs.dim() != 2 or not log_probs.dtype.is_floating_point:
        raise ValueError(f"choose_budget: log_probs must be [bs, B] float, got {tuple(log_probs.shape)} {log_probs.dtype}")
    bs, budget = log_probs.shape
    if budget < 1:
        raise ValueError("choose_budget: log_probs needs at least one node column")
    if costs.shape != (budget,):
        raise ValueError(f"choose_budget: costs must be [B={budget}], got {tuple(costs.shape)}")
    if live is not None and (live.shape != (bs,) or live.dtype != torch.bool):
        raise ValueError(f"choose_budget: live must be [bs={bs}] bool, got {tuple(live.shape)} {live.dtype}")
    if smoothed is not None and (smoothed.shape != (budget,) or smoothed.dtype != torch.float32
                                 or not smoothed.is_contiguous()):
        raise ValueError(f"choose_budget: smoothed must be [B={budget}] contiguous float32, "
                         f"got {tuple(smoothed.shape)} {smoothed.dtype}")
    if not 0 < alpha <= 1:
        raise ValueError(f"choose_budget: alpha {alpha} is out of range (allowed (0, 1])")


if triton is not None:

    @triton.jit
    def _choose_kernel(LP, LIVE, COSTS, SMOOTHED, OUT, rows, budget, alpha, s_row, s_col,
                       HAS_LIVE: tl.constexpr, HAS_SMOOTHED: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_B: tl.constexpr):
        cols = tl.arange(0, BLOCK_B)
        col_ok = cols < budget
        probs = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)  # summed over rows at the end
        counted = tl.zeros([BLOCK_R], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = r < rows
            if HAS_LIVE:
                ok = ok & (tl.load(LIVE + r, mask=ok, other=0) != 0)
            lp = tl.load(LP + r[:, None] * s_row + cols[None, :] * s_col, mask=ok[:, None] & col_ok[None, :],
                         other=float("-inf"))
            probs += tl.exp(lp.to(tl.float32))
            counted += ok.to(tl.float32)
        gains = tl.cumsum(tl.sum(probs, axis=0), axis=0)  # [BLOCK_B]: expected accepted drafts per prefix
        n = tl.sum(counted, axis=0)
        costs = tl.load(COSTS + cols, mask=col_ok, other=float("inf")).to(tl.float32)
        if HAS_SMOOTHED:  # a running mean of the per-row gains (negative first entry: nothing seen yet)
            old = tl.load(SMOOTHED + cols, mask=col_ok, other=0.0)
            mean = gains / tl.maximum(n, 1.0)
            new = tl.where(tl.load(SMOOTHED) < 0, mean, old + alpha * (mean - old))
            new = tl.where(n > 0, new, old)
            tl.store(SMOOTHED + cols, new, mask=col_ok)
            ratio = (1.0 + new) / costs
        else:
            ratio = (gains + n) / costs
        ratio = tl.where(col_ok, ratio, -1.0)
        tl.store(OUT, tl.argmax(ratio, axis=0).to(tl.int64) + 1)


def choose_budget_triton(log_probs: torch.Tensor, costs: torch.Tensor, live: torch.Tensor | None = None,
                         smoothed: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    """The one-launch choice (CUDA, or CPU tensors under TRITON_INTERPRET=1); see ddtree.budget.choose_budget."""
    if triton is None:
        raise RuntimeError("choose_budget_triton: triton is not installed (pip install 'triton>=3.0')")
    check_choice_inputs(log_probs, costs, live, smoothed, alpha)
    bs, budget = log_probs.shape
    if budget > MAX_BUDGET:
        raise ValueError(f"choose_budget_triton: B = {budget} is out of range (allowed 1..{MAX_BUDGET})")
    for name, t in (("costs", costs), ("live", live), ("smoothed", smoothed)):
        if t is not None and t.device != log_probs.device:
            raise ValueError(f"choose_budget_triton: {name} is on {t.device}, log_probs on {log_probs.device}")
    out = torch.empty((), dtype=torch.long, device=log_probs.device)
    block_b = triton.next_power_of_2(budget)
    block_r = max(1, min(triton.next_power_of_2(max(bs, 1)), 4096 // block_b, 32))
    _choose_kernel[(1,)](
        log_probs, live.view(torch.uint8) if live is not None else log_probs, costs.contiguous(),
        smoothed if smoothed is not None else costs, out, bs, budget, float(alpha), *log_probs.stride(),
        HAS_LIVE=live is not None, HAS_SMOOTHED=smoothed is not None, BLOCK_R=block_r, BLOCK_B=block_b, num_warps=4,
    )
    return out
