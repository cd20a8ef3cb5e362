"""After a walk: gather what the accepted path hands on, in one launch.

A round's tail needs, per row, the tokens of the accepted path (for the host), the target's hidden-state
taps at those nodes, their positions and (optionally) the drafter ring's slots they go to (for the
drafter's context), and the new bonus token in the batch's bonus buffer. In torch that is a clamp, two
gathers, an arange, an add, a copy, a cat and five more ops for the slots: a dozen launches of a
microsecond or two, at fixture size as long as the work. Here one program per (row, path position) does
all of it; the torch reference (`gather_accepted_reference`) is the CPU path.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

try:  # Triton is optional: CPU machines use the reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Backend = Literal["auto", "triton", "reference"]


class Accepted(NamedTuple):
    host: torch.Tensor  # [bs, W+2] int64: path tokens..., new bonus, accepted length
    taps: torch.Tensor  # [bs, W, F] the target's taps at the path's nodes
    positions: torch.Tensor  # [bs, W] starts[b] + j
    slots: torch.Tensor | None  # [bs, W] the drafter ring slot of each path row (capacity: not stored)


def ring_slots_reference(accept_lens: torch.Tensor, total: torch.Tensor, capacity: int, width: int) -> torch.Tensor:
    """Where the drafter's ring stores path row j of row b: (total[b] + j) % capacity for the rows it keeps
    (j < accept_lens[b], and only the last `capacity` of them), `capacity` (its write sink) for the others."""
    j = torch.arange(width, device=accept_lens.device)[None, :]
    lens = accept_lens.to(torch.long)[:, None]
    live = (j < lens) & (j >= lens - capacity)
    return torch.where(live, (total.to(torch.long)[:, None] + j) % capacity, capacity)


def _check_inputs(accepted: torch.Tensor, accept_lens: torch.Tensor, node_tokens: torch.Tensor,
                  new_bonus: torch.Tensor, taps: torch.Tensor, starts: torch.Tensor,
                  bonus_out: torch.Tensor | None, ring: tuple[torch.Tensor, int] | None) -> tuple[int, int, int, int]:
    if accepted.dim() != 2 or accepted.dtype.is_floating_point:
        raise ValueError(f"gather_accepted: accepted must be [bs, W] integer, got {tuple(accepted.shape)} {accepted.dtype}")
    bs, width = accepted.shape
    if node_tokens.dim() != 2 or node_tokens.shape[0] != bs:
        raise ValueError(f"gather_accepted: node_tokens must be [bs={bs}, N], got {tuple(node_tokens.shape)}")
    nodes = node_tokens.shape[1]
    if taps.dim() != 3 or taps.shape[:2] != (bs, nodes):
        raise ValueError(f"gather_accepted: taps must be [bs={bs}, N={nodes}, F], got {tuple(taps.shape)}")
    if width > nodes:
        raise ValueError(f"gather_accepted: a path of {width} nodes is longer than the tree ({nodes} nodes)")
    named = {"accept_lens": accept_lens, "new_bonus": new_bonus, "starts": starts}
    if bonus_out is not None:
        named["bonus_out"] = bonus_out
    if ring is not None:
        named["ring total"] = ring[0]
        if ring[1] < 1:
            raise ValueError(f"gather_accepted: the ring's capacity must be >= 1, got {ring[1]}")
    for name, t in named.items():
        if t.shape != (bs,) or t.dtype.is_floating_point:
            raise ValueError(f"gather_accepted: {name} must be [bs={bs}] integer, got {tuple(t.shape)} {t.dtype}")
    for name, t in {"node_tokens": node_tokens, "taps": taps, **named}.items():
        if t.device != accepted.device:
            raise ValueError(f"gather_accepted: {name} is on {t.device}, accepted on {accepted.device}")
    return bs, width, nodes, taps.shape[2]


def gather_accepted_reference(
    accepted: torch.Tensor, accept_lens: torch.Tensor, node_tokens: torch.Tensor, new_bonus: torch.Tensor,
    taps: torch.Tensor, starts: torch.Tensor, bonus_out: torch.Tensor | None = None,
    ring: tuple[torch.Tensor, int] | None = None,
) -> Accepted:
    """The torch ops (see `gather_accepted`)."""
    _, width, _, features = _check_inputs(accepted, accept_lens, node_tokens, new_bonus, taps, starts, bonus_out, ring)
    idx = accepted.clamp_min(0)  # -1 padding reads node 0: those rows are past the length, never used
    path_taps = taps.gather(1, idx[:, :, None].expand(-1, -1, features))
    tokens = node_tokens.gather(1, idx)
    host = torch.cat([tokens, new_bonus[:, None].to(tokens), accept_lens[:, None].to(tokens)], dim=1)
    positions = starts[:, None] + torch.arange(width, device=accepted.device)
    if bonus_out is not None:
        bonus_out.copy_(new_bonus)
    slots = None if ring is None else ring_slots_reference(accept_lens, ring[0], ring[1], width)
    return Accepted(host, path_taps, positions, slots)


if triton is not None:

    @triton.jit
    def _gather_kernel(
        ACC, LENS, TOK, BONUS, TAPS, STARTS, HOST, OUT_TAPS, POS, BONUS_OUT, TOTAL, SLOTS, width, features,
        capacity, s_acc_b, s_acc_j, s_tok_b, s_tok_n, s_tap_b, s_tap_n, s_tap_f,
        HAS_BONUS_OUT: tl.constexpr, HAS_RING: tl.constexpr, BLOCK_F: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        node = tl.maximum(tl.load(ACC + b * s_acc_b + j * s_acc_j), 0).to(tl.int64)
        tl.store(HOST + b * (width + 2) + j, tl.load(TOK + b * s_tok_b + node * s_tok_n))
        tl.store(POS + b * width + j, tl.load(STARTS + b) + j)
        if HAS_RING:
            length = tl.load(LENS + b).to(tl.int64)
            live = (j < length) & (j >= length - capacity)
            slot = tl.where(live, (tl.load(TOTAL + b).to(tl.int64) + j) % capacity, capacity)
            tl.store(SLOTS + b * width + j, slot)
        if j == 0:
            bonus = tl.load(BONUS + b)
            tl.store(HOST + b * (width + 2) + width, bonus)
            tl.store(HOST + b * (width + 2) + width + 1, tl.load(LENS + b).to(tl.int64))
            if HAS_BONUS_OUT:
                tl.store(BONUS_OUT + b, bonus)
        src = TAPS + b * s_tap_b + node * s_tap_n
        dst = OUT_TAPS + (b * width + j) * features
        for f0 in range(0, features, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            ok = f < features
            tl.store(dst + f, tl.load(src + f * s_tap_f, mask=ok), mask=ok)


def gather_accepted_triton(
    accepted: torch.Tensor, accept_lens: torch.Tensor, node_tokens: torch.Tensor, new_bonus: torch.Tensor,
    taps: torch.Tensor, starts: torch.Tensor, bonus_out: torch.Tensor | None = None,
    ring: tuple[torch.Tensor, int] | None = None,
) -> Accepted:
    """The Triton path of `gather_accepted` (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("gather_accepted_triton: triton is not installed (pip install 'triton>=3.0')")
    bs, width, _, features = _check_inputs(accepted, accept_lens, node_tokens, new_bonus, taps, starts, bonus_out, ring)
    if node_tokens.dtype != torch.long or new_bonus.dtype != torch.long or starts.dtype != torch.long:
        raise ValueError("gather_accepted_triton: node_tokens, new_bonus and starts must be int64")
    device = accepted.device
    host = torch.empty(bs, width + 2, dtype=torch.long, device=device)
    path_taps = torch.empty(bs, width, features, dtype=taps.dtype, device=device)
    positions = torch.empty(bs, width, dtype=torch.long, device=device)
    slots = None if ring is None else torch.empty(bs, width, dtype=torch.long, device=device)
    if bs and width:
        block_f = min(1024, max(16, triton.next_power_of_2(features)))
        _gather_kernel[(bs, width)](
            accepted, accept_lens, node_tokens, new_bonus, taps, starts, host, path_taps, positions,
            bonus_out if bonus_out is not None else new_bonus, new_bonus if ring is None else ring[0],
            positions if slots is None else slots, width, features, 1 if ring is None else ring[1],
            *accepted.stride(), *node_tokens.stride(), *taps.stride(),
            HAS_BONUS_OUT=bonus_out is not None, HAS_RING=ring is not None, BLOCK_F=block_f, num_warps=4,
        )
    return Accepted(host, path_taps, positions, slots)


def gather_accepted(
    accepted: torch.Tensor, accept_lens: torch.Tensor, node_tokens: torch.Tensor, new_bonus: torch.Tensor,
    taps: torch.Tensor, starts: torch.Tensor, bonus_out: torch.Tensor | None = None,
    ring: tuple[torch.Tensor, int] | None = None, backend: Backend = "auto",
) -> Accepted:
    """What the accepted path hands on: Accepted(host[bs, W+2], taps[bs, W, F], positions[bs, W], slots).

    accepted[bs, W] node indices of each row's path (-1 past accept_lens[b]; column 0 is the root),
    node_tokens[bs, N] every node's token (the verify's input ids), new_bonus[bs] the target's token after
    the path, taps[bs, N, F] the target's hidden-state taps at every node, starts[bs] the committed length
    at the round's start (the root's position). host = [path tokens..., new bonus, accepted length] (int64:
    the one row per request the host reads back); path_taps[b, j] = taps[b, accepted[b, j]];
    positions[b, j] = starts[b] + j. Entries past a row's length are don't-cares. bonus_out[bs], when given,
    receives new_bonus. ring = (total[bs], capacity) of the drafter's context ring: slots[b, j] is where path
    row j goes (`ring_slots_reference`; None without a ring). backend "auto": the Triton kernel on CUDA when
    Triton is installed, else the torch ops.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"gather_accepted: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "triton" or (backend == "auto" and accepted.is_cuda and triton is not None):
        return gather_accepted_triton(accepted, accept_lens, node_tokens, new_bonus, taps, starts, bonus_out, ring)
    return gather_accepted_reference(accepted, accept_lens, node_tokens, new_bonus, taps, starts, bonus_out, ring)
