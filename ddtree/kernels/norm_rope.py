"""Per-head q/k RMSNorm (optional) and rotate-half RoPE in one pass, straight from a projection's output.

x is the projection output viewed as [bs, n, heads, d] (any strides, e.g. a column slice of a fused qkv
GEMM); the result is a contiguous [bs, heads, n, d], the layout attention reads. `norm_rope_write` does
the same for keys and writes them, with the values beside them, straight into a cache at given slots
(a KV cache's next positions, a drafter's ring buffer): one launch instead of a rotation and two
scattered copies per layer. cos/sin are what
`Rotary.forward` returns, [bs, 1, n, d] in x's dtype. A Triton kernel (one program per (request, token,
block of heads): the norm's scale is per head, and the rotated partner d +- d/2 is loaded a second time
rather than shuffled in registers) and a torch reference that is exactly the models' old op sequence
(ddtree.models.layers: `RMSNorm.forward`, `.transpose(1, 2)`, `apply_rope`), so CPU numerics do not move.
The ops are spelled out here rather than imported: the models import this module, not the reverse.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

try:  # Triton is optional: CPU machines use the reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Backend = Literal["auto", "triton", "reference"]

MAX_HEAD_DIM = 256
_TILE = 4096  # elements per program: heads x padded head_dim


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[int, int, int, int]:
    if x.dim() != 4:
        raise ValueError(f"norm_rope: x must be [bs, n, heads, d], got {tuple(x.shape)}")
    bs, n, heads, d = x.shape
    if d % 2 or not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(f"norm_rope: x's head_dim must be even and in [2, {MAX_HEAD_DIM}], got {d}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"norm_rope: x must be floating point, got {x.dtype}")
    if weight is not None and (tuple(weight.shape) != (d,) or weight.dtype != x.dtype):
        raise ValueError(f"norm_rope: weight must be [d={d}] {x.dtype} or None, got {tuple(weight.shape)} {weight.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (bs, 1, n, d) or t.dtype != x.dtype:
            raise ValueError(f"norm_rope: {name} must be [bs={bs}, 1, n={n}, d={d}] {x.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")
    others = {"weight": weight, "cos": cos, "sin": sin}
    for name, other in others.items():
        if other is not None and other.device != x.device:
            raise ValueError(f"norm_rope: {name} is on {other.device}, x on {x.device}")
    return bs, n, heads, d


def norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The torch ops the models ran before the kernel, in the same order (RMSNorm.forward, transpose,
    apply_rope); the result is [bs, heads, n, d] with whatever strides those ops give."""
    _check_inputs(x, weight, cos, sin)
    if weight is not None:
        dtype = x.dtype
        x = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(dtype)
    x = x.transpose(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


if triton is not None:

    @triton.jit
    def _norm_rope_qkv_kernel(
        Q, WQ, QOUT, K, WK, COS, SIN, KOUT, V, VOUT, SLOTS, n, q_heads, kv_heads, eps, n_slots, k_blocks,
        sq_b, sq_n, sq_h, sq_d,
        sqo_b, sqo_h, sqo_s, sqo_d,
        sx_b, sx_n, sx_h, sx_d,
        sc_b, sc_n, sc_d,
        ss_b, ss_n, ss_d,
        so_b, so_h, so_s, so_d,
        sv_b, sv_n, sv_h, sv_d,
        svo_b, svo_h, svo_s, svo_d,
        sl_b, sl_n,
        HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
    ):
        # a layer's q and its k/v in one launch: the first k_blocks programs of a row write keys and values
        # into the cache, the rest rotate the queries; norm_rope and norm_rope_write launch one side alone
        row = tl.program_id(0)
        b = (row // n).to(tl.int64)
        i = (row % n).to(tl.int64)
        blk = tl.program_id(1)
        if blk < k_blocks:
            hs = blk * BLOCK_H + tl.arange(0, BLOCK_H)
            _norm_rope_heads(K, WK, COS, SIN, KOUT, V, VOUT, SLOTS, b, i, hs, kv_heads, eps, n_slots,
                             sx_b, sx_n, sx_h, sx_d, sc_b, sc_n, sc_d, ss_b, ss_n, ss_d, so_b, so_h, so_s, so_d,
                             sv_b, sv_n, sv_h, sv_d, svo_b, svo_h, svo_s, svo_d, sl_b, sl_n,
                             HEAD_DIM, BLOCK_D, HAS_WEIGHT, True, True)
        else:
            hq = (blk - k_blocks) * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
            _norm_rope_heads(Q, WQ, COS, SIN, QOUT, Q, QOUT, SLOTS, b, i, hq, q_heads, eps, n_slots,
                             sq_b, sq_n, sq_h, sq_d, sc_b, sc_n, sc_d, ss_b, ss_n, ss_d, sqo_b, sqo_h, sqo_s, sqo_d,
                             sq_b, sq_n, sq_h, sq_d, sqo_b, sqo_h, sqo_s, sqo_d, sl_b, sl_n,
                             HEAD_DIM, BLOCK_D, HAS_WEIGHT, False, False)

    @triton.jit
    def _norm_rope_heads(
        X, W, COS, SIN, OUT, V, VOUT, SLOTS, b, i, hs, heads, eps, n_slots,
        sx_b, sx_n, sx_h, sx_d, sc_b, sc_n, sc_d, ss_b, ss_n, ss_d, so_b, so_h, so_s, so_d,
        sv_b, sv_n, sv_h, sv_d, svo_b, svo_h, svo_s, svo_d, sl_b, sl_n,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SLOTS: tl.constexpr,
        HAS_V: tl.constexpr,
    ):
        # heads hs of token i of request b
        dims = tl.arange(0, BLOCK_D)
        half: tl.constexpr = HEAD_DIM // 2
        first = dims < half
        partner = tl.where(first, dims + half, dims - half)
        dim_ok = dims < HEAD_DIM
        mask = (hs < heads)[:, None] & dim_ok[None, :]
        base = X + b * sx_b + i * sx_n + hs[:, None].to(tl.int64) * sx_h
        x = tl.load(base + dims[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            # RMSNorm's order: normalise in float32, round to x's dtype, then scale (and round again)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # [BLOCK_H]
            w = tl.load(W + dims, mask=dim_ok, other=0.0).to(tl.float32)
            wp = tl.load(W + partner, mask=dim_ok, other=0.0).to(tl.float32)
            dt = X.dtype.element_ty
            x = (w[None, :] * (x * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp[None, :] * (xp * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(COS + b * sc_b + i * sc_n + dims * sc_d, mask=dim_ok, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * ss_b + i * ss_n + dims * ss_d, mask=dim_ok, other=0.0).to(tl.float32)
        rot = tl.where(first[None, :], -xp, xp)  # rotate_half: (-x2, x1)
        y = x * c[None, :] + rot * s[None, :]
        if HAS_SLOTS:  # a cache: token i of row b goes to slot SLOTS[b, i]; slots outside [0, n_slots) drop
            # loaded once per head row (the same address): keeps every mask a block, as the interpreter wants
            slot = tl.load(SLOTS + b * sl_b + i * sl_n + 0 * hs).to(tl.int64)[:, None]  # [BLOCK_H, 1]
            mask = mask & (slot >= 0) & (slot < n_slots)
        else:
            slot = i
        heads_off = hs[:, None].to(tl.int64)
        o = OUT + b * so_b + heads_off * so_h + slot * so_s + dims[None, :] * so_d
        tl.store(o, y.to(OUT.dtype.element_ty), mask=mask)
        if HAS_V:  # the values of the same token and heads, copied beside the keys
            val = tl.load(V + b * sv_b + i * sv_n + heads_off * sv_h + dims[None, :] * sv_d, mask=mask)
            tl.store(VOUT + b * svo_b + heads_off * svo_h + slot * svo_s + dims[None, :] * svo_d, val, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
            out: torch.Tensor, v: torch.Tensor | None, v_out: torch.Tensor | None, slots: torch.Tensor | None) -> None:
    """One kernel launch; out (and v_out) are [bs, heads, S, d] with any strides. With slots (and v): keys and
    values into a cache; without: queries (x, out as norm_rope_qkv's q side)."""
    if slots is not None:
        assert v is not None and v_out is not None
        _launch_qkv(None, None, None, x, v, weight, eps, cos, sin, out, v_out, slots)
    else:
        _launch_qkv(x, weight, out, None, None, None, eps, cos, sin, None, None, None)


def _launch_qkv(q: torch.Tensor | None, q_weight: torch.Tensor | None, q_out: torch.Tensor | None,
                k: torch.Tensor | None, v: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, k_out: torch.Tensor | None, v_out: torch.Tensor | None,
                slots: torch.Tensor | None) -> None:
    """_norm_rope_qkv_kernel over the queries (q, q_out) and/or the keys and values (k, v into k_out, v_out
    at slots); a side left None gets no programs (its pointers are placeholders)."""
    any_x = q if q is not None else k
    assert any_x is not None
    bs, n, _, d = any_x.shape
    q_heads = q.shape[2] if q is not None else 0
    kv_heads = k.shape[2] if k is not None else 0
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(triton.next_power_of_2(max(kv_heads, 1)), max(1, _TILE // block_d))
    block_hq = min(triton.next_power_of_2(max(q_heads, 1)), max(1, _TILE // block_d))
    k_blocks = triton.cdiv(kv_heads, block_h)
    grid = (bs * n, k_blocks + triton.cdiv(q_heads, block_hq))
    weight = q_weight if q is not None else k_weight
    qq, qo = (q, q_out) if q is not None and q_out is not None else (any_x, k_out)
    kk, kv, ko, vo = (k, v, k_out, v_out) if k is not None else (any_x, any_x, q_out, q_out)
    sl = slots if slots is not None else any_x
    _norm_rope_qkv_kernel[grid](
        qq, q_weight if q_weight is not None else any_x, qo, kk, k_weight if k_weight is not None else any_x, cos, sin,
        ko, kv, vo, sl, n, q_heads, kv_heads, eps, ko.shape[2], k_blocks,
        *qq.stride(), *qo.stride(), *kk.stride(),
        cos.stride(0), cos.stride(2), cos.stride(3), sin.stride(0), sin.stride(2), sin.stride(3),
        *ko.stride(), *kv.stride(), *vo.stride(), *(slots.stride() if slots is not None else (0, 0)),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_HQ=block_hq, BLOCK_D=block_d, HAS_WEIGHT=weight is not None,
        num_warps=4 if max(block_h if k is not None else 1, block_hq if q is not None else 1) * block_d <= 2048 else 8,
    )


def norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of `norm_rope` (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("norm_rope_triton: triton is not installed (pip install 'triton>=3.0')")
    bs, n, heads, d = _check_inputs(x, weight, cos, sin)
    if _needs_grad(x, weight, cos, sin):
        raise ValueError("norm_rope_triton: the kernel has no backward; x or weight requires grad "
                         "(use backend 'auto' or 'reference' for training)")
    if out is None:
        out = torch.empty(bs, heads, n, d, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (bs, heads, n, d) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"norm_rope: out must be a contiguous {(bs, heads, n, d)} {x.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if out.numel() == 0:
        return out
    _launch(x, weight, eps, cos, sin, out, None, None, None)
    return out


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x[bs, n, heads, d] -> RoPE(RMSNorm(x) if weight is not None else x) as [bs, heads, n, d].

    weight[d] in x's dtype (a q_norm / k_norm weight) or None (no norm); cos/sin [bs, 1, n, d] in x's
    dtype. backend "auto" runs the Triton kernel on CUDA when Triton is installed and no gradient has to
    flow through (the kernel has no backward: forward_train keeps the torch ops), else the reference
    (the CPU therefore keeps the models' old numerics bit for bit).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"norm_rope: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "triton" or (backend == "auto" and x.is_cuda and triton is not None
                               and not _needs_grad(x, weight, cos, sin)):
        return norm_rope_triton(x, weight, eps, cos, sin)
    return norm_rope_reference(x, weight, eps, cos, sin)


def _check_write(k: torch.Tensor, v: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                 slots: torch.Tensor) -> None:
    bs, n, heads, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"norm_rope_write: v must match k {tuple(k.shape)} {k.dtype} on {k.device}, "
                         f"got {tuple(v.shape)} {v.dtype} on {v.device}")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if (t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (bs, heads, d) or t.dtype != k.dtype
                or t.device != k.device):
            raise ValueError(f"norm_rope_write: {name} must be [bs={bs}, heads={heads}, S, d={d}] {k.dtype} on "
                             f"{k.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if v_out.shape != k_out.shape:
        raise ValueError(f"norm_rope_write: v_out {tuple(v_out.shape)} must match k_out {tuple(k_out.shape)}")
    if tuple(slots.shape) != (bs, n) or slots.dtype.is_floating_point or slots.device != k.device:
        raise ValueError(f"norm_rope_write: slots must be [bs={bs}, n={n}] integer on {k.device}, "
                         f"got {tuple(slots.shape)} {slots.dtype} on {slots.device}")


def norm_rope_write(
    k: torch.Tensor,
    v: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    slots: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """Keys and values straight into a cache: k_out[b, :, slots[b, i]] = norm_rope(k)[b, :, i] and
    v_out[b, :, slots[b, i]] = v[b, i] (as [heads, d]).

    k/v[bs, n, heads, d] (any strides, e.g. column slices of one projection GEMM); k_out/v_out
    [bs, heads, S, d] (a cache layer's rows, any strides); slots[bs, n] integer. Slots must lie in [0, S):
    checking that would cost a host sync, so the kernel drops a write outside it and the reference raises.
    backend as in `norm_rope`; the reference is the rotation then two index_put copies (the ops a cache
    write ran before this kernel, so CPU numerics do not move).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"norm_rope_write: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    _check_inputs(k, weight, cos, sin)
    _check_write(k, v, k_out, v_out, slots)
    if backend == "triton" or (backend == "auto" and k.is_cuda and triton is not None
                               and not _needs_grad(k, v, weight, cos, sin)):
        if triton is None:
            raise RuntimeError("norm_rope_write: triton is not installed (pip install 'triton>=3.0')")
        if _needs_grad(k, v, weight, cos, sin):
            raise ValueError("norm_rope_write: the kernel has no backward; an input requires grad")
        if k.numel():
            _launch(k, weight, eps, cos, sin, k_out, v, v_out, slots)
        return
    rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [bs, 1]
    # advanced indices on dims (bs, S) around a slice -> values laid out [bs, n, heads, d]
    k_out[rows, :, slots] = norm_rope_reference(k, weight, eps, cos, sin).transpose(1, 2)
    v_out[rows, :, slots] = v


def norm_rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  k_out: torch.Tensor, v_out: torch.Tensor, slots: torch.Tensor,
                  backend: Backend = "auto") -> torch.Tensor:
    """`norm_rope(q, ...)` and `norm_rope_write(k, v, ...)` of one layer in one launch: returns the rotated
    q as [bs, q_heads, n, d] and writes k/v into the cache at slots (q[bs, n, q_heads, d], k/v[bs, n, kv_heads,
    d], any strides; both norms None or both given). On CUDA one kernel whose programs run the two launches'
    code (the norm's sum may reduce in another order under the larger block's warps: float32 rounding); the
    reference is the two calls' references, so CPU numerics do not move.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"norm_rope_qkv: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("norm_rope_qkv: q_weight and k_weight must both be given or both be None")
    bs, n, q_heads, d = _check_inputs(q, q_weight, cos, sin)
    _check_inputs(k, k_weight, cos, sin)  # the same cos/sin: q and k share bs, n and head_dim
    _check_write(k, v, k_out, v_out, slots)
    grad = _needs_grad(q, k, v, q_weight, k_weight, cos, sin)
    use_kernel = backend == "triton" or (backend == "auto" and q.is_cuda and triton is not None and not grad)
    if not use_kernel:
        norm_rope_write(k, v, k_weight, eps, cos, sin, k_out, v_out, slots, backend="reference")
        return norm_rope_reference(q, q_weight, eps, cos, sin)
    if triton is None:
        raise RuntimeError("norm_rope_qkv: triton is not installed (pip install 'triton>=3.0')")
    if grad:
        raise ValueError("norm_rope_qkv: the kernel has no backward; an input requires grad")
    q_out = torch.empty(bs, q_heads, n, d, dtype=q.dtype, device=q.device)
    if q_out.numel() == 0:
        return q_out
    _launch_qkv(q, q_weight, q_out, k, v, k_weight, eps, cos, sin, k_out, v_out, slots)
    return q_out
