"""Tests for ddtree.train: corpus, tokenizer, target and drafter training, the CLI (CPU, tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ddtree.errors import ConfigError
from ddtree.train.card import GATE_STATEMENT
from ddtree.train.cli import main
from ddtree.train.corpus import (
    EOT_ID,
    MASK_ID,
    CorpusSpec,
    build_corpus,
    encode_corpus,
    humaneval_problems,
    is_heldout,
    iter_stdlib_files,
    load_tokens,
    read_documents,
    read_gate_ids,
    stdlib_root,
)
from ddtree.train.drafter import (
    DraftBatch,
    DrafterShape,
    block_labels,
    draft_loss,
    drafter_step,
    position_weights,
    sample_anchors,
    sample_anchors_between,
    target_labels,
    train_drafter,
)
from ddtree.train.loop import BatchSampler, TrainOptions
from ddtree.train.rollouts import RolloutRows, Rollouts, RolloutSpec, make_rollouts
from ddtree.train.target import TargetShape, train_target
from ddtree.train.tokenizer import (
    load_tokenizer,
    train_corpus_tokenizer,
    train_tokenizer,
)

TINY_TARGET = TargetShape(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, intermediate_size=128, max_position_embeddings=512)
TINY_DRAFTER = DrafterShape(num_hidden_layers=1, block_size=4, window=32, num_anchors=8, gamma=4.0)

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"


def tiny_opts(**kw: object) -> TrainOptions:
    base: dict[str, object] = {"steps": 40, "batch_size": 4, "seq_len": 64, "lr": 1e-2, "warmup_steps": 5,
                               "log_every": 10, "eval_batches": 2, "seed": 0}
    base.update(kw)
    return TrainOptions(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tokenized corpus: 30 stdlib files (25% held out), HumanEval, gate problems x4."""
    out = tmp_path_factory.mktemp("data")
    build_corpus(out, CorpusSpec(max_stdlib_files=30, heldout_percent=25.0, gate_repeat=4))
    train_corpus_tokenizer(out, out / "tokenizer.json", vocab_size=300)
    encode_corpus(out)
    return out


