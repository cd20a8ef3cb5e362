"""SGLang's /generate request (GenerateReqInput and SamplingParams of SGLang 0.5.23), parsed into engine Requests.

Every field SGLang defines is known here and falls in one of three kinds:
  implemented   (text, input_ids, sampling_params, stream, rid, return_logprob, ...; the sampling fields below)
  metadata      (log_metrics, custom_labels, routing_key, ...): accepted with any value; they do not change
                what is generated (they steer SGLang's logging, routing and caches, which ddtree does not have)
  no-op only    (lora_path, image_data, penalties, constrained decoding, ...): accepted at SGLang's default
                (the value that does nothing), and a 400 naming the field and "not supported" otherwise.
A field SGLang does not define is a 400 too, so a client that thinks it set something finds out.
`null` means "the default", as in SGLang. A sampling option that the loaded engine's Request cannot carry
yet is no-op only as well (`ENGINE_FIELDS`).

Every problem is a RequestError naming the field (dotted path, e.g. `sampling_params.max_new_tokens`)
and the allowed range, raised before anything is queued. /v1 (ddtree.serving.openai_api) reuses
`SamplingParams`, `check_sampling` and `make_jobs` under its own field names.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ddtree.errors import RequestError
from ddtree.request import Request
from ddtree.text import TextCodec

M = TypeVar("M", bound=BaseModel)

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform for any practical purpose
MAX_N = 64  # parallel samples of one prompt
MAX_STOP_STRINGS = 16
NULL_IS_VALUE = {"max_new_tokens", "max_tokens"}  # null: as many tokens as the context leaves (SGLang's reading)
ENGINE_FIELDS = {f.name for f in dataclasses.fields(Request)}  # what a Request can carry to the engine

# SGLang's SamplingParams fields that ddtree accepts only at the value that does nothing.
SAMPLING_NOOP: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "beam_width": (None, 1),
    "json_schema": (None, ""),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
    "stop_regex": (None, "", []),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
    "watermark": (None, False, {}),
    "spaces_between_special_tokens": (True,),  # tokenizers' decode has no such switch
}

# GenerateReqInput fields that do not change what is generated: any value is accepted.
GENERATE_METADATA = (
    "log_metrics", "no_logs", "custom_labels", "routing_key", "conversation_id", "session_id",
    "received_time", "external_trace_header", "extra_key", "cache_salt", "kv_hints", "http_worker_ipc",
)
# GenerateReqInput fields accepted only at their no-op value (a batch may send a list of them).
GENERATE_NOOP: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "image_data": (None, [], ""),
    "video_data": (None, [], ""),
    "audio_data": (None, [], ""),
    "mm_hashes": (None, []),
    "mm_content_hashes": (None, []),
    "use_audio_in_video": (False,),
    "video_config": (None, {}),
    "watermark": (None, False),
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []),
    "return_sampling_mask": (None, False),
    "sampling_logprobs_mode": (None,),
    "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (False,),
    "return_hidden_states": (False, None),
    "return_routed_experts": (False, None),
    "routed_experts_start_len": (0, None),
    "return_indexer_topk": (False, None),
    "modalities": (None, []),
    "session_params": (None, {}),
    "lora_path": (None, ""),
    "lora_id": (None, ""),
    "custom_logit_processor": (None, ""),
    "positional_embed_overrides": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,),
    "routed_dp_rank": (None, 0),
    "data_parallel_rank": (None, 0),
    "disagg_prefill_dp_rank": (None,),
    "background": (False,),
    "require_reasoning": (False,),
    "max_thinking_tokens": (None,),
    "priority": (None,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "return_prompt_token_ids": (False,),
    "need_wait_for_mm_inputs": (None, False),
    "num_items_assigned": (None,),
    "encoder_urls": (None, []),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,),
    "images_config": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "multi_item_delimiter_indices": (None,),
    "token_indices_to_pool": (None,),
}


class StrictBody(BaseModel):
    # strict: 1.5 is not an int and "5" is not a number; extra fields are caught before this
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingParams(StrictBody):
    """The sampling fields ddtree implements, with SGLang's defaults (temperature 1.0, max_new_tokens 128)."""

    max_new_tokens: int | None = 128  # null: as many as the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    stream_interval: int | None = None  # accepted: ddtree streams after every decode round
    sampling_seed: int | None = None
    seed: int | None = None  # ddtree's older name for sampling_seed


class GenerateBody(StrictBody):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    return_text_in_logprobs: bool = False


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served context and vocabulary, and the text codec."""

    context_length: int
    vocab_size: int
    codec: TextCodec | None = None


@dataclass(frozen=True)
class Output:
    """What the server does with a request's tokens on their way out (text, stop strings, log-probs)."""

    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: int = 0  # stop strings only count from here on, as stop tokens do in the engine
    logprobs: bool = False
    text_in_logprobs: bool = False


