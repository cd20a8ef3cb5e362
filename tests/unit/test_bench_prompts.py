"""Code prompts: exact lengths, distinct, deterministic, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddtree.bench.prompts import code_prompts, default_source_dir
from ddtree.errors import ConfigError


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    source = Path(default_source_dir())
    text = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(source.glob("*.py"))[:3]]
    tok.train_from_iterator(text, trainer=trainer)
    return tok


@pytest.mark.parametrize("context_len", [1, 64, 1000])
def test_exact_length_distinct_deterministic(context_len: int) -> None:
    prompts = code_prompts(byte_encode, context_len, 8)
    assert len(prompts) == 8
    assert all(len(p) == context_len for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    assert code_prompts(byte_encode, context_len, 8) == prompts
    # a longer run starts with the same prompts (stable offsets)
    assert code_prompts(byte_encode, context_len, 10)[:8] == prompts


def test_real_code_with_a_tokenizers_tokenizer(bpe: Tokenizer) -> None:
    prompts = code_prompts(bpe, 256, 4)
    assert [len(p) for p in prompts] == [256] * 4
    assert len({tuple(p) for p in prompts}) == 4
    first_file = sorted(Path(default_source_dir()).glob("*.py"))[0].read_text(encoding="utf-8")
    assert bpe.decode(prompts[0]) in first_file  # cut from the real corpus, in order
    assert max(max(p) for p in prompts) < bpe.get_vocab_size()


def test_source_dir_and_short_corpus(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("y = 2\n" * 10)
    (tmp_path / "a.py").write_text("x = 1\n" * 10)
    prompts = code_prompts(byte_encode, 12, 2, source_dir=tmp_path)
    assert bytes(prompts[0]).decode() == "x = 1\nx = 1\n"  # sorted: a.py first
    # 10 identical windows per file: duplicates are skipped, 2 distinct + separators remain
    with pytest.raises(ConfigError, match=r"context_len x count: .* need 50"):
        code_prompts(byte_encode, 12, 50, source_dir=tmp_path)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        pytest.param((0, 1), "context_len", id="zero-context"),
        pytest.param((8, 0), "count", id="zero-count"),
    ],
)
def test_bad_arguments(args: tuple[int, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        code_prompts(byte_encode, *args)


def test_bad_source_and_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no .py files"):
        code_prompts(byte_encode, 8, 1, source_dir=tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        code_prompts(byte_encode, 8, 1, source_dir=tmp_path / "missing")
    with pytest.raises(ConfigError, match="tokenizer_or_encode"):
        code_prompts(42, 8, 1)
