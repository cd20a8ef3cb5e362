"""ddtree.models target + KV cache against transformers' Qwen3/Llama on tiny random configs (CPU, no download)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.errors import ModelLoadError, RequestError
from ddtree.models import TargetConfig, init_target, load_target, save_target

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS = 97, 64, 3
F32_ATOL = 1e-4  # float32: same math as transformers, only summation order may differ
BF16_ATOL = 5e-2  # bfloat16: 8-bit mantissa, differences from op ordering/fused kernels


def _hf_model(family: str, tie: bool = False) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=tie, eos_token_id=2, bos_token_id=1, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():  # HF's init leaves norms at 1; perturb them so a norm mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_target(path), path


def _prefill(model, ids: torch.Tensor, max_len: int = 64, taps=None):
    bs, n = ids.shape
    cache = model.new_cache(bs, max_len)
    logits, t = model(ids, torch.arange(n)[None].expand(bs, n), cache, tap_layers=taps)
    cache.advance(torch.full((bs,), n))
    return cache, logits, t


def test_logits_and_taps_match_transformers(pair) -> None:
    hf, model, _ = pair
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        _, logits, taps = _prefill(model, ids, taps=[0, 1, 2])
        train_logits, train_taps = model.forward_train(ids, [1, 2])
    assert logits.dtype == torch.float32 and logits.shape == (3, 13, VOCAB)
    assert ref.logits.std() > 0.01  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(logits, ref.logits, atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(train_logits, ref.logits, atol=F32_ATOL, rtol=0)
    for i in range(LAYERS):  # z-lab convention: tap k = hidden_states[k + 1]
        torch.testing.assert_close(taps[..., i * HIDDEN:(i + 1) * HIDDEN], ref.hidden_states[i + 1], atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(train_taps, torch.cat(ref.hidden_states[2:4], -1), atol=F32_ATOL, rtol=0)


def test_bfloat16_logits_close(pair) -> None:
    hf, _, path = pair
    model = load_target(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        _, logits, _ = _prefill(model, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=BF16_ATOL, rtol=0)


def test_prefill_then_decodes_equal_full_forward(pair) -> None:
    _, model, _ = pair
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, full_taps = model.forward_train(ids, [0, 2])
        cache, logits, _ = _prefill(model, ids[:, :7])
        steps = [logits[:, -1]]
        for t in range(7, 12):
            out, taps = model(ids[:, t:t + 1], torch.full((2, 1), t), cache, tap_layers=[0, 2])
            torch.testing.assert_close(taps[:, 0], full_taps[:, t], atol=F32_ATOL, rtol=0)
            cache.advance(torch.ones(2, dtype=torch.long))
            steps.append(out[:, 0])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 6:12], atol=F32_ATOL, rtol=0)
    assert cache.lengths.tolist() == [12, 12]


def _tree() -> tuple[list[int], list[int]]:
    """A 6-node tree (root 0): parents of nodes 1..6 and their depths."""
    parents = [0, 0, 1, 1, 2, 4]
    depths = [1, 1, 2, 2, 2, 3]
    return parents, depths


def test_tree_verify_equals_each_root_to_node_path(pair) -> None:
    _, model, _ = pair
    gen = torch.Generator().manual_seed(4)
    parents, depths = _tree()
    n = len(parents) + 1
    prefix = torch.randint(0, VOCAB, (2, 8), generator=gen)
    tokens = torch.randint(0, VOCAB, (2, n), generator=gen)  # node 0 = bonus token
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i - 1]]
    depth = torch.tensor([0] + depths)
    with torch.no_grad():
        cache, _, _ = _prefill(model, prefix)
        start = 8
        logits, taps = model(tokens, (start + depth)[None].expand(2, n), cache,
                             tree_mask=anc[None].expand(2, n, n), tap_layers=[1])
        for i in range(n):
            path = [j for j in range(n) if anc[i, j]]  # ancestors in index order = root-to-node order
            seq = torch.cat([prefix, tokens[:, path]], 1)
            ref, ref_taps = model.forward_train(seq, [1])
            torch.testing.assert_close(logits[:, i], ref[:, -1], atol=F32_ATOL, rtol=0)
            torch.testing.assert_close(taps[:, i], ref_taps[:, -1], atol=F32_ATOL, rtol=0)
    assert cache.lengths.tolist() == [8, 8]  # verify never advances


def test_compaction_then_decode_equals_fresh_prefill(pair) -> None:
    _, model, _ = pair
    gen = torch.Generator().manual_seed(5)
    parents, depths = _tree()
    n = len(parents) + 1
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i - 1]]
    depth = torch.tensor([0] + depths)
    prefix = torch.randint(0, VOCAB, (2, 8), generator=gen)
    tokens = torch.randint(0, VOCAB, (2, n), generator=gen)
    # row 0 accepts 0 -> 2 -> 5 (non-contiguous); row 1 accepts 0 -> 1 -> 4 -> 6 (padded src)
    src = torch.tensor([[0, 2, 5, 3], [0, 1, 4, 6]])
    counts = torch.tensor([3, 4])
    nxt = torch.randint(0, VOCAB, (2, 1), generator=gen)
    with torch.no_grad():
        cache, _, _ = _prefill(model, prefix, max_len=32)
        model(tokens, (8 + depth)[None].expand(2, n), cache, tree_mask=anc[None].expand(2, n, n))
        cache.compact(src, counts)
        assert cache.lengths.tolist() == [11, 12]
        out, _ = model(nxt, cache.lengths[:, None].clone(), cache)
        for b in range(2):
            seq = torch.cat([prefix[b], tokens[b, src[b, :counts[b]]], nxt[b]])[None]
            ref, _ = model.forward_train(seq)
            torch.testing.assert_close(out[b, 0], ref[0, -1], atol=F32_ATOL, rtol=0)


def test_right_padded_batched_prefill_equals_per_row(pair) -> None:
    _, model, _ = pair
    gen = torch.Generator().manual_seed(6)
    lens = [5, 11, 8]
    ids = torch.randint(0, VOCAB, (3, 11), generator=gen)
    with torch.no_grad():
        cache = model.new_cache(3, 32)
        logits, _ = model(ids, torch.arange(11)[None].expand(3, 11), cache)
        cache.advance(torch.tensor(lens))
        nxt = torch.randint(0, VOCAB, (3, 1), generator=gen)
        step, _ = model(nxt, cache.lengths[:, None].clone(), cache)
        for b, n in enumerate(lens):
            ref, _ = model.forward_train(torch.cat([ids[b, :n], nxt[b]])[None])
            torch.testing.assert_close(logits[b, :n], ref[0, :n], atol=F32_ATOL, rtol=0)
            torch.testing.assert_close(step[b, 0], ref[0, n], atol=F32_ATOL, rtol=0)


def test_logit_positions_and_kv_len_hint(pair) -> None:
    _, model, _ = pair
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(6)[None].expand(2, 6)
    with torch.no_grad():
        full, _ = model(ids, pos, model.new_cache(2, 16))
        last, _ = model(ids, pos, model.new_cache(2, 16), logit_positions=torch.tensor([[5], [2]]),
                        kv_len_hint=16)
    torch.testing.assert_close(last[:, 0], full[[0, 1], [5, 2]], atol=F32_ATOL, rtol=0)


def test_cache_reset_and_overflow(pair) -> None:
    _, model, _ = pair
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache, _, _ = _prefill(model, ids, max_len=8)
        cache.reset(torch.tensor([True, False]))
        assert cache.lengths.tolist() == [0, 6]
        with pytest.raises(RequestError, match="max_len is 8"):
            model(ids[:, :3], torch.zeros(2, 3, dtype=torch.long), cache)
        with pytest.raises(RequestError, match="kv_len_hint 9"):
            model(ids[:, :1], torch.zeros(2, 1, dtype=torch.long), cache, kv_len_hint=9)


def test_save_target_round_trip_readable_by_transformers(tmp_path: Path) -> None:
    cfg = TargetConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       tie_word_embeddings=True, eos_token_id=2)
    model = init_target(cfg, seed=0)
    save_target(model, tmp_path)
    again = load_target(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, _ = model.forward_train(ids)
        b, _ = again.forward_train(ids)
        c = hf(ids).logits
    assert again.config == dataclasses.replace(model.config, torch_dtype="float32")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=F32_ATOL, rtol=0)


# -- bad folders ----------------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path: Path) -> Path:
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    return tmp_path


def _edit_tensors(folder: Path, edit) -> None:
    (f,) = folder.glob("*.safetensors")
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
                     "missing tensor 'model.layers.1.self_attn.k_norm.weight'", id="missing-tensor"),
        pytest.param(lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(129, HIDDEN)}),
                     r"'model.layers.0.mlp.up_proj.weight' has shape \(129, 64\), expected \(128, 64\)",
                     id="wrong-shape"),
        pytest.param(lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}),
                     "unexpected tensor 'model.layers.9.mlp.up_proj.weight'", id="extra-tensor"),
    ],
)
def test_bad_tensors_name_the_tensor(folder: Path, edit, message: str) -> None:
    _edit_tensors(folder, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_target(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
                     "rope_parameters.rope_type 'yarn' is not supported", id="rope-yarn"),
        pytest.param(lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}),
                     "rope_scaling.rope_type 'linear' is not supported", id="rope-linear-legacy"),
        pytest.param(lambda c: c.update(model_type="gpt2"), "model_type 'gpt2' is not supported", id="model-type"),
        pytest.param(lambda c: c.pop("hidden_size"), "'hidden_size' is missing", id="no-hidden"),
        pytest.param(lambda c: c.update(num_key_value_heads=3),
                     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)", id="gqa"),
    ],
)
def test_bad_config_names_the_field(folder: Path, edit, message: str) -> None:
    _edit_config(folder, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_target(folder)


def test_missing_folder_and_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_target(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_model("llama").config.to_dict()))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_target(tmp_path)


def test_legacy_rope_theta_and_default_scaling_accepted(folder: Path) -> None:
    def legacy(c: dict) -> None:
        c.pop("rope_parameters", None)
        c.update(rope_theta=50000.0, rope_scaling={"rope_type": "default"})
    _edit_config(folder, legacy)
    assert load_target(folder).config.rope_theta == 50000.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_verify_compact_decode_match_cpu_without_host_sync(pair) -> None:
    """On CUDA the mask, writes, verify and compaction never wait for the host, and match the CPU."""
    _, cpu_model, path = pair
    model = load_target(path, device="cuda", dtype=torch.float32)
    parents, depths = _tree()
    n = len(parents) + 1
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i - 1]]
    gen = torch.Generator().manual_seed(10)
    prefix = torch.randint(0, VOCAB, (2, 8), generator=gen)
    tokens = torch.randint(0, VOCAB, (2, n), generator=gen)
    tpos = (8 + torch.tensor([0] + depths))[None].expand(2, n)
    src, counts = torch.tensor([[0, 2, 5, 3], [0, 1, 4, 6]]), torch.tensor([3, 4])
    results = []
    for m, dev in ((cpu_model, "cpu"), (model, "cuda")):
        args = [t.to(dev) for t in (prefix, tokens, tpos, anc[None].expand(2, n, n).contiguous(), src, counts)]
        p, t, tp, mask, s, c = args
        ppos = torch.arange(8, device=dev)[None].expand(2, 8)
        cache = m.new_cache(2, 32)
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                m(p, ppos, cache)
                cache.advance(torch.full((2,), 8, device=dev))
                verify, taps = m(t, tp, cache, tree_mask=mask, tap_layers=[0, 1])
                cache.compact(s, c)
                step, _ = m(t[:, :1], cache.lengths[:, None].clone(), cache)
        finally:
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        results.append([x.cpu() for x in (verify, taps, step, cache.lengths)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=0)  # TF32/kernels may differ slightly


def test_row_view_shares_storage_and_bad_hint(pair) -> None:
    _, model, _ = pair
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full, _ = model.forward_train(ids[1:2])
        cache = model.new_cache(3, 16)
        row = cache.rows(1, 2)
        out, _ = model(ids[1:2], torch.arange(5)[None], row, kv_len_hint=5)
        row.advance(torch.tensor([5]))
        assert cache.lengths.tolist() == [0, 5, 0]
        assert cache.k[:, 1, :, :5].abs().sum() > 0 and cache.k[:, [0, 2]].abs().sum() == 0
        with pytest.raises(RequestError, match="kv_len_hint 5 is below the longest row"):
            model(ids[:, :1], torch.zeros(3, 1, dtype=torch.long), cache, kv_len_hint=5)
    torch.testing.assert_close(out, full, atol=F32_ATOL, rtol=0)