@pytest.fixture(scope="module")
def target_dir(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("target")
    train_target(data_dir, out, tiny_opts(), TINY_TARGET, command="test")
    return out


# -- corpus ------------------------------------------------------------------------------------

def test_corpus_manifest_lists_heldout_gate_and_counts(data_dir: Path) -> None:
    m = json.loads((data_dir / "manifest.json").read_text())
    held = [f["path"] for f in m["stdlib_files"] if f["split"] == "heldout"]
    assert held and m["heldout_files"] == held
    assert all(is_heldout(p, 25.0) for p in held)
    assert m["gate_ids"] and m["gate_repeat"] == 4
    n_train_stdlib = len(m["stdlib_files"]) - len(held)
    assert m["train_documents"] == n_train_stdlib + m["humaneval_problems"] + 3 * len(m["gate_ids"])
    assert m["heldout_documents"] == len(held)


def test_token_arrays_are_uint16_with_one_eot_per_document(data_dir: Path) -> None:
    m = json.loads((data_dir / "manifest.json").read_text())
    train, held = load_tokens(data_dir, "train"), load_tokens(data_dir, "heldout")
    assert train.dtype == np.uint16 and held.dtype == np.uint16
    assert train[0] == EOT_ID and held[0] == EOT_ID
    assert int((np.asarray(train) == EOT_ID).sum()) == m["train_documents"]
    assert int((np.asarray(held) == EOT_ID).sum()) == m["heldout_documents"]
    assert int(train.max()) < m["vocab_size"]


def test_corpus_is_deterministic(tmp_path: Path) -> None:
    spec = CorpusSpec(max_stdlib_files=5, heldout_percent=50.0)
    a, b = build_corpus(tmp_path / "a", spec), build_corpus(tmp_path / "b", spec)
    assert a == b
    assert (tmp_path / "a" / "documents.jsonl").read_bytes() == (tmp_path / "b" / "documents.jsonl").read_bytes()


def test_heldout_share_is_close_to_the_percent() -> None:
    share = sum(is_heldout(f"pkg/mod_{i}.py", 3.0) for i in range(20_000)) / 20_000
    assert 0.025 < share < 0.035, f"held-out share {share:.4f}, expected ~0.03"


def test_stdlib_files_are_sorted_small_and_utf8() -> None:
    rels = []
    for rel, text in iter_stdlib_files(stdlib_root(), 200_000):
        rels.append(rel)
        assert len(text.encode()) <= 200_000
        if len(rels) == 50:
            break
    assert rels == sorted(rels) and not any("site-packages" in r for r in rels)


def test_gate_file_comments_and_unknown_ids(tmp_path: Path) -> None:
    problems = humaneval_problems()
    f = tmp_path / "gate.txt"
    f.write_text("# the gate\nHumanEval/3\n\nHumanEval/5  # inline comment\n")
    assert read_gate_ids(f, problems) == ["HumanEval/3", "HumanEval/5"]
    f.write_text("HumanEval/9999\n")
    with pytest.raises(ConfigError, match="gate_file: .*gate.txt: unknown HumanEval task ids"):
        read_gate_ids(f, problems)


def test_a_missing_gate_file_is_an_error_naming_it_not_a_guess(tmp_path: Path) -> None:
    """The corpus repeats exactly the coding gate's problems; other ids would train for a gate that is not run."""
    with pytest.raises(ConfigError, match="gate_file: gate problems: .*absent.txt not found.*restore it"):
        read_gate_ids(tmp_path / "absent.txt", humaneval_problems())


def test_humaneval_documents_keep_prompt_and_solution_apart(data_dir: Path) -> None:
    docs = {d.name: d for d in read_documents(data_dir)}
    first = humaneval_problems()[0]
    doc = docs[f"humaneval/{first['task_id']}"]
    assert doc.parts == [first["prompt"], first["canonical_solution"]]


# -- tokenizer ---------------------------------------------------------------------------------

def test_tokenizer_round_trip_is_exact(data_dir: Path) -> None:
    tok = load_tokenizer(data_dir / "tokenizer.json")
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id("<|endoftext|>") == EOT_ID and tok.token_to_id("<|mask|>") == MASK_ID
    texts = [d.text for d in read_documents(data_dir)[:40]]
    texts += ["\tx = 'héllo wörld ✓ 🐍'\r\n\x0c  trailing  \n", "", " leading space", "\x00\x7f bytes"]
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_tokenizer_rejects_vocab_below_the_byte_alphabet() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(["x = 1"], vocab_size=100)


# -- training pieces ---------------------------------------------------------------------------

def test_sampler_aligned_windows_start_at_a_document_boundary() -> None:
    tokens = np.array([0, 5, 6, 7, 0, 8, 9, 0, 3, 4, 5, 6, 7, 8], dtype=np.uint16)
    sampler = BatchSampler(tokens, seq_len=4, doc_start_prob=1.0, seed=0)
    batch = sampler.sample(64)
    assert batch.shape == (64, 4)
    eots = set(np.flatnonzero(tokens == 0).tolist())
    for row in batch.tolist():
        starts = [s for s in range(len(tokens) - 3) if tokens[s : s + 4].tolist() == row]
        assert any(s in eots or s - 1 in eots for s in starts), row


def test_anchors_labels_and_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(3, 20, 8, 4, gen)
    assert anchors.shape == (3, 8)
    assert int(anchors.min()) >= 1 and int(anchors.max()) <= 20 - 4
    assert all(len(set(r)) == 8 for r in anchors.tolist())
    ids = torch.arange(100, 120)[None].expand(3, -1)
    labels = block_labels(ids, anchors, 4)
    assert torch.equal(labels, 100 + anchors[:, :, None] + torch.arange(1, 4))
    w = position_weights(4, 4.0, torch.device("cpu"))
    assert torch.allclose(w, torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 4))
    # a perfect prediction at every position costs ~0; a wrong one at k=1 costs more than at k=3
    logits = torch.full((1, 1, 3, 10), -30.0)
    lab = torch.tensor([[[1, 2, 3]]])
    logits[0, 0, torch.arange(3), lab[0, 0]] = 30.0
    assert float(draft_loss(logits, lab, w)) < 1e-6
    miss1, miss3 = logits.clone(), logits.clone()
    miss1[0, 0, 0] = miss1[0, 0, 0].roll(1)
    miss3[0, 0, 2] = miss3[0, 0, 2].roll(1)
    assert float(draft_loss(miss1, lab, w)) > float(draft_loss(miss3, lab, w))


