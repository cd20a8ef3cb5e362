"""The OpenAI API as SGLang 0.5.23 serves it: /v1/completions, /v1/chat/completions, /v1/models.

Request fields are SGLang's CompletionRequest / ChatCompletionRequest (which hold OpenAI's and SGLang's
own), sorted as in validation.py: implemented; metadata (any value; e.g. `user`); no-op only (a 400
naming the field unless at its default). `n` samples per prompt, `stop`, `logprobs` (the target's
log-prob of each token, when the engine reports them), `stream` with `stream_options.include_usage`,
and `usage` in every final answer. Chat renders the model folder's chat template (ddtree.serving.chat);
a folder without one answers chat with a 400.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ddtree.errors import RequestError
from ddtree.serving.chat import TemplateError, load_chat_template
from ddtree.serving.replies import FastJSONResponse, Reply, collect, follow_all, sse, sse_response, submit_all
from ddtree.serving.state import ServerState
from ddtree.serving.validation import (
    ENGINE_FIELDS,
    Job,
    Limits,
    SamplingParams,
    StrictBody,
    make_jobs,
    new_rid,
    split_known,
    tokenize,
    validate,
)

# Fields both requests share and ddtree takes only at their no-op value.
COMMON_NOOP: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "json_schema": (None, ""),
    "stop_regex": (None, "", []),
    "lora_path": (None, ""),
    "session_params": (None, {}),
    "custom_params": (None, {}),
    "custom_logit_processor": (None, ""),
    "watermark": (None, False, {}),
    "images_config": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "priority": (None,),
    "data_parallel_rank": (None, 0),
}
COMMON_METADATA = ("user", "session_id", "custom_labels", "extra_key", "cache_salt", "return_spec_tokens_details",
                   "return_cached_tokens_details")
COMPLETION_NOOP = {**COMMON_NOOP, "echo": (False,), "suffix": (None, "")}
CHAT_NOOP = {
    **COMMON_NOOP,
    "tools": (None, []),
    "tool_choice": ("none", "auto", None),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "thinking": (None,),
    "task": (None,),
    "continue_final_message": (False,),
    "return_prompt_token_ids": (False,),
    "return_meta_info": (False,),
    "return_input_ids_in_sglext": (False,),
    "return_output_ids_in_sglext": (False,),
    "return_sampling_mask": (False,),
    "sampling_logprobs_mode": (None,),
    "return_flat_raw_output_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (True, False),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "use_audio_in_video": (False,),
    "video_config": (None, {}),
    "input_ids": (None,),
}
CHAT_METADATA = (*COMMON_METADATA, "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                 "parallel_tool_calls", "separate_reasoning", "stream_reasoning")


class StreamOptions(StrictBody):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage on every chunk


class _Sampling(StrictBody):
    """The sampling fields of both requests (OpenAI's names: max_tokens, min_tokens, seed)."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | list[str] | None = None
    return_token_ids: bool = False

    def sampling(self, max_new_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, min_new_tokens=self.min_tokens, n=self.n, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, no_stop_trim=self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens, sampling_seed=self.seed,
        )


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


NAMES = {  # our sampling field -> the /v1 field that sets it
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed", "seed": "seed",
    **{k: k for k in ("temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids")},
}


def _stream_options(body: _Sampling) -> StreamOptions:
    if body.stream_options is None:
        return StreamOptions()
    if not body.stream:
        raise RequestError("stream_options: only allowed with stream: true", field="stream_options")
    data = split_known(body.stream_options, StreamOptions, "stream_options", noop={})
    return validate(StreamOptions, data, "stream_options")


def _check_logprobs(requested: bool, field: str) -> None:
    if requested and "return_logprob" not in ENGINE_FIELDS:
        raise RequestError(f"{field}: log-probs are not supported by this engine (accepted only at null)", field=field)


def _jobs(body: _Sampling, prompts: list[list[int]], max_new: int | None, limits: Limits, prefix: str,
          logprobs: bool, names: dict[str, str]) -> list[Job]:
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if isinstance(body.rid, str) and len(prompts) > 1:
        rids = [f"{body.rid}-{i}" for i in range(len(prompts))]  # one rid for several prompts: their prefix
    if len(rids) != len(prompts):
        raise RequestError(f"rid: {len(rids)} rids for {len(prompts)} prompts", field="rid")
    params = body.sampling(max_new)
    jobs: list[Job] = []
    for i, (tokens, rid) in enumerate(zip(prompts, rids, strict=True)):
        jobs.extend(make_jobs(rid or f"{prefix}-{new_rid()}", i, tokens, params, limits, stream=body.stream,
                              prompt_field="prompt" if prefix == "cmpl" else "messages", names=names,
                              logprobs=logprobs))
    return jobs


def parse_completion(body: dict[str, Any], limits: Limits) -> tuple[list[Job], CompletionBody, StreamOptions]:
    data = split_known(body, CompletionBody, "", noop=COMPLETION_NOOP, metadata=COMMON_METADATA)
    parsed = validate(CompletionBody, data)
    if parsed.prompt is None:
        raise RequestError("prompt: missing prompt (a string, a list of strings or token ids)", field="prompt")
    if parsed.best_of is not None and parsed.best_of != parsed.n:
        raise RequestError(f"best_of: {parsed.best_of} is not supported by ddtree (accepted only at null or n = {parsed.n})",
                           field="best_of")
    if parsed.logprobs is not None and parsed.logprobs != 0:
        raise RequestError(f"logprobs: {parsed.logprobs} top log-probs are not supported by ddtree "
                           "(accepted: null, or 0 for each token's own log-prob)", field="logprobs")
    _check_logprobs(parsed.logprobs is not None, "logprobs")
    options = _stream_options(parsed)
    prompt = parsed.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestError("prompt: empty list of prompts", field="prompt")
    prompts = [tokenize(p, None, limits, "prompt") if isinstance(p, str) else tokenize(None, p, limits, "prompt")
               for p in items]
    jobs = _jobs(parsed, prompts, parsed.max_tokens, limits, "cmpl", parsed.logprobs is not None, NAMES)
    return jobs, parsed, options


def _flatten_content(content: Any, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.{i}: content part {kind!r} is not supported by ddtree (text parts only)",
                                   field=f"{where}.{i}")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: expected a string or a list of text parts", field=where)


def parse_chat(body: dict[str, Any], limits: Limits, template: Any) -> tuple[list[Job], ChatBody, StreamOptions]:
    data = split_known(body, ChatBody, "", noop=CHAT_NOOP, metadata=CHAT_METADATA)
    parsed = validate(ChatBody, data)
    if not parsed.messages:
        raise RequestError("messages: missing or empty (a list of {role, content})", field="messages")
    if parsed.top_logprobs not in (None, 0):
        raise RequestError(f"top_logprobs: {parsed.top_logprobs} is not supported by ddtree (accepted only at null or 0)",
                           field="top_logprobs")
    _check_logprobs(parsed.logprobs, "logprobs")
    options = _stream_options(parsed)
    if template is None:
        raise RequestError("messages: this model folder has no chat template (tokenizer_config.json chat_template); "
                           "use /v1/completions or /generate", field="messages")
    if limits.codec is None:
        raise RequestError("messages: chat needs the model folder's tokenizer.json", field="messages")
    messages = []
    for i, message in enumerate(parsed.messages):
        if not isinstance(message.get("role"), str):
            raise RequestError(f"messages.{i}.role: missing or not a string", field=f"messages.{i}.role")
        messages.append({**message, "content": _flatten_content(message.get("content"), f"messages.{i}.content")})
    try:
        text = template.render(messages, add_generation_prompt=True, **(parsed.chat_template_kwargs or {}))
    except TemplateError as err:
        raise RequestError(f"messages: the chat template refused them: {err}", field="messages") from err
    tokens = limits.codec.encode(text, add_special_tokens=False)
    if not tokens:
        raise RequestError("messages: the rendered chat template is empty", field="messages")
    tokenize(None, tokens, limits, "messages")
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
        raise RequestError("max_tokens: send max_tokens or max_completion_tokens, not both", field="max_tokens")
    max_new = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
    names = dict(NAMES, max_new_tokens="max_completion_tokens" if parsed.max_completion_tokens is not None else "max_tokens")
    return _jobs(parsed, [tokens], max_new, limits, "chatcmpl", parsed.logprobs, names), parsed, options


def _completion_logprobs(reply: Reply, start: int = 0) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of the reply's tokens from index `start` on (a stream sends each token once)."""
    if not reply.job.output.logprobs:
        return None
    tokens = [reply.decode([t]) for t in reply.ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    values = reply.token_logprobs()[start:]
    return {"tokens": tokens[start:], "token_logprobs": values, "top_logprobs": [None] * len(values),
            "text_offset": offsets[start:]}


def _chat_logprobs(reply: Reply, start: int = 0) -> dict[str, Any] | None:
    if not reply.job.output.logprobs:
        return None
    content = []
    for token, value in list(zip(reply.ids, reply.token_logprobs()))[start:]:
        text = reply.decode([token])
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def _spec_details(reply: Reply) -> dict[str, Any]:
    meta = reply.meta_info()
    keys = ("spec_verify_ct", "spec_accept_length", "spec_accept_histogram", "spec_num_correct_drafts", "e2e_latency")
    return {k: meta[k] for k in keys}


def _sum_usage(replies: list[Reply]) -> dict[str, int]:
    # a prompt's tokens count once however many samples it has (OpenAI's accounting)
    prompt = sum(len(r.progress.request.prompt_ids) for r in replies if r.job.sample_index == 0)
    completion = sum(len(r.ids) for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def install_openai_routes(app: FastAPI, state: ServerState, read_body: Any) -> None:  # noqa: C901 - one closure per route
    template = load_chat_template(state.args.model_path)
    served = state.args.served_model_name or state.args.model_path

    def index(reply: Reply, n: int) -> int:
        return reply.job.prompt_index * n + reply.job.sample_index

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served, "object": "model", "created": int(state.started_at), "owned_by": "ddtree",
                "root": state.args.model_path, "parent": None, "max_model_len": state.context_length}
        return {"object": "list", "data": [card]}

    async def run(jobs: list[Job], body: _Sampling, options: StreamOptions, kind: str) -> Response:
        pairs = submit_all(state, jobs)
        created = int(time.time())
        base = {"id": jobs[0].request.request_id, "object": kind, "created": created, "model": body.model or served}
        if not body.stream:
            replies = await collect(state, pairs)
            choices = [choice(r, body, final=True) for r in replies]
            extra: dict[str, Any] = {"spec_tokens_details": _spec_details(replies[0])}
            if kind == "text_completion":
                extra["output_ids"] = list(replies[0].ids)
            return FastJSONResponse(dict(base, choices=choices, usage=_sum_usage(replies), sglext=extra))
        replies = [reply for _, reply in pairs]

        async def chunks() -> AsyncIterator[bytes]:
            chunk_kind = kind if kind == "text_completion" else "chat.completion.chunk"
            head = dict(base, object=chunk_kind)
            sent = dict.fromkeys(range(len(replies)), 0)  # text sent so far, per choice
            sent_tokens = dict.fromkeys(range(len(replies)), 0)  # tokens whose log-probs are out, per choice
            ended: set[int] = set()  # choices whose last chunk is out (an interleaved stream may repeat a reply)
            if chunk_kind != "text_completion":
                for r in replies:
                    yield sse(dict(head, choices=[{"index": index(r, body.n), "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}], usage=None))
            async for r in updates:
                i = index(r, body.n)
                if i in ended:
                    continue
                text = r.stream_text()
                delta, sent[i] = text[sent[i]:], len(text)
                if not delta and not r.finished:
                    continue
                c = choice(r, body, final=r.finished, delta=delta, from_token=sent_tokens[i])
                sent_tokens[i] = len(r.ids)
                # a choice's last chunk carries its usage as well: every final answer has it
                show_usage = options.continuous_usage_stats or r.finished
                chunk = dict(head, choices=[c], usage=r.usage() if show_usage else None)
                if r.finished:
                    chunk["sglext"] = {"spec_tokens_details": _spec_details(r)}
                    ended.add(i)
                yield sse(chunk)
            if options.include_usage:
                yield sse(dict(head, choices=[], usage=_sum_usage(replies)))

        response = sse_response(state, pairs, chunks())  # built while the prefill runs, as /generate's
        updates = await follow_all(state, pairs)
        return response

    def choice(r: Reply, body: _Sampling, final: bool, delta: str | None = None, from_token: int = 0) -> dict[str, Any]:
        """One choice: a whole answer (delta None), or a stream chunk with the log-probs of tokens from_token on."""
        chat = isinstance(body, ChatBody)
        out: dict[str, Any] = {"index": index(r, body.n)}
        if chat and delta is None:
            out["message"] = {"role": "assistant", "content": r.text, "reasoning_content": None, "tool_calls": None}
        elif chat:
            out["delta"] = {"content": delta}
        else:
            out["text"] = r.text if delta is None else delta
        streamed = delta is not None
        out["logprobs"] = (_chat_logprobs(r, from_token) if chat else _completion_logprobs(r, from_token)
                           ) if final or streamed else None
        out["finish_reason"] = r.finish_reason if final else None
        out["matched_stop"] = r.matched_stop if final else None
        if body.return_token_ids and final:
            out["token_ids" if not chat else "response_token_ids"] = list(r.ids)
            out["prompt_token_ids"] = list(r.progress.request.prompt_ids)
        return out

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        jobs, body, options = parse_completion(await read_body(request), state.limits)
        return await run(jobs, body, options, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        jobs, body, options = parse_chat(await read_body(request), state.limits, template)
        return await run(jobs, body, options, "chat.completion")