@dataclass(frozen=True)
class Job:
    """One validated sequence to generate, ready for the scheduler."""

    request: Request
    stream: bool
    output: Output = Output()
    prompt_index: int = 0  # which prompt of the body (a batch, or /v1's prompt list)
    sample_index: int = 0  # which of its n samples


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)  # ~5x json's speed on a body of 1024 token ids
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and json reads (NaN, integers past 64 bits) gets json's answer and field errors
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise RequestError(f"body: malformed JSON ({err})", field="body") from err
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object", field="body")
    return body


def split_known(
    data: dict[str, Any], model: type[BaseModel], where: str, *, noop: dict[str, tuple[Any, ...]],
    metadata: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`data` reduced to `model`'s fields: no-op fields checked and dropped, metadata dropped, anything else a 400."""
    prefix = f"{where}." if where else ""
    kept: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key in model.model_fields:
            kept[key] = value
        elif key in noop:
            check_noop(f"{prefix}{key}", value, noop[key])
        elif key not in metadata:
            unknown.append(key)
    if unknown:
        unknown.sort()
        raise RequestError(
            f"{prefix}{unknown[0]}: unknown field(s) {unknown}; allowed: {sorted([*model.model_fields, *noop, *metadata])}",
            field=f"{prefix}{unknown[0]}",
        )
    return kept


def check_noop(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """A field ddtree does not implement: fine at its no-op value (or a batch's list of them), else a 400."""
    values = value if isinstance(value, list) and value and [] not in allowed else [value]
    if all(_is_one_of(v, allowed) for v in values):
        return
    shown = " or ".join(json.dumps(a) for a in allowed)
    raise RequestError(f"{field}: {value!r} is not supported by ddtree (accepted only at {shown})", field=field)


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    # type-exact: 0 is not False, 1.0 is accepted for 1
    return any(value == a and (type(value) is type(a) or {type(value), type(a)} <= {int, float}) for a in allowed)


def validate(model: type[M], data: dict[str, Any], where: str = "") -> M:
    """`data` as `model`; `null` fields take their defaults (as SGLang's do). Raises RequestError naming the field."""
    data = {k: v for k, v in data.items() if v is not None or model.model_fields[k].default is None or k in NULL_IS_VALUE}
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        # loc is (field, [union member tag], [list index]...): keep the field, drop tags and indices
        loc = [str(p) for p in first["loc"]]
        field = ".".join(([where] if where else []) + loc[:1])
        raise RequestError(f"{field}: {first['msg']} (got {first.get('input')!r})", field=field) from err


def parse_sampling(data: dict[str, Any], where: str = "sampling_params") -> SamplingParams:
    if not isinstance(data, dict):
        raise RequestError(f"{where}: expected a JSON object", field=where)
    key = tuple((k, type(v), v) for k, v in data.items())  # type-exact: 0, 0.0 and false are not one key
    try:
        return _known_sampling(where, key)
    except TypeError:  # unhashable (a list of stops, a dict): not kept
        return _parse_sampling(data, where)


@functools.lru_cache(maxsize=256)
def _known_sampling(where: str, key: tuple[tuple[str, type, Any], ...]) -> SamplingParams:
    """The SamplingParams of sampling fields seen before, kept (they are only read): a client sends the same
    ones again and again, and their split and pydantic's validation cost ~20-30 us a request after an idle
    gap. Errors are not kept (lru_cache keeps results only)."""
    return _parse_sampling({k: v for k, _, v in key}, where)


def _parse_sampling(data: dict[str, Any], where: str) -> SamplingParams:
    return validate(SamplingParams, split_known(data, SamplingParams, where, noop=SAMPLING_NOOP), where)


def seed_of(params: SamplingParams) -> int | None:
    return params.sampling_seed if params.sampling_seed is not None else params.seed


def stops_of(params: SamplingParams) -> tuple[str, ...]:
    stop = params.stop
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def check_sampling(
    params: SamplingParams, limits: Limits, prompt_len: int, *, prompt_field: str, names: dict[str, str]
) -> int:
    """Range checks; returns max_new_tokens resolved against the context. `names` maps our field names to the
    caller's (max_tokens for /v1)."""

    def name(key: str) -> str:
        return names.get(key, f"sampling_params.{key}")

    def bad(key: str, why: str) -> RequestError:
        return RequestError(f"{name(key)}: {why}", field=name(key))

    ctx = limits.context_length
    if prompt_len >= ctx:
        raise RequestError(
            f"{prompt_field}: the prompt has {prompt_len} tokens; the context length is {ctx} "
            "(prompt + max_new_tokens must fit)",
            field=prompt_field,
        )
    max_new = params.max_new_tokens if params.max_new_tokens is not None else ctx - prompt_len
    if not 1 <= max_new <= ctx:
        raise bad("max_new_tokens", f"{max_new} is out of range (allowed 1..{ctx}, the context length)")
    if prompt_len + max_new > ctx:
        raise bad(
            "max_new_tokens",
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = {prompt_len + max_new} exceeds the "
            f"context length {ctx}; allowed max_new_tokens 1..{ctx - prompt_len}",
        )
    t = params.temperature
    if not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
        raise bad("temperature", f"{t} is out of range (allowed 0..{MAX_TEMPERATURE}; 0 = greedy)")
    for key in ("sampling_seed", "seed"):
        value = getattr(params, key)
        if value is not None and not 0 <= value <= MAX_SEED:
            raise bad(key, f"{value} is out of range (allowed 0..2**63-1)")
    if not (math.isfinite(params.top_p) and 0.0 < params.top_p <= 1.0):
        raise bad("top_p", f"{params.top_p} is out of range (allowed (0, 1]; 1 = off)")
    if not (params.top_k == -1 or params.top_k >= 1):
        raise bad("top_k", f"{params.top_k} is out of range (allowed -1 = off, or >= 1)")
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        raise bad("min_p", f"{params.min_p} is out of range (allowed [0, 1]; 0 = off)")
    if not 0 <= params.min_new_tokens <= max_new:
        raise bad("min_new_tokens", f"{params.min_new_tokens} is out of range (allowed 0..max_new_tokens = {max_new})")
    if not 1 <= params.n <= MAX_N:
        raise bad("n", f"{params.n} is out of range (allowed 1..{MAX_N})")
    if params.stream_interval is not None and params.stream_interval < 1:
        raise bad("stream_interval", f"{params.stream_interval} is out of range (allowed >= 1)")
    stops = stops_of(params)
    if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
        raise bad("stop", f"up to {MAX_STOP_STRINGS} non-empty strings (got {list(stops)!r})")
    if stops and limits.codec is None:
        raise bad("stop", "stop strings need the model folder's tokenizer.json (use stop_token_ids instead)")
    for token in params.stop_token_ids or []:
        if not 0 <= token < limits.vocab_size:
            raise bad("stop_token_ids", f"token id {token} is outside the vocabulary (allowed 0..{limits.vocab_size - 1})")
    engine_side = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0}
    for key, off in engine_side.items():
        if getattr(params, key) != off and key not in ENGINE_FIELDS:
            raise bad(key, f"{getattr(params, key)!r} is not supported by this engine (accepted only at {off})")
    return max_new


def tokenize(text: str | None, ids: list[int] | None, limits: Limits, field: str) -> list[int]:
    if ids is not None:
        if not ids:
            raise RequestError(f"{field}: empty prompt (need at least 1 token)", field=field)
        if min(ids) < 0 or max(ids) >= limits.vocab_size:  # builtins: a 1024-id prompt in C, not a Python loop
            token = next(t for t in ids if not 0 <= t < limits.vocab_size)
            raise RequestError(
                f"{field}: token id {token} is outside the vocabulary (allowed 0..{limits.vocab_size - 1})",
                field=field,
            )
        return ids  # make_jobs copies it into each Request
    assert text is not None
    if text == "":
        raise RequestError(f"{field}: empty prompt", field=field)
    if limits.codec is None:
        raise RequestError(f"{field}: this model folder has no tokenizer.json; send input_ids instead", field=field)
    tokens = limits.codec.encode(text)
    if not tokens:
        raise RequestError(f"{field}: the text encodes to no tokens", field=field)
    return tokens


def _rid_source() -> None:
    global _rid_prefix, _rid_count
    _rid_prefix, _rid_count = os.urandom(8).hex(), itertools.count()


_rid_prefix, _rid_count = "", itertools.count()
_rid_source()
os.register_at_fork(after_in_child=_rid_source)  # a forked process draws its own prefix


def new_rid() -> str:
    """A request id unique to this process: 32 hex digits like SGLang's uuid4().hex, a random prefix drawn once
    per process and a counter. uuid4 costs ~3 us warm and ~40-50 us in a request after an idle gap (a getrandom
    call and UUID's Python); this ~0.6 and ~11-16."""
    return f"{_rid_prefix}{next(_rid_count):016x}"


def make_jobs(
    rid: str, prompt_index: int, tokens: list[int], params: SamplingParams, limits: Limits, *, stream: bool,
    prompt_field: str, names: dict[str, str], logprobs: bool = False, text_in_logprobs: bool = False,
) -> list[Job]:
    """The n jobs of one prompt. With n > 1 sample i gets rid `{rid}-{i}` and seed `seed + i` (when seeded)."""
    max_new = check_sampling(params, limits, len(tokens), prompt_field=prompt_field, names=names)
    output = Output(stops_of(params), params.no_stop_trim, params.skip_special_tokens, params.min_new_tokens,
                    logprobs, text_in_logprobs)
    seed = seed_of(params)
    jobs = []
    for i in range(params.n):
        fields: dict[str, Any] = dict(
            request_id=rid if params.n == 1 else f"{rid}-{i}",
            prompt_ids=list(tokens),
            max_new_tokens=max_new,
            temperature=float(params.temperature),
            seed=None if seed is None else (seed + i) % (MAX_SEED + 1),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            top_p=float(params.top_p),
            top_k=params.top_k,
            min_p=float(params.min_p),
            min_new_tokens=params.min_new_tokens,
            return_logprob=logprobs,
        )
        request = Request(**{k: v for k, v in fields.items() if k in ENGINE_FIELDS})
        jobs.append(Job(request, stream, output, prompt_index, i))
    return jobs


def parse_generate(body: dict[str, Any], limits: Limits) -> tuple[list[Job], bool]:
    """The jobs of one /generate body and whether the answer is a list (a batch, or n > 1)."""
    parsed = validate(GenerateBody, split_known(body, GenerateBody, "", noop=GENERATE_NOOP, metadata=GENERATE_METADATA))
    if parsed.text is None and parsed.input_ids is None:
        raise RequestError("text: missing prompt; send text or input_ids", field="text")
    if parsed.text is not None and parsed.input_ids is not None:
        raise RequestError("input_ids: send text or input_ids, not both", field="input_ids")
    field = "text" if parsed.text is not None else "input_ids"
    prompts: list[tuple[str | None, list[int] | None]]
    if isinstance(parsed.text, list):
        prompts, batched = [(t, None) for t in parsed.text], True
    elif isinstance(parsed.text, str):
        prompts, batched = [(parsed.text, None)], False
    elif parsed.input_ids and isinstance(parsed.input_ids[0], list):
        prompts, batched = [(None, ids) for ids in parsed.input_ids], True  # type: ignore[misc]
    else:
        prompts, batched = [(None, parsed.input_ids or [])], False  # type: ignore[list-item]
    if batched and not prompts:
        raise RequestError(f"{field}: empty batch", field=field)
    count = len(prompts)
    rids = _per_prompt("rid", parsed.rid, count, batched)
    if isinstance(parsed.rid, str) and batched:
        rids = [f"{parsed.rid}-{i}" for i in range(count)]  # SGLang: a string is the batch's id prefix
    if len({r for r in rids if r is not None}) != len([r for r in rids if r is not None]):
        raise RequestError("rid: duplicate rids in one batch", field="rid")
    raw_params = _per_prompt("sampling_params", parsed.sampling_params, count, batched)
    logprobs = _per_prompt("return_logprob", parsed.return_logprob, count, batched)
    jobs: list[Job] = []
    for i, ((text, ids), rid) in enumerate(zip(prompts, rids, strict=True)):
        where = "sampling_params" if not isinstance(parsed.sampling_params, list) else f"sampling_params.{i}"
        params = parse_sampling(raw_params[i] or {}, where)
        if bool(logprobs[i]) and "return_logprob" not in ENGINE_FIELDS:
            raise RequestError("return_logprob: true is not supported by this engine (accepted only at false)",
                               field="return_logprob")
        tokens = tokenize(text, ids, limits, field)
        names = {} if where == "sampling_params" else {k: f"{where}.{k}" for k in SamplingParams.model_fields}
        jobs.extend(make_jobs(rid or new_rid(), i, tokens, params, limits, stream=parsed.stream, prompt_field=field,
                              names=names, logprobs=bool(logprobs[i]), text_in_logprobs=parsed.return_text_in_logprobs))
    return jobs, batched or len(jobs) > 1


def _per_prompt(field: str, value: Any, count: int, batched: bool) -> list[Any]:
    """A field given once for the body or as a list with one entry per prompt (a batch)."""
    if isinstance(value, list) and batched:
        if len(value) != count:
            raise RequestError(f"{field}: {len(value)} entries for {count} prompts", field=field)
        return list(value)
    if isinstance(value, list):
        raise RequestError(f"{field}: a list is for a batch of prompts; this body has one", field=field)
    return [value] * count
