"""The residual add and the RMSNorm after it in one pass, and SwiGLU's silu(gate) * up in one pass.

A decoder layer at batch 1 is two GEMVs' worth of weight reads and a dozen small elementwise launches
around them; at real width (hidden 2048-4096) those launches cost as much as the weights take to read
(docs/perf.md, "Findings that explain the code"). `add_rms_norm(x, delta, weight)` returns (x + delta,
RMSNorm(x + delta)) in one launch instead of five (the add, the upcast, the norm, the downcast, the scale);
`silu_mul(gate, up)` is one launch instead of two.

Numerics: the Triton kernels round where the torch ops round (the sum to x's dtype, the normalised row to
x's dtype before the scale, silu to x's dtype before the product), so they differ from the reference only
by the order of the float32 sum of squares and by the exponential's last bits. Rows are independent, so a
one-token step and a verify over many tokens compute each row identically: T = 0 outputs of AR and of the
tree verify stay comparable as before. The torch references are exactly the models' op sequences
(RMSNorm.forward, SwiGLU's product), and off CUDA "auto" runs them, so CPU numerics do not move.
`ENABLED` (a module switch) sends "auto" to the references on CUDA too: the profile's A/B runs.
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

ENABLED = True  # False: "auto" runs the torch references on CUDA as well (A/B measurement)
MAX_WIDTH = 16384  # one program holds a whole row


def _use_kernel(backend: Backend, *tensors: torch.Tensor | None) -> bool:
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if backend == "triton":
        if triton is None:
            raise RuntimeError("triton is not installed (pip install 'triton>=3.0')")
        if grad:
            raise ValueError("the Triton kernel has no backward (use backend 'auto' or 'reference')")
        return True
    first = tensors[0]
    return (backend == "auto" and ENABLED and triton is not None and first is not None and first.is_cuda
            and not grad)


def _check_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> int:
    d = x.shape[-1]
    if not x.dtype.is_floating_point or x.dim() < 1:
        raise ValueError(f"add_rms_norm: x must be a floating-point [..., D] tensor, got {tuple(x.shape)} {x.dtype}")
    if d > MAX_WIDTH:
        raise ValueError(f"add_rms_norm: rows of at most {MAX_WIDTH} elements, got {d}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device):
        raise ValueError(f"add_rms_norm: delta must match x {tuple(x.shape)} {x.dtype} on {x.device}, got "
                         f"{tuple(delta.shape)} {delta.dtype} on {delta.device}")
    if tuple(weight.shape) != (d,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"add_rms_norm: weight must be [D={d}] {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    return d


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + delta (x when delta is None): the models' ops (layers.RMSNorm.forward)."""
    _check_norm(x, delta, weight)
    s = x if delta is None else x + delta
    return s, weight * F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, DELTA, W, SUM, OUT, d, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < d
        x = tl.load(X + row * d + cols, mask=ok, other=0.0)
        if HAS_DELTA:  # the add rounds to x's dtype, as torch's does
            x = (x.to(tl.float32) + tl.load(DELTA + row * d + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(SUM + row * d + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / d + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        h = (xf * rstd).to(x.dtype).to(tl.float32)  # normalise in float32, round, then scale (RMSNorm's order)
        tl.store(OUT + row * d + cols, (h * w).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(G, U, OUT, n_cols, sg_r, su_r, so_r, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        g = tl.load(G + row * sg_r + cols, mask=ok, other=0.0)
        u = tl.load(U + row * su_r + cols, mask=ok, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # silu rounds before the product, as torch's
        tl.store(OUT + row * so_r + cols, (act * u).to(OUT.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of `add_rms_norm` (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("add_rms_norm_triton: triton is not installed (pip install 'triton>=3.0')")
    d = _check_norm(x, delta, weight)
    x = x.contiguous()
    s = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    rows = x.numel() // d if d else 0
    if rows:
        block = max(16, triton.next_power_of_2(d))
        _add_rms_norm_kernel[(rows,)](x, x if delta is None else delta.contiguous(), weight, s, out, d, eps,
                                      HAS_DELTA=delta is not None, BLOCK=block,
                                      num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return s, out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., D] (+ delta[..., D]) -> (s = x + delta, weight * RMSNorm(s)), both in x's dtype; delta None: s = x.

    backend "auto": the Triton kernel on CUDA (when installed, ENABLED and no gradient is needed), else the
    reference, which is the models' own ops bit for bit.
    """
    if _use_kernel(backend, x, delta, weight):
        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)


def _check_swiglu(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device or gate.dim() < 1:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must match")


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: SwiGLU's product as the models compute it."""
    _check_swiglu(gate, up)
    return F.silu(gate) * up


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton path of `silu_mul`; gate/up may be column slices of one [..., 2I] GEMM output (rows strided)."""
    if triton is None:
        raise RuntimeError("silu_mul_triton: triton is not installed (pip install 'triton>=3.0')")
    _check_swiglu(gate, up)
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)  # views when only the rows are strided
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(1024, max(16, triton.next_power_of_2(n)))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0),
                                                               out.stride(0), BLOCK=block, num_warps=4)
    return out.view(gate.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """silu(gate) * up in gate's dtype; backend as in `add_rms_norm`."""
    if _use_kernel(backend, gate, up):
        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)
