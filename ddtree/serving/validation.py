"""Request bodies of /generate and /v1/completions: parsed, type-checked and range-checked into engine Requests.

Every problem is a RequestError naming the field (dotted path, e.g. `sampling_params.max_new_tokens`)
and the allowed range, raised before anything is queued. Unknown fields are rejected, not ignored,
so a client that thinks it set something finds out.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ddtree.engine import Request
from ddtree.errors import RequestError
from ddtree.text import TextCodec

M = TypeVar("M", bound=BaseModel)

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform for any practical purpose


class _Strict(BaseModel):
    # strict: 1.5 is not an int and "5" is not a number; extra fields are caught before this
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingParams(_Strict):
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    top_p: float = 1.0  # accepted only at its no-op value
    top_k: int = -1  # accepted only at its no-op value


class GenerateBody(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | list[str] | None = None


class CompletionBody(_Strict):
    model: str | None = None
    prompt: str | list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0  # OpenAI's default
    seed: int | None = None
    stream: bool = False
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    user: str | None = None


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served context and vocabulary, and the text codec."""

    context_length: int
    vocab_size: int
    codec: TextCodec | None = None


@dataclass(frozen=True)
class Job:
    """One validated prompt, ready for the scheduler."""

    request: Request
    stream: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"body: malformed JSON ({err})", field="body") from err
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object", field="body")
    return body


def _check_known(data: dict[str, Any], model: type[BaseModel], where: str) -> None:
    allowed = list(model.model_fields)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        prefix = f"{where}." if where else ""
        raise RequestError(
            f"{prefix}{unknown[0]}: unknown field(s) {unknown}; allowed: {allowed}",
            field=f"{prefix}{unknown[0]}",
        )


def _validate(model: type[M], data: dict[str, Any], where: str = "") -> M:
    _check_known(data, model, where)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        # loc is (field, [union member tag], [list index]...): keep the field, drop tags and indices
        loc = [str(p) for p in first["loc"]]
        field = ".".join(([where] if where else []) + loc[:1])
        raise RequestError(f"{field}: {first['msg']} (got {first.get('input')!r})", field=field) from err


def check_sampling(
    params: SamplingParams, limits: Limits, prompt_len: int, *, prompt_field: str, names: dict[str, str]
) -> None:
    """Range checks; `names` maps our field names to the caller's (max_tokens for /v1)."""

    def name(key: str) -> str:
        return names.get(key, f"sampling_params.{key}")

    ctx = limits.context_length
    if not 1 <= params.max_new_tokens <= ctx:
        raise RequestError(
            f"{name('max_new_tokens')}: {params.max_new_tokens} is out of range (allowed 1..{ctx}, the context length)",
            field=name("max_new_tokens"),
        )
    if prompt_len >= ctx:
        raise RequestError(
            f"{prompt_field}: the prompt has {prompt_len} tokens; the context length is {ctx} "
            "(prompt + max_new_tokens must fit)",
            field=prompt_field,
        )
    if prompt_len + params.max_new_tokens > ctx:
        raise RequestError(
            f"{name('max_new_tokens')}: prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) "
            f"= {prompt_len + params.max_new_tokens} exceeds the context length {ctx}; "
            f"allowed max_new_tokens 1..{ctx - prompt_len}",
            field=name("max_new_tokens"),
        )
    t = params.temperature
    if not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
        raise RequestError(
            f"{name('temperature')}: {t} is out of range (allowed 0..{MAX_TEMPERATURE}; 0 = greedy)",
            field=name("temperature"),
        )
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise RequestError(f"{name('seed')}: {params.seed} is out of range (allowed 0..2**63-1)", field=name("seed"))
    if params.top_p != 1.0:
        raise RequestError(f"{name('top_p')}: {params.top_p} is unsupported (only 1.0 is accepted)", field=name("top_p"))
    if params.top_k != -1:
        raise RequestError(f"{name('top_k')}: {params.top_k} is unsupported (only -1 is accepted)", field=name("top_k"))
    for token in params.stop_token_ids or []:
        if not 0 <= token < limits.vocab_size:
            raise RequestError(
                f"{name('stop_token_ids')}: token id {token} is outside the vocabulary (allowed 0..{limits.vocab_size - 1})",
                field=name("stop_token_ids"),
            )


