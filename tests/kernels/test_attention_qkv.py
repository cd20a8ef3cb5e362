"""tree_attention_qkv: a layer's attention from its raw q/k/v projections in one launch, against the two it
replaces (norm_rope_qkv, then tree_attention over the cache), and its reference against those references.

On machines without CUDA the kernel runs in Triton's interpreter (set at import, as in test_tree_attention).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.bitmask import ancestor_mask, pack_mask
from ddtree.kernels.norm_rope import norm_rope_qkv
from ddtree.kernels.tree_attention import Rotation, tree_attention, tree_attention_qkv, tree_attention_triton
from ddtree.models.layers import Rotary
from tests.kernels.kernel_asserts import (
    assert_close,
    interpreter_off_but_installed,
    run_triton_cases_in_child,
    triton_runtime,
)
from tests.kernels.test_tree_attention import random_parents

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    bs: int
    prefix: int  # the largest cache length
    n: int  # tree nodes (1: an AR step)
    group: int
    hkv: int
    d: int
    dtype: torch.dtype
    norm: bool = True
    splits: int | None = None
    room: int = 7  # cache slots past prefix + n
    seed: int = 0

    @property
    def id(self) -> str:
        split = "" if self.splits is None else f"-s{self.splits}"
        return (f"b{self.bs}-p{self.prefix}-n{self.n}-g{self.group}x{self.hkv}-d{self.d}-{str(self.dtype)[6:]}"
                f"-{'norm' if self.norm else 'nonorm'}{split}")


CPU_CASES = [
    Case(1, 40, 1, 2, 2, 64, torch.float32),
    Case(2, 37, 9, 2, 2, 64, torch.float32, seed=1),
    Case(3, 130, 5, 4, 1, 32, torch.float32, norm=False, splits=4, seed=2),
    Case(2, 70, 17, 1, 2, 16, torch.float32, splits=2, seed=3),
    Case(2, 20, 9, 2, 1, 64, torch.bfloat16, seed=4),
]
GPU_CASES = [
    Case(1, 1024, 1, 4, 8, 128, torch.bfloat16, seed=10),
    Case(1, 1024, 9, 4, 8, 128, torch.bfloat16, seed=11),
    Case(32, 1024, 9, 2, 8, 128, torch.bfloat16, seed=12),
    Case(4, 300, 33, 2, 2, 64, torch.float32, seed=13),
]


def make_inputs(case: Case, device: torch.device) -> dict:
    """Raw q/k/v as column slices of one projection, a NaN-poisoned cache with room past every row's tree."""
    gen = torch.Generator().manual_seed(case.seed)
    hq = case.hkv * case.group
    proj = torch.randn(case.bs, case.n, (hq + 2 * case.hkv) * case.d, generator=gen).to(device=device, dtype=case.dtype)
    q, k, v = proj.split([hq * case.d, case.hkv * case.d, case.hkv * case.d], dim=-1)
    shape = (case.bs, case.n, -1, case.d)
    max_len = case.prefix + case.n + case.room
    k_cache = torch.randn(case.bs, case.hkv, max_len, case.d, generator=gen)
    v_cache = torch.randn(case.bs, case.hkv, max_len, case.d, generator=gen)
    lens = torch.randint(0, case.prefix + 1, (case.bs,), generator=gen)
    lens[0] = case.prefix
    unused = torch.arange(max_len)[None, :] >= lens[:, None]
    k_cache[unused[:, None, :, None].expand_as(k_cache)] = float("nan")
    v_cache[unused[:, None, :, None].expand_as(v_cache)] = float("nan")
    weights = [None, None]
    if case.norm:
        weights = [(1.0 + 0.1 * torch.randn(case.d, generator=gen)).to(device=device, dtype=case.dtype)
                   for _ in range(2)]
    depth = torch.randint(0, case.n, (case.bs, case.n), generator=gen)
    cos, sin = Rotary(case.d, 10000.0)((lens[:, None] + depth).to(device), case.dtype)
    cast = lambda t: t.to(device=device, dtype=case.dtype)
    return {"q": q.view(shape), "k": k.view(shape), "v": v.view(shape),
            "rotation": Rotation(weights[0], weights[1], EPS, cos, sin),
            "k_cache": cast(k_cache), "v_cache": cast(v_cache), "cache_lens": lens.to(device),
            "tree_bitmask": pack_mask(ancestor_mask(random_parents(case.bs, case.n, gen))).to(device),
            "scale": case.d ** -0.5}


