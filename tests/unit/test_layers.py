"""ddtree.models.layers FusedLinear: fused q/k/v and gate/up GEMMs give the same bits, keep names and training.

The CPU test runs (this suite, the transformers comparisons, engine vs AR) go through the fused path, so
the first test here is the one that says whether that is allowed: fused and separate GEMMs must agree
bit for bit on this machine's CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddtree.models import (
    DFlashDrafter,
    Target,
    TargetConfig,
    init_target,
    load_drafter,
    load_target,
)
from ddtree.models.layers import Rotary

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def _config(model_type: str = "qwen3", bias: bool = False) -> TargetConfig:
    return TargetConfig(model_type=model_type, vocab_size=53, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        attention_bias=bias, mlp_bias=bias)


def _random_biases(model: torch.nn.Module) -> None:
    """init_target zeroes biases; a fused-bias mix-up must not hide behind zeros."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _logits(model: Target, ids: torch.Tensor, taps: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    bs, n = ids.shape
    with torch.inference_mode():
        return model(ids, torch.arange(n)[None].expand(bs, n), model.new_cache(bs, n + 4), tap_layers=taps)


def _drafter_logits(drafter: DFlashDrafter, taps: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    bs, n, _ = taps.shape
    with torch.inference_mode():
        ctx = drafter.new_context(bs, None, n + block.shape[1])
        drafter.append_context(ctx, taps, torch.arange(n)[None].expand(bs, n), torch.full((bs,), n))
        return drafter(ctx, block, torch.full((bs,), n))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
def test_fused_fixture_models_match_unfused_bit_for_bit_on_cpu(dtype: torch.dtype) -> None:
    target = load_target(FIXTURES / "target", dtype=dtype)
    drafter = load_drafter(FIXTURES / "drafter", target, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (3, 21), generator=gen)
    block = torch.randint(0, target.config.vocab_size, (3, drafter.config.block_size), generator=gen)
    logits, taps = _logits(target, ids, drafter.tap_layers)
    assert taps is not None
    draft = _drafter_logits(drafter, taps, block)
    target.fuse_projections()
    drafter.fuse_projections()
    assert target.model.layers[0].self_attn.qkv_proj is not None and drafter.layers[0].mlp.gate_up is not None
    fused_logits, fused_taps = _logits(target, ids, drafter.tap_layers)
    assert torch.equal(fused_logits, logits), "target: the fused GEMMs changed the CPU logits"
    assert fused_taps is not None and torch.equal(fused_taps, taps)
    assert torch.equal(_drafter_logits(drafter, taps, block), draft), "drafter: the fused GEMMs changed the CPU logits"


@pytest.mark.parametrize(("model_type", "bias"), [
    pytest.param("qwen3", False, id="qwen3"),
    pytest.param("qwen3", True, id="qwen3-bias"),
    pytest.param("llama", True, id="llama-bias"),
])
def test_fusion_keeps_names_storage_and_logits(model_type: str, bias: bool) -> None:
    model = init_target(_config(model_type, bias), seed=1)
    _random_biases(model)
    names = {k: v.shape for k, v in model.state_dict().items()}
    ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(1))
    before, _ = _logits(model, ids)
    model.fuse_projections()
    assert {k: v.shape for k, v in model.state_dict().items()} == names, "state_dict names or shapes changed"
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.qkv_proj is not None and mlp.gate_up is not None
    # the Linears are views of the fused tensors: no second copy of the weights
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == attn.qkv_proj.weight[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[mlp.gate_proj.out_features:].data_ptr()
    if bias:
        assert attn.qkv_proj.bias is not None and attn.k_proj.bias.data_ptr() == attn.qkv_proj.bias[32:].data_ptr()
    after, _ = _logits(model, ids)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    storage = attn.qkv_proj.weight.data_ptr()
    model.fuse_projections()  # already fused: a no-op
    assert attn.qkv_proj.weight.data_ptr() == storage


def test_training_updates_reach_the_fused_gemm() -> None:
    """Gradients flow through the separate Linears (the fused tensor is outside autograd) and an optimizer's
    in-place step lands in the fused tensor, so inference after training sees the new weights."""
    model = init_target(_config(bias=True), seed=2)
    model.fuse_projections()
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits, _ = model.forward_train(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0
    assert attn.q_norm is not None and attn.q_norm.weight.grad is not None  # through norm_rope's torch path
    assert model.model.layers[0].mlp.up_proj.bias.grad is not None
    opt.step()
    fused, _ = _logits(model, ids)
    assert attn.qkv_proj is not None and not attn.qkv_proj.live, "with grad enabled the fused GEMM must not run"
    with torch.inference_mode():
        assert attn.qkv_proj.live, "_logits (inference mode) must have used the fused GEMM"
    reference = init_target(_config(bias=True))
    reference.load_state_dict(model.state_dict())  # an unfused copy of the trained weights
    torch.testing.assert_close(fused, _logits(reference, ids)[0], atol=1e-6, rtol=0)


def test_replaced_weights_fall_back_to_separate_gemms() -> None:
    """load_state_dict(assign=True) or .to(dtype) re-points the Parameters: the stale fused tensor is not used."""
    model = init_target(_config(), seed=4)
    model.fuse_projections()
    fresh = init_target(_config(), seed=5)
    model.load_state_dict(fresh.state_dict(), assign=True)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not attn.qkv_proj.intact
    ids = torch.randint(0, 53, (1, 5), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logits(model, ids)[0], _logits(fresh, ids)[0], atol=0, rtol=0)
    model.fuse_projections()  # re-fusing picks up the new weights
    assert attn.qkv_proj.intact
    torch.testing.assert_close(_logits(model, ids)[0], _logits(fresh, ids)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rotary_table_rows_are_the_computed_values(dtype: torch.dtype) -> None:
    """The accelerator path gathers cos/sin from a table; its rows must be the on-the-fly values bit for bit
    (and a position past the table reads the last row rather than faulting)."""
    rotary = Rotary(64, 1_000_000.0, max_positions=5000)
    positions = torch.tensor([[0, 1, 4095, 4999], [17, 2048, 3, 77]])
    table = rotary.table(positions.device, dtype)
    assert table.shape == (5000, 2, 64) and table.dtype == dtype
    cos, sin = rotary(positions, dtype)  # CPU: computed
    rows = table[positions]
    assert torch.equal(rows[:, :, 0], cos[:, 0]) and torch.equal(rows[:, :, 1], sin[:, 0])
    if torch.cuda.is_available():
        gpu = positions.cuda()
        cos_gpu, sin_gpu = rotary(gpu, dtype)
        want_cos, want_sin = rotary._compute(gpu, dtype)
        assert torch.equal(cos_gpu[:, 0], want_cos) and torch.equal(sin_gpu[:, 0], want_sin)
        past = rotary(torch.tensor([[7000]], device="cuda"), dtype)[0]
        assert torch.equal(past[0, 0, 0], rotary.table(gpu.device, dtype)[-1, 0])
