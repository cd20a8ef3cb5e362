"""Benchmark prompts cut from real code, exactly `context_len` tokens each, deterministic.

The corpus is the sorted .py files of a source directory: `source_dir` when given, else
fixtures/prompts/*.py when that folder has any, else the top level of the Python standard library
(`sysconfig.get_paths()["stdlib"]`). Files are encoded one by one (only as many as needed) and
joined; prompt i is the i-th non-overlapping window of `context_len` tokens, so prompts start at
different offsets and are the same for the same (corpus, tokenizer, context_len, count).
Real code rather than random ids, because acceptance length depends on how predictable the text is.

When the served model's tokenizer is not a tokenizer.json this project can read (Kimi's is
tiktoken-based), `service_encoder(base_url)` tokenizes through the service's own `/tokenize`
(SGLang's TokenizeRequest/TokenizeResponse: `{"prompt": text, "add_special_tokens": false}` ->
`{"tokens": [...], "count": N}`), so the prompts are still exactly `context_len` tokens of the
model that serves them, sent as input_ids.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError, ServiceError

FIXTURE_PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts"
FILE_SEPARATOR = "\n\n"

Encode = Callable[[str], Any]


def default_source_dir() -> Path:
    if FIXTURE_PROMPTS.is_dir() and any(FIXTURE_PROMPTS.glob("*.py")):
        return FIXTURE_PROMPTS
    return Path(sysconfig.get_paths()["stdlib"])


def _encoder(tokenizer_or_encode: Any) -> Callable[[str], list[int]]:
    """A str -> token ids function from a tokenizers.Tokenizer, an HF tokenizer or a callable."""
    encode = getattr(tokenizer_or_encode, "encode", None)
    if encode is not None:
        def call(text: str) -> Any:
            try:  # no BOS/EOS in the middle of a cut prompt
                return encode(text, add_special_tokens=False)
            except TypeError:
                return encode(text)
    elif callable(tokenizer_or_encode):
        call = tokenizer_or_encode
    else:
        raise ConfigError(f"tokenizer_or_encode: {type(tokenizer_or_encode).__name__} has no "
                          "encode() and is not callable; pass a tokenizers.Tokenizer or str -> ids")

    def ids(text: str) -> list[int]:
        out = call(text)
        if hasattr(out, "ids"):  # tokenizers.Encoding
            out = out.ids
        elif isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    return ids


def service_encoder(base_url: str, timeout_s: float = 120.0) -> Callable[[str], list[int]]:
    """str -> token ids through the service's POST /tokenize; each distinct text is asked once."""
    import httpx

    from ddtree.service.base import http_client

    url = base_url.rstrip("/") + "/tokenize"
    cache: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text in cache:
            return cache[text]
        try:
            with http_client(timeout_s) as client:
                response = client.post(url, json={"prompt": text, "add_special_tokens": False})
        except httpx.HTTPError as err:
            raise ServiceError(f"POST {url}: {type(err).__name__}: {err}") from err
        if response.status_code != 200:
            raise ServiceError(f"POST {url} answered {response.status_code}: {response.text[:300]} (the service "
                               "cannot count tokens; give --model-path a folder with a tokenizer.json and "
                               "--tokenize local)")
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) or \
                body.get("count", len(tokens)) != len(tokens):
            raise ServiceError(f"POST {url}: expected {{'tokens': [int, ...], 'count': N}} (SGLang's "
                               f"TokenizeResponse), got {response.text[:300]}")
        cache[text] = tokens
        return tokens

    return encode


def _corpus_tokens(files: list[Path], encode: Callable[[str], list[int]]) -> Iterator[list[int]]:
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield encode(text + FILE_SEPARATOR)


def code_prompts(tokenizer_or_encode: Any, context_len: int, count: int,
                 source_dir: str | Path | None = None) -> list[list[int]]:
    """`count` distinct prompts of exactly `context_len` token ids cut from a code corpus."""
    for name, value in (("context_len", context_len), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: {value!r} must be an integer >= 1")
    root = Path(source_dir) if source_dir is not None else default_source_dir()
    if not root.is_dir():
        raise ConfigError(f"source_dir: {root} is not a directory")
    files = sorted(root.glob("*.py"))
    if not files:
        raise ConfigError(f"source_dir: {root} has no .py files to cut prompts from")
    encode = _encoder(tokenizer_or_encode)

    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    buffer: list[int] = []
    total = 0
    for ids in _corpus_tokens(files, encode):
        buffer.extend(ids)
        total += len(ids)
        while len(buffer) >= context_len and len(prompts) < count:
            window, buffer = buffer[:context_len], buffer[context_len:]
            key = tuple(window)
            if key not in seen:  # repeated boilerplate would make two prompts identical
                seen.add(key)
                prompts.append(window)
        if len(prompts) == count:
            return prompts
    raise ConfigError(
        f"context_len x count: the corpus in {root} ({len(files)} files) has {total} tokens, "
        f"enough for {len(prompts)} distinct prompts of {context_len} tokens; need {count} "
        f"(about {context_len * count} tokens). Lower context_len or count, or pass a larger "
        "source_dir."
    )