def two_calls(inputs: dict, backend: str, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_rope_qkv into a copy of the cache, then tree_attention over it: (out, k_cache, v_cache)."""
    r = inputs["rotation"]
    kc, vc, lens = inputs["k_cache"].clone(), inputs["v_cache"].clone(), inputs["cache_lens"]
    slots = lens[:, None] + torch.arange(inputs["q"].shape[1], device=lens.device)
    q = norm_rope_qkv(inputs["q"], inputs["k"], inputs["v"], r.q_weight, r.k_weight, EPS, r.cos, r.sin, kc, vc,
                      slots, backend=backend)
    if backend == "triton":
        out = tree_attention_triton(q, kc, vc, lens, None, None, inputs["tree_bitmask"], inputs["scale"],
                                    splits=splits)
    else:
        out = tree_attention(q, kc, vc, lens, None, None, inputs["tree_bitmask"], inputs["scale"], backend=backend)
    return out, kc, vc


def one_call(inputs: dict, backend: str, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc, vc = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    args = {**inputs, "k_cache": kc, "v_cache": vc}
    if backend == "triton" and splits is not None:  # the kernel path with a forced split count
        r = args.pop("rotation")
        q, k, v = (args.pop(x).transpose(1, 2) for x in ("q", "k", "v"))
        out = tree_attention_triton(q, kc, vc, args["cache_lens"], k, v, args["tree_bitmask"], args["scale"],
                                    splits=splits, rotation=r)
    else:
        out = tree_attention_qkv(**args, backend=backend)
    return out, kc, vc


def assert_same_cache(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: written slots differ"
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{what}: written values differ"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[:3]])
def test_reference_is_the_two_references(case: Case) -> None:
    inputs = make_inputs(case, torch.device("cpu"))
    out, kc, vc = one_call(inputs, "reference")
    want, kw, vw = two_calls(inputs, "reference")
    assert torch.equal(out, want)
    assert_same_cache(kc, kw, "keys")
    assert_same_cache(vc, vw, "values")


def _check_kernel(case: Case) -> None:
    inputs = make_inputs(case, DEVICE)
    out, kc, vc = one_call(inputs, "triton", case.splits)
    want, kw, vw = two_calls(inputs, "triton", case.splits)
    assert not out.isnan().any()
    assert_same_cache(vc, vw, "values (copied bit for bit)")
    # the norm's sum may reduce in another order than norm_rope's kernel: float32 rounding, then 16-bit ties
    tol = {"atol": 1e-5, "rtol": 1e-5} if case.dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert torch.equal(kc.isnan(), kw.isnan()), "the fused kernel wrote other slots than norm_rope_qkv"
    assert_close(kc.nan_to_num(), kw.nan_to_num(), what=f"written keys, {case.id}", **tol)
    assert_close(out, want, what=f"attention, {case.id}", **tol)
    ref, _, _ = one_call(inputs, "reference")
    # against the reference's torch ops, which round after each op (norm_rope's tests: up to a few bf16 ulps)
    ref_tol = {"dtype": case.dtype} if case.dtype == torch.float32 else {"atol": 6e-2, "rtol": 2e-2}
    assert_close(out, ref, what=f"kernel against the reference, {case.id}", **ref_tol)


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_the_two_launches(case: Case) -> None:
    _check_kernel(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: real widths are too slow for the Triton interpreter")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_triton_matches_the_two_launches_gpu(case: Case) -> None:
    _check_kernel(case)


@needs_triton
def test_triton_drops_writes_past_the_cache() -> None:
    """A row whose tree would run past max_len writes only the slots that exist, as norm_rope_write does."""
    case = Case(2, 30, 9, 2, 1, 32, torch.float32, room=0, seed=5)
    inputs = make_inputs(case, DEVICE)
    inputs["cache_lens"] = inputs["cache_lens"].clone()
    inputs["cache_lens"][1] = case.prefix + 4  # 5 of its 9 nodes fit
    _, kc, vc = one_call(inputs, "triton")
    _, kw, vw = two_calls(inputs, "triton")
    assert not kc[1, :, case.prefix + 4:].isnan().any(), "row 1's 5 nodes that fit are written"
    assert not kc[0].isnan().any(), "row 0 fills its cache to the end"
    assert torch.equal(kc.isnan(), kw.isnan()) and torch.equal(vc.nan_to_num(), vw.nan_to_num())


@needs_triton
@pytest.mark.parametrize("n", [1, 6])
def test_triton_target_forward_equals_the_two_launches(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-style target's forward on the Triton path (an AR step, then a tree verify) with the rotation in
    the attention kernel gives the logits and the cache of the two launches (layers.ROTATE_IN_ATTENTION off)."""
    from ddtree.models import layers
    from ddtree.models.configs import TargetConfig
    from ddtree.models.target import init_target

    cfg = TargetConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                       eos_token_id=2)
    target = init_target(cfg, device=DEVICE, seed=0)
    target.fuse_projections()
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, 64, (2, 11), generator=gen).to(DEVICE)
    tree = ancestor_mask(random_parents(2, n, gen)).to(DEVICE)
    ids = torch.randint(0, 64, (2, n), generator=gen).to(DEVICE)
    results = []
    for rotate in (True, False):
        monkeypatch.setattr(layers, "ROTATE_IN_ATTENTION", rotate)
        cache = target.new_cache(2, 32)
        with torch.inference_mode():
            target.forward(prompt, torch.arange(11, device=DEVICE).expand(2, 11), cache)  # sdpa prefill
            cache.lengths.copy_(torch.tensor([11, 7], device=DEVICE))  # rows of different lengths
            pos = cache.lengths[:, None] + tree.sum(-1) - 1  # each node's depth past its row's prefix
            logits, _ = target.forward(ids, pos, cache, tree_mask=tree, attention="triton")
        results.append((logits, cache.k.clone(), cache.v.clone()))
    (a, ka, va), (b, kb, vb) = results
    assert_close(a, b, atol=1e-5, rtol=1e-5, what=f"logits, {n} nodes")
    assert_close(ka, kb, atol=1e-5, rtol=1e-5, what="keys written")
    assert torch.equal(va[0], vb[0]), "the first layer's values are copied bit for bit"
    assert_close(va, vb, atol=1e-5, rtol=1e-5, what="values written (later layers see rounding-close inputs)")


def test_bad_input_names_the_field() -> None:
    inputs = make_inputs(CPU_CASES[1], torch.device("cpu"))
    r = inputs["rotation"]
    with pytest.raises(ValueError, match="both"):
        tree_attention_qkv(**{**inputs, "rotation": Rotation(r.q_weight, None, EPS, r.cos, r.sin)})
    with pytest.raises(ValueError, match="backend"):
        tree_attention_qkv(**inputs, backend="cuda")
    with pytest.raises(ValueError, match="k_out must be"):
        tree_attention_qkv(**{**inputs, "k_cache": inputs["k_cache"][:, :1]})


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")
