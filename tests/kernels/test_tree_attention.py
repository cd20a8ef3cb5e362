"""Tree attention: the torch reference against a naive per-query loop, the Triton kernel against the reference.

On machines without CUDA the kernel runs in Triton's interpreter on small shapes: TRITON_INTERPRET=1 must
be set before triton is first imported, so this module sets it at import (CPU machines only). If triton
was already imported without it, `test_triton_cases_in_interpreter_child` reruns the Triton cases in a
child process. The error bounds per dtype are in kernel_asserts.TOLERANCES (bf16 1e-2, fp32 ~1e-5).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (see module docstring)

import torch.nn.functional as F

from ddtree.kernels.bitmask import ancestor_mask, causal_bitmask, pack_mask
from ddtree.kernels.tree_attention import (
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
)
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

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}


@dataclass(frozen=True)
class Case:
    bs: int
    prefix: int  # the largest cache length; rows get lengths in [0, prefix]
    n: int  # tree nodes incl. root
    group: int  # q heads per kv head
    hkv: int
    d: int
    dtype: torch.dtype
    in_cache: bool  # tree K/V read from the cache at slots cache_lens[b] + j
    splits: int | None = None
    seed: int = 0

    @property
    def id(self) -> str:
        where = "cache" if self.in_cache else "new"
        split = "" if self.splits is None else f"-s{self.splits}"
        return (f"b{self.bs}-p{self.prefix}-n{self.n}-g{self.group}x{self.hkv}-d{self.d}-"
                f"{DTYPE_NAMES[self.dtype]}-{where}{split}")


# small enough for the interpreter (a few seconds in all on 2 cores)
CPU_CASES = [
    Case(1, 0, 2, 1, 1, 64, torch.float32, False),
    Case(2, 37, 9, 2, 2, 64, torch.float32, True, seed=1),
    Case(3, 130, 17, 4, 1, 64, torch.bfloat16, False, seed=2),
    Case(2, 64, 33, 1, 2, 128, torch.float32, True, splits=2, seed=3),
    Case(4, 200, 64, 2, 1, 64, torch.bfloat16, True, splits=4, seed=4),
    Case(2, 50, 65, 2, 1, 64, torch.float32, False, seed=5),
    Case(1, 300, 5, 2, 2, 128, torch.bfloat16, False, seed=6),
    Case(5, 20, 3, 1, 2, 64, torch.float32, True, seed=7),
    Case(2, 90, 9, 2, 1, 64, torch.float16, True, splits=3, seed=8),
    Case(2, 40, 9, 2, 1, 96, torch.float32, False, seed=9),
]


def _gpu_cases(count: int) -> list[Case]:
    """A fixed sample of the full grid (batch 1..32, prefix 0..4096, n 2..65, GQA 1/2/4, d 64/128)."""
    grid = list(itertools.product((1, 3, 8, 32), (0, 100, 1024, 4096), (2, 9, 17, 33, 64, 65), (1, 2, 4),
                                  (64, 128), (torch.bfloat16, torch.float32), (False, True)))
    picks = random.Random(1234).sample(grid, count)
    return [Case(bs, p, n, g, 8 // g if g < 4 else 2, d, dt, inc, seed=i) for i, (bs, p, n, g, d, dt, inc)
            in enumerate(picks)]


GPU_CASES = _gpu_cases(48)


def random_parents(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, n] parent arrays with parent[i] < i: random trees, plus a chain and a star row when bs allows."""
    idx = torch.arange(n)
    parents = (torch.rand(bs, n, generator=gen) * idx).floor().long()  # [bs, n], parent[0] = 0
    if bs > 1:
        parents[1] = (idx - 1).clamp(min=0)  # chain
    if bs > 2:
        parents[2] = 0  # star
    return parents


