"""Engine(fold_norms=...): the target's layer norms multiplied into its GEMMs (Target.fold_norms).

By default the engine folds only a 16-bit CUDA target at real width, where the few-row GEMMs take the skinny
kernel (engine.folding_pays; tests/unit/test_engine_paths.py has the GPU case). Asked to, it folds any target
whose projections allow it; a folded engine must still commit the target's own tokens, and in float32 the same
tokens as the unfolded one (the norms' weights are drawn away from 1, so a lost or doubled weight shows).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import Engine, folding_pays
from ddtree.errors import ConfigError
from ddtree.models import TargetConfig, init_target
from tests.unit.test_engine import AR, make_engine, prompts

SPECS = [
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None), id="dflash-wnone-bs8"),
    pytest.param(SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048), id="b8-k4-w2048-bs8"),
]


def _engine(fold_norms: bool | None) -> Engine:
    """make_engine's pair (the same weights every call) with norm weights drawn in [0.5, 1.5)."""
    built = make_engine(seed=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in built.target.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))
    return Engine(built.target, built.drafter, fold_norms=fold_norms)


@pytest.fixture(scope="module")
def folded() -> Engine:
    return _engine(True)


def test_the_engine_folds_where_asked_and_by_default_only_where_it_pays(folded: Engine) -> None:
    assert folded.norms_folded and folded.target.norms_folded
    # the unit norm weight is a buffer that moves with the model and is never saved with it
    assert not any("_unit_norm" in name for name in folded.target.state_dict())
    assert dict(folded.target.named_buffers())["_unit_norm"].device == folded.device
    plain = _engine(None)
    assert not folding_pays(plain.target)  # a float32 target on the CPU
    assert not plain.norms_folded and not plain.target.norms_folded
    assert not _engine(False).norms_folded


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_folded_engine_commits_the_targets_own_tokens(folded: Engine, spec: SpecConfig, temperature: float) -> None:
    batch = prompts(4, seed=21)
    ref = folded.generate(batch, 24, temperature=temperature, spec=AR, seed=5)
    out = folded.generate(batch, 24, temperature=temperature, spec=spec, seed=5)
    for i, (r, o) in enumerate(zip(ref, out, strict=True)):
        assert o.token_ids == r.token_ids, f"{spec.id} prompt {i}: differs from the folded engine's AR"


def test_folded_and_unfolded_decode_the_same_greedy_tokens_in_float32(folded: Engine) -> None:
    """Only W * g's rounding differs; in float32 it moves the logits by ~1e-7 relative, far inside the margins.
    20 prompts of up to 40 tokens prefill more rows than the skinny route would take on a GPU."""
    batch = prompts(20, seed=22)
    unfolded = _engine(False)
    ref = unfolded.generate(batch, 24, spec=AR)
    for spec in (AR, SPECS[1].values[0]):
        out = folded.generate(batch, 24, spec=spec)
        assert [o.token_ids for o in out] == [r.token_ids for r in ref], spec.id


def test_asked_to_fold_a_target_it_cannot_names_why() -> None:
    config = TargetConfig(model_type="qwen2", vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
                          attention_bias=True, eos_token_id=None)
    target = init_target(config, seed=0).eval()
    with pytest.raises(ConfigError, match=r"fold_norms: layer 0 needs fused, bias-free q/k/v"):
        Engine(target, fold_norms=True)
    assert target.fold_refusal() is not None and not folding_pays(target)
    assert not Engine(target).norms_folded  # by default it just does not fold
