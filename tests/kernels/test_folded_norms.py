"""Folded norms (Target.fold_norms): each RMSNorm's weight multiplied into the GEMM after it, the residual
stream's GEMMs returning the rows' sums of squares, the next GEMM scaling by 1 / rms. The skinny kernel's
norm_sums / return_sums against the torch ops (Triton's interpreter on machines without CUDA), the layers'
fallback, and the fixture target's forward folded against unfolded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.skinny_gemm import Tiles, skinny_linear, skinny_linear_reference
from ddtree.models import layers
from ddtree.models.layers import FoldedNorm, linear
from tests.kernels.kernel_asserts import assert_close, interpreter_off_but_installed, run_triton_cases_in_child, triton_runtime

pytestmark = pytest.mark.kernels

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"
HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
SPLIT_TILES = Tiles(block_n=32, block_k=64, split=3, stages=2, warps=4)  # K = 256 over 3 programs


def _inputs(rows: int, k: int, n: int, swiglu: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = 3.0 * torch.randn(rows, k, generator=gen, device=DEVICE)  # far from unit rms: a lost scale shows
    norm = 0.5 + torch.rand(k, generator=gen, device=DEVICE)
    weight = torch.randn(2 * n if swiglu else n, k, generator=gen, device=DEVICE) * k ** -0.5
    residual = torch.randn(rows, n, generator=gen, device=DEVICE)
    return x, norm, weight, residual


def _parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """x's rows' sums of squares cut into `parts` unequal column slices ([parts, rows]), as GEMM blocks return them."""
    cuts = torch.linspace(0, x.shape[-1], parts + 1).round().long().tolist()
    return torch.stack([x[:, a:b].square().sum(-1) for a, b in zip(cuts, cuts[1:])])


@needs_triton
@pytest.mark.parametrize("tiles", [None, SPLIT_TILES], ids=["auto", "split3"])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("parts", [1, 5])
def test_triton_folded_norm_is_the_norm_before_the_product(tiles: Tiles | None, swiglu: bool,
                                                                    parts: int) -> None:
    x, norm, weight, _ = _inputs(5, 256, 96, swiglu, seed=parts)
    expected = skinny_linear_reference(x, weight, swiglu=swiglu, norm_weight=norm)
    got = skinny_linear(x, weight * norm, swiglu=swiglu, tiles=tiles, norm_sums=_parts(x, parts))
    assert_close(got, expected, what=f"folded norm, {parts} parts", atol=1e-4, rtol=1e-4)
    # the scale comes from the sums: doubled sums are a different norm
    off = skinny_linear(x, weight * norm, swiglu=swiglu, tiles=tiles, norm_sums=2 * _parts(x, parts))
    assert (off - expected).abs().max() > 1e-2


@needs_triton
@pytest.mark.parametrize("tiles", [None, SPLIT_TILES], ids=["auto", "split3"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_triton_return_sums_are_the_stored_rows_sums_of_squares_by_block(tiles: Tiles | None,
                                                                        with_residual: bool) -> None:
    x, _, weight, residual = _inputs(7, 256, 96, False, seed=3)
    res = residual if with_residual else None
    out, sums = skinny_linear(x, weight, tiles=tiles, residual=res, return_sums=True)
    expected = skinny_linear_reference(x, weight, residual=res)
    assert_close(out, expected, what="product", atol=1e-4, rtol=1e-4)
    block_n = (tiles or Tiles()).block_n
    assert sums.shape == (-(-96 // block_n), 7) and sums.dtype == torch.float32
    by_block = torch.stack([out[:, c:c + block_n].square().sum(-1) for c in range(0, 96, block_n)])
    assert_close(sums, by_block, what="sums by column block", atol=1e-3, rtol=1e-4)


@needs_triton
def test_triton_sums_chain_through_the_kernel_as_a_layer_runs_them() -> None:
    """o_proj's sums feed gate/up's folded norm: the same as RMSNorm of o_proj's output before gate/up."""
    x, norm, w_o, residual = _inputs(3, 256, 256, False, seed=7)
    _, _, w_gu, _ = _inputs(3, 256, 64, True, seed=8)
    h, sums = skinny_linear(x, w_o, residual=residual, return_sums=True)
    got = skinny_linear(h, w_gu * norm, swiglu=True, norm_sums=sums)
    expected = skinny_linear_reference(skinny_linear_reference(x, w_o, residual=residual), w_gu, swiglu=True,
                                       norm_weight=norm)
    assert_close(got, expected, what="chained", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("swiglu", [False, True])
def test_layers_linear_off_the_kernel_route_runs_the_folded_norm_as_torch_ops(swiglu: bool) -> None:
    """Prefill-sized inputs (and every CPU input) take torch's ops with the same meaning."""
    gen = torch.Generator().manual_seed(11)
    x = 2.0 * torch.randn(2, 40, 64, generator=gen)
    norm = layers.RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(64, generator=gen))
    weight = torch.randn(48 if swiglu else 24, 64, generator=gen) * 0.1
    expected = linear(x, weight, swiglu=swiglu, norm=norm)
    sums = x.square().sum(-1).reshape(1, -1)
    got = linear(x, weight * norm.weight.detach(), swiglu=swiglu, norm=FoldedNorm(sums, norm.eps))
    assert_close(got, expected, what="folded, torch ops", atol=1e-5, rtol=1e-5)
    out, out_sums = linear(x, weight[:24], residual=torch.ones(2, 40, 24), return_sums=True)
    assert out_sums.shape == (1, 80)
    assert_close(out_sums[0], out.reshape(80, 24).square().sum(-1), what="sums", atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton and not in_interpreter_child")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"norm_sums": torch.ones(1, 4), "norm_weight": torch.ones(16)}, "two norms"),
    ({"norm_sums": torch.ones(1, 3)}, r"\[parts >= 1, rows = 4\]"),
    ({"norm_sums": torch.ones(1, 4, dtype=torch.float64)}, "float32"),
    ({"swiglu": True, "return_sums": True}, "not SwiGLU's"),
])
def test_bad_sums_name_what_does_not_fit(kwargs: dict, message: str) -> None:
    x, weight = torch.ones(4, 16), torch.ones(8, 16)
    with pytest.raises(ValueError, match=message):
        skinny_linear_reference(x, weight, **kwargs)