@pytest.mark.parametrize(
    ("field", "value"),
    [pytest.param("lr", -1.0, id="negative-lr"), pytest.param("steps", 0, id="zero-steps"),
     pytest.param("device", "tpu", id="unknown-device"), pytest.param("time_budget_s", 0.0, id="zero-budget")],
)
def test_train_options_name_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny_opts(**{field: value})


# -- end to end --------------------------------------------------------------------------------

def test_target_trains_saves_and_loads(target_dir: Path) -> None:
    from ddtree.models import load_target

    log = json.loads((target_dir / "train_log.json").read_text())
    first, last = np.mean(log["losses"][:3]), np.mean(log["losses"][-3:])
    # uniform over 300 tokens is ln(300) = 5.70; unigram statistics alone get well below 5
    assert last < first - 0.5, f"loss {first:.3f} -> {last:.3f} did not drop by 0.5"
    assert log["final_heldout_loss"] is not None and log["steps"] == 40
    model = load_target(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32" and cfg["eos_token_id"] == EOT_ID
    assert model.config.num_hidden_layers == 6 and model.config.vocab_size == 300
    stored = load_file(str(target_dir / "model.safetensors"))  # stored small, run in float32
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    card = (target_dir / "README.md").read_text()
    assert GATE_STATEMENT in card and "gate problems are in the training data on purpose" in card
    assert "held-out loss" in card and (target_dir / "tokenizer.json").exists()
    # a retrained target keeps the committed fixture's chat template (the chat endpoint and gate use it)
    written = json.loads((target_dir / "tokenizer_config.json").read_text())
    committed = json.loads((FIXTURE_TARGET / "tokenizer_config.json").read_text())
    assert written["chat_template"] == committed["chat_template"] and "Chat template" in card


def test_drafter_trains_saves_and_loads(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    from ddtree.models import load_drafter, load_target

    out = tmp_path / "drafter"
    summary = train_drafter(data_dir, target_dir, out, tiny_opts(steps=30), TINY_DRAFTER, command="test")
    first, last = np.mean(summary["losses"][:3]), np.mean(summary["losses"][-3:])
    assert last < first - 0.5, f"drafter loss {first:.3f} -> {last:.3f} did not drop by 0.5"
    target = load_target(target_dir)
    drafter = load_drafter(out, target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID and cfg["block_size"] == 4
    assert drafter.config.target_layer_ids == tuple(summary["shape"]["target_layer_ids"])
    assert len(summary["heldout"]["accuracy_per_position"]) == 3
    card = (out / "README.md").read_text()
    assert GATE_STATEMENT in card and "accuracy per block position" in card
    assert (out / "tokenizer.json").read_bytes() == (data_dir / "tokenizer.json").read_bytes()


def test_drafter_init_from_target_copies_the_last_layers(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    from ddtree.models import load_target

    shape = DrafterShape(num_hidden_layers=1, block_size=4, window=32, num_anchors=8, init="target")
    summary = train_drafter(data_dir, target_dir, tmp_path / "d", tiny_opts(steps=1, eval_batches=0), shape)
    assert summary["init_copied_target_layers"] == [5]
    assert load_target(target_dir).config.num_hidden_layers == 6


def test_drafter_card_says_fine_tuned_when_started_from_a_drafter(data_dir: Path, target_dir: Path,
                                                                  tmp_path: Path) -> None:
    from dataclasses import replace

    train_drafter(data_dir, target_dir, tmp_path / "a", tiny_opts(steps=1, eval_batches=0), TINY_DRAFTER)
    assert "trained from scratch" in (tmp_path / "a" / "README.md").read_text()
    shape = replace(TINY_DRAFTER, init_from=str(tmp_path / "a"))
    train_drafter(data_dir, target_dir, tmp_path / "b", tiny_opts(steps=1, eval_batches=0), shape)
    card = (tmp_path / "b" / "README.md").read_text()
    assert "trained from scratch" not in card and f"fine-tuned from the drafter in `{tmp_path / 'a'}`" in card


def assert_same_drafts(target: Any, want: Any, want_taps: list[int], got: Any, got_taps: list[int],
                       block_size: int) -> None:
    """`got` drafts what `want` does on the same ids and anchors, each fed the target's taps it reads."""
    ids = torch.randint(2, target.config.vocab_size, (2, 40))
    anchors = torch.tensor([[3, 17], [9, 30]])
    with torch.no_grad():
        _, taps_want = target.forward_train(ids, want_taps)
        _, taps_got = target.forward_train(ids, got_taps)
        expected = want.forward_train(taps_want, ids, anchors, block_size, 32)
        actual = got.forward_train(taps_got, ids, anchors, block_size, 32)
    assert torch.allclose(actual, expected, atol=1e-5)


def test_a_grown_drafter_starts_out_computing_what_the_smaller_one_does(data_dir: Path, target_dir: Path,
                                                                         tmp_path: Path) -> None:
    from dataclasses import replace

    from ddtree.models import init_drafter, load_drafter, load_target
    from ddtree.train.drafter_init import init_from_drafter

    train_drafter(data_dir, target_dir, tmp_path / "a", tiny_opts(steps=1, eval_batches=0), TINY_DRAFTER)
    target = load_target(target_dir)
    small = load_drafter(tmp_path / "a", target, dtype=torch.float32)
    # same taps as the small one; two more layers and block 8
    shape = replace(TINY_DRAFTER, num_hidden_layers=3, block_size=8, target_layer_ids=small.config.target_layer_ids)
    big = init_drafter(shape.config(target.config), target, seed=1).to(torch.float32)
    assert init_from_drafter(big, small, "a") == [1, 2]
    taps = list(small.config.target_layer_ids)
    assert_same_drafts(target, small, taps, big, taps, 8)
    assert big.layers[2].mlp.down_proj.weight.abs().sum() == 0 and big.layers[2].mlp.up_proj.weight.abs().sum() > 0
    # fewer layers, or another tap set, do not fit
    with pytest.raises(ConfigError, match="init_from: a does not fit.*fewer"):
        init_from_drafter(small, big, "a")
    other = init_drafter(replace(TINY_DRAFTER, target_layer_ids=(0,)).config(target.config), target, seed=1)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        init_from_drafter(other.to(torch.float32), small, "a")
    # through train_drafter, the card says which layers were added
    summary = train_drafter(data_dir, target_dir, tmp_path / "b", tiny_opts(steps=1, eval_batches=0),
                            replace(shape, init_from=str(tmp_path / "a")))
    assert summary["init_grown_layers"] == [1, 2]
    assert "layers [1, 2] added" in (tmp_path / "b" / "README.md").read_text()


def test_a_drafter_given_more_taps_starts_out_computing_what_it_did(data_dir: Path, target_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Taps [t0] -> [t1, t0]: t0's fusion columns move to its new place, t1's start at zero, so the outputs
    are unchanged; a tap set that drops one of start's taps does not fit."""
    from dataclasses import replace

    from ddtree.models import init_drafter, load_drafter, load_target
    from ddtree.train.drafter_init import init_from_drafter

    target = load_target(target_dir)
    layers = target.config.num_hidden_layers
    assert layers >= 2
    old, extra = layers - 1, 0
    train_drafter(data_dir, target_dir, tmp_path / "a", tiny_opts(steps=1, eval_batches=0),
                  replace(TINY_DRAFTER, target_layer_ids=(old,)))
    small = load_drafter(tmp_path / "a", target, dtype=torch.float32)
    wide = init_drafter(replace(TINY_DRAFTER, target_layer_ids=(extra, old)).config(target.config), target,
                        seed=1).to(torch.float32)
    assert init_from_drafter(wide, small, "a") == []
    d = target.config.hidden_size
    assert wide.fc.weight[:, :d].abs().sum() == 0 and torch.equal(wide.fc.weight[:, d:], small.fc.weight)
    assert_same_drafts(target, small, [old], wide, [extra, old], TINY_DRAFTER.block_size)
    with pytest.raises(ConfigError, match=r"target_layer_ids \[0, .*\] -> \[.*\] \(drops \[0\]\)"):
        init_from_drafter(small, wide, "a")
    summary = train_drafter(data_dir, target_dir, tmp_path / "b", tiny_opts(steps=1, eval_batches=0),
                            replace(TINY_DRAFTER, target_layer_ids=(extra, old), init_from=str(tmp_path / "a")))
    assert summary["init_added_taps"] == [extra]
    assert f"target layers [{extra}] added to the taps" in (tmp_path / "b" / "README.md").read_text()


def test_a_drafter_with_wider_mlps_starts_out_computing_what_the_narrower_one_does(data_dir: Path, target_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """intermediate_size I -> 3 I: start's units keep their weights, the new units' down-projection columns start at
    zero (their gate and up rows random), so the outputs are unchanged; a narrower MLP does not fit."""
    from dataclasses import replace

    from ddtree.models import init_drafter, load_drafter, load_target
    from ddtree.train.drafter_init import init_from_drafter

    train_drafter(data_dir, target_dir, tmp_path / "a", tiny_opts(steps=1, eval_batches=0), TINY_DRAFTER)
    target = load_target(target_dir)
    small = load_drafter(tmp_path / "a", target, dtype=torch.float32)
    width = small.config.intermediate_size
    shape = replace(TINY_DRAFTER, intermediate_size=3 * width, target_layer_ids=small.config.target_layer_ids)
    wide = init_drafter(shape.config(target.config), target, seed=1).to(torch.float32)
    assert init_from_drafter(wide, small, "a") == []
    mlp = wide.layers[0].mlp
    assert mlp.down_proj.weight.shape[1] == 3 * width and mlp.down_proj.weight[:, width:].abs().sum() == 0
    assert mlp.up_proj.weight[width:].abs().sum() > 0
    assert torch.equal(mlp.gate_proj.weight[:width], small.layers[0].mlp.gate_proj.weight)
    taps = list(small.config.target_layer_ids)
    assert_same_drafts(target, small, taps, wide, taps, TINY_DRAFTER.block_size)
    with pytest.raises(ConfigError, match=r"intermediate_size \d+ -> \d+ \(narrower\)"):
        init_from_drafter(small, wide, "a")
    summary = train_drafter(data_dir, target_dir, tmp_path / "b", tiny_opts(steps=1, eval_batches=0),
                            replace(shape, init_from=str(tmp_path / "a")))
    assert json.loads((tmp_path / "b" / "config.json").read_text())["intermediate_size"] == 3 * width
    assert summary["steps"] == 1


def test_soft_loss_is_the_kl_to_the_targets_distribution_at_each_block_position() -> None:
    from ddtree.train.drafter import soft_loss

    gen = torch.Generator().manual_seed(0)
    t_logits = torch.randn(2, 20, 11, generator=gen)
    anchors = torch.tensor([[2, 9], [0, 12]])
    idx = anchors[:, :, None] + torch.arange(3)  # positions anchor + k - 1, k = 1..3
    same = torch.stack([t_logits[b, idx[b]] for b in range(2)])  # [2, 2, 3, 11]
    w = position_weights(4, 4.0, torch.device("cpu"))
    assert float(soft_loss(same, t_logits, anchors, w)) == pytest.approx(0.0, abs=1e-6)
    off = same.clone()
    off[1, 0, 2] = torch.randn(11, generator=gen)
    p, q = torch.log_softmax(same[1, 0, 2], -1), torch.log_softmax(off[1, 0, 2], -1)
    want = float((p.exp() * (p - q)).sum() * w[2] / (w.sum() * 4))
    assert float(soft_loss(off, t_logits, anchors, w)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ConfigError, match="soft_weight"):
        DrafterShape(soft_weight=1.5)


def test_drafter_trains_with_a_soft_share_and_says_so(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    summary = train_drafter(data_dir, target_dir, tmp_path / "s", tiny_opts(steps=2, eval_batches=0),
                            replace(TINY_DRAFTER, soft_weight=0.5))
    assert summary["shape"]["soft_weight"] == 0.5 and all(np.isfinite(summary["losses"]))
    assert "the other 0.5 is KL from the target's whole distribution" in (tmp_path / "s" / "README.md").read_text()


def test_time_budget_stops_early_and_still_saves(data_dir: Path, tmp_path: Path) -> None:
    opts = tiny_opts(steps=1_000_000, time_budget_s=1.0, eval_batches=1)
    summary = train_target(data_dir, tmp_path / "t", opts, TINY_TARGET)
    assert 0 < summary["steps"] < 1_000_000 and summary["train_time_s"] < 5
    assert (tmp_path / "t" / "model.safetensors").exists()


def test_cli_reports_missing_data_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["target", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--steps", "1"])
    assert rc == 2
    assert "data:" in capsys.readouterr().err


def test_cli_corpus_then_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    assert main(["corpus", "--out", str(data), "--vocab-size", "280", "--max-stdlib-files", "4",
                 "--heldout-percent", "50", "--gate-repeat", "2"]) == 0
    assert main(["target", "--data", str(data), "--out", str(tmp_path / "t"), "--steps", "3", "--batch-size", "2",
                 "--seq-len", "32", "--hidden-size", "32", "--heads", "1", "--kv-heads", "1", "--head-dim", "32",
                 "--intermediate-size", "64", "--log-every", "1", "--eval-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "[corpus]" in out and "step 3/3" in out and "eta" in out
    assert json.loads((tmp_path / "t" / "train_log.json").read_text())["command"].startswith("ddtree train target")


# -- self-distillation: rollouts, anchors in the generated part, target labels ------------------

@pytest.fixture(scope="module")
def rollouts_dir(data_dir: Path, target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rollouts")
    spec = RolloutSpec(num=6, prompt_len_min=4, prompt_len_max=40, gen_len=12, batch_size=4, seed=3)
    make_rollouts(data_dir, target_dir, out, spec, command="test")
    return out


def test_rollouts_are_the_targets_greedy_continuations(data_dir: Path, target_dir: Path, rollouts_dir: Path) -> None:
    from ddtree.config import SpecConfig
    from ddtree.engine import Engine
    from ddtree.models import load_target

    r = Rollouts.load(rollouts_dir)
    info = json.loads((rollouts_dir / "rollouts.json").read_text())
    assert len(r) == 6 == info["sequences"] and r.tokens.dtype == np.uint16
    assert r.gen_lens.tolist() == [12] * 6 and all(4 <= p <= 40 for p in r.prompt_lens.tolist())
    train = np.asarray(load_tokens(data_dir, "train"))
    target = load_target(target_dir)
    engine = Engine(target)
    for i in (0, 5):
        seq = r.sequence(i).astype(np.int64)
        p = int(r.prompt_lens[i])
        prompt = seq[:p]
        # the prompt is a window of the training array
        assert any(np.array_equal(train[s : s + p], prompt) for s in np.flatnonzero(train == prompt[0]))
        alone = engine.generate(prompt.tolist(), 12, spec=SpecConfig(algorithm="NONE"), ignore_eos=True)
        assert alone.token_ids == seq[p:].tolist()  # type: ignore[union-attr]
    # and independently of the engine: each generated token is the argmax given everything before it
    seq = torch.from_numpy(r.sequence(1).astype(np.int64))[None]
    p = int(r.prompt_lens[1])
    with torch.no_grad():
        logits, _ = target.forward_train(seq)
    assert torch.equal(logits[0, p - 1 : -1].argmax(-1), seq[0, p:])


def test_greedy_continue_prefills_in_chunks_and_row_groups_exactly(target_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ddtree.train.rollouts as rollouts_mod
    from ddtree.models import load_target

    target = load_target(target_dir)
    ids = torch.randint(2, target.config.vocab_size, (5, 50), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(rollouts_mod, "PREFILL_ELEMENTS", 2 * 16 * (50 + 6))  # 2 rows a prefill forward
    out = rollouts_mod.greedy_continue(target, ids, 6, chunk=16)  # 4 chunks, the last one short
    with torch.no_grad():
        logits, _ = target.forward_train(torch.cat([ids, out], 1))
    assert out.shape == (5, 6) and torch.equal(logits[:, 49:-1].argmax(-1), out)


def test_greedy_continue_with_ragged_prompts_is_each_prompt_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right-padded rows of other lengths (the last token of some in an earlier prefill chunk, row groups of
    two): every row continues exactly as its own prompt does alone. The committed fixture target, whose
    continuations depend on their context (the module's briefly trained one says much the same everywhere)."""
    import ddtree.train.rollouts as rollouts_mod
    from ddtree.models import load_target

    target = load_target(FIXTURE_TARGET)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([50, 7, 33, 16, 17])
    ids = torch.randint(2, target.config.vocab_size, (5, 50), generator=gen)
    padded = ids.clone()
    for row, n in enumerate(lengths.tolist()):
        padded[row, n:] = 0
    monkeypatch.setattr(rollouts_mod, "PREFILL_ELEMENTS", 2 * 16 * (50 + 6))
    out = rollouts_mod.greedy_continue(target, padded, 6, chunk=16, lengths=lengths)
    alone = [rollouts_mod.greedy_continue(target, ids[row : row + 1, :n], 6)[0] for row, n in enumerate(lengths.tolist())]
    assert len({tuple(a.tolist()) for a in alone}) == 5, "the prompts should not all continue alike"
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(out[row], alone[row]), f"row {row} (prompt of {n})"


def test_rollouts_with_a_length_per_sequence(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    spec = RolloutSpec(num=12, prompt_len_min=4, prompt_len_max=40, gen_len=8, batch_size=4, seed=5,
                       prompt_lengths="per-sequence")
    summary = make_rollouts(data_dir, target_dir, tmp_path, spec)
    r = Rollouts.load(tmp_path)
    lens = r.prompt_lens.tolist()
    assert len(r) == 12 == summary["sequences"] and len(set(lens)) > 3  # more lengths than the 3 batches
    assert all(4 <= n <= 40 for n in lens) and r.gen_lens.tolist() == [8] * 12
    train = np.asarray(load_tokens(data_dir, "train"))
    from ddtree.models import load_target

    target = load_target(target_dir)
    for i in range(12):
        seq, n = r.sequence(i).astype(np.int64), lens[i]
        assert any(np.array_equal(train[s : s + n], seq[:n]) for s in np.flatnonzero(train == seq[0]))
        with torch.no_grad():
            logits, _ = target.forward_train(torch.from_numpy(seq)[None])
        assert torch.equal(logits[0, n - 1 : -1].argmax(-1), torch.from_numpy(seq[n:])), f"sequence {i}"


def test_rollouts_time_budget_saves_what_exists(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    spec = RolloutSpec(num=10_000, prompt_len_min=4, prompt_len_max=8, gen_len=4, batch_size=2, time_budget_s=0.5)
    summary = make_rollouts(data_dir, target_dir, tmp_path, spec)
    assert summary["stopped_early"] and 0 < summary["sequences"] < 10_000
    assert len(Rollouts.load(tmp_path)) == summary["sequences"]


@pytest.mark.parametrize(("field", "kw"), [("gen_len", {"gen_len": 0}), ("prompt_len_max", {"prompt_len_max": 2}),
                                           ("num", {"num": 0}), ("prompt_lengths", {"prompt_lengths": "random"})])
def test_rollout_spec_names_the_bad_field(field: str, kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=field):
        RolloutSpec(prompt_len_min=4, **kw)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=6),
    seq_len=st.integers(9, 40),
    block=st.integers(2, 8),
    num_anchors=st.integers(1, 16),
    seed=st.integers(0, 1000),
)
def test_rollout_anchors_keep_every_label_in_the_generated_part(
    lens: list[tuple[int, int]], seq_len: int, block: int, num_anchors: int, seed: int
) -> None:
    # token = 1000 + index in its sequence for the prompt, 2000 + index for the generated part
    prompts = [[1000 + j for j in range(p)] for p, _ in lens]
    gens = [[2000 + p + j for j in range(g)] for p, g in lens]
    r = Rollouts.from_lists(prompts, gens)
    try:
        rows = RolloutRows(r, seq_len, block, seed)
    except ConfigError:
        assert all(min(p + g, seq_len) - block < max(1, p - max(0, p + g - seq_len) - 1) for p, g in lens)
        return
    ids, lo, hi = rows.sample(5)
    anchors = sample_anchors_between(lo, hi, seq_len, num_anchors, torch.Generator().manual_seed(seed))
    for b in range(5):
        row, a = ids[b].tolist(), anchors[b].tolist()
        assert len(set(a)) == len(a) and a == sorted(a) and min(a) >= 1
        for x in a:
            # the anchor is the last prompt token or a generated one; every label a+1..a+block-1 is generated
            assert row[x] >= 1000 and (row[x] >= 2000 or x + 1 < seq_len and row[x + 1] >= 2000)
            assert all(row[x + k] >= 2000 for k in range(1, block))
            # the row is the sequence's tail, so position x's context is that sequence's own past
            assert row[x] - row[0] == x or row[0] >= 2000 or row[x] >= 2000


def test_target_labels_are_argmax_at_anchor_plus_k_minus_1() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 20, 11, generator=gen)
    anchors = torch.tensor([[1, 5, 12], [3, 4, 16]])
    labels = target_labels(logits, anchors, 4)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            for k in range(1, 4):
                assert int(labels[b, i, k - 1]) == int(logits[b, a + k - 1].argmax())


def test_drafter_step_labels_by_target_except_own_rows(target_dir: Path) -> None:
    from ddtree.models import init_drafter, load_target

    target = load_target(target_dir)
    drafter = init_drafter(TINY_DRAFTER.config(target.config), target, seed=0)
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    w = position_weights(4, 4.0, torch.device("cpu"))
    batch = DraftBatch(ids, torch.tensor([10, 1]), torch.tensor([20, 20]), torch.tensor([True, False]))
    with torch.no_grad():
        _, _, labels = drafter_step(drafter, target, batch, TINY_DRAFTER, torch.Generator().manual_seed(2), w, "target")
        _, _, data = drafter_step(drafter, target, batch, TINY_DRAFTER, torch.Generator().manual_seed(2), w, "data")
        t_logits, _ = target.forward_train(ids)
    anchors_row0 = labels[0, :, 0]  # row 0 keeps its own tokens
    assert torch.equal(labels[0], data[0]) and anchors_row0.shape[0] == min(8, 11)
    pred = t_logits.argmax(-1)
    assert not torch.equal(labels[1], data[1])  # a random-token row: the target disagrees with the data
    # row 1 labels are target argmaxes at anchor + k - 1: recover anchors from data labels
    for i in range(labels.shape[1]):
        matches = [a for a in range(1, 21) if torch.equal(ids[1, a + 1 : a + 4], data[1, i])]
        assert any(torch.equal(pred[1, a : a + 3], labels[1, i]) for a in matches)
    with pytest.raises(ConfigError, match="label"):
        drafter_step(drafter, target, ids, TINY_DRAFTER, torch.Generator(), w, "teacher")


def test_distill_cli_writes_a_loadable_drafter_with_a_card(
    data_dir: Path, target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddtree.models import load_drafter, load_target

    out = tmp_path / "distill"
    rc = main(["distill", "--data", str(data_dir), "--target", str(target_dir), "--out", str(out), "--num", "8",
               "--prompt-len-min", "8", "--prompt-len-max", "40", "--gen-len", "24", "--rollout-batch-size", "4",
               "--steps", "6", "--batch-size", "4", "--log-every", "2", "--eval-batches", "1", "--draft-layers", "1",
               "--block-size", "4", "--window", "32", "--num-anchors", "8", "--rollout-share", "0.5"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "[rollouts] saved 8 sequences" in text and "labels: target; 2/4 rows from 8 rollout sequences" in text
    log = json.loads((out / "drafter" / "train_log.json").read_text())
    assert log["label"] == "target" and log["rollouts"]["sequences"] == 8 and log["rollouts"]["gen_len"] == 24
    assert log["options"]["seq_len"] == 64 and log["steps"] == 6
    assert "vs_target" in log["heldout"]
    load_drafter(out / "drafter", load_target(target_dir))
    card = (out / "drafter" / "README.md").read_text()
    assert "greedy" in card and "8 sequences" in card and "24 generated tokens each" in card
    assert "the target's own argmax" in card and "share 0.5" in card
    lo, hi = log["rollouts"]["prompt_len_range"]
    assert 8 <= lo <= hi <= 40 and f"prompts of {lo}..{hi} tokens" in card


def test_drafter_with_data_labels_and_no_rollouts_keeps_the_old_card(data_dir: Path, target_dir: Path,
                                                                    tmp_path: Path) -> None:
    summary = train_drafter(data_dir, target_dir, tmp_path / "d", tiny_opts(steps=2, eval_batches=1), TINY_DRAFTER,
                            label="data")
    assert summary["label"] == "data" and summary["rollouts"] is None
    card = (tmp_path / "d" / "README.md").read_text()
    assert "the data's token anchor + k" in card and "corpus windows only" in card
    with pytest.raises(ConfigError, match="rollout_share"):
        train_drafter(data_dir, target_dir, tmp_path / "e", tiny_opts(steps=1), TINY_DRAFTER, rollout_share=1.5)


def test_rollouts_cli_draws_a_prompt_length_per_sequence(data_dir: Path, target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    rc = main(["rollouts", "--data", str(data_dir), "--target", str(target_dir), "--out", str(out), "--num", "8",
               "--prompt-len-min", "4", "--prompt-len-max", "40", "--gen-len", "4", "--batch-size", "4",
               "--prompt-lengths", "per-sequence"])
    assert rc == 0
    info = json.loads((out / "rollouts.json").read_text())
    assert info["spec"]["prompt_lengths"] == "per-sequence" and info["sequences"] == 8
    assert len(set(Rollouts.load(out).prompt_lens.tolist())) > 2  # 2 batches, more lengths
