"""ddtree.models DFlash drafter: config round-trip, incremental context vs training path, window, ring buffer, fit checks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.errors import ModelLoadError
from ddtree.models import (
    DFlashDrafter,
    DrafterConfig,
    TargetConfig,
    init_drafter,
    init_target,
    load_drafter,
    load_target,
    save_drafter,
    save_target,
)

VOCAB, HIDDEN = 61, 32
ATOL = 2e-5  # float32: the incremental and training paths sum in different orders
TAPS = [0, 2, 3]
MASK_ID = 60


def _target_config(hidden: int = HIDDEN) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64,
                        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _drafter_dict(**over) -> dict:
    """A z-lab-shaped config.json (the keys of z-lab/Qwen3-8B-DFlash-b16), scaled down."""
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 4,
        "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": MASK_ID},
        "num_target_layers": 5,
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }
    d.update(over)
    return d


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def target():
    t = init_target(_target_config(), seed=0)
    with torch.no_grad():  # larger weights so the drafter's logits are far from uniform
        t.model.embed_tokens.weight.mul_(30)
    return t.eval()


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    d = init_drafter(DrafterConfig.from_dict(_drafter_dict()), target, seed=1)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.mul_(5)
    _perturb_norms(d, 2)
    return d.eval()


@pytest.fixture(scope="module")
def seq(target):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (2, 24), generator=gen)
    with torch.no_grad():
        _, taps = target.forward_train(ids, TAPS)
    return ids, taps


def _block(ids: torch.Tensor, a: list[int], block: int) -> torch.Tensor:
    out = torch.full((len(a), block), MASK_ID)
    out[:, 0] = ids[torch.arange(len(a)), torch.tensor(a)]
    return out


def _naive_block(drafter: DFlashDrafter, taps: torch.Tensor, bonus: int, lo: int, a: int, block: int) -> torch.Tensor:
    """One block written out the z-lab way: K/V = k/v_proj(cat(fused ctx[lo:a], block)), full softmax, one row."""
    c = drafter.config
    ctx = drafter.hidden_norm(drafter.fc(taps[lo:a]))  # [n, D]
    x = drafter.target.embed(torch.tensor([bonus] + [MASK_ID] * (block - 1)))  # [blk, D]
    pos = torch.arange(lo, a + block).float()
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)  # [n + blk, d]

    def rope(t: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:  # t[h, n, d]
        t1, t2 = t.chunk(2, -1)
        return t * ang.cos() + torch.cat([-t2, t1], -1) * ang.sin()

    for layer in drafter.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_norm(at.q_proj(h).view(block, c.num_attention_heads, c.head_dim)).transpose(0, 1)
        kv_in = torch.cat([ctx, h])
        k = at.k_norm(at.k_proj(kv_in).view(-1, c.num_key_value_heads, c.head_dim)).transpose(0, 1)
        v = at.v_proj(kv_in).view(-1, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        q, k = rope(q, ang[-block:]), rope(k, ang)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(c.head_dim), -1)
        o = (w @ v).transpose(0, 1).reshape(block, -1)
        x = x + at.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.target.lm_head(drafter.norm(x[1:]))


def _incremental(drafter, taps, anchors: list[int], block: int, window, chunk: int = 5) -> torch.Tensor:
    """Append rows [0, a_b) per row in padded chunks, then draft the block at a_b."""
    bs = taps.shape[0]
    ctx = drafter.new_context(bs, window, max_len=64)
    done = [0] * bs
    while any(d < a for d, a in zip(done, anchors)):
        counts = torch.tensor([min(chunk, a - d) for d, a in zip(done, anchors)])
        idx = torch.tensor([[min(d + j, taps.shape[1] - 1) for j in range(chunk)] for d in done])
        drafter.append_context(ctx, taps[torch.arange(bs)[:, None], idx], idx, counts)
        done = [d + int(c) for d, c in zip(done, counts)]
    return ctx


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("window", [None, 6], ids=["no-window", "w6"])
def test_incremental_equals_training_path_and_naive_reference(drafter, seq, window, attention) -> None:
    ids, taps = seq
    anchors = [17, 9]
    block = drafter.config.block_size
    with torch.no_grad():
        ctx = _incremental(drafter, taps, anchors, block, window)
        assert ctx.total.tolist() == anchors
        inc = drafter(ctx, _block(ids, anchors, block), torch.tensor(anchors), attention=attention)
        train = drafter.forward_train(taps, ids, torch.tensor([[17, 3, 9], [9, 17, 0]]), block, window)
        assert inc.shape == (2, block - 1, VOCAB) and train.shape == (2, 3, block - 1, VOCAB)
        assert inc.std() > 0.1
        torch.testing.assert_close(inc[0], train[0, 0], atol=ATOL, rtol=0)
        torch.testing.assert_close(inc[1], train[1, 0], atol=ATOL, rtol=0)
        for b, a in enumerate(anchors):
            lo = 0 if window is None else max(0, a - window)
            ref = _naive_block(drafter, taps[b], int(ids[b, a]), lo, a, block)
            torch.testing.assert_close(inc[b], ref, atol=ATOL, rtol=0)


def test_window_equals_only_last_w_positions(drafter, seq) -> None:
    ids, taps = seq
    a, w, block = 20, 5, 4
    with torch.no_grad():
        windowed = drafter(_incremental(drafter, taps[:1], [a], block, w), _block(ids[:1], [a], block), torch.tensor([a]))
        only_last = drafter.new_context(1, None, 64)
        pos = torch.arange(a - w, a)[None]
        drafter.append_context(only_last, taps[:1, a - w:a], pos, torch.tensor([w]))
        ref = drafter(only_last, _block(ids[:1], [a], block), torch.tensor([a]))
        full = drafter(_incremental(drafter, taps[:1], [a], block, None), _block(ids[:1], [a], block), torch.tensor([a]))
    torch.testing.assert_close(windowed, ref, atol=ATOL, rtol=0)
    assert (windowed - full).abs().max() > 1e-3  # the window really cut something off


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_ring_buffer_wraps_with_uneven_rows(drafter, seq, attention) -> None:
    ids, taps = seq
    w, block = 4, 4
    with torch.no_grad():
        ctx = drafter.new_context(2, w, max_len=64)
        done = [0, 0]
        # uneven appends, some longer than the window (only the last w rows may survive)
        for counts in ([3, 7], [0, 2], [6, 1], [2, 5], [5, 3]):
            m = max(counts)
            idx = torch.tensor([[min(d + j, 23) for j in range(m)] for d in done])
            drafter.append_context(ctx, taps[torch.arange(2)[:, None], idx], idx, torch.tensor(counts))
            done = [d + c for d, c in zip(done, counts)]
        assert ctx.total.tolist() == done == [16, 18]
        assert ctx.stored.tolist() == [w, w]
        out = drafter(ctx, _block(ids, done, block), torch.tensor(done), attention=attention)
        train = drafter.forward_train(taps, ids, torch.tensor([[16], [18]]), block, w)
    torch.testing.assert_close(out, train[:, 0], atol=ATOL, rtol=0)


def test_reset_rows_forgets_context(drafter, seq) -> None:
    ids, taps = seq
    with torch.no_grad():
        ctx = _incremental(drafter, taps, [10, 10], 4, None)
        ctx.reset(torch.tensor([False, True]))
        assert ctx.total.tolist() == [10, 0]
        drafter.append_context(ctx, taps[:, :3], torch.arange(3)[None].expand(2, 3), torch.tensor([0, 3]))
        out = drafter(ctx, _block(ids, [10, 3], 4), torch.tensor([10, 3]))
        train = drafter.forward_train(taps, ids, torch.tensor([[10], [3]]), 4, None)
    torch.testing.assert_close(out, train[:, 0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block", [2, 7], ids=["block2", "block7"])
def test_block_size_other_than_trained(drafter, seq, block) -> None:
    ids, taps = seq
    assert block != drafter.config.block_size
    with torch.no_grad():
        out = drafter(_incremental(drafter, taps, [12, 8], block, None), _block(ids, [12, 8], block), torch.tensor([12, 8]))
        train = drafter.forward_train(taps, ids, torch.tensor([[12], [8]]), block, None)
    assert out.shape == (2, block - 1, VOCAB)
    torch.testing.assert_close(out, train[:, 0], atol=ATOL, rtol=0)


def test_unknown_attention_is_refused(drafter, seq) -> None:
    ids, _ = seq
    ctx = drafter.new_context(1, None, max_len=16)
    with pytest.raises(ValueError, match=r"attention: 'flash' is not one of \('sdpa', 'triton', 'reference'\)"):
        drafter(ctx, ids[:1, :4], torch.tensor([0]), attention="flash")


def test_block_size_one_is_refused(drafter) -> None:
    ctx = drafter.new_context(1, None, 8)
    with pytest.raises(ValueError, match="block_size: must be >= 2"):
        drafter(ctx, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


# -- folders -------------------------------------------------------------------------------------

def test_config_round_trip(tmp_path: Path, target, drafter) -> None:
    save_drafter(drafter, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"]
    assert written["dflash_config"] == {"target_layer_ids": TAPS, "mask_token_id": MASK_ID}
    assert set(load_file(str(tmp_path / "model.safetensors"))) >= {
        "fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
        "layers.1.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight",
    }
    again = load_drafter(tmp_path, target)
    assert again.config == dataclasses.replace(drafter.config, torch_dtype="float32")
    assert again.config.block_size == 4 and again.config.window is None
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_model_prefix_and_derived_layer_ids(tmp_path: Path, target, drafter) -> None:
    save_drafter(drafter, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file({"model." + k: v for k, v in load_file(str(f)).items()}, str(f))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"] = {"mask_token_id": MASK_ID}  # z-lab derives ids over [1, n_target - 3]
    cfg["num_hidden_layers"], cfg["layer_types"] = 2, None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # derived: 2 draft layers over [1, 2] -> [1, 2]; the fc width (3 taps) no longer fits
    with pytest.raises(ModelLoadError, match=r"'fc.weight' has input width 96, expected .* = 64"):
        load_drafter(tmp_path, target)


def test_zlab_defaults_for_target_layer_ids() -> None:
    from ddtree.models import build_target_layer_ids

    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]


def test_sliding_window_read_from_layer_types() -> None:
    cfg = DrafterConfig.from_dict(_drafter_dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16))
    assert cfg.window == 16
    nested = _drafter_dict(dflash_config={"target_layer_ids": TAPS, "mask_token_id": 3, "block_size": 8})
    del nested["block_size"]
    assert DrafterConfig.from_dict(nested).block_size == 8


def _write_drafter_folder(path: Path, target, **over) -> None:
    d = init_drafter(DrafterConfig.from_dict(_drafter_dict()), target, seed=0)
    save_drafter(d, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(over)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        pytest.param({"dflash_config": {"target_layer_ids": [0, 2, 5], "mask_token_id": MASK_ID}},
                     r"target_layer_ids contains 5, outside the target's layers \[0, 4\]", id="tap-out-of-range"),
        pytest.param({"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": MASK_ID}},
                     r"'fc.weight' has input width 96, expected len\(target_layer_ids\) \(2\) x hidden_size \(32\) = 64",
                     id="wrong-fc-width"),
        pytest.param({"dflash_config": {"target_layer_ids": TAPS, "mask_token_id": VOCAB}},
                     r"mask_token_id 61 is outside the vocabulary \[0, 60\]", id="mask-id"),
        pytest.param({"vocab_size": VOCAB + 1}, "vocab_size 62 != target vocab_size 61", id="vocab"),
        pytest.param({"architectures": ["Qwen3ForCausalLM"]}, "architectures must contain 'DFlashDraftModel'",
                     id="architecture"),
        pytest.param({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
                     "rope_scaling.rope_type 'yarn' is not supported", id="rope"),
    ],
)
def test_fit_checks(tmp_path: Path, target, over: dict, message: str) -> None:
    _write_drafter_folder(tmp_path, target, **over)
    with pytest.raises(ModelLoadError, match=message):
        load_drafter(tmp_path, target)


def test_hidden_mismatch(tmp_path: Path, target) -> None:
    _write_drafter_folder(tmp_path, target)
    other = init_target(_target_config(hidden=48), seed=0)
    save_target(other, tmp_path / "t48")
    with pytest.raises(ModelLoadError, match="hidden_size 32 != target hidden_size 48"):
        load_drafter(tmp_path, load_target(tmp_path / "t48"))
    with pytest.raises(ModelLoadError, match="hidden_size 32 != target hidden_size 48"):
        init_drafter(DrafterConfig.from_dict(_drafter_dict()), other)


def test_missing_drafter_tensor(tmp_path: Path, target) -> None:
    _write_drafter_folder(tmp_path, target)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    t.pop("hidden_norm.weight")
    save_file(t, str(f))
    with pytest.raises(ModelLoadError, match="missing tensor 'hidden_norm.weight'"):
        load_drafter(tmp_path, target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_append_and_draft_match_cpu_without_host_sync(tmp_path: Path, target, drafter, seq) -> None:
    ids, taps = seq
    save_target(target, tmp_path / "t")
    save_drafter(drafter, tmp_path / "d")
    gpu_target = load_target(tmp_path / "t", device="cuda", dtype=torch.float32)
    gpu_drafter = load_drafter(tmp_path / "d", gpu_target, device="cuda", dtype=torch.float32)
    outs = []
    for d, dev in ((drafter, "cpu"), (gpu_drafter, "cuda")):
        t = taps.to(dev)
        pos = torch.arange(12, device=dev)[None].expand(2, 12)
        counts = torch.tensor([12, 7], device=dev)
        block = _block(ids, [12, 7], 4).to(dev)
        start = torch.tensor([12, 7], device=dev)
        ctx = d.new_context(2, 5, max_len=32)
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                d.append_context(ctx, t[:, :12], pos, counts)
                outs.append(d(ctx, block, start).cpu() if dev == "cpu" else d(ctx, block, start))
        finally:
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(outs[1].cpu(), outs[0], atol=1e-3, rtol=0)


def test_context_row_view_shares_storage(drafter, seq) -> None:
    ids, taps = seq
    with torch.no_grad():
        ctx = drafter.new_context(3, None, 32)
        row = ctx.rows(2, 3)
        drafter.append_context(row, taps[1:2, :9], torch.arange(9)[None], torch.tensor([9]))
        assert ctx.total.tolist() == [0, 0, 9]
        out = drafter(row, _block(ids[1:2], [9], 4), torch.tensor([9]))
        train = drafter.forward_train(taps[1:2], ids[1:2], torch.tensor([[9]]), 4, None)
    torch.testing.assert_close(out, train[:, 0], atol=ATOL, rtol=0)
