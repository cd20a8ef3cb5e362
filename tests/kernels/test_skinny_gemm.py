"""skinny_gemm: the few-row Triton GEMM (split K, last-arriver reduction, SwiGLU epilogue) against its torch
reference, and the route layers.linear takes to it.

The kernel sums in another order and rounds once, so it is held to a tolerance scaled to the product; a
lost split, a block reduced twice or a counter left set shows up as errors of the product's own size (or as
NaN: outputs start as torch.empty and the NaN-poisoned cases check every element was written). On machines
without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels import skinny_gemm
from ddtree.kernels.skinny_gemm import Tiles, choose_tiles, skinny_linear, skinny_linear_reference
from tests.kernels.kernel_asserts import (
    assert_close,
    interpreter_off_but_installed,
    run_triton_cases_in_child,
    triton_runtime,
)

pytestmark = pytest.mark.kernels

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"
HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# float32 differs by summation order only in the interpreter (IEEE) and on a GPU (IEEE dot too); 16-bit
# outputs by about an ulp of the output, which the reference rounds twice with SwiGLU
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2},
             torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # x's leading dims (their product is the rows)
    k: int
    n: int  # output columns (for swiglu the weight has 2n rows)
    dtype: torch.dtype
    swiglu: bool = False
    tiles: Tiles | None = None
    seed: int = 0
    norm: bool = False
    residual: bool = False

    @property
    def id(self) -> str:
        tiles = "auto" if self.tiles is None else self.tiles.label.replace(" ", "-")
        flags = [name for name in ("swiglu", "norm", "residual") if getattr(self, name)]
        return "-".join([f"x{'x'.join(map(str, self.shape))}-k{self.k}-n{self.n}-{NAMES[self.dtype]}", *flags, tiles])


CPU_CASES = [
    Case((1,), 256, 96, torch.float32),
    Case((3,), 200, 40, torch.float32, tiles=Tiles(32, 64, 3, 2, 4), seed=1),  # K, N off the tiles; 3 splits
    Case((1, 9), 512, 64, torch.float32, swiglu=True, tiles=Tiles(16, 64, 4, 2, 4), seed=2),
    Case((1, 1), 1024, 130, torch.bfloat16, swiglu=True, seed=3),  # the chosen tiles; N off the block
    Case((1, 2), 2048, 40, torch.bfloat16, norm=True, seed=11),  # the chosen split (one column block), norm
    Case((1, 9), 512, 64, torch.float32, swiglu=True, norm=True, residual=True, tiles=Tiles(16, 64, 4, 2, 4),
         seed=12),  # every epilogue over split K
    Case((16,), 128, 64, torch.float16, tiles=Tiles(64, 32, 1, 2, 4), seed=4),
    Case((2, 7), 384, 48, torch.float32, tiles=Tiles(16, 128, 8, 2, 4), seed=5),  # more splits than loads: 3
    Case((33,), 96, 32, torch.float32, tiles=Tiles(16, 32, 2, 2, 4), seed=6),  # rows past one 16-row block
    Case((1, 3), 200, 48, torch.float32, tiles=Tiles(16, 64, 2, 2, 4), norm=True, seed=7),  # norm over split K
    Case((2,), 256, 40, torch.float32, tiles=Tiles(16, 64, 3, 2, 4), residual=True, seed=8),
    Case((1, 5), 192, 24, torch.bfloat16, swiglu=True, norm=True, seed=9),
    Case((4,), 130, 72, torch.float32, tiles=Tiles(32, 32, 1, 2, 4), norm=True, residual=True, seed=10),
]
GPU_CASES = [  # the 1b and 8b shapes' projections (docs/perf.md, "The engine at real width")
    Case((1, 1), 2048, 4096, torch.bfloat16, seed=10),
    Case((1, 9), 2048, 6144, torch.bfloat16, swiglu=True, seed=11),
    Case((1, 1), 6144, 2048, torch.bfloat16, seed=12),
    Case((1, 9), 12288, 4096, torch.bfloat16, seed=13),
    Case((1, 1), 4096, 24576 // 2, torch.bfloat16, swiglu=True, seed=14),
    Case((1, 1), 4096, 151936, torch.bfloat16, seed=15),
    Case((4, 4), 4096, 4096, torch.float16, tiles=Tiles(128, 256, 4, 3, 8), seed=16),
    Case((1,), 4096, 1000, torch.float32, seed=17),
    Case((1, 1), 2048, 4096, torch.bfloat16, norm=True, seed=18),  # a layer's q/k/v with its input norm
    Case((1, 9), 4096, 4096, torch.bfloat16, residual=True, seed=19),  # o_proj into the residual stream
    Case((1, 9), 4096, 12288, torch.bfloat16, swiglu=True, norm=True, seed=20),  # post-attention norm, gate/up
    Case((1, 1), 12288, 4096, torch.bfloat16, residual=True, seed=21),  # down into the residual stream
]


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    x = torch.randn(*case.shape, case.k, generator=gen, device=DEVICE).to(case.dtype)
    rows = 2 * case.n if case.swiglu else case.n
    weight = (torch.randn(rows, case.k, generator=gen, device=DEVICE) * case.k ** -0.5).to(case.dtype)
    return x, weight


def extras(case: Case) -> dict[str, torch.Tensor | None]:
    """The norm weight and residual of a case (None where it has none)."""
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed + 1000)
    # the input scaled away from 1, so a skipped norm is off by far more than the tolerance
    norm = (1.0 + 0.3 * torch.randn(case.k, generator=gen, device=DEVICE)).to(case.dtype) if case.norm else None
    residual = torch.randn(*case.shape, case.n, generator=gen, device=DEVICE).to(case.dtype) if case.residual else None
    return {"norm_weight": norm, "residual": residual}


def check(case: Case) -> None:
    x, weight = make_inputs(case)
    if case.norm:
        x = 3.0 * x
    more = extras(case)
    expected = skinny_linear_reference(x, weight, swiglu=case.swiglu, **more)
    for attempt in range(2):  # the second launch finds the arrival counters as the first left them
        out = skinny_linear(x, weight, swiglu=case.swiglu, tiles=case.tiles, **more)
        assert out.shape == (*case.shape, case.n) and out.dtype == case.dtype and out.is_contiguous()
        assert_close(out, expected, what=f"{case.id}, launch {attempt + 1}", **TOLERANCE[case.dtype])


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_reference(case: Case) -> None:
    check(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: real widths are too slow for the Triton interpreter")
@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_triton_matches_reference_gpu(case: Case) -> None:
    check(case)


def check_rows_alike(case: Case) -> None:
    """Every row of a product is the same bits whether it runs alone or among up to 16 rows (the tiles and the
    order of the sums do not depend on the row count there), so an AR step's row and a verify's rows agree."""
    x, weight = make_inputs(case)
    more = extras(case)
    tiles = case.tiles  # None: the kernel's own choice at each row count, as the engine runs it
    full = skinny_linear(x, weight, swiglu=case.swiglu, tiles=tiles, **more)
    for rows in (1, 5, 9, 15):
        part = {k: None if v is None else v[:rows] for k, v in more.items() if k == "residual"}
        alone = skinny_linear(x[:rows], weight, swiglu=case.swiglu, tiles=tiles,
                              norm_weight=more["norm_weight"], **part)
        assert torch.equal(alone, full[:rows]), f"{case.id}: {rows} rows differ from the first {rows} of 16"


@needs_triton
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id) for c in [
        # float32 outputs: a 16-bit store would round away most differences in the sums
        Case((16,), 512, 64, torch.float32, seed=30),
        Case((16,), 512, 48, torch.float32, swiglu=True, norm=True, tiles=Tiles(16, 64, 3, 2, 4), seed=31),
        Case((16,), 256, 40, torch.float32, residual=True, tiles=Tiles(16, 32, 4, 2, 4), seed=32),
    ]])
def test_triton_rows_alike_at_any_row_count(case: Case) -> None:
    check_rows_alike(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: real widths are too slow for the Triton interpreter")
@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id) for c in [
        Case((16,), 2048, 4096, torch.bfloat16, seed=33),  # 1b q/k/v: no split, loads of 256
        Case((16,), 6144, 2048, torch.bfloat16, seed=34),  # 1b down: split K
        Case((16,), 4096, 12288, torch.bfloat16, swiglu=True, seed=35),  # 8b gate/up
        Case((16,), 4096, 4096, torch.bfloat16, residual=True, norm=True, seed=36),
    ]])
def test_triton_rows_alike_at_any_row_count_gpu(case: Case) -> None:
    check_rows_alike(case)


@needs_triton
def test_triton_every_output_written_and_split_counters_reset() -> None:
    """Outputs NaN-poisoned by the allocator would show: every element is written, for split and unsplit
    tiles alike, and a product run after a split one of another shape is still right."""
    split = Case((5,), 256, 72, torch.float32, tiles=Tiles(16, 32, 4, 2, 4), seed=20)
    whole = Case((2,), 160, 24, torch.float32, tiles=Tiles(16, 32, 1, 2, 4), seed=21)
    for case in (split, whole, split):
        x, weight = make_inputs(case)
        out = skinny_linear(x, weight, tiles=case.tiles)
        assert not out.isnan().any(), f"{case.id}: unwritten outputs"
        assert_close(out, F.linear(x, weight), what=case.id, **TOLERANCE[case.dtype])
    counters, _ = skinny_gemm.WORKSPACE.get(DEVICE, 0)
    assert int(counters.abs().sum()) == 0, "an arrival counter was left set"


def test_choose_tiles_follows_the_h200_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    sms = 132
    monkeypatch.setattr(skinny_gemm, "_sm_count", lambda device: sms)
    qkv = choose_tiles(1, 4096, 6144, False, cuda)  # 96 column blocks: no split, long loads
    assert (qkv.block_n, qkv.block_k, qkv.split) == (64, 256, 1)
    small = choose_tiles(1, 2048, 4096, False, cuda)  # 64 blocks (1b's q/k/v) is still a third of the SMs
    assert small.split == 1
    down = choose_tiles(1, 6144, 2048, False, cuda)  # 32 blocks: split K until every SM has a program
    assert (down.block_k, down.split) == (128, 5) and 32 * down.split >= sms
    small_k = choose_tiles(1, 1024, 1024, False, cuda)  # splits keep >= 4 loads of 128
    assert small_k.split == 2
    glu = choose_tiles(9, 2048, 6144, True, cuda)  # a SwiGLU program reads gate and up rows: loads of 128
    assert (glu.block_n, glu.block_k, glu.split) == (64, 128, 1)  # 1b's gate/up: 96 blocks, one wave
    # 8b's gate/up: 192 blocks of 64 rows are a wave and a part-empty one; 96 of 128 rows are one wave
    wide = choose_tiles(1, 4096, 12288, True, cuda)
    assert (wide.block_n, wide.block_k, wide.split, wide.stages) == (128, 128, 1, 3)
    assert choose_tiles(16, 4096, 12288, True, cuda) == wide, "rows 1 to 16 take the same tiles (rows alike)"
    assert choose_tiles(1, 4096, 12288, True, cuda, itemsize=4).block_n == 64, "measured for 16 bits only"
    assert choose_tiles(17, 4096, 12288, True, cuda).block_n == 64, "past the route's 16 rows"
    assert choose_tiles(1, 4096, 20000, True, cuda).block_n == 64, "past two waves the tail is a small share"
    assert choose_tiles(1, 4096, 12288, False, cuda).block_n == 64, "measured for SwiGLU only"
    short = choose_tiles(1, 512, 8192, False, cuda)  # under four loads of 256: loads of 128
    assert short.block_k == 128
    # four stages of the tiles must fit in shared memory: float32 and many rows take shorter loads
    assert choose_tiles(1, 4096, 6144, False, cuda, itemsize=4).block_k == 128
    assert choose_tiles(18, 256, 1024, True, cuda, itemsize=4).block_k == 64
    assert choose_tiles(64, 4096, 6144, False, cuda).block_k == 128


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"block_n": 48}, "block_n must be a power of two", id="block-n"),
    pytest.param({"block_k": 8}, "block_k must be a power of two >= 16", id="block-k"),
    pytest.param({"split": 0}, "split >= 1", id="split"),
    pytest.param({"warps": 3}, "warps in 1/2/4/8/16", id="warps"),
])
def test_bad_tiles_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tiles(**kwargs)


@pytest.mark.parametrize(("x", "weight", "swiglu", "message"), [
    pytest.param(torch.zeros(2, 64), torch.zeros(8, 32), False, r"weight must be \[N, K=64\]", id="k-mismatch"),
    pytest.param(torch.zeros(1, 2, 2, 64), torch.zeros(8, 64), False, r"x must be \[rows, K\] or \[bs, rows, K\]",
                 id="x-rank"),
    pytest.param(torch.zeros(2, 64), torch.zeros(8, 64, dtype=torch.float64), False, "weight is torch.float64",
                 id="dtype"),
    pytest.param(torch.zeros(2, 64), torch.zeros(7, 64), True, "swiglu needs an even number", id="swiglu-odd"),
    pytest.param(torch.zeros(65, 64), torch.zeros(8, 64), False, "at most 64 rows", id="too-many-rows"),
    pytest.param(torch.zeros(2, 64), torch.zeros(64, 8).t(), False, "rows must be contiguous", id="strided-weight"),
])
def test_bad_input_names_what_does_not_fit(x: torch.Tensor, weight: torch.Tensor, swiglu: bool,
                                           message: str) -> None:
    if skinny_gemm.triton is None:
        pytest.skip("triton is not installed: skinny_linear refuses to run before checking its inputs")
    with pytest.raises(ValueError, match=message):
        skinny_linear(x, weight, swiglu=swiglu)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: CUDA graphs")
def test_graph_replays_match_and_growth_during_capture_is_refused() -> None:
    """A captured product replays right many times (the counters reset in the graph too); a workspace that
    would have to grow inside a capture is refused with what to do, and the capture is abandoned cleanly."""
    case = Case((1, 1), 4096, 4096, torch.bfloat16, seed=30)
    x, weight = make_inputs(case)
    skinny_linear(x, weight)  # the warm-up grows the workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, weight)
    for _ in range(5):
        x.normal_()
        graph.replay()
        assert_close(out, F.linear(x, weight), what="graph replay", **TOLERANCE[case.dtype])
    big = torch.randn(64, 8192, device=DEVICE, dtype=torch.bfloat16)
    w_big = torch.randn(8192 * 4, 8192, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="run the same shapes once eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            skinny_linear(big, w_big, tiles=Tiles(64, 128, 8, 3, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: the few-row kernel path of models.layers.linear")
@pytest.mark.parametrize("rows", [1, 9])
def test_layers_linear_few_row_route_matches_cublas(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """layers.linear with GEMV_MAX_ROWS on runs the skinny kernel (with SwiGLU's product) and agrees with
    cuBLAS; below SKINNY_MIN_K it stays on cuBLAS."""
    from ddtree.models import layers

    calls: list[int] = []
    real = layers.skinny_linear
    monkeypatch.setattr(layers, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, rows, 2048, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (0.05 * torch.randn(2 * 768, 2048, generator=gen)).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setattr(layers, "GEMV_MAX_ROWS", 16)
    got, got_glu = layers.linear(x, w), layers.linear(x, w, swiglu=True)
    assert len(calls) == 2
    layers.linear(x[..., :512], w[:, :512])
    assert len(calls) == 2, "a product below SKINNY_MIN_K went to the kernel"
    monkeypatch.setattr(layers, "GEMV_MAX_ROWS", 0)
    assert_close(got, F.linear(x, w), what="linear", atol=3e-2, rtol=2e-2)
    assert_close(got_glu, layers.linear(x, w, swiglu=True), what="linear + swiglu", atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")


def _kernel_is_interpreted() -> bool:
    from triton.runtime.jit import JITFunction

    return not isinstance(skinny_gemm._skinny_kernel, JITFunction)


@pytest.mark.skipif(skinny_gemm.triton is None or not _kernel_is_interpreted(),
                    reason="the kernel is compiled in this process, so its sm_90 build checks ran here, "
                           "or triton is not installed")
def test_sm90_checks_in_a_compiling_child() -> None:
    run_triton_cases_in_child(__file__, "hopper_build or shared_memory", interpret=False)


@pytest.mark.parametrize(("extra", "message"), [
    pytest.param({"norm_weight": torch.ones(32)}, r"norm_weight must be \[K=64\]", id="norm-shape"),
    pytest.param({"residual": torch.zeros(2, 7)}, r"skinny_linear: residual must be \(2, 8\)", id="residual-shape"),
    pytest.param({"residual": torch.zeros(2, 8, dtype=torch.float64)}, "residual must be", id="residual-dtype"),
])
def test_bad_norm_or_residual_names_the_argument(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        skinny_linear_reference(torch.zeros(2, 64), torch.zeros(8, 64), **extra)
    if skinny_gemm.triton is not None:
        with pytest.raises(ValueError, match=message):
            skinny_linear(torch.zeros(2, 64), torch.zeros(8, 64), **extra)


def test_reference_is_the_layers_ops() -> None:
    """The reference is layers.RMSNorm, F.linear, SwiGLU's silu * up and the residual add, bit for bit."""
    from ddtree.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    nw, res = 1 + 0.2 * torch.randn(64, generator=gen), torch.randn(3, 16, generator=gen)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.copy_(nw)
    gate, up = F.linear(norm(x), w).chunk(2, dim=-1)
    expected = res + F.silu(gate) * up
    assert torch.equal(skinny_linear_reference(x, w, swiglu=True, norm_weight=nw, eps=1e-6, residual=res), expected)


def fixture_forwards(target, q: int, attention: str, last_tap: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and taps of a q-token forward (q > 1: a causal verify chain) of the fixture target over a
    random cached context of 24 tokens at batch 2; the taps are layer 0 and, with last_tap, the last layer
    (without it the final norm can ride in the head's GEMM), and the logits those of the last 2 queries."""
    gen = torch.Generator().manual_seed(q)
    cache = target.new_cache(2, 40)
    with torch.no_grad():
        dev = target.device  # drawn on the CPU (the same ids on any device), then moved
        prompt = torch.randint(2, target.config.vocab_size, (2, 24), generator=gen).to(dev)
        target.forward(prompt, torch.arange(24, device=dev)[None].expand(2, 24), cache)
        cache.lengths.fill_(24)
        ids = torch.randint(2, target.config.vocab_size, (2, q), generator=gen).to(dev)
        pos = (24 + torch.arange(q, device=dev))[None].expand(2, q)
        layers = [0, target.config.num_hidden_layers - 1] if last_tap else [0]
        logits, taps = target.forward(ids, pos, cache, tap_layers=layers, attention=attention,
                                      logit_positions=torch.tensor([[max(q - 2, 0), q - 1]] * 2, device=dev))
    return logits, taps


@pytest.mark.parametrize("last_tap", [True, False])
@pytest.mark.parametrize("q", [1, 9])
def test_target_layers_with_norms_and_adds_in_the_gemms_are_the_same_forward(q: int, last_tap: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused-layer loop (norm as each GEMM's input, residual add as its output) computes the forward the
    add + norm loop does: on the CPU its torch ops are the same ops, so logits and taps are bit for bit equal."""
    from ddtree.models import load_target
    from ddtree.models import target as target_module

    target = load_target(FIXTURE_TARGET, dtype=torch.float32)
    target.fuse_projections()
    expected = fixture_forwards(target, q, "reference", last_tap)
    monkeypatch.setattr(target_module, "skinny_route", lambda x, weight: True)
    monkeypatch.setattr(target_module, "NORMS_IN_SKINNY_GEMMS", True)
    with torch.no_grad():  # training (gradients to the weights) runs the separate Linears
        assert target._skinny_layers(torch.zeros(1, 1, target.config.hidden_size))
    got = fixture_forwards(target, q, "reference", last_tap)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@needs_triton
@pytest.mark.parametrize(("q", "last_tap", "norms_inside"), [(1, True, True), (9, True, True), (9, False, True),
                                                             (9, True, False)])
def test_triton_target_forward_through_the_kernel_matches(q: int, last_tap: bool, norms_inside: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture target's forward with every few-row GEMM on the kernel (with norms_inside, its norm
    prologues and residual epilogues too; the SwiGLU epilogue always; in the interpreter on the CPU) against
    its cuBLAS / torch-ops forward."""
    from ddtree.models import layers, load_target
    from ddtree.models import target as target_module

    target = load_target(FIXTURE_TARGET, device=DEVICE, dtype=torch.float32)
    target.fuse_projections()
    expected = fixture_forwards(target.cpu(), q, "reference", last_tap) if not HAS_CUDA else None
    calls: list[int] = []
    real = layers.skinny_linear
    monkeypatch.setattr(layers, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # the fixture is float32 and narrow: let the route take the 2 x q rows after the prefill (IEEE float32 on a GPU too)
    monkeypatch.setattr(layers, "_gemv_rows", lambda x, weight, bias: bias is None and x[..., 0].numel() <= 18)
    monkeypatch.setattr(target_module, "NORMS_IN_SKINNY_GEMMS", norms_inside)
    got = fixture_forwards(target, q, "reference", last_tap)
    n_layers = target.config.num_hidden_layers
    assert len(calls) == 4 * n_layers + 1, f"{len(calls)} kernel calls; 4 a layer and the head expected"
    if expected is None:
        monkeypatch.undo()
        expected = fixture_forwards(target, q, "reference", last_tap)
    assert_close(got[0], expected[0], what=f"logits, q {q}", atol=2e-3, rtol=2e-3)
    assert_close(got[1], expected[1], what=f"taps, q {q}", atol=2e-3, rtol=2e-3)


def _hopper_build(dtype: str = "bf16", stages: int = 4, warps: int = 4, **constexprs: object) -> object:
    """The kernel compiled for sm_90 as the JIT would specialise it for real-width shapes (pointers, dims
    and strides divisible by 16); no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = skinny_gemm._skinny_kernel
    pointers = {"X": f"*{dtype}", "W": f"*{dtype}", "NW": f"*{dtype}", "R": f"*{dtype}", "OUT": f"*{dtype}",
                "PART": "*fp32", "COUNT": "*i32", "SUMS_IN": "*fp32", "SUMS_OUT": "*fp32"}
    ints = ("n_rows", "n_out", "k_dim", "k_split", "sx_m", "sw_n", "sr_m", "so_m", "n_sum_parts")
    values = {"SPLIT": 4, "SWIGLU": False, "HAS_NORM": False, "HAS_RES": False, "UPCAST": False, "EVEN": True,
              "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "HAS_SUMS": False, "RETURN_SUMS": False,
              "SUM_PARTS": 1} | constexprs
    signature = pointers | dict.fromkeys(ints, "i32") | {"eps": "fp32"} | dict.fromkeys(values, "constexpr")
    index = kernel.arg_names.index
    aligned = {(index(n),): [["tt.divisibility", 16]] for n in [*pointers, *ints] if n not in ("n_rows", "n_sum_parts")}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(index(n),): v for n, v in values.items()},
                       attrs=aligned)
    # fp fusion as the JIT's default has it (Triton 3.9 warns when it is left to the default)
    return skinny_gemm.triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})


def _needs_compiled_kernel() -> None:
    if _kernel_is_interpreted():
        pytest.skip("the Triton interpreter is on in this process (its kernels are not compiled); "
                    "test_sm90_checks_in_a_compiling_child runs it")


H200_SHARED_BYTES = 232448  # the most shared memory a block may take on an H200 (227 KB)


@pytest.mark.skipif(skinny_gemm.triton is None, reason="triton is not installed")
@pytest.mark.parametrize(("rows", "k", "n", "swiglu", "dtype", "epilogue"), [
    (1, 4096, 6144, False, "bf16", {"HAS_NORM": True}),  # 8b q/k/v
    (16, 4096, 12288, True, "bf16", {"HAS_NORM": True}),  # 8b gate/up at the route's most rows
    (1, 4096, 12288, True, "bf16", {"HAS_SUMS": True, "SUM_PARTS": 64}),  # the same, folded
    (9, 12288, 4096, False, "bf16", {"HAS_RES": True}),  # 8b down
    (1, 6144, 2048, False, "bf16", {}),  # 1b down: split K
    (64, 4096, 6144, False, "bf16", {}),  # the kernel's most rows
    (64, 4096, 12288, True, "fp16", {}),
    (18, 256, 1024, True, "fp32", {"UPCAST": True}),  # the fixture target's gate/up in its forward test
    (18, 1024, 256, False, "fp32", {"UPCAST": True, "HAS_RES": True}),  # and its down
], ids=lambda v: str(v) if not isinstance(v, dict) else "+".join(v) or "plain")
def test_chosen_tiles_fit_the_h200s_shared_memory(rows: int, k: int, n: int, swiglu: bool, dtype: str,
                                                  epilogue: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """choose_tiles' pick for each shape the engine and the GPU tests launch compiles for sm_90 within a
    block's shared memory (four stages of 64 x 128 float32 SwiGLU tiles at 18 rows once needed 257 KB, and
    the launch failed on the H200 only)."""
    _needs_compiled_kernel()
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    monkeypatch.setattr(skinny_gemm, "_sm_count", lambda device: 132)  # the H200's
    tiles = choose_tiles(rows, k, n, swiglu, torch.device("cuda"), itemsize)
    build = _hopper_build(dtype, tiles.stages, tiles.warps, SPLIT=tiles.split, SWIGLU=swiglu,
                          BLOCK_M=max(16, 1 << (rows - 1).bit_length()), BLOCK_N=tiles.block_n,
                          BLOCK_K=tiles.block_k, EVEN=k % tiles.block_k == 0, **epilogue)
    assert build.metadata.shared <= H200_SHARED_BYTES, (
        f"{tiles.label} for {rows} x {k} -> {n} ({dtype}) takes {build.metadata.shared} B of shared memory")


@pytest.mark.skipif(skinny_gemm.triton is None, reason="triton is not installed")
@pytest.mark.parametrize("epilogue", [{}, {"HAS_NORM": True, "HAS_RES": True}, {"SWIGLU": True, "SPLIT": 1},
                                      {"HAS_SUMS": True, "SUM_PARTS": 64, "SWIGLU": True, "SPLIT": 1},
                                      {"HAS_RES": True, "RETURN_SUMS": True, "SPLIT": 1}])
def test_hopper_build_pipelines_the_weight_loads_into_wgmma(epilogue: dict) -> None:
    """What the kernel is for, checked in its sm_90 build: the weight and x tiles are copied asynchronously
    (cp.async) into `stages` shared-memory buffers, and the product is Hopper's wgmma. A change that loses
    the pipeline (a load the pipeliner cannot take, a transformed operand) builds and passes the numeric
    tests, and reads the weight at a fraction of the bandwidth."""
    _needs_compiled_kernel()
    build = _hopper_build(**epilogue)
    ptx = build.asm["ptx"]
    parts = 2 if epilogue.get("SWIGLU") else 1
    stage_bytes = (parts * 64 * 128 + 128 * 16) * 2  # weight tile(s) + x.T tile, bfloat16
    assert build.metadata.shared >= 4 * stage_bytes, f"{build.metadata.shared} B of shared memory: not 4 stages"
    assert "cp.async" in ptx and "wgmma.mma_async" in ptx