def make_inputs(case: Case, device: torch.device) -> dict:
    """Random inputs; every cache slot the call must not read is NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    hq = case.hkv * case.group
    max_len = case.prefix + case.n + 7
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    q = randn(case.bs, hq, case.n, case.d)
    k_cache, v_cache = randn(case.bs, case.hkv, max_len, case.d), randn(case.bs, case.hkv, max_len, case.d)
    lens = torch.randint(0, case.prefix + 1, (case.bs,), generator=gen)
    lens[0] = case.prefix
    if case.bs > 3:
        lens[3] = 0
    used = lens + (case.n if case.in_cache else 0)  # slots >= used are never read
    unused = torch.arange(max_len)[None, :] >= used[:, None]  # [bs, max_len]
    k_cache[unused[:, None, :, None].expand_as(k_cache)] = float("nan")
    v_cache[unused[:, None, :, None].expand_as(v_cache)] = float("nan")
    k_new = v_new = None
    if not case.in_cache:
        k_new, v_new = randn(case.bs, case.hkv, case.n, case.d), randn(case.bs, case.hkv, case.n, case.d)
    bitmask = pack_mask(ancestor_mask(random_parents(case.bs, case.n, gen)))
    cast = lambda t: None if t is None else t.to(device=device, dtype=case.dtype)
    return {"q": cast(q), "k_cache": cast(k_cache), "v_cache": cast(v_cache), "cache_lens": lens.to(device),
                "k_new": cast(k_new), "v_new": cast(v_new), "tree_bitmask": bitmask.to(device), "scale": case.d ** -0.5}


def exact(inputs: dict) -> torch.Tensor:
    """The reference in float64 on the same (already rounded) inputs: the 'true' answer."""
    up = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
    return tree_attention_reference(**up, compute_dtype=torch.float64)


# -- the reference ------------------------------------------------------------------------------------


def naive_tree_attention(inputs: dict) -> torch.Tensor:
    """One query at a time: gather exactly the keys it may see, softmax in float64."""
    q, kc, vc = inputs["q"].double(), inputs["k_cache"].double(), inputs["v_cache"].double()
    lens, bits, scale = inputs["cache_lens"].tolist(), inputs["tree_bitmask"], inputs["scale"]
    bs, hq, n, _ = q.shape
    group = hq // kc.shape[1]
    out = torch.empty_like(q)
    for b in range(bs):
        if inputs["k_new"] is None:
            kt, vt = kc[b, :, lens[b]:lens[b] + n], vc[b, :, lens[b]:lens[b] + n]
        else:
            kt, vt = inputs["k_new"][b].double(), inputs["v_new"][b].double()
        for h in range(hq):
            hk = h // group
            for i in range(n):
                word = int(bits[b, i]) if bits.dim() == 2 else None
                seen = [j for j in range(n) if ((word >> j) & 1 if word is not None
                                                else (int(bits[b, i, j // 64]) >> (j % 64)) & 1)]
                keys = torch.cat([kc[b, hk, :lens[b]], kt[hk, seen]])
                vals = torch.cat([vc[b, hk, :lens[b]], vt[hk, seen]])
                weights = torch.softmax(keys @ q[b, h, i] * scale, dim=0)
                out[b, h, i] = weights @ vals
    return out


@pytest.mark.parametrize("case", [
    pytest.param(Case(1, 0, 1, 1, 1, 8, torch.float64, False), id="root-only"),
    pytest.param(Case(3, 6, 5, 2, 2, 8, torch.float64, False, seed=1), id="gqa2-new"),
    pytest.param(Case(4, 5, 7, 4, 1, 4, torch.float64, True, seed=2), id="gqa4-in-cache"),
    pytest.param(Case(2, 3, 66, 1, 1, 4, torch.float64, False, seed=3), id="two-words"),
])
def test_reference_matches_naive_loop(case: Case) -> None:
    inputs = make_inputs(case, torch.device("cpu"))
    assert_close(tree_attention_reference(**inputs, compute_dtype=torch.float64), naive_tree_attention(inputs),
                 what=f"reference vs naive loop, {case.id}")


def test_reference_chain_is_causal_attention() -> None:
    """A chain tree over an empty prefix is plain causal attention."""
    case = Case(2, 0, 12, 2, 2, 16, torch.float32, False, seed=11)
    inputs = make_inputs(case, torch.device("cpu"))
    inputs["tree_bitmask"] = causal_bitmask(case.n).expand(case.bs, case.n)
    k = inputs["k_new"].repeat_interleave(case.group, dim=1)
    v = inputs["v_new"].repeat_interleave(case.group, dim=1)
    expected = F.scaled_dot_product_attention(inputs["q"], k, v, is_causal=True)
    assert_close(tree_attention_reference(**inputs), expected, what="chain vs causal SDPA")


def test_reference_is_float32_and_never_reads_unused_slots() -> None:
    inputs = make_inputs(Case(3, 20, 9, 2, 1, 16, torch.bfloat16, True, seed=12), torch.device("cpu"))
    out = tree_attention_reference(**inputs)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert_close(out, exact(inputs), dtype=torch.bfloat16, what="bf16 reference vs float64")


# -- the Triton kernel ----------------------------------------------------------------------------------


def _check_kernel(case: Case) -> None:
    inputs = make_inputs(case, DEVICE)
    poisoned = torch.full_like(inputs["q"], float("nan"))  # an unwritten element stays NaN and fails
    out = tree_attention_triton(**inputs, splits=case.splits, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr()
    assert out.dtype == case.dtype
    assert_close(out, exact(inputs), dtype=case.dtype, what=f"triton vs reference, {case.id}")


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_reference(case: Case) -> None:
    _check_kernel(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: large shapes are too slow for the Triton interpreter")
@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_triton_matches_reference_gpu(case: Case) -> None:
    _check_kernel(case)


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_triton_splits_agree(splits: int) -> None:
    """Splitting the prefix across programs (and merging) gives the same answer as one pass."""
    case = Case(2, 150, 9, 2, 2, 64, torch.float32, False, splits=splits, seed=21)
    _check_kernel(case)


@needs_triton
@pytest.mark.parametrize(("block_t", "block_m", "num_warps"), [(16, None, None), (32, 16, 2), (64, 32, 8)])
def test_triton_tile_overrides_agree(block_t: int, block_m: int | None, num_warps: int | None) -> None:
    """Smaller tree tiles (several per bitmask word, across two words) and row blocks give the same answer."""
    case = Case(2, 40, 70, 2, 2, 32, torch.float32, False, seed=24)
    inputs = make_inputs(case, DEVICE)
    out = tree_attention_triton(**inputs, block_t=block_t, block_m=block_m, num_warps=num_warps)
    assert_close(out, exact(inputs), what=f"block_t {block_t}, block_m {block_m}")


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_tf32_is_close(splits: int) -> None:
    """tf32=True (the drafter's choice for float32) stays within TF32's rounding of the exact answer, through
    the dispatcher too; the reference ignores the flag."""
    case = Case(2, 150, 9, 2, 2, 64, torch.float32, False, splits=splits, seed=25)
    inputs = make_inputs(case, DEVICE)
    out = tree_attention_triton(**inputs, splits=splits, tf32=True)
    assert_close(out, exact(inputs), atol=3e-3, rtol=3e-3, what=f"tf32, {splits} splits")
    via = tree_attention(**inputs, backend="triton", tf32=True)
    assert_close(via, exact(inputs), atol=3e-3, rtol=3e-3, what="tf32 through the dispatcher")
    assert torch.equal(tree_attention(**inputs, backend="reference", tf32=True),
                       tree_attention(**inputs, backend="reference"))


def test_triton_rejects_a_tile_across_words() -> None:
    inputs = make_inputs(Case(1, 4, 5, 1, 1, 16, torch.float32, False), torch.device("cpu"))
    with pytest.raises(ValueError, match="block_t must be 16, 32 or 64"):
        tree_attention_triton(**inputs, block_t=128)


@needs_triton
def test_triton_chain_bitmask_and_strided_inputs() -> None:
    """The chain (causal bitmask broadcast over the batch) and q in [bs, n, H, d] memory order."""
    case = Case(3, 70, 17, 2, 2, 64, torch.float32, True, seed=22)
    inputs = make_inputs(case, DEVICE)
    inputs["tree_bitmask"] = causal_bitmask(case.n, DEVICE).expand(case.bs, case.n)  # stride 0 over bs
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view
    assert_close(tree_attention_triton(**inputs), exact(inputs), what="chain, strided q")


@needs_triton
def test_dispatcher_picks_triton_by_device() -> None:
    case = Case(2, 30, 5, 2, 1, 64, torch.float32, False, seed=23)
    inputs = make_inputs(case, DEVICE)
    auto = tree_attention(**inputs)
    chosen = tree_attention_triton(**inputs) if HAS_CUDA else tree_attention_reference(**inputs)
    assert torch.equal(auto, chosen), "backend='auto' should be Triton on CUDA and the reference on CPU"
    assert torch.equal(tree_attention(**inputs, backend="reference"), tree_attention_reference(**inputs))
    assert_close(tree_attention(**inputs, backend="triton"), exact(inputs), what="forced triton")


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")


# -- bad input ----------------------------------------------------------------------------------------


def _bad(**changes: object) -> dict:
    inputs = make_inputs(Case(2, 10, 5, 2, 2, 16, torch.float32, False), torch.device("cpu"))
    inputs.update(changes)
    return inputs


@pytest.mark.parametrize(("changes", "message"), [
    pytest.param({"q": torch.zeros(2, 4, 5)}, "q must be", id="q-rank"),
    pytest.param({"q": torch.zeros(2, 3, 5, 16)}, "multiple of Hkv", id="heads-not-grouped"),
    pytest.param({"q": torch.zeros(2, 4, 300, 16)}, r"n \(tree nodes", id="too-many-nodes"),
    pytest.param({"cache_lens": torch.zeros(3, dtype=torch.long)}, "cache_lens", id="lens-shape"),
    pytest.param({"tree_bitmask": torch.zeros(2, 5, dtype=torch.int32)}, "int64", id="bitmask-dtype"),
    pytest.param({"tree_bitmask": torch.zeros(2, 4, dtype=torch.long)}, "tree_bitmask", id="bitmask-shape"),
    pytest.param({"v_new": None}, "both k_new and v_new", id="half-new"),
    pytest.param({"k_new": torch.zeros(2, 2, 4, 16)}, "k_new must be", id="k-new-shape"),
])
def test_bad_input_names_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tree_attention_reference(**_bad(**changes))


def test_bad_backend() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        tree_attention(**_bad(), backend="cuda")  # type: ignore[arg-type]


def test_case_grid_is_wide() -> None:
    """Guard the GPU sample: it must keep covering the shapes the engine uses."""
    seen = {f: {getattr(c, f) for c in GPU_CASES} for f in ("bs", "prefix", "n", "group", "d", "dtype", "in_cache")}
    assert {1, 32} <= seen["bs"] and 4096 in seen["prefix"] and {64, 65} & seen["n"], seen
    assert seen["group"] == {1, 2, 4} and seen["d"] == {64, 128} and len(seen["dtype"]) == 2, seen