def _fixture():
    from ddtree.models import load_target

    target = load_target(FIXTURE_TARGET, device=DEVICE, dtype=torch.float32)
    target.fuse_projections()
    return target


@pytest.mark.parametrize("route", [True, False])
@pytest.mark.parametrize("q", [1, 9])
def test_a_folded_target_forwards_as_the_unfolded_one_and_unfolds_bit_for_bit(
        q: int, route: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows on the skinny route (here forced, the torch ops standing in for the kernel on the CPU) take the
    folded layers (each GEMM scaled by its rows' 1 / rms from the sums); rows off it take the add + norm loop
    with a weight of ones. Either is the unfolded forward."""
    from ddtree.models import target as target_module
    from tests.kernels.test_skinny_gemm import fixture_forwards

    target = _fixture()
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    expected = fixture_forwards(target, q, "reference")
    kept = target.fold_norms(keep=True)
    monkeypatch.setattr(target_module, "skinny_route", lambda x, weight: route)
    norm_weights: list[torch.Tensor] = []
    real_norm = target_module.add_rms_norm
    monkeypatch.setattr(target_module, "add_rms_norm",
                        lambda x, delta, weight, eps: norm_weights.append(weight) or real_norm(x, delta, weight, eps))
    folded_calls: list[object] = []
    real_linear = layers.linear
    monkeypatch.setattr(layers, "linear", lambda *a, **kw: folded_calls.append(kw.get("norm")) or real_linear(*a, **kw))
    assert target.norms_folded
    with pytest.raises(RuntimeError, match="folded already"):
        target.fold_norms()
    with pytest.raises(RuntimeError, match="inference state"):
        target.forward_train(torch.zeros(1, 4, dtype=torch.long, device=DEVICE))
    got = fixture_forwards(target, q, "reference")
    n_layers = target.config.num_hidden_layers
    n_forwards = 2  # the context's prefill and the forward compared
    ones = [w for w in norm_weights if torch.equal(w, torch.ones_like(w))]
    if route:  # the sums between the GEMMs, and only the final norm as a kernel
        assert sum(isinstance(n, layers.FoldedNorm) for n in folded_calls) == 2 * n_layers * n_forwards
        assert len(norm_weights) == n_forwards and not ones
    else:  # every layer's two norms scale by ones; the final norm by its weight
        assert not any(isinstance(n, layers.FoldedNorm) for n in folded_calls)
        assert len(norm_weights) == (2 * n_layers + 1) * n_forwards and len(ones) == 2 * n_layers * n_forwards
    # the Linears read their rows of the fused weight: folded too
    assert not torch.equal(target.model.layers[0].self_attn.q_proj.weight,
                           before["model.layers.0.self_attn.q_proj.weight"])
    assert_close(got[0], expected[0], what=f"logits, q {q}", atol=2e-4, rtol=2e-4)
    assert_close(got[1], expected[1], what=f"taps, q {q}", atol=2e-4, rtol=2e-4)
    target.unfold_norms(kept)
    assert not target.norms_folded
    for name, p in target.named_parameters():
        assert torch.equal(p, before[name]), name


@needs_triton
def test_triton_folded_target_through_the_kernel_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every few-row GEMM on the kernel (the interpreter on the CPU): four a layer with the sums between them,
    and the head; the same logits and taps as the unfolded forward on torch's ops."""
    from tests.kernels.test_skinny_gemm import fixture_forwards

    target = _fixture()
    expected = fixture_forwards(target, 9, "reference")
    target.fold_norms()
    calls: list[dict] = []
    real = layers.skinny_linear
    monkeypatch.setattr(layers, "skinny_linear", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(layers, "_gemv_rows", lambda x, weight, bias: bias is None and x[..., 0].numel() <= 18)
    got = fixture_forwards(target, 9, "reference")
    n_layers = target.config.num_hidden_layers
    assert len(calls) == 4 * n_layers + 1
    assert sum(kw["norm_sums"] is not None for kw in calls) == 2 * n_layers
    assert sum(kw["return_sums"] for kw in calls) == 2 * n_layers
    assert_close(got[0], expected[0], what="logits", atol=2e-3, rtol=2e-3)
    assert_close(got[1], expected[1], what="taps", atol=2e-3, rtol=2e-3)
