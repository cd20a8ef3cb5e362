"""add_rms_norm and silu_mul: the torch references against the models' ops, the Triton kernels against them.

The references must be exactly the ops the layers ran before (x + delta then RMSNorm.forward; F.silu(gate) *
up), bit for bit, so CPU numerics do not move. The kernels round where those ops round and differ only by
the order of the float32 sum of squares and the exponential's last bits: within an ulp of the output's
dtype. Each row is computed alone, so a row's result does not depend on how many rows share the launch
(what keeps an AR step and a tree verify comparable at T = 0). On machines without CUDA the kernels run in
Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels import residual_norm
from ddtree.kernels.residual_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    silu_mul,
    silu_mul_reference,
    silu_mul_triton,
)
from ddtree.models.layers import RMSNorm
from tests.kernels.kernel_asserts import (
    assert_close,
    interpreter_off_but_installed,
    run_triton_cases_in_child,
    triton_runtime,
)

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
EPS = 1e-6
# about an ulp of the output (the interpreter's bfloat16 casts truncate: two ulps there) where a float32 sum of squares in another order crosses a rounding boundary
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
       torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 48), (2, 9, 256), (3, 5, 2048), (1, 7, 100)]  # [bs, rows, D]; 100: a width below its block


def _inputs(shape, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    delta = torch.randn(shape, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, delta, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_is_the_model_ops_bit_for_bit(shape, dtype) -> None:
    x, delta, weight = _inputs(shape, dtype, 1, torch.device("cpu"))
    norm = RMSNorm(shape[-1], EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        s, h = add_rms_norm_reference(x, delta, weight, EPS)
        assert torch.equal(s, x + delta)
        assert torch.equal(h, norm(x + delta))
        s0, h0 = add_rms_norm_reference(x, None, weight, EPS)
        assert s0 is x and torch.equal(h0, norm(x))
    gate, up = x, delta
    assert torch.equal(silu_mul_reference(gate, up), F.silu(gate) * up)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_add_rms_norm_matches_reference(shape, dtype) -> None:
    x, delta, weight = _inputs(shape, dtype, 2)
    s, h = add_rms_norm_triton(x, delta, weight, EPS)
    s_ref, h_ref = add_rms_norm_reference(x, delta, weight, EPS)
    if HAS_CUDA or dtype != torch.bfloat16:
        assert torch.equal(s, s_ref), "the residual sum rounds once, as torch's add does"
    else:  # the interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest, as torch)
        assert_close(s, s_ref, what="residual sum", **TOL[dtype])
    assert_close(h, h_ref, what="normed", **TOL[dtype])
    s0, h0 = add_rms_norm_triton(x, None, weight, EPS)
    assert torch.equal(s0, x)
    assert_close(h0, add_rms_norm_reference(x, None, weight, EPS)[1], what="normed (no delta)", **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rows_do_not_depend_on_their_neighbours(dtype) -> None:
    """Row r of a 9-row launch equals the same row launched alone, bit for bit (AR step vs verify)."""
    x, delta, weight = _inputs((1, 9, 256), dtype, 3)
    _, h_all = add_rms_norm_triton(x, delta, weight, EPS)
    g_all = silu_mul_triton(x, delta)
    for r in (0, 4, 8):
        _, h_one = add_rms_norm_triton(x[:, r:r + 1], delta[:, r:r + 1], weight, EPS)
        assert torch.equal(h_one[:, 0], h_all[:, r])
        assert torch.equal(silu_mul_triton(x[:, r:r + 1], delta[:, r:r + 1])[:, 0], g_all[:, r])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 9, 1536), (1, 3, 50)], ids=str)
def test_triton_silu_mul_on_fused_gemm_halves(shape, dtype) -> None:
    """gate/up as the two column halves of one [.., 2I] GEMM output (strided rows), as SwiGLU hands them."""
    gen = torch.Generator().manual_seed(4)
    y = (4 * torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)).to(dtype).to(DEVICE)
    gate, up = y.chunk(2, dim=-1)
    out = silu_mul_triton(gate, up)
    assert out.shape == gate.shape and out.is_contiguous()
    assert not out.isnan().any(), "every element written"
    assert_close(out, silu_mul_reference(gate, up), what="silu * up", **TOL[dtype])


@needs_triton
def test_triton_dispatcher_and_switch() -> None:
    """"auto" runs the kernel on CUDA only, never under autograd, and not while ENABLED is off."""
    x, delta, weight = _inputs((1, 2, 64), torch.float32, 5)
    if not HAS_CUDA:  # CPU tensors: the reference, whatever the switch says
        s, h = add_rms_norm(x, delta, weight, EPS)
        assert torch.equal(h, add_rms_norm_reference(x, delta, weight, EPS)[1])
    residual_norm.ENABLED = False
    try:
        assert torch.equal(add_rms_norm(x, delta, weight, EPS)[1], add_rms_norm_reference(x, delta, weight, EPS)[1])
        assert torch.equal(silu_mul(x, delta), silu_mul_reference(x, delta))
    finally:
        residual_norm.ENABLED = True
    w = weight.clone().requires_grad_()
    _, h = add_rms_norm(x, delta, w, EPS)
    h.sum().backward()  # the reference is differentiable; the kernel would have no grad_fn
    assert w.grad is not None
    with pytest.raises(ValueError, match="no backward"):
        add_rms_norm(x, delta, w, EPS, backend="triton")


def test_bad_input_names_the_argument() -> None:
    x, delta, weight = _inputs((1, 2, 64), torch.float32, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="delta must match"):
        add_rms_norm(x, delta[:, :1], weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(x, delta, weight[:3], EPS)
    with pytest.raises(ValueError, match="gate"):
        silu_mul(x, delta[:, :1])
    with pytest.raises(ValueError, match="backend"):
        silu_mul(x, delta, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: real widths are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 4096), (32, 9, 4096), (1, 9, 2048)], ids=str)
def test_triton_matches_reference_gpu(shape, dtype) -> None:
    x, delta, weight = _inputs(shape, dtype, 7)
    s, h = add_rms_norm_triton(x, delta, weight, EPS)
    assert torch.equal(s, x + delta)
    assert_close(h, add_rms_norm_reference(x, delta, weight, EPS)[1], what="normed", **TOL[dtype])
    gate, up = _inputs((*shape[:-1], 3 * shape[-1]), dtype, 8)[:2]
    assert_close(silu_mul_triton(gate, up), silu_mul_reference(gate, up), what="silu * up", **TOL[dtype])


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")
