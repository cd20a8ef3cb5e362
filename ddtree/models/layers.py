"""Building blocks shared by the target and the drafter: RMSNorm, RoPE tables, SwiGLU MLP, masked attention.

Numerics follow the Hugging Face Qwen3/Llama modules (norm in float32 then cast back, RoPE
tables in float32 then cast), so a loaded checkpoint gives the same logits as transformers.
The q/k norm and the rotation itself live in ddtree.kernels.norm_rope (a torch reference off CUDA).
Projections that read the same input can be fused into one GEMM for inference (`FusedLinear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.fused_linear import REAL_WIDTH
from ddtree.kernels.norm_rope import norm_rope, norm_rope_qkv, norm_rope_write
from ddtree.kernels.residual_norm import silu_mul
from ddtree.kernels.skinny_gemm import MAX_ROWS, Tiles, folded_linear_reference, skinny_linear

# Inference linears of at most this many rows (bias-free, 16-bit, CUDA, K >= SKINNY_MIN_K) run
# ddtree.kernels.skinny_gemm's Triton kernel instead of cuBLAS, a gate/up GEMM with SwiGLU's product in the
# same launch; 0 = cuBLAS always. 16 covers batch 1's AR step, verify and drafter block. Process-wide, like
# the engine's BLAS choice; GEMV_TILES = a skinny_gemm.Tiles for every product, or None (the kernel's own
# choice). docs/perf.md, "The engine at real width", says what they measured.
GEMV_MAX_ROWS = 16
GEMV_TILES: Tiles | None = None
SKINNY_MIN_K = REAL_WIDTH  # below a real model's width a GEMM is a few us of launch either way


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not GEMV_MAX_ROWS or bias is not None or not x.is_cuda or x.dtype == torch.float32 or x.dim() not in (2, 3):
        return False
    if x.shape[-1] < SKINNY_MIN_K or weight.stride(-1) != 1:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return x.numel() // max(x.shape[-1], 1) <= min(GEMV_MAX_ROWS, MAX_ROWS)


def skinny_route(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs the skinny kernel (so a norm before it and an add after it are free)."""
    return _gemv_rows(x, weight, None)


@dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm whose weight has been multiplied into the columns of the GEMM after it (Target.fold_norms):
    what is left of it is each row's 1 / rms, from `sums` ([parts, rows] float32, the rows' sums of squares
    in parts, as the GEMM that wrote the rows returned them with return_sums)."""

    sums: torch.Tensor
    eps: float


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
           norm: RMSNorm | FoldedNorm | None = None, residual: torch.Tensor | None = None,
           return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """residual + F.linear(norm(x), weight, bias), with silu(gate) * up of its two halves when swiglu (weight =
    [gate; up]); norm and residual optional. Through cuBLAS with the norm and the add as torch ops, or for few
    rows through the skinny Triton kernel, which does all of it in one launch (GEMV_MAX_ROWS). A FoldedNorm
    scales the product by each row's 1 / rms; return_sums also returns the result rows' sums of squares
    ([parts, rows] float32: what the next FoldedNorm takes)."""
    folded = norm if isinstance(norm, FoldedNorm) else None
    norm_weight = None if norm is None or folded is not None else norm.weight
    norm_sums = None if folded is None else folded.sums
    eps = 1e-6 if norm is None else norm.eps
    if _gemv_rows(x, weight, bias):
        return skinny_linear(x, weight, swiglu=swiglu, tiles=GEMV_TILES, norm_weight=norm_weight, eps=eps,
                             residual=residual, norm_sums=norm_sums, return_sums=return_sums)
    if folded is not None or return_sums:
        if bias is not None:
            raise ValueError("linear: a folded norm or return_sums needs a bias-free weight")
        return folded_linear_reference(x, weight, swiglu, norm_weight, eps, residual, norm_sums, return_sums)
    if norm is not None:
        x = norm(x)
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = silu_mul(gate, up)
    return y if residual is None else residual + y


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
    """Rotate-half RoPE at absolute positions (the Llama/Qwen3 'default' rope type).

    On an accelerator, with `max_positions` given, cos/sin come from a table of every position computed
    once per device and dtype (the same float32 ops, so the same values): one gather per forward instead
    of five launches. Positions past the table (which the engine's context check rules out) are clamped.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        # kept out of the module's buffers so .to(bfloat16) never rounds the frequencies
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            self._inv_freq[device] = 1.0 / (self.theta**exps)  # [d/2] float32
        return self._inv_freq[device]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, 2, head_dim]: cos and sin of every position (built on first use)."""
        assert self.max_positions is not None
        key = (device, dtype)
        if key not in self._tables:
            cos, sin = self._compute(torch.arange(self.max_positions, device=device), dtype)
            self._tables[key] = torch.stack((cos, sin), dim=1)
        return self._tables[key]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions[bs, q] -> cos, sin [bs, 1, q, head_dim] ready to broadcast over heads
        if self.max_positions is not None and positions.device.type != "cpu":
            table = self.table(positions.device, dtype)
            rows = table[positions.clamp(max=table.shape[0] - 1)]  # [bs, q, 2, d]
            return rows[:, None, :, 0], rows[:, None, :, 1]
        cos, sin = self._compute(positions, dtype)
        return cos[:, None], sin[:, None]


class FusedLinear:
    """Linears that read the same input, run as one GEMM (inference only).

    The weights (and the biases: all or none of the Linears must have one) are concatenated once and
    each Linear's parameter is re-pointed at its rows of that tensor, so memory is not doubled,
    state_dict() keeps its names and in-place updates (load_state_dict, an optimizer step) reach both.
    If a parameter has been replaced since (load_state_dict(assign=True), .to(dtype)), or gradients
    must flow to the weights, `live` is False and callers run the separate Linears.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        biases: list[torch.Tensor] = [lin.bias for lin in linears if lin.bias is not None]
        if biases and len(biases) != len(linears):
            raise ValueError("FusedLinear: either every Linear has a bias or none has")
        self.linears = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat(tuple(lin.weight for lin in linears))  # [sum(out), in]
            self.bias = torch.cat(biases) if biases else None
        for lin, w in zip(linears, self.weight.split(self.sizes)):
            lin.weight.data = w
        if self.bias is not None:
            for lin, b in zip(linears, self.bias.split(self.sizes)):
                lin.bias.data = b
        self._ptrs = self._param_ptrs()

    def _param_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for lin in self.linears for p in (lin.weight, lin.bias) if p is not None)

    @property
    def intact(self) -> bool:
        """Every Linear still reads its rows of the fused tensor."""
        return self._param_ptrs() == self._ptrs

    @property
    def live(self) -> bool:
        if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in self.linears):
            return False  # the fused tensor is outside autograd: training runs the separate Linears
        return self.intact

    def __call__(self, x: torch.Tensor, skip: int = 0, norm: RMSNorm | FoldedNorm | None = None) -> list[torch.Tensor]:
        """x[..., in] (RMSNorm'd first when `norm` is given) -> one output per Linear from the `skip`-th on
        (their rows are contiguous, so the tail is one GEMM too), as column slices of one [..., sum(out)] result."""
        start = sum(self.sizes[:skip])
        bias = None if self.bias is None else self.bias[start:]
        return list(linear(x, self.weight[start:], bias, norm=norm).split(self.sizes[skip:], dim=-1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up: FusedLinear | None = None

    def fuse_projections(self) -> None:
        """One GEMM for gate and up from now on (see FusedLinear); a no-op while already fused."""
        if self.gate_up is None or not self.gate_up.intact:
            self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, norm: RMSNorm | FoldedNorm | None = None, residual: torch.Tensor | None = None,
                return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """residual + the MLP of norm(x) (norm and residual optional: the skinny kernel folds them into its
        GEMMs, elsewhere they are torch ops); a FoldedNorm or return_sums (see `linear`) need the fused,
        bias-free gate/up."""
        gate_up = self.gate_up if self.gate_up is not None and self.gate_up.live else None
        if gate_up is not None and gate_up.bias is None:  # GEMM and product: one launch where `linear` fuses them
            act = linear(x, gate_up.weight, swiglu=True, norm=norm)
            if return_sums:
                return linear(act, self.down_proj.weight, self.down_proj.bias, residual=residual, return_sums=True)
        elif isinstance(norm, FoldedNorm) or return_sums:
            raise ValueError("SwiGLU: a folded norm or return_sums needs the fused, bias-free gate/up (fuse_projections)")
        else:
            h = x if norm is None else norm(x)
            act = silu_mul(*gate_up(h)) if gate_up is not None else silu_mul(self.gate_proj(h), self.up_proj(h))
        down = self.down_proj
        if gate_up is not None:
            return linear(act, down.weight, down.bias, residual=residual)
        y = down(act)
        return y if residual is None else residual + y


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
        self.eps = eps
        self.qkv_proj: FusedLinear | None = None

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v from now on (and for k, v alone: their rows are the fused tail); a no-op
        while already fused."""
        if self.qkv_proj is None or not self.qkv_proj.intact:
            self.qkv_proj = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _fused(self) -> FusedLinear | None:
        return self.qkv_proj if self.qkv_proj is not None and self.qkv_proj.live else None

    def rope_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # q[bs, n, H*d] -> [bs, H, n, d], normed (if qk_norm) and rotated
        bs, n, _ = q.shape
        weight = None if self.q_norm is None else self.q_norm.weight
        return norm_rope(q.view(bs, n, self.n_heads, self.head_dim), weight, self.eps, cos, sin)

    def rope_kv(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # k/v[bs, n, KV*d] -> [bs, KV, n, d]; k normed (if qk_norm) and rotated
        bs, n, _ = k.shape
        weight = None if self.k_norm is None else self.k_norm.weight
        k = norm_rope(k.view(bs, n, self.n_kv, self.head_dim), weight, self.eps, cos, sin)
        return k, v.view(bs, n, self.n_kv, self.head_dim).transpose(1, 2)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x[bs, q, D] -> q[bs, H, q, d], k/v[bs, KV, q, d], rotated
        fused = self._fused()
        q, k, v = fused(x) if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        return (self.rope_q(q, cos, sin), *self.rope_kv(k, v, cos, sin))

    def qkv_from(
        self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv` from an already computed [bs, q, (H + 2 KV) * d] output of the fused q/k/v weight."""
        q, k, v = projected.split([self.n_heads * self.head_dim, *(2 * [self.n_kv * self.head_dim])], dim=-1)
        return (self.rope_q(q, cos, sin), *self.rope_kv(k, v, cos, sin))

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x[bs, n, D] -> k, v [bs, KV, n, d]
        fused = self._fused()
        k, v = fused(x, skip=1) if fused is not None else (self.k_proj(x), self.v_proj(x))
        return self.rope_kv(k, v, cos, sin)

    def qkv_into(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_out: torch.Tensor,
                 v_out: torch.Tensor, slots: torch.Tensor, norm: RMSNorm | FoldedNorm | None = None) -> torch.Tensor:
        """`qkv` of norm(x) (x itself without `norm`), with k and v written straight into a cache layer
        k_out/v_out[bs, KV, S, d] at slots[bs, q]; returns q[bs, H, q, d]."""
        fused = self._fused()
        if fused is not None:
            q, k, v = fused(x, norm=norm)
        elif isinstance(norm, FoldedNorm):
            raise ValueError("qkv_into: a folded norm needs the fused q/k/v projection (fuse_projections)")
        else:
            h = x if norm is None else norm(x)
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        bs, n, _ = q.shape
        kv_shape = (bs, n, self.n_kv, self.head_dim)
        if (self.q_norm is None) != (self.k_norm is None):  # one norm without the other: two launches
            self.write_kv(k, v, cos, sin, k_out, v_out, slots)
            return self.rope_q(q, cos, sin)
        qw = None if self.q_norm is None else self.q_norm.weight
        kw = None if self.k_norm is None else self.k_norm.weight
        # the q rotation and the k/v cache write in one launch (ddtree.kernels.norm_rope.norm_rope_qkv)
        return norm_rope_qkv(q.view(bs, n, self.n_heads, self.head_dim), k.view(kv_shape), v.view(kv_shape),
                             qw, kw, self.eps, cos, sin, k_out, v_out, slots)

    def key_value_into(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_out: torch.Tensor,
                       v_out: torch.Tensor, slots: torch.Tensor) -> None:
        """`key_value`, written straight into k_out/v_out[bs, KV, S, d] at slots[bs, n]."""
        fused = self._fused()
        k, v = fused(x, skip=1) if fused is not None else (self.k_proj(x), self.v_proj(x))
        self.write_kv(k, v, cos, sin, k_out, v_out, slots)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_out: torch.Tensor, v_out: torch.Tensor, slots: torch.Tensor) -> None:
        """Projected k/v[bs, n, KV*d] (k normed if qk_norm, rotated) into k_out/v_out[bs, KV, S, d] at slots[bs, n]."""
        bs, n, _ = k.shape
        weight = None if self.k_norm is None else self.k_norm.weight
        shape = (bs, n, self.n_kv, self.head_dim)
        norm_rope_write(k.view(shape), v.view(shape), weight, self.eps, cos, sin, k_out, v_out, slots)

    def out_buffer(self, q: torch.Tensor) -> torch.Tensor:
        """An attention output for q[bs, H, n, d], laid out [bs, n, H, d] underneath so `out` needs no copy."""
        bs, heads, n, d = q.shape
        return q.new_empty(bs, n, heads, d).transpose(1, 2)

    def merge_heads(self, o: torch.Tensor) -> torch.Tensor:
        # o[bs, H, q, d] -> [bs, q, H*d] (a view when o came from out_buffer)
        bs, _, n, _ = o.shape
        return o.transpose(1, 2).reshape(bs, n, self.n_heads * self.head_dim)

    def out(self, o: torch.Tensor, residual: torch.Tensor | None = None,
            return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # o[bs, H, q, d] -> [bs, q, D] (+ residual); return_sums: and its rows' sums of squares (see `linear`)
        fused = self._fused()  # inference (see FusedLinear.live): `linear` may pick the few-row kernel
        if fused is not None or return_sums:
            return linear(self.merge_heads(o), self.o_proj.weight, self.o_proj.bias, residual=residual,
                          return_sums=return_sums)
        y = self.o_proj(self.merge_heads(o))
        return y if residual is None else residual + y


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
