"""A linear layer with its neighbours folded into the same launch, for the drafter's few-row GEMMs.

`fused_linear(x, W)` is x @ W.T, optionally with
  norm_weight  RMSNorm of each row of x first (HF order: normalise in float32, cast back, scale),
  swiglu       W holds [gate; up] rows: the result is silu(x @ gate.T) * (x @ up.T),
  residual     added to the result.
So a decoder layer's norm -> q/k/v, o_proj -> +x, norm -> gate/up -> SwiGLU and down -> +x are four
launches instead of ten. A drafting step runs a handful of rows (a block of 8 per request) through tiny
layers, where every launch costs more than its arithmetic; that is why this exists (cuBLAS has no
prologue/epilogue fusion for a norm or a SwiGLU, and torch.compile is not on the serving path). Only the
drafter uses it: its numbers steer which tokens are proposed, never which are accepted, so the summation
order may differ from torch's and float32 tiles multiply in TF32 on a GPU (H200, the fixture drafter's
shapes at batch 1, graph replays: 3-5 us a call in TF32, 7-18 us in IEEE float32, whose tl.dot runs on
the CUDA cores). The target keeps torch's ops.

The Triton kernel: one program per (block of output columns, block of rows), a K loop of tl.dot tiles,
the row norm as a first pass over K. The torch reference is the models' own op sequence.
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

# "auto" sends more rows than this to the reference: a prefill's thousands of rows are cuBLAS's ground
MAX_KERNEL_ROWS = 512
# ...and, over a real model's width (K >= REAL_WIDTH), more rows than this: there the kernel's small tiles
# read the weight 1.1-2.2x slower than cuBLAS at 9 rows (H200, docs/perf.md "The engine at real width"),
# while a launch saved is ~2 us of a 20-300 us product
REAL_WIDTH, MAX_REAL_WIDTH_ROWS = 1024, 16


def check_inputs(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                 residual: torch.Tensor | None, swiglu: bool, who: str = "fused_linear") -> tuple[int, int]:
    """(K, output columns); raises ValueError naming the argument that does not fit (`who`: the caller's name,
    ddtree.kernels.skinny_gemm checks the same arguments)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"{who}: x must be [rows, K] or [bs, rows, K], got {tuple(x.shape)}")
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{who}: weight must be [N, K={k}], got {tuple(weight.shape)}")
    n = weight.shape[0]
    if swiglu and n % 2:
        raise ValueError(f"{who}: swiglu needs an even number of weight rows (gate then up), got {n}")
    n_out = n // 2 if swiglu else n
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"{who}: weight is {weight.dtype} on {weight.device}, x is {x.dtype} on {x.device}")
    if norm_weight is not None and (tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype
                                    or norm_weight.device != x.device):
        raise ValueError(f"{who}: norm_weight must be [K={k}] {x.dtype} on {x.device}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}")
    want = (*x.shape[:-1], n_out)
    if residual is not None and (tuple(residual.shape) != want or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"{who}: residual must be {want} {x.dtype} on {x.device}, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    return k, n_out


def fused_linear_reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                           eps: float = 1e-6, residual: torch.Tensor | None = None,
                           swiglu: bool = False) -> torch.Tensor:
    """The torch ops the kernel replaces (layers.RMSNorm, F.linear, SwiGLU's silu * up, the residual add)."""
    check_inputs(x, weight, norm_weight, residual, swiglu)
    h = x
    if norm_weight is not None:
        h = norm_weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    y = F.linear(h, weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


# how the kernel multiplies a tile: tl.dot in IEEE float32, tl.dot in TF32, or tl.dot on 16-bit inputs as
# they are (a multiply-and-sum on the CUDA cores without tl.dot was slower than IEEE at every drafter shape)
DOT_MODES = {"ieee": 0, "tf32": 1, "native": 2}

if triton is not None:

    @triton.jit
    def _tile_product(x, w, MODE: tl.constexpr):
        """x[BLOCK_M, BLOCK_K] @ w[BLOCK_N, BLOCK_K].T in float32."""
        if MODE == 0:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif MODE == 1:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")
        else:
            return tl.dot(x, tl.trans(w))

    @triton.jit
    def _fused_linear_kernel(
        X, W, NW, R, OUT,
        rows_per_batch, n_rows, n_out, k_dim, eps,
        sx_b, sx_r, sx_k, sw_n, sw_k, sr_b, sr_r, sr_n, so_b, so_r, so_n,
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        bi = (rows // rows_per_batch).to(tl.int64)  # x may be a [bs, rows, K] view with any strides
        ri = (rows % rows_per_batch).to(tl.int64)
        x_rows = X + bi * sx_b + ri * sx_r
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        ks0 = tl.arange(0, BLOCK_K)

        if HAS_NORM:  # pass 1: each row's mean square, in float32
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, k_dim, BLOCK_K):
                ks = k0 + ks0
                xk = tl.load(x_rows[:, None] + ks[None, :] * sx_k, mask=row_ok[:, None] & (ks < k_dim)[None, :],
                             other=0.0).to(tl.float32)
                ss += tl.sum(xk * xk, 1)
            rstd = 1.0 / tl.sqrt(ss / k_dim + eps)

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + ks0
            k_ok = ks < k_dim
            xk = tl.load(x_rows[:, None] + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_NORM:  # normalise in float32, round to x's dtype, then scale (as RMSNorm does)
                nw = tl.load(NW + ks, mask=k_ok, other=0.0)
                h = (xk.to(tl.float32) * rstd[:, None]).to(xk.dtype).to(tl.float32)
                xk = (h * nw.to(tl.float32)[None, :]).to(xk.dtype)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(W + cols[:, None] * sw_n + ks[None, :] * sw_k, mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += _tile_product(xk, w, DOT)
            if SWIGLU:  # the up rows follow the gate rows
                wu = tl.load(W + (cols + n_out)[:, None] * sw_n + ks[None, :] * sw_k, mask=w_mask, other=0.0)
                acc_up += _tile_product(xk, wu, DOT)

        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        out_mask = row_ok[:, None] & col_ok[None, :]
        if HAS_RES:
            res = tl.load(R + (bi * sr_b + ri * sr_r)[:, None] + cols[None, :] * sr_n, mask=out_mask, other=0.0)
            acc += res.to(tl.float32)
        o_ptrs = OUT + (bi * so_b + ri * so_r)[:, None] + cols[None, :] * so_n
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=out_mask)


def real_width_tiles(n_out: int, swiglu: bool) -> tuple[int, int]:
    """(block_n, block_k) for a few-row product over a real model's width (K >= 1024): the tilings that read
    the weight fastest on the H200 at hidden 2048 and 4096, rows 1 and 9 (docs/perf.md, "The engine at real
    width": 16 x 256 up to 8192 weight rows, e.g. down 12288 -> 4096 40.9 against 81.9 us with the small-model
    32 x 64; 32 x 128 for 12288-24576 rows; 64 x 128 for a 151936-row head). A SwiGLU program reads gate and
    up rows, so it takes half the columns to read the same bytes."""
    rows = n_out * (2 if swiglu else 1)
    if rows <= 8192:
        return 16, 256
    if rows <= 32768:
        return (16 if swiglu else 32), 128
    return 64, 128


def fused_linear_triton(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, residual: torch.Tensor | None = None, swiglu: bool = False,
                        block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
                        dot: str | None = None) -> torch.Tensor:
    """The Triton path of `fused_linear` (CUDA, or CPU tensors under TRITON_INTERPRET=1). block_n, block_k,
    num_warps and dot (a DOT_MODES key) override the choices made from the shapes (for tuning runs)."""
    if triton is None:
        raise RuntimeError("fused_linear_triton: triton is not installed (pip install 'triton>=3.0')")
    k, n_out = check_inputs(x, weight, norm_weight, residual, swiglu)
    x3 = x if x.dim() == 3 else x[None]
    bs, rows_per_batch = x3.shape[0], x3.shape[1]
    n_rows = bs * rows_per_batch
    out = x3.new_empty(bs, rows_per_batch, n_out)
    res3 = out if residual is None else (residual if residual.dim() == 3 else residual[None])
    if n_rows == 0 or n_out == 0:
        return out if x.dim() == 3 else out[0]
    if dot is None:  # float32: TF32 tensor cores on a GPU; the interpreter's 16-bit dot is unreliable: upcast there
        dot = "native" if x.dtype != torch.float32 and x.is_cuda else "tf32" if x.is_cuda else "ieee"
    if dot not in DOT_MODES:
        raise ValueError(f"fused_linear: dot must be one of {sorted(DOT_MODES)}, got {dot!r}")
    if k >= REAL_WIDTH and n_rows <= MAX_REAL_WIDTH_ROWS and block_n is None and block_k is None:
        block_n, block_k = real_width_tiles(n_out, swiglu)
    block_k = block_k or 64
    block_m = 16 if n_rows <= 16 else 32
    # few rows: narrow column blocks, so the weight (the bytes that matter) is read by many programs at once
    block_n = block_n or (32 if n_rows <= 32 else 64)
    grid = (triton.cdiv(n_out, block_n), triton.cdiv(n_rows, block_m))
    _fused_linear_kernel[grid](
        x3, weight, norm_weight if norm_weight is not None else weight, res3, out,
        rows_per_batch, n_rows, n_out, k, eps,
        *x3.stride(), *weight.stride(), *res3.stride(), *out.stride(),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SWIGLU=swiglu,
        DOT=DOT_MODES[dot], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out if x.dim() == 3 else out[0]


def fused_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None, swiglu: bool = False,
                 backend: Backend = "auto") -> torch.Tensor:
    """x[rows, K] or [bs, rows, K] (any strides) @ weight[N, K].T, with the optional RMSNorm before (norm_weight
    [K]), SwiGLU after (weight = [gate; up], the result has N/2 columns) and residual added (the result's
    shape). Returns a new contiguous tensor in x's dtype.

    backend "auto" runs the Triton kernel on CUDA tensors of at most MAX_KERNEL_ROWS rows (MAX_REAL_WIDTH_ROWS
    when K >= REAL_WIDTH) when Triton is installed and no gradient is needed, else the reference; "triton" /
    "reference" force one (the kernel has no backward).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"fused_linear: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, weight, norm_weight, residual))
    rows = x[..., 0].numel()
    few_rows = rows <= (MAX_KERNEL_ROWS if x.shape[-1] < REAL_WIDTH else MAX_REAL_WIDTH_ROWS)
    if backend == "triton" or (backend == "auto" and x.is_cuda and triton is not None and not grad and few_rows):
        if grad:
            raise ValueError("fused_linear: the Triton kernel has no backward (use backend 'auto' or 'reference')")
        return fused_linear_triton(x, weight, norm_weight, eps, residual, swiglu)
    return fused_linear_reference(x, weight, norm_weight, eps, residual, swiglu)
