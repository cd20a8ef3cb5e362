"""fused_linear: the torch reference against the models' modules, the Triton kernel against the reference.

The reference must be exactly RMSNorm -> Linear, SwiGLU (fused gate/up) and x + Linear(o) as the layers
compute them (bit for bit on the CPU). The kernel sums in another order and rounds once, so it is held to
kernel_asserts.TOLERANCES scaled by the reduction length. On machines without CUDA the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is; see test_tree_attention.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.fused_linear import fused_linear, fused_linear_reference, fused_linear_triton
from ddtree.models import dflash, load_drafter, load_target
from ddtree.models.layers import RMSNorm, SwiGLU
from tests.kernels.kernel_asserts import (
    assert_close,
    interpreter_off_but_installed,
    run_triton_cases_in_child,
    triton_runtime,
)

pytestmark = pytest.mark.kernels

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"
FIXTURE_DRAFTER = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "drafter"
HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
EPS = 1e-6
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# |out - reference|: float32 differs by summation order only in the interpreter (IEEE), by TF32's 10-bit
# mantissa on a GPU (~1e-3 at these sizes); 16-bit outputs by about an ulp of the output (the reference rounds
# after the norm, the GEMM and the SwiGLU; the kernel keeps float32 until the store)
TOLERANCE = {torch.float32: {"atol": 1e-2, "rtol": 1e-2} if HAS_CUDA else {"atol": 1e-4, "rtol": 1e-4},
             torch.float16: {"atol": 1e-2, "rtol": 1e-2}, torch.bfloat16: {"atol": 6e-2, "rtol": 3e-2}}


@dataclass(frozen=True)
class Case:
    bs: int
    rows: int
    k: int
    n: int  # output columns (for swiglu the weight has 2n rows)
    dtype: torch.dtype
    norm: bool = False
    residual: bool = False
    swiglu: bool = False
    sliced: bool = False  # x is x_full[:, 1:] of a [bs, rows + 1, k] tensor (the drafter's lm_head input)
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [f"b{self.bs}-r{self.rows}-k{self.k}-n{self.n}-{DTYPE_NAMES[self.dtype]}"]
        parts += [name for name in ("norm", "residual", "swiglu", "sliced") if getattr(self, name)]
        return "-".join(parts)


CPU_CASES = [
    Case(1, 8, 64, 48, torch.float32, norm=True),
    Case(2, 8, 80, 40, torch.float32, residual=True, seed=1),  # K, N not multiples of the tiles
    Case(1, 5, 64, 24, torch.float32, norm=True, swiglu=True, seed=2),
    Case(3, 7, 64, 96, torch.float32, norm=True, sliced=True, seed=3),
    Case(2, 9, 32, 16, torch.bfloat16, norm=True, residual=True, seed=4),
    Case(1, 40, 48, 32, torch.float16, swiglu=True, residual=True, seed=5),  # rows over one row block
    Case(1, 1, 16, 8, torch.float32, seed=6),
    Case(1, 8, 1024, 40, torch.float32, norm=True, seed=7),  # K >= 1024: the real-width tiles (16 x 256)
    Case(1, 1, 1280, 24, torch.bfloat16, swiglu=True, residual=True, seed=8),
]
GPU_CASES = [
    Case(1, 8, 256, 512, torch.float32, norm=True, seed=10),  # the fixture drafter's q/k/v at batch 1
    Case(1, 7, 256, 4096, torch.float32, norm=True, sliced=True, seed=11),  # its lm_head
    Case(32, 8, 256, 768, torch.float32, norm=True, swiglu=True, seed=12),
    Case(32, 8, 768, 256, torch.float32, residual=True, seed=13),
    Case(4, 16, 4096, 1024, torch.bfloat16, norm=True, seed=14),
    Case(8, 16, 1024, 3072, torch.bfloat16, norm=True, swiglu=True, seed=15),
    Case(2, 33, 3072, 1024, torch.float16, residual=True, seed=16),
    # a real-width drafter at batch 1 (8b: hidden 4096, intermediate 12288; a head of 40000 rows)
    Case(1, 8, 4096, 6144, torch.bfloat16, norm=True, seed=17),
    Case(1, 8, 4096, 12288, torch.bfloat16, norm=True, swiglu=True, seed=18),
    Case(1, 8, 12288, 4096, torch.bfloat16, residual=True, seed=19),
    Case(1, 7, 2048, 40000, torch.bfloat16, norm=True, sliced=True, seed=20),
]


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(case.dtype)

    x = randn(case.bs, case.rows + 1, case.k)[:, 1:] if case.sliced else randn(case.bs, case.rows, case.k)
    weight = randn(2 * case.n if case.swiglu else case.n, case.k, scale=case.k ** -0.5)
    return {
        "x": x,
        "weight": weight,
        "norm_weight": (1.0 + 0.1 * torch.randn(case.k, generator=gen, device=device)).to(case.dtype) if case.norm else None,
        "residual": randn(case.bs, case.rows, case.n) if case.residual else None,
    }


def module_ops(case: Case, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
               residual: torch.Tensor | None) -> torch.Tensor:
    """What the drafter's layers compute without the kernel: RMSNorm, Linear (or a fused-gate/up SwiGLU), + x."""
    h = x
    if norm_weight is not None:
        norm = RMSNorm(case.k, EPS).to(device=x.device, dtype=x.dtype)
        norm.weight.data.copy_(norm_weight)
        h = norm(x)
    if case.swiglu:
        mlp = SwiGLU(case.k, case.n).to(device=x.device, dtype=x.dtype)
        gate, up = weight.chunk(2)
        mlp.gate_proj.weight.data.copy_(gate)
        mlp.up_proj.weight.data.copy_(up)
        gate_out, up_out = mlp.gate_proj(h), mlp.up_proj(h)
        y = torch.nn.functional.silu(gate_out) * up_out
    else:
        y = torch.nn.functional.linear(h, weight)
    return y if residual is None else residual + y


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES if c.dtype == torch.float32])
def test_reference_is_the_module_ops(case: Case) -> None:
    args = make_inputs(case, torch.device("cpu"))
    out = fused_linear_reference(**args, eps=EPS, swiglu=case.swiglu)
    expected = module_ops(case, **args)
    # one GEMM over [gate; up] against two: the same dot products, so equal up to BLAS blocking
    assert_close(out, expected, atol=1e-6, rtol=1e-6, what=f"reference vs modules, {case.id}")
    if not case.swiglu:
        assert torch.equal(out, expected), f"{case.id}: the reference drifted from the module ops"


