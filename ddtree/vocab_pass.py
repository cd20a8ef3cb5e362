"""The vocabulary pass of a DDTree round: per-depth top-K log-probs of the drafter's logits.

The first step of every tree build (ddtree.tree.build_tree / build_trees): logits[..., L, V] ->
(log_probs[..., L, K] float32, ids[..., L, K] long), K = min(topk, V), best first. Two versions with the
same values: `top_log_probs`, the reference (topk of a full log_softmax), and `top_log_probs_fast`, its
ids found in two stages over blocks of the raw logits. Pure tensor code; ddtree.kernels.tree_ops holds the
Triton version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["LOG_PROB_FLOOR", "top_log_probs", "top_log_probs_fast"]

# A zero-probability token (a -inf logit) gets this log-prob instead of -inf, so it still sorts
# below every real token but never mixes with the -inf that marks padding slots. 15 of them still
# sum to a finite float32.
LOG_PROB_FLOOR = -1e30
T = TypeVar("T")
_CPU_CHUNK_ELEMS = 1 << 19  # 2 MiB of float32 per log_softmax call on CPU
_BLOCK = 32  # tokens per block in the two-stage top-k


def top_log_probs(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K log-probs and token ids per position, best first (the reference vocabulary pass).

    logits[..., L, V] -> (log_probs[..., L, K] float32, ids[..., L, K] long), K = min(topk, V):
    topk of log_softmax over the full vocabulary in float32, one row at a time in effect, so any
    batch of rows gets bit-identical values.
    """
    v = logits.shape[-1]
    k = min(topk, v)
    rows = logits.reshape(-1, v)  # [R, V], a view when contiguous
    parts = _per_chunk_log_softmax(rows, lambda lsm, _: lsm.topk(k, dim=-1))
    values = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]  # [R, K]
    ids = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]  # [R, K]
    return _finish_top(values, ids, logits.shape)


def top_log_probs_fast(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_log_probs with the same values (bit for bit) and, without exact ties, the same ids.

    The top-K ids come from the raw logits in two stages: the max of every block of 32 tokens,
    the top-K blocks by that max (they hold the K largest values, ties included), then the top-K
    of those K * 32 candidates. The values are then gathered from the same row-wise log_softmax
    the reference uses, so only the final gather differs, not the arithmetic.
    """
    v = logits.shape[-1]
    k = min(topk, v)
    rows = logits.reshape(-1, v)  # [R, V]
    ids = _block_topk_ids(rows, k)  # [R, K]
    values = torch.cat(_per_chunk_log_softmax(rows, lambda lsm, sl: lsm.gather(1, ids[sl])))  # [R, K]
    return _finish_top(values, ids, logits.shape)


def _per_chunk_log_softmax(rows: torch.Tensor, fn: Callable[[torch.Tensor, slice], T]) -> list[T]:
    """fn(log_softmax(rows[sl]) in float32, sl) for cache-sized row slices of rows[R, V].

    On CPU a [bs*L, V] float32 temporary is tens of MB of fresh pages; ~2 MiB slices written
    into one reused buffer stay in cache and run 2-3x faster. On an accelerator: one slice.
    """
    r, v = rows.shape
    if rows.device.type != "cpu" or r * v <= _CPU_CHUNK_ELEMS:
        return [fn(torch.log_softmax(rows.float(), dim=-1), slice(0, r))]
    step = max(1, _CPU_CHUNK_ELEMS // v)
    buf = torch.empty(step, v, dtype=torch.float32, device=rows.device)
    out = []
    for i in range(0, r, step):
        sl = slice(i, min(i + step, r))
        piece = rows[sl].float()
        out.append(fn(torch.log_softmax(piece, dim=-1, out=buf[: piece.shape[0]]), sl))
    return out


def _block_topk_ids(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the top-k values of every row of rows[R, V], sorted by value, best first."""
    r, v = rows.shape
    nblocks = v // _BLOCK
    if nblocks < 4 * k:  # too few blocks to save anything
        return rows.topk(k, dim=-1).indices
    head = rows[:, : nblocks * _BLOCK].reshape(r, nblocks, _BLOCK)
    _, best_blocks = head.amax(dim=-1).topk(k, dim=-1)  # [R, k]
    offsets = torch.arange(_BLOCK, device=rows.device)
    cand = (best_blocks[:, :, None] * _BLOCK + offsets).reshape(r, k * _BLOCK)  # [R, k*32]
    if v > nblocks * _BLOCK:  # the tail that fills no whole block is always a candidate
        tail = torch.arange(nblocks * _BLOCK, v, device=rows.device).expand(r, -1)
        cand = torch.cat([cand, tail], dim=1)
    _, pick = rows.gather(1, cand).topk(k, dim=-1)  # [R, k]
    return cand.gather(1, pick)


def _finish_top(values: torch.Tensor, ids: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    # -inf logits stay finite (see the floor); rounding never makes a log-prob positive, clamp anyway
    values = values.clamp(min=LOG_PROB_FLOOR, max=0.0)
    out = (*shape[:-1], values.shape[-1])
    return values.reshape(out), ids.reshape(out)
