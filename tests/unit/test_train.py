"""Tests for ddtree.train: corpus, tokenizer, target and drafter training, the CLI (CPU, tiny sizes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

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
    DrafterShape,
    block_labels,
    draft_loss,
    position_weights,
    sample_anchors,
    train_drafter,
)
from ddtree.train.loop import BatchSampler, TrainOptions
from ddtree.train.target import TargetShape, train_target
from ddtree.train.tokenizer import (
    load_tokenizer,
    train_corpus_tokenizer,
    train_tokenizer,
)

TINY_TARGET = TargetShape(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, intermediate_size=128, max_position_embeddings=512)
TINY_DRAFTER = DrafterShape(num_hidden_layers=1, block_size=4, window=32, num_anchors=8, gamma=4.0)


def tiny_opts(**kw: object) -> TrainOptions:
    base: dict[str, object] = {"steps": 40, "batch_size": 4, "seq_len": 64, "lr": 1e-2, "warmup_steps": 5,
                               "log_every": 10, "eval_batches": 2, "seed": 0}
    base.update(kw)
    return TrainOptions(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny: one thread is fastest, and on a loaded 2-core CI box extra threads spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def test_gate_file_comments_fallback_and_unknown_ids(tmp_path: Path) -> None:
    problems = humaneval_problems()
    f = tmp_path / "gate.txt"
    f.write_text("# the gate\nHumanEval/3\n\nHumanEval/5  # inline comment\nHumanEval/3\n")
    assert read_gate_ids(f, problems) == ["HumanEval/3", "HumanEval/5"]
    assert read_gate_ids(tmp_path / "absent.txt", problems) == [f"HumanEval/{i}" for i in range(24)]
    f.write_text("HumanEval/9999\n")
    with pytest.raises(ConfigError, match="gate_file"):
        read_gate_ids(f, problems)


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
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16" and cfg["eos_token_id"] == EOT_ID
    assert model.config.num_hidden_layers == 6 and model.config.vocab_size == 300
    card = (target_dir / "README.md").read_text()
    assert GATE_STATEMENT in card and "gate problems are in the training data on purpose" in card
    assert "held-out loss" in card and (target_dir / "tokenizer.json").exists()


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
