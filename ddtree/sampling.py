"""Token choice at the target's outputs: argmax at T = 0, counter-based Gumbel-max at T > 0.

The Gumbel noise is a pure function of (seed, absolute position of the token being chosen, vocab id).
So the token the target picks at position p does not depend on how p was reached: one AR step, a
node in a chain, or a node deep in a tree all see the same noise. With the same seed, NONE, DFLASH
and DDTREE therefore produce identical tokens at any temperature, and losslessness becomes an exact,
testable property instead of a statistical one. Argmax of logits/T + Gumbel is an exact sample of
softmax(logits/T).

The hash is written out here (murmur3's 32-bit finaliser over a mixed counter) because torch's
generators are stateful streams, not counter-based functions of arbitrary positions.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on int64 tensors holding 32-bit values; products wrap, the mask keeps the low bits.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [bs, q, V] (float32) determined by (seeds[bs], positions[bs, q], vocab id)."""
    device = positions.device
    seeds = seeds.to(device=device, dtype=torch.int64) & _M32
    pos = positions.to(torch.int64) & _M32
    vocab = torch.arange(vocab_size, device=device, dtype=torch.int64)
    key = _fmix32((seeds[:, None] * 0x9E3779B1 + pos * 0x7FEB352D) & _M32)  # [bs, q]
    x = _fmix32((key[:, :, None] ^ ((vocab * 0x846CA68B) & _M32)) & _M32)  # [bs, q, V]
    x = _fmix32((x + 0x68E31DA4) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), exact in float32
    return -torch.log(-torch.log(u))


def choose_tokens_no_sync(
    logits: torch.Tensor,  # [bs, q, V] float32
    temperatures: torch.Tensor,  # [bs] float32, 0 = greedy
    seeds: torch.Tensor,  # [bs] int64
    positions: torch.Tensor,  # [bs, q] absolute position of the token being chosen
    any_sampled: bool,  # host-known: whether any row has T > 0 (skips the noise entirely if not)
) -> torch.Tensor:
    """The target's token at every query position [bs, q]; no host synchronisation."""
    if not any_sampled:
        return logits.argmax(dim=-1)
    temps = temperatures.to(logits.device, torch.float32)[:, None, None]
    sampled = temps > 0
    scaled = torch.where(sampled, logits / temps.clamp_min(1e-6), logits)
    noise = gumbel_noise(seeds, positions, logits.shape[-1])
    scores = torch.where(sampled, scaled + noise, scaled)
    return scores.argmax(dim=-1)
