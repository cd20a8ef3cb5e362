"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP, masked attention.

Numerics follow the Hugging Face Qwen3/Llama modules (norm in float32 then cast back, RoPE
tables in float32 then cast), so a loaded checkpoint gives the same logits as transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: normalise in float32, cast back, then scale. F.rms_norm does the normalisation
        # as one op (bit-identical here on the CPU, 2x faster; a single kernel where torch fuses it)
        dtype = x.dtype
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE at absolute positions (the Llama/Qwen3 'default' rope type)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # kept out of the module's buffers so .to(bfloat16) never rounds the frequencies
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            self._inv_freq[device] = 1.0 / (self.theta**exps)  # [d/2] float32
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions[bs, q] -> cos, sin [bs, 1, q, head_dim] ready to broadcast over heads
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x[bs, heads, q, d]; cos/sin [bs, 1, q, d]
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAProjections(nn.Module):
    """The q/k/v/o projections of grouped-query attention (HF weight names), optional per-head q/k
    RMSNorm, and the output projection; the target's and the drafter's attention share them."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def out(self, o: torch.Tensor) -> torch.Tensor:
        # o[bs, H, q, d] -> [bs, q, D]
        bs, _, n, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(bs, n, self.n_heads * self.head_dim))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention through SDPA with a boolean mask (True = may attend).

    q[bs, H, q, d], k/v[bs, KV, s, d], mask[bs, 1, q, s] or None (full) -> out[bs, H, q, d].
    The H/KV query heads of a group are folded into the query axis instead of copying K/V, so the
    (possibly long) cache is read in place and any SDPA backend works.
    """
    bs, n_heads, n_q, d = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    if rep > 1:
        q = q.reshape(bs, n_kv, rep * n_q, d)
        if mask is not None:
            mask = mask[:, :, None].expand(bs, 1, rep, n_q, mask.shape[-1]).reshape(bs, 1, rep * n_q, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(bs, n_heads, n_q, d)
