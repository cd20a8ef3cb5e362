"""Held-out prompts for the acceptance bench: which files, which windows, from which stdlib copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddtree.bench.prompts import code_prompts
from ddtree.profiling.acceptance import heldout_files, heldout_prompts, main
from ddtree.text import load_tokenizer

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A target folder whose card holds out two files, and a stdlib copy holding them."""
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(FIXTURE_TARGET / "tokenizer.json", target / "tokenizer.json")
    (target / "README.md").write_text("# card\n\n- Held out for acceptance (3 names, one missing): a/long.py, short.py, gone.py\n")
    root = tmp_path / "stdlib"
    (root / "a").mkdir(parents=True)
    (root / "a" / "long.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200)))
    (root / "short.py").write_text("import os\nprint(os.getcwd())\n")
    return target, root


def test_files_resolve_against_the_named_root_and_skip_missing_ones(pair: tuple[Path, Path]) -> None:
    target, root = pair
    assert heldout_files(target, root) == [root / "a" / "long.py", root / "short.py"]


def test_per_file_takes_the_next_non_overlapping_windows(pair: tuple[Path, Path]) -> None:
    target, root = pair
    ids = load_tokenizer(target).encode((root / "a" / "long.py").read_text())  # type: ignore[union-attr]
    ctx = 100
    assert len(ids) > 3 * ctx + 1
    one = heldout_prompts(target, 1, ctx, root)
    assert one == [ids[:ctx]]
    three = heldout_prompts(target, 3, ctx, root, per_file=3)
    assert three == [ids[:ctx], ids[ctx : 2 * ctx], ids[2 * ctx : 3 * ctx]]
    with pytest.raises(SystemExit, match="only 1 held-out prompts"):
        heldout_prompts(target, 2, ctx, root)  # the short file has fewer than ctx tokens
    with pytest.raises(SystemExit, match="--per-file"):
        heldout_prompts(target, 1, ctx, root, per_file=0)


def test_source_dir_cuts_the_prompts_from_that_folder(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """--source-dir: the prompts are code_prompts' windows of that folder, not the card's files; a folder with too
    little code is refused before any model loads."""
    import argparse

    import ddtree.profiling.acceptance as acc

    target, root = pair
    args = argparse.Namespace(target=target, source_dir=root / "a", context=50, prompts=2)
    assert acc.source_prompts(args) == code_prompts(load_tokenizer(target), 50, 2, root / "a")

    class Loaded(Exception):
        pass

    def loaded(*_: object, **__: object) -> None:
        raise Loaded

    def card(*_: object, **__: object) -> None:
        raise AssertionError("the card's held-out files were read")

    monkeypatch.setattr(acc.Engine, "from_pretrained", loaded)
    monkeypatch.setattr(acc, "heldout_prompts", card)
    with pytest.raises(Loaded):  # the prompts were cut, then the model would load
        main(["--target", str(target), "--source-dir", str(root / "a"), "--prompts", "2", "--context", "50"])
    with pytest.raises(SystemExit, match="--source-dir: context_len x count"):
        main(["--target", str(target), "--source-dir", str(root), "--prompts", "5", "--context", "50"])


def test_greedy_confidence_is_the_targets_own_probability_of_its_ar_tokens() -> None:
    """The AR row's greedy_p: the target's softmax at each generated position, read back from a plain forward
    over prompt + output, agrees with what the engine's log-probs summarize."""
    import torch

    from ddtree.config import Algorithm, SpecConfig
    from ddtree.engine import Engine
    from ddtree.models.loading import load_target
    from ddtree.profiling.acceptance import greedy_confidence, measure

    assert greedy_confidence([0.0, -1.0, -0.01]) == pytest.approx(
        {"median": 0.99005, "mean": (1 + 0.36788 + 0.99005) / 3, "share_over_0.9": 2 / 3}, rel=1e-4)
    drafter = FIXTURE_TARGET.parent / "drafter"
    engine = Engine.from_pretrained(FIXTURE_TARGET, drafter, device="cpu")
    codec = load_tokenizer(FIXTURE_TARGET)
    prompts = [codec.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"),  # type: ignore[union-attr]
               codec.encode("import os\n\nfor name in os.listdir('.'):\n")]  # type: ignore[union-attr]
    row = measure(engine, prompts, SpecConfig(algorithm=Algorithm.NONE), 12, 2, logprobs=True)
    target = load_target(FIXTURE_TARGET, device="cpu", dtype=torch.float32)
    probs = []
    for prompt, out in zip(prompts, row["outputs"], strict=True):
        with torch.no_grad():
            logits, _ = target.forward_train(torch.tensor([prompt + out]))
        p = logits[0, len(prompt) - 1 : -1].softmax(-1)
        assert p.argmax(-1).tolist() == out  # greedy
        probs += p.max(-1).values.tolist()
    expected = torch.tensor(probs, dtype=torch.float64)
    assert row["greedy_p"]["mean"] == pytest.approx(expected.mean().item(), abs=1e-4)
    assert row["greedy_p"]["median"] == pytest.approx(expected.median().item(), abs=1e-4)
