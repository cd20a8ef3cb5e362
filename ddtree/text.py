"""Text <-> token ids for the server: a model folder's tokenizer.json through the `tokenizers` library.

The folder's tokenizer_config.json (when there is one) adds what transformers reads from it: the chat
template and the special tokens' text (bos_token, eos_token, ...) that the template refers to.

The engine works on token ids only; this module is the one place that knows about text. A model
folder without a tokenizer.json (e.g. a random test model) has no codec: the server then accepts
`input_ids` only and answers with empty `text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders

from ddtree.errors import ModelLoadError

TOKENIZER_FILE = "tokenizer.json"


class TextCodec:
    """Encode prompts and decode outputs with one `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, path: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.path = path
        # decode(a + b) == decode(a) + decode(b) wherever decode(a) ends on a whole character: a lone byte-level
        # decoder (GPT-2's, Llama 3's, Qwen's) maps every token to its bytes and all the bytes to text at once.
        # Not so for one that treats the first token apart (Metaspace drops its leading space).
        self.concatenative = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens follows the tokenizer's own post-processor (a BOS if it declares one); a rendered
        # chat template already holds its special tokens, so chat encodes without them (as transformers does)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


class IncrementalDecoder:
    """The text of a growing list of ids, decoding only its newest tokens.

    Decoding the whole output again for every streamed chunk costs O(n) a chunk, O(n^2) a stream. Here the
    text is extended by decode(window) - decode(window without the new ids), where the window starts at the
    ids confirmed last time: decoders that treat a sequence's first token specially (a leading space) see the
    same start in both decodes, and bytes of a character not yet complete (U+FFFD) wait for the next ids.
    `text` is therefore the text of `ids[:confirmed]`; `whole(ids)` is the exact text of all of them (it may
    differ where a tokenizer's decoder is not local: then it decodes the whole list).

    concatenative: the decoder's text of a + b is a's and b's wherever a's ends on a whole character
    (TextCodec.concatenative): then only the new ids are decoded, once, and `whole` decodes only those not yet
    confirmed.
    """

    def __init__(self, decode: Callable[[list[int]], str], concatenative: bool = False) -> None:
        self._decode = decode
        self.concatenative = concatenative
        self.text = ""
        self.confirmed = 0  # ids spelled by `text`
        self._window = 0  # where the next decode starts

    def extend(self, ids: Sequence[int]) -> str:
        if len(ids) > self.confirmed:
            if self.concatenative:
                new = self._decode(list(ids[self.confirmed:]))
                if new and not new.endswith("\ufffd"):
                    self.text += new
                    self.confirmed = len(ids)
                return self.text
            known = self._decode(list(ids[self._window:self.confirmed]))
            longer = self._decode(list(ids[self._window:]))
            if len(longer) > len(known) and not longer.endswith("\ufffd"):
                self.text += longer[len(known):]
                self._window, self.confirmed = self.confirmed, len(ids)
        return self.text

    def whole(self, ids: Sequence[int]) -> str:
        """The exact text of `ids` (the ids given to `extend`, and maybe more); `text` stays as it was."""
        if self.concatenative and len(ids) >= self.confirmed:
            return self.text + self._decode(list(ids[self.confirmed:])) if len(ids) > self.confirmed else self.text
        return self._decode(list(ids))


def load_tokenizer(model_dir: str | Path) -> TextCodec | None:
    """The codec of `model_dir/tokenizer.json`, or None when the folder has no tokenizer file."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TextCodec(Tokenizer.from_file(str(path)), str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"tokenizer: cannot read {path}: {err}") from err
