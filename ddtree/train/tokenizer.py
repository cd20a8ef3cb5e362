"""The fixture tokenizer: a byte-level BPE trained on the corpus, lossless on any text.

Byte-level pre-tokenizer and decoder, no normalizer, the 256 byte symbols always in the
alphabet: decode(encode(text)) == text for every string (no unknown token exists). Special
tokens: <|endoftext|> = 0 (document separator, eos/bos) and <|mask|> = 1 (the DFlash drafter's
mask token).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddtree.errors import ConfigError
from ddtree.train.corpus import SPECIAL_TOKENS, read_documents

MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials plus every byte
MAX_VOCAB = 65_536  # token arrays are uint16


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # use_regex splits words/digits/whitespace runs (GPT-2 style); add_prefix_space would
    # insert a byte that decode cannot remove, so it stays off
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (fewer only if merges run out)."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"vocab_size: {vocab_size} is outside [{MIN_VOCAB}, {MAX_VOCAB}]")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:  # the trainer places specials first; check, never assume
            raise ConfigError(f"tokenizer: special token {special!r} got id {tok.token_to_id(special)}, want {i}")
    return tok


def train_corpus_tokenizer(corpus_dir: str | Path, out_file: str | Path, vocab_size: int = 4096) -> Tokenizer:
    """Train on the corpus's training documents (each once) and save tokenizer.json."""
    docs = [d for d in read_documents(corpus_dir) if d.split == "train"]
    tok = train_tokenizer((d.text for d in docs), vocab_size=vocab_size)
    save_tokenizer(tok, out_file)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"tokenizer: {path} is missing; run `ddtree train tokenizer` first")
    return Tokenizer.from_file(str(path))
