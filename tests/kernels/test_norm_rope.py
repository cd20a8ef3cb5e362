"""q/k RMSNorm + RoPE: the torch reference against the models' op sequence, the Triton kernel against the reference;
`norm_rope_write` (keys rotated and values copied straight into cache slots) against the same ops + index_put.

The reference must equal RMSNorm -> transpose -> rotate-half RoPE bit for bit (the CPU numerics of the
models ride on it). The kernel computes in float32 and rounds once at the end, where the reference rounds
after every op, so it is held to kernel_asserts.TOLERANCES. On machines without CUDA the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is; see test_tree_attention.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.norm_rope import (
    norm_rope,
    norm_rope_qkv,
    norm_rope_reference,
    norm_rope_triton,
    norm_rope_write,
)
from ddtree.models.layers import RMSNorm, Rotary
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

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
EPS = 1e-6
# Triton's interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest), and the normed
# path rounds three times (norm, weight, output): up to ~3 bf16 ulps (0.047 at |x| = 2) off the reference.
# On CUDA the reference itself rounds x*cos and rotate(x)*sin to bfloat16 before adding them, where the
# kernel adds in float32: where the two nearly cancel the reference is off by a few ulps of the terms
# (H200: 1 element in 8.5M, -0.1377 vs -0.125 at b32-n65-h32-d128)
BF16_TOLERANCE = {"atol": 6e-2, "rtol": 2e-2} if not HAS_CUDA else {"atol": 3e-2, "rtol": 1e-2}


@dataclass(frozen=True)
class Case:
    bs: int
    n: int
    heads: int
    d: int
    dtype: torch.dtype
    norm: bool  # a q_norm / k_norm weight, or None (Llama-style targets)
    extra: int = 0  # x is a column slice of a [bs, n, (heads + extra) * d] projection (a fused qkv GEMM)
    seed: int = 0

    @property
    def id(self) -> str:
        slice_ = f"-slice{self.extra}" if self.extra else ""
        return (f"b{self.bs}-n{self.n}-h{self.heads}-d{self.d}-{DTYPE_NAMES[self.dtype]}-"
                f"{'norm' if self.norm else 'nonorm'}{slice_}")


CPU_CASES = [
    Case(1, 1, 4, 64, torch.float32, True),
    Case(2, 9, 2, 64, torch.bfloat16, True, extra=6, seed=1),
    Case(3, 17, 4, 128, torch.float16, False, seed=2),
    Case(8, 5, 2, 128, torch.float32, False, extra=2, seed=3),
    Case(1, 65, 3, 64, torch.float16, True, extra=1, seed=4),
    Case(4, 33, 2, 128, torch.bfloat16, False, seed=5),
    Case(2, 3, 2, 96, torch.float32, True, seed=6),  # head_dim not a power of two: masked block
    Case(1, 2, 2, 256, torch.bfloat16, True, extra=2, seed=7),
]
GPU_CASES = [
    Case(32, 65, 32, 128, torch.bfloat16, True, extra=16, seed=10),
    Case(1, 4096, 8, 128, torch.bfloat16, True, seed=11),
    Case(64, 1, 64, 128, torch.float16, False, extra=16, seed=12),
    Case(16, 33, 8, 256, torch.float32, True, seed=13),
    Case(7, 257, 40, 64, torch.bfloat16, False, extra=8, seed=14),
]


def make_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x[bs, n, heads, d] (a strided view when case.extra), weight[d] or None, cos/sin[bs, 1, n, d]."""
    gen = torch.Generator(device=device).manual_seed(case.seed)
    width = (case.heads + case.extra) * case.d
    proj = torch.randn(case.bs, case.n, width, generator=gen, device=device).to(case.dtype)
    x = proj[..., case.extra * case.d:].view(case.bs, case.n, case.heads, case.d)
    weight = None
    if case.norm:
        weight = (1.0 + 0.1 * torch.randn(case.d, generator=gen, device=device)).to(case.dtype)
    positions = torch.randint(0, 8192, (case.bs, case.n), generator=gen, device=device)
    cos, sin = Rotary(case.d, 10000.0)(positions, case.dtype)
    return x, weight, cos, sin


