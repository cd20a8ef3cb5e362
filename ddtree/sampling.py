"""Token choice at the target's outputs: argmax at T = 0, counter-based Gumbel-max at T > 0.

The Gumbel noise is a pure function of (seed, absolute position of the token being chosen, vocab id).
So the token the target picks at position p does not depend on how p was reached: one AR step, a
node in a chain, or a node deep in a tree all see the same noise. With the same seed, NONE, DFLASH
and DDTREE therefore produce identical tokens at any temperature, and losslessness becomes an exact,
testable property instead of a statistical one. Argmax of logits/T + Gumbel is an exact sample of
softmax(logits/T).

top-k / top-p / min-p truncate the distribution before the noise is added (`Filters`): the node token is
then drawn from the target's processed distribution with the same coupled noise, so the three algorithms
stay token-identical for a seed with truncation too.

The hash is written out here (murmur3's 32-bit finaliser over a mixed counter) because torch's
generators are stateful streams, not counter-based functions of arbitrary positions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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


class Mode(enum.IntFlag):
    """What a batch's token choice needs this round (host-known; part of a captured graph's key).

    Falsy only when every row is greedy with nothing extra, so `bool(mode)` still reads "any sampled"
    where only SAMPLED matters (choose_tokens_no_sync's any_sampled takes `bool(mode & SAMPLED)`).
    """

    GREEDY = 0
    SAMPLED = 1  # some row has T > 0
    FILTERED = 2  # some sampled row truncates (top_k / top_p / min_p)
    BAN = 4  # some row is below its min_new_tokens: its stop tokens are banned
    LOGPROBS = 8  # some row wants the log-prob of each committed token


@dataclass(frozen=True)
class Filters:
    """Per-row truncation of the sampled distribution, as SGLang applies it (all [bs] tensors on the device).

    top_k (int64, <= 0 or >= V = off), top_p (float32, 1 = off), min_p (float32, 0 = off): the kept set is
    computed on softmax(logits / T) sorted in descending order: rank < top_k, the mass before a token < top_p,
    and p >= min_p * p_max. The first token always stays.
    """

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor


def filter_logits(scaled: torch.Tensor, filters: Filters) -> torch.Tensor:
    """`scaled` [bs, q, V] with the tokens outside each row's kept set at -inf."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True)  # [bs, q, V]
    probs = ordered.softmax(dim=-1)
    ranks = torch.arange(vocab, device=scaled.device)
    top_k = filters.top_k.to(scaled.device)[:, None, None]
    top_p = filters.top_p.to(scaled.device, torch.float32)[:, None, None]
    min_p = filters.min_p.to(scaled.device, torch.float32)[:, None, None]
    # top_p = 1 keeps everything exactly (a cumulative sum can round past 1 before the smallest tokens), so a
    # row's draw never depends on whether another row in the batch truncates
    keep = (((top_k <= 0) | (ranks < top_k)) & ((top_p >= 1) | (probs.cumsum(dim=-1) - probs < top_p))
            & (probs >= min_p * probs[..., :1]))
    keep[..., 0] = True
    kept = torch.empty_like(keep).scatter_(-1, order, keep)
    return scaled.masked_fill(~kept, float("-inf"))


def ban_tokens(logits: torch.Tensor, banned: torch.Tensor, until: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`logits` [bs, q, V] with row b's `banned[b]` tokens [bs, V] (bool) at -inf where position < until[b].

    min_new_tokens: a row's stop tokens cannot be chosen before its minimum length, a function of the
    position only, so every algorithm bans at the same places.
    """
    active = positions.to(until.device)[:, :, None] < until[:, None, None]  # [bs, q, 1]
    return logits.masked_fill(active & banned[:, None, :], float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] [bs, q] (float32): the target's own log-prob of each chosen token."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return logits.float().gather(-1, tokens[..., None]).squeeze(-1) - lse


def choose_tokens_no_sync(
    logits: torch.Tensor,  # [bs, q, V] float32
    temperatures: torch.Tensor,  # [bs] float32, 0 = greedy
    seeds: torch.Tensor,  # [bs] int64
    positions: torch.Tensor,  # [bs, q] absolute position of the token being chosen
    any_sampled: bool,  # host-known: whether any row has T > 0 (skips the noise entirely if not)
    filters: Filters | None = None,  # host-known: None when no sampled row truncates its distribution
) -> torch.Tensor:
    """The target's token at every query position [bs, q]; no host synchronisation.

    A sampled row draws from its processed distribution (softmax of logits / T, truncated by `filters`) with
    the position's Gumbel noise, so the draw is still a pure function of (seed, position, processed logits).
    Greedy rows take the argmax (top-k/top-p/min-p never remove the most likely token).
    """
    if not any_sampled:
        return logits.argmax(dim=-1)
    temps = temperatures.to(logits.device, torch.float32)[:, None, None]
    sampled = temps > 0
    scaled = torch.where(sampled, logits / temps.clamp_min(1e-6), logits)
    if filters is not None:
        scaled = filter_logits(scaled, filters)
    noise = gumbel_noise(seeds, positions, logits.shape[-1])
    scores = torch.where(sampled, scaled + noise, scaled)
    return scores.argmax(dim=-1)