def _check_kernel(case: Case) -> None:
    args = make_inputs(case, DEVICE)
    out = fused_linear_triton(**args, eps=EPS, swiglu=case.swiglu)
    assert out.is_contiguous() and out.shape == (case.bs, case.rows, case.n) and out.dtype == case.dtype
    assert_close(out, fused_linear_reference(**args, eps=EPS, swiglu=case.swiglu),
                 what=f"triton vs reference, {case.id}", **TOLERANCE[case.dtype])


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
@pytest.mark.parametrize("dot", ["ieee", "tf32"])
def test_triton_two_dim_input_tiling_and_dot_overrides(dot: str) -> None:
    """[rows, K] input gives [rows, N]; other tiles and each way of multiplying give the same result (IEEE
    float32 to float32 rounding)."""
    case = CPU_CASES[1]
    args = make_inputs(case, DEVICE)
    flat = {"x": args["x"][0], "weight": args["weight"], "residual": args["residual"][0]}
    expected = fused_linear_reference(**flat)
    tol = TOLERANCE[case.dtype] if dot == "tf32" else {"atol": 1e-4, "rtol": 1e-4}
    assert_close(fused_linear_triton(**flat, dot=dot), expected, what=f"2-d input, {dot}", **tol)
    assert_close(fused_linear_triton(**flat, block_n=16, block_k=16, num_warps=2, dot=dot), expected,
                 what=f"block_n 16, block_k 16, {dot}", **tol)
    with pytest.raises(ValueError, match="dot must be one of"):
        fused_linear_triton(**flat, dot="tf16")