def _tokenize(text: str | None, ids: list[int] | None, limits: Limits, field: str) -> list[int]:
    if ids is not None:
        if not ids:
            raise RequestError(f"{field}: empty prompt (need at least 1 token)", field=field)
        for token in ids:
            if not 0 <= token < limits.vocab_size:
                raise RequestError(
                    f"{field}: token id {token} is outside the vocabulary (allowed 0..{limits.vocab_size - 1})",
                    field=field,
                )
        return list(ids)
    assert text is not None
    if text == "":
        raise RequestError(f"{field}: empty prompt", field=field)
    if limits.codec is None:
        raise RequestError(f"{field}: this model folder has no tokenizer.json; send input_ids instead", field=field)
    tokens = limits.codec.encode(text)
    if not tokens:
        raise RequestError(f"{field}: the text encodes to no tokens", field=field)
    return tokens


def new_rid() -> str:
    return uuid.uuid4().hex


def parse_generate(body: dict[str, Any], limits: Limits) -> tuple[list[Job], bool]:
    """The jobs of one /generate body and whether the caller sent a batch (then it gets a list back)."""
    parsed = _validate(GenerateBody, body)
    if parsed.text is None and parsed.input_ids is None:
        raise RequestError("text: missing prompt; send text or input_ids", field="text")
    if parsed.text is not None and parsed.input_ids is not None:
        raise RequestError("input_ids: send text or input_ids, not both", field="input_ids")
    params = _validate(SamplingParams, parsed.sampling_params or {}, "sampling_params")
    field = "text" if parsed.text is not None else "input_ids"
    prompts: list[tuple[str | None, list[int] | None]]
    if isinstance(parsed.text, list):
        prompts, batched = [(t, None) for t in parsed.text], True
    elif isinstance(parsed.text, str):
        prompts, batched = [(parsed.text, None)], False
    elif parsed.input_ids and isinstance(parsed.input_ids[0], list):
        prompts, batched = [(None, list(ids)) for ids in parsed.input_ids], True  # type: ignore[arg-type]
    else:
        prompts, batched = [(None, list(parsed.input_ids or []))], False  # type: ignore[arg-type]
    if batched and not prompts:
        raise RequestError(f"{field}: empty batch", field=field)
    if batched and parsed.stream:
        raise RequestError("stream: streaming takes a single prompt, not a batch", field="stream")
    rids = parsed.rid if isinstance(parsed.rid, list) else [parsed.rid] * len(prompts)
    if isinstance(parsed.rid, str) and batched:
        raise RequestError("rid: a batch needs a list of rids, one per prompt", field="rid")
    if len(rids) != len(prompts):
        raise RequestError(f"rid: {len(rids)} rids for {len(prompts)} prompts", field="rid")
    if len({r for r in rids if r is not None}) != len([r for r in rids if r is not None]):
        raise RequestError("rid: duplicate rids in one batch", field="rid")
    jobs = []
    for (text, ids), rid in zip(prompts, rids, strict=True):
        tokens = _tokenize(text, ids, limits, field)
        check_sampling(params, limits, len(tokens), prompt_field=field, names={})
        jobs.append(Job(_request(rid or new_rid(), tokens, params), parsed.stream))
    return jobs, batched


def _request(rid: str, tokens: list[int], params: SamplingParams) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=tokens,
        max_new_tokens=params.max_new_tokens,
        temperature=float(params.temperature),
        seed=params.seed,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
    )


COMPLETION_NAMES = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "seed": "seed",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop_token_ids": "stop_token_ids",
}


def parse_completion(body: dict[str, Any], limits: Limits) -> tuple[Job, CompletionBody]:
    parsed = _validate(CompletionBody, body)
    if parsed.prompt is None:
        raise RequestError("prompt: missing prompt (a string or a list of token ids)", field="prompt")
    if parsed.n != 1:
        raise RequestError(f"n: {parsed.n} is unsupported (only 1 is accepted)", field="n")
    text, ids = (parsed.prompt, None) if isinstance(parsed.prompt, str) else (None, parsed.prompt)
    tokens = _tokenize(text, ids, limits, "prompt")
    params = SamplingParams(
        max_new_tokens=parsed.max_tokens,
        temperature=parsed.temperature,
        ignore_eos=parsed.ignore_eos,
        seed=parsed.seed,
        stop_token_ids=parsed.stop_token_ids,
        top_p=parsed.top_p,
        top_k=parsed.top_k,
    )
    check_sampling(params, limits, len(tokens), prompt_field="prompt", names=COMPLETION_NAMES)
    return Job(_request("cmpl-" + new_rid(), tokens, params), parsed.stream), parsed
