"""Packed ancestor bitmasks for tree attention: build, pack and unpack (pure torch, no host sync).

A tree of n nodes (root first) packs its ancestor-or-self mask into int64 words: bit j of word
(i, j // 64) is set iff node j is an ancestor of node i or i itself. For n <= 64 the words collapse
to one per row, `[bs, n]` int64 (the layout ddtree.tree.compile_trees emits); larger trees use
`[bs, n, ceil(n / 64)]`. Bit 63 lands in the sign bit, which is fine: only bits are ever read.
This module knows nothing of kernels or models.
"""

from __future__ import annotations

import torch

WORD_BITS = 64


def num_words(n: int) -> int:
    """int64 words per row for a tree of n nodes."""
    return (n + WORD_BITS - 1) // WORD_BITS


def causal_bitmask(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The chain (causal) tree of n nodes: row i holds bits 0..i.

    Returns [n] int64 when n <= 64, else [n, ceil(n/64)]; broadcast it over the batch with
    `.expand(bs, *shape)` (a stride-0 view is fine for the kernels).
    """
    if n < 1:
        raise ValueError(f"causal_bitmask: n must be >= 1, got {n}")
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
    return pack_mask(mask)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask[..., n, n] bool -> packed words: [..., n] int64 when n <= 64, else [..., n, ceil(n/64)]."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"pack_mask: mask must be [..., n, n], got shape {tuple(mask.shape)}")
    n = mask.shape[-1]
    words = num_words(n)
    pad = words * WORD_BITS - n
    bits = torch.nn.functional.pad(mask.long(), (0, pad))  # [..., n, words*64]
    bits = bits.unflatten(-1, (words, WORD_BITS))  # [..., n, words, 64]
    shifts = torch.arange(WORD_BITS, device=mask.device, dtype=torch.long)
    # distinct powers of two never carry, so the sum is the bitwise OR (bit 63 wraps to the sign)
    packed = (bits << shifts).sum(dim=-1)  # [..., n, words]
    return packed.squeeze(-1) if words == 1 else packed


def as_words(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """View packed words as [..., n, words] (adds the unit words dim for the n <= 64 layout)."""
    words = num_words(n)
    if words == 1 and bitmask.dim() >= 1 and bitmask.shape[-1] == n:
        return bitmask[..., None]
    if bitmask.dim() >= 2 and tuple(bitmask.shape[-2:]) == (n, words):
        return bitmask
    want = f"[..., {n}]" if words == 1 else f"[..., {n}, {words}]"
    raise ValueError(f"tree_bitmask: expected {want} int64 words for n={n} nodes, got shape {tuple(bitmask.shape)}")


def unpack_bitmask(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """Packed words ([..., n] or [..., n, words]) -> mask[..., n, n] bool."""
    words = as_words(bitmask, n)  # [..., n, words]
    shifts = torch.arange(WORD_BITS, device=bitmask.device, dtype=torch.long)
    bits = (words[..., None] >> shifts) & 1  # [..., n, words, 64]
    return bits.flatten(-2)[..., :n].bool()


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents[..., n] long (parents[..., 0] ignored: node 0 is the root; parent[i] < i) -> mask[..., n, n] bool.

    Row i is ancestor-or-self: built by walking each node's parent row, so it needs parent[i] < i
    (heap pop order guarantees that).
    """
    n = parents.shape[-1]
    mask = torch.zeros(*parents.shape, n, dtype=torch.bool, device=parents.device)  # [..., n, n]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    mask[..., 0, :] = eye[0]
    for i in range(1, n):
        par = parents[..., i].clamp(0, i - 1)  # [...]
        row = torch.gather(mask, -2, par[..., None, None].expand(*par.shape, 1, n)).squeeze(-2)
        mask[..., i, :] = row | eye[i]
    return mask
