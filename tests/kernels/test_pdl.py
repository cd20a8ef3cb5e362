"""Programmatic dependent launch (ddtree.kernels.pdl): when kernels launch dependent, and that a real-width
forward launched so, eagerly and as a CUDA graph replayed many times, is the forward launched plainly bit for
bit (a kernel that read its input before the one ahead had written it would differ, now and then).

The sm_90 builds' order (nothing but weight prefetches before the wait) is checked on any machine in
test_skinny_gemm.py; the GPU cases need a device of compute capability 9.0 or later.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels import pdl, skinny_gemm
from ddtree.kernels.skinny_gemm import MAX_PREFETCH_LINES, prefetch_lines

pytestmark = pytest.mark.kernels

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs compute capability >= 9.0")


def test_cpu_tensors_and_the_switch_launch_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # before anything asks the driver
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}


def test_prefetch_lines_stay_within_the_budget_the_range_and_a_power_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skinny_gemm, "PREFETCH_BYTES", 16 << 20)
    # 1b's q/k/v: 4096 rows of K = 2048 bfloat16 (32 lines each), 16 MB in all: every line fits
    assert prefetch_lines(4096, 2048, 64, 2) == 32
    # 8b's gate/up: 24576 rows of K = 4096 (64 lines): 16 MB is 5.3 lines a row -> 4
    assert prefetch_lines(24576, 4096, 64, 2) == 4
    # a split's range bounds it: 5 splits of 1280 of K = 6144 -> 20 lines, rounded down to 16
    assert prefetch_lines(160, 1280, 64, 2) == 16
    assert prefetch_lines(64, 1 << 20, 64, 2) == MAX_PREFETCH_LINES
    assert prefetch_lines(1 << 30, 4096, 64, 2) == 0  # not one line a row fits
    monkeypatch.setattr(skinny_gemm, "PREFETCH_BYTES", 0)
    assert prefetch_lines(4096, 2048, 64, 2) == 0


def _narrow_forward(q: int) -> tuple[object, ...]:
    """The narrow random shape (hidden 1024) in bfloat16, folded, over a 300-token cache; a q-token forward
    through the skinny GEMMs and the Triton attention (the kernels a batch-1 round takes)."""
    from ddtree.bench.random_models import random_models

    target, _ = random_models("narrow", device="cuda", dtype=torch.bfloat16)
    target.fold_norms()
    cache = target.new_cache(1, 512)
    gen = torch.Generator(device="cuda").manual_seed(q)
    prefix = torch.randint(0, target.config.vocab_size, (1, 300), device="cuda", generator=gen)
    with torch.inference_mode():
        target(prefix, torch.arange(300, device="cuda")[None], cache)
        cache.advance(torch.tensor([300], device="cuda"))
    ids = torch.randint(0, target.config.vocab_size, (1, q), device="cuda", generator=gen)
    pos = torch.arange(300, 300 + q, device="cuda")[None]
    return target, cache, ids, pos


def _forward(target, cache, ids, pos) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    logits, taps = target(ids, pos, cache, tap_layers=[1, 2], attention="triton")
    return logits, taps


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("q", [1, 9])
def test_a_forward_launched_dependent_is_the_plain_one_bit_for_bit(q: int, monkeypatch: pytest.MonkeyPatch) -> None:
    target, cache, ids, pos = _narrow_forward(q)
    results: dict[str, list[torch.Tensor]] = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, mode)
        assert pdl.enabled(ids.device) == (mode == "1")
        with torch.inference_mode():
            eager = _forward(target, cache, ids, pos)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _forward(target, cache, ids, pos)
            replays = []
            for _ in range(50):  # a race shows in some replays, not every one
                graph.replay()
                replays.append(torch.cat([captured[0].flatten(), captured[1].float().flatten()]).clone())
            torch.cuda.synchronize()
        results[mode] = [torch.cat([eager[0].flatten(), eager[1].float().flatten()]), *replays]
    plain = results["0"][0]
    assert all(torch.equal(r, plain) for r in results["0"]), "the plain forward is not deterministic"
    for i, r in enumerate(results["1"]):
        assert torch.equal(r, plain), f"launched dependent, {'eager' if i == 0 else f'replay {i}'}: differs"


@pytest.mark.gpu
@needs_hopper
def test_an_engine_launched_dependent_commits_the_plain_engines_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA-graphed rounds (every Triton kernel of a round launched dependent) at 1 and 20 prompts, AR and
    DDTREE: the tokens of the same engine with DDTREE_PDL=0."""
    from ddtree.bench.random_models import random_models
    from ddtree.config import SpecConfig
    from ddtree.engine import Engine
    from tests.unit.test_engine import AR, prompts

    spec = SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048)
    out: dict[str, list[list[int]]] = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, mode)
        engine = Engine(*random_models("narrow", device="cuda", dtype=torch.bfloat16))  # graphs captured anew
        out[mode] = [o.token_ids for count in (1, 20) for s in (AR, spec)
                     for o in engine.generate(prompts(count, seed=40 + count), 32, spec=s)]
    assert out["1"] == out["0"]