@needs_triton
def test_dispatcher_picks_by_device_and_gradient() -> None:
    case = CPU_CASES[0]
    args = make_inputs(case, DEVICE)
    expected = fused_linear_reference(**args)
    auto = fused_linear(**args)  # Triton on CUDA, the reference (bit for bit) on CPU
    if HAS_CUDA:
        assert_close(auto, expected, what="auto", **TOLERANCE[case.dtype])
    else:
        assert torch.equal(auto, expected), "auto on CPU must be the reference"
    weight = args["weight"].clone().requires_grad_()
    out = fused_linear(args["x"], weight, args["norm_weight"])  # a gradient flows: the reference
    out.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0, "no gradient reached the weight"
    with pytest.raises(ValueError, match="no backward"):
        fused_linear(args["x"], weight, backend="triton")


@pytest.mark.parametrize(("change", "message"), [
    pytest.param({"x": torch.zeros(4)}, r"x must be \[rows, K\] or \[bs, rows, K\]", id="x-rank"),
    pytest.param({"weight": torch.zeros(8, 32)}, r"weight must be \[N, K=64\]", id="weight-shape"),
    pytest.param({"weight": torch.zeros(8, 64, dtype=torch.float64)}, "weight is torch.float64", id="weight-dtype"),
    pytest.param({"norm_weight": torch.ones(32)}, r"norm_weight must be \[K=64\]", id="norm-shape"),
    pytest.param({"residual": torch.zeros(1, 8, 7)}, r"residual must be \(1, 8, 8\)", id="residual-shape"),
    pytest.param({"weight": torch.zeros(7, 64), "swiglu": True}, "swiglu needs an even number", id="swiglu-odd"),
])
def test_bad_input_names_the_argument(change: dict, message: str) -> None:
    args: dict = {"x": torch.zeros(1, 8, 64), "weight": torch.zeros(8, 64), "norm_weight": None, "residual": None}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fused_linear(**args)
    with pytest.raises(ValueError, match="backend must be"):
        fused_linear(torch.zeros(1, 8, 64), torch.zeros(8, 64), backend="gpu")  # type: ignore[arg-type]


@needs_triton
def test_triton_drafter_forward_runs_fused_and_matches_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture drafter's kernel path (attention 'triton', fused projections) drafts with four fused_linear
    launches a layer plus the head (its context append with one a layer), and its logits match the module
    path's."""
    target = load_target(FIXTURE_TARGET, device=DEVICE, dtype=torch.float32)
    drafter = load_drafter(FIXTURE_DRAFTER, target, device=DEVICE, dtype=torch.float32)
    drafter.fuse_projections()
    calls: list[int] = []
    real = dflash.fused_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash, "fused_linear", counting)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    width = len(drafter.tap_layers) * drafter.config.hidden_size
    taps = torch.randn(2, 24, width, generator=gen, device=DEVICE)
    positions = torch.arange(24, device=DEVICE)[None].expand(2, 24)
    ctx = drafter.new_context(2, 16, max_len=64)  # a window shorter than the context: the ring wraps
    block_ids = torch.randint(2, drafter.config.vocab_size, (2, drafter.config.block_size), generator=gen, device=DEVICE)
    start = torch.tensor([24, 19], device=DEVICE)
    layers = len(drafter.layers)
    with torch.no_grad():
        drafter.append_context(ctx, taps, positions, torch.tensor([24, 19], device=DEVICE))
        assert len(calls) == layers, f"append_context: fused_linear ran {len(calls)} times (one k/v GEMM a layer)"
        fast = drafter(ctx, block_ids, start, attention="triton")
        assert len(calls) == 5 * layers + 1, f"forward: fused_linear ran {len(calls) - layers} times"
        slow = drafter(ctx, block_ids, start, attention="reference")
    assert len(calls) == 5 * layers + 1, "the module path must not run the kernel"
    assert fast.dtype == torch.float32 and fast.shape == slow.shape
    # TF32 through two layers and the head: a few logits in 60k move by ~2e-2 (H200); a dropped residual or
    # norm moves them by O(1)
    tol = {"atol": 5e-2, "rtol": 2e-2} if HAS_CUDA else TOLERANCE[torch.float32]
    assert_close(fast, slow, what="drafter logits, fused vs module path", **tol)


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")
