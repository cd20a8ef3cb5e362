"""IncrementalDecoder against a full decode: for any ids and any way they arrive, its text is the full text
of the ids it has confirmed, a prefix of the whole text, and the whole text once the last character is complete.
Checked on the fixture's byte-level BPE (multi-byte characters split across tokens, special tokens) and on a
Metaspace decoder (the first token's leading space dropped); on the byte-level one also as a concatenative
decoder (only new ids decoded) and `whole`, the exact text of any ids that extend the ones seen."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from ddtree.text import IncrementalDecoder, TextCodec, load_tokenizer

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"
CODEC = load_tokenizer(FIXTURE)
assert CODEC is not None

METASPACE_VOCAB = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "x": 3, "\u2581": 4, "\u2581\u00e9t\u00e9": 5}
METASPACE = Tokenizer(models.WordLevel(METASPACE_VOCAB, unk_token="<unk>"))
METASPACE.decoder = decoders.Metaspace()


def _arrive(decode, ids: list[int], cuts: list[int], concatenative: bool = False) -> IncrementalDecoder:
    dec = IncrementalDecoder(decode, concatenative)
    at, i = 0, 0
    while at < len(ids):
        at = min(len(ids), at + cuts[i % len(cuts)])
        i += 1
        text = dec.extend(ids[:at])
        assert text == decode(ids[: dec.confirmed])  # the text of what it has confirmed
    return dec


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, CODEC.vocab_size - 1), max_size=80), st.lists(st.integers(1, 7), min_size=1, max_size=9),
       st.booleans(), st.booleans(), st.integers(0, 3))
def test_byte_level_bpe_text_grows_as_the_full_decode(ids: list[int], cuts: list[int], skip: bool,
                                                      concatenative: bool, more: int) -> None:
    def decode(x: list[int]) -> str:
        return CODEC.decode(x, skip_special_tokens=skip)

    dec = _arrive(decode, ids, cuts, concatenative)
    full = decode(ids)
    assert full.startswith(dec.text)
    if not full.endswith("\ufffd"):
        assert dec.text == full
    assert dec.whole(ids) == full  # exact, whether or not the last character was complete
    longer = ids + [(7 * i + 11) % CODEC.vocab_size for i in range(more)]  # ids it has not seen
    assert dec.whole(longer) == decode(longer)
    assert dec.whole(ids[:-1]) == decode(ids[:-1])  # fewer than it confirmed: decoded anew


def test_a_byte_level_codec_is_concatenative_and_a_metaspace_one_is_not() -> None:
    assert CODEC.concatenative
    assert not TextCodec(METASPACE).concatenative


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(METASPACE_VOCAB) - 1), max_size=30), st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_a_decoder_that_drops_the_first_space_is_decoded_from_the_same_start(ids: list[int], cuts: list[int]) -> None:
    dec = _arrive(METASPACE.decode, ids, cuts)
    assert dec.text == METASPACE.decode(ids)
    assert dec.whole(ids + [1]) == METASPACE.decode(ids + [1])


def test_a_character_split_across_tokens_waits_for_its_last_byte() -> None:
    ids = CODEC.encode("caf\u00e9 \u00fcber \U0001f600", add_special_tokens=False)
    dec = IncrementalDecoder(CODEC.decode)
    seen = [dec.extend(ids[:n]) for n in range(1, len(ids) + 1)]
    assert all("\ufffd" not in t for t in seen)
    assert seen[-1] == "caf\u00e9 \u00fcber \U0001f600"