def model_ops(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What the target's and the drafter's attention ran before the kernel existed."""
    if weight is not None:
        norm = RMSNorm(x.shape[-1], EPS).to(device=x.device, dtype=x.dtype)
        norm.weight.data.copy_(weight)
        x = norm(x)
    x = x.transpose(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def float64_math(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.double(), cos.double(), sin.double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    x = x.transpose(1, 2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_reference_is_the_model_ops_bit_for_bit(case: Case) -> None:
    x, weight, cos, sin = make_inputs(case, torch.device("cpu"))
    out = norm_rope_reference(x, weight, EPS, cos, sin)
    assert torch.equal(out, model_ops(x, weight, cos, sin)), f"{case.id}: the reference drifted from the model ops"
    assert_close(out, float64_math(x, weight, cos, sin), dtype=case.dtype, what=f"reference vs float64, {case.id}")


def _check_kernel(case: Case) -> None:
    x, weight, cos, sin = make_inputs(case, DEVICE)
    out = norm_rope_triton(x, weight, EPS, cos, sin)
    assert out.is_contiguous() and out.shape == (case.bs, case.heads, case.n, case.d)
    assert_close(out, norm_rope_reference(x, weight, EPS, cos, sin), what=f"triton vs reference, {case.id}",
                 **_tolerance(case.dtype))


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return BF16_TOLERANCE if dtype == torch.bfloat16 else {}


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_reference(case: Case) -> None:
    _check_kernel(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: full-size shapes are too slow for the Triton interpreter")
@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_triton_matches_reference_gpu(case: Case) -> None:
    _check_kernel(case)


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in (CPU_CASES[1], CPU_CASES[6])])
def test_triton_writes_every_output_element(case: Case) -> None:
    """A NaN-poisoned out buffer: any element the kernel skips stays NaN and fails assert_close."""
    x, weight, cos, sin = make_inputs(case, DEVICE)
    out = torch.full((case.bs, case.heads, case.n, case.d), float("nan"), dtype=case.dtype, device=DEVICE)
    result = norm_rope_triton(x, weight, EPS, cos, sin, out=out)
    assert result.data_ptr() == out.data_ptr(), "out= was not written in place"
    assert_close(out, norm_rope_reference(x, weight, EPS, cos, sin), what=f"poisoned out, {case.id}",
                 **_tolerance(case.dtype))


@needs_triton
def test_dispatcher_picks_triton_by_device() -> None:
    case = CPU_CASES[1]
    x, weight, cos, sin = make_inputs(case, DEVICE)
    expected = norm_rope_reference(x, weight, EPS, cos, sin)
    auto = norm_rope(x, weight, EPS, cos, sin)  # Triton on CUDA, the reference (bit for bit) on CPU
    if HAS_CUDA:
        assert_close(auto, expected, what="auto")
    else:
        assert torch.equal(auto, expected), "auto on CPU must be the reference"
    assert_close(norm_rope(x, weight, EPS, cos, sin, backend="triton"), expected, what="backend='triton'",
                 **_tolerance(case.dtype))


@needs_triton
def test_training_keeps_the_differentiable_reference() -> None:
    """The kernel has no backward: auto must not pick it when a gradient flows, and 'triton' refuses."""
    case = CPU_CASES[0]
    x, weight, cos, sin = make_inputs(case, DEVICE)
    assert weight is not None
    weight.requires_grad_()
    out = norm_rope(x, weight, EPS, cos, sin)
    out.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0, "no gradient reached the norm weight"
    with pytest.raises(ValueError, match="no backward"):
        norm_rope(x, weight, EPS, cos, sin, backend="triton")
    with torch.no_grad():
        assert_close(norm_rope(x, weight, EPS, cos, sin, backend="triton"), out.detach(), what="triton under no_grad")


def _cache_write_case(case: Case, slots_of: str) -> tuple:
    """k, v (strided views of one projection), cache layers poisoned with NaN, and slots[bs, n]."""
    k, weight, cos, sin = make_inputs(case, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed + 100)
    v = torch.randn(case.bs, case.n, case.heads * case.d, generator=gen, device=DEVICE).to(case.dtype)
    v = v.view(case.bs, case.n, case.heads, case.d)
    size = case.n + 7
    # the cache's own layout ([layers, bs, heads, S, d] sliced at one layer): strided rows, as the models pass
    k_out = torch.full((2, case.bs, case.heads, size, case.d), float("nan"), dtype=case.dtype, device=DEVICE)[1]
    v_out = torch.full_like(k_out, float("nan"))
    if slots_of == "next":  # a KV cache: each row's next n slots after its length
        lengths = torch.randint(0, size - case.n + 1, (case.bs,), generator=gen, device=DEVICE)
        slots = lengths[:, None] + torch.arange(case.n, device=DEVICE)
    else:  # a ring buffer: any distinct slots per row
        slots = torch.stack([torch.randperm(size, generator=gen, device=DEVICE)[: case.n] for _ in range(case.bs)])
    return k, v, weight, cos, sin, k_out, v_out, slots


@needs_triton
@pytest.mark.parametrize("slots_of", ["next", "ring"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[:6]])
def test_triton_write_matches_rotation_and_index_put(case: Case, slots_of: str) -> None:
    """Kernel and reference both land k (rotated) and v at the slots, and touch no other slot (NaN stays)."""
    k, v, weight, cos, sin, k_out, v_out, slots = _cache_write_case(case, slots_of)
    k_ref, v_ref = k_out.clone(), v_out.clone()
    norm_rope_write(k, v, weight, EPS, cos, sin, k_ref, v_ref, slots, backend="reference")
    rows = torch.arange(case.bs, device=DEVICE)[:, None]
    assert torch.equal(k_ref[rows, :, slots], norm_rope_reference(k, weight, EPS, cos, sin).transpose(1, 2))
    assert torch.equal(v_ref[rows, :, slots], v), "the reference's values are not a plain copy"
    norm_rope_write(k, v, weight, EPS, cos, sin, k_out, v_out, slots, backend="triton")
    assert torch.equal(k_out.isnan(), k_ref.isnan()), "the kernel wrote other slots than the reference"
    assert torch.equal(v_out.nan_to_num(), v_ref.nan_to_num()), "values must be copied bit for bit"
    assert_close(k_out.nan_to_num(), k_ref.nan_to_num(), what=f"written keys, {case.id}", **_tolerance(case.dtype))


def _qkv_case(case: Case, q_heads: int, slots_of: str) -> tuple:
    """A layer's q (q_heads heads) beside _cache_write_case's k/v, with its own norm weight."""
    k, v, weight, cos, sin, k_out, v_out, slots = _cache_write_case(case, slots_of)
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed + 200)
    q = torch.randn(case.bs, case.n, (q_heads + 1) * case.d, generator=gen, device=DEVICE).to(case.dtype)
    q = q[..., case.d:].view(case.bs, case.n, q_heads, case.d)  # a strided slice, as of a fused GEMM
    q_weight = None if weight is None else (1.0 + 0.1 * torch.randn(case.d, generator=gen, device=DEVICE)).to(case.dtype)
    return q, q_weight, k, v, weight, cos, sin, k_out, v_out, slots


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[:4]])
def test_qkv_reference_is_the_two_calls(case: Case) -> None:
    q, qw, k, v, kw, cos, sin, k_out, v_out, slots = _qkv_case(case, 2 * case.heads, "next")
    k_ref, v_ref = k_out.clone(), v_out.clone()
    norm_rope_write(k, v, kw, EPS, cos, sin, k_ref, v_ref, slots, backend="reference")
    got = norm_rope_qkv(q, k, v, qw, kw, EPS, cos, sin, k_out, v_out, slots, backend="reference")
    assert torch.equal(got, norm_rope_reference(q, qw, EPS, cos, sin))
    assert torch.equal(k_out.nan_to_num(), k_ref.nan_to_num()) and torch.equal(v_out.nan_to_num(), v_ref.nan_to_num())


@needs_triton
@pytest.mark.parametrize("slots_of", ["next", "ring"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[:6]])
def test_triton_qkv_matches_the_two_launches(case: Case, slots_of: str) -> None:
    """One launch for q and the k/v write: q as norm_rope's kernel gives it, the cache as norm_rope_write's
    (NaN-poisoned slots elsewhere untouched); 4x the kv heads as queries (grouped-query attention)."""
    q, qw, k, v, kw, cos, sin, k_out, v_out, slots = _qkv_case(case, 4 * case.heads, slots_of)
    k_two, v_two = k_out.clone(), v_out.clone()
    norm_rope_write(k, v, kw, EPS, cos, sin, k_two, v_two, slots, backend="triton")
    q_two = norm_rope_triton(q, qw, EPS, cos, sin)
    got = norm_rope_qkv(q, k, v, qw, kw, EPS, cos, sin, k_out, v_out, slots, backend="triton")
    assert got.shape == q_two.shape and got.is_contiguous() and not got.isnan().any()
    assert torch.equal(k_out.isnan(), k_two.isnan()), "the kernel wrote other slots than the two launches"
    assert torch.equal(v_out.nan_to_num(), v_two.nan_to_num()), "values must be copied bit for bit"
    tol = {"atol": 1e-6, "rtol": 1e-6} if case.dtype == torch.float32 else _tolerance(case.dtype)
    assert_close(got, q_two, what=f"queries, {case.id}", **tol)
    assert_close(k_out.nan_to_num(), k_two.nan_to_num(), what=f"written keys, {case.id}", **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: real widths are too slow for the Triton interpreter")
@pytest.mark.parametrize("case", [Case(32, 9, 8, 128, torch.bfloat16, True, seed=20),
                                  Case(1, 1, 8, 128, torch.bfloat16, True, seed=21)], ids=lambda c: c.id)
def test_triton_qkv_matches_the_two_launches_gpu(case: Case) -> None:
    test_triton_qkv_matches_the_two_launches(case, "next")


def test_qkv_rejects_one_norm_without_the_other() -> None:
    q, qw, k, v, kw, cos, sin, k_out, v_out, slots = _qkv_case(CPU_CASES[1], 8, "next")
    with pytest.raises(ValueError, match="both"):
        norm_rope_qkv(q, k, v, qw, None, EPS, cos, sin, k_out, v_out, slots)
    with pytest.raises(ValueError, match="cos must be"):  # q and k of different lengths
        norm_rope_qkv(q[:, :1], k, v, qw, kw, EPS, cos[:, :, :1], sin[:, :, :1], k_out, v_out, slots)


@needs_triton
def test_triton_write_drops_slots_outside_the_cache() -> None:
    """A slot past the end (or negative) is dropped by the kernel: no write lands anywhere else."""
    case = CPU_CASES[1]
    k, v, weight, cos, sin, k_out, v_out, slots = _cache_write_case(case, "next")
    slots = slots.clone()
    slots[0, 0], slots[1, -1] = k_out.shape[2], -1
    norm_rope_write(k, v, weight, EPS, cos, sin, k_out, v_out, slots, backend="triton")
    written = ~k_out.isnan().all(dim=-1).all(dim=1)  # [bs, S]
    assert int(written.sum()) == case.bs * case.n - 2
    assert torch.equal(written, ~v_out.isnan().all(dim=-1).all(dim=1))


def test_write_rejects_mismatched_shapes() -> None:
    case = CPU_CASES[0]
    k, v, weight, cos, sin, k_out, v_out, slots = _cache_write_case(case, "next")
    with pytest.raises(ValueError, match="k_out must be"):
        norm_rope_write(k, v, weight, EPS, cos, sin, k_out[:, :1], v_out, slots)
    with pytest.raises(ValueError, match="slots must be"):
        norm_rope_write(k, v, weight, EPS, cos, sin, k_out, v_out, slots.float())
    with pytest.raises(ValueError, match="v must match"):
        norm_rope_write(k, v[:, :, :1], weight, EPS, cos, sin, k_out, v_out, slots)


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")


def _bad(field: str) -> torch.Tensor:
    return {
        "x": torch.zeros(2, 3, 64),
        "x-odd": torch.zeros(1, 3, 2, 63),
        "weight": torch.ones(32),
        "cos": torch.zeros(1, 1, 3, 64),
        "sin": torch.zeros(1, 1, 3, 64, dtype=torch.float64),
    }[field]


@pytest.mark.parametrize(("field", "message"), [
    pytest.param("x", r"x must be \[bs, n, heads, d\]", id="x-rank"),
    pytest.param("x-odd", "head_dim must be even", id="x-odd-head-dim"),
    pytest.param("weight", r"weight must be \[d=64\]", id="weight-shape"),
    pytest.param("cos", r"cos must be \[bs=2, 1, n=3, d=64\]", id="cos-shape"),
    pytest.param("sin", r"sin must be \[bs=2, 1, n=3, d=64\] torch.float32", id="sin-dtype"),
])
def test_bad_input_names_the_argument(field: str, message: str) -> None:
    args = dict(zip(("x", "weight", "cos", "sin"), make_inputs(Case(2, 3, 2, 64, torch.float32, True), torch.device("cpu"))))
    args[field.removesuffix("-odd")] = _bad(field)
    with pytest.raises(ValueError, match=message):
        norm_rope_reference(args["x"], args["weight"], EPS, args["cos"], args["sin"])
    with pytest.raises(ValueError, match="backend must be"):
        norm_rope(args["x"], args["weight"], EPS, args["cos"], args["sin"], backend="gpu")  # type: ignore[arg-type]
