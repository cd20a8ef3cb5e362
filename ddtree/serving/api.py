"""HTTP routes with SGLang's API shape: /generate, /v1/completions, /server_info, health, cache, metrics.

Errors are always `{"error": {"message": str, "field": str | null, "code": int}}` with a 4xx/5xx
status: the message names the field and the allowed range. Validation happens before anything is
queued, and a bad request never disturbs the others.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ddtree.errors import RequestError
from ddtree.serving.args import read_config
from ddtree.serving.state import Progress, RequestStream, ServerState
from ddtree.serving.validation import Job, parse_completion, parse_generate, parse_json


def error_response(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "code": status}}, status_code=status)


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however it ends: finished, client gone, or server stopping."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def install_routes(app: FastAPI, state: ServerState) -> None:  # noqa: C901 - one closure per route
    def decode(ids: list[int]) -> str:
        return state.codec.decode(ids) if state.codec is not None else ""

    def generate_payload(p: Progress) -> dict[str, Any]:
        return {"text": decode(p.output_ids), "output_ids": list(p.output_ids), "meta_info": p.meta_info(state.engine.eos_token_id)}

    def reject(err: RequestError) -> JSONResponse:
        state.metrics.record_outcome("invalid" if err.status_code < 500 else "error")
        return error_response(err.status_code, str(err), err.field)

    async def read_body(request: Request) -> dict[str, Any]:
        if state.draining:
            raise RequestError("server is shutting down", status_code=503)
        return parse_json(await request.body())

    async def first_update(stream: RequestStream) -> AsyncIterator[Progress]:
        """Wait for the first round so a refused prefill can still be a 4xx, then keep streaming."""
        updates = stream.updates()
        first = await anext(updates)
        return _prepend(first, updates)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        return reject(err)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(422, str(err))

    @app.get("/health")
    async def health() -> Response:
        if not state.serving:
            return error_response(503, "not ready" if not state.draining else "shutting down")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not await state.health_generate():
            return error_response(503, "not ready" if not state.draining else "shutting down")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return PlainTextResponse("Cache flushed (ddtree keeps no prefix cache).\n")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return state.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = read_config(state.args.model_path)
        return {
            "model_path": state.args.model_path,
            "served_model_name": state.args.served_model_name or state.args.model_path,
            "tokenizer_path": state.codec.path if state.codec else None,
            "is_generation": True,
            "architectures": cfg.get("architectures"),
            "model_type": cfg.get("model_type"),
            "vocab_size": state.engine.vocab_size,
            "eos_token_id": state.engine.eos_token_id,
            "context_length": state.context_length,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = state.args.served_model_name or state.args.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ddtree"}]}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        jobs, batched = parse_generate(await read_body(request), state.limits)
        streams = _submit_all(state, jobs)
        if jobs[0].stream:
            stream = streams[0]
            try:
                updates = await first_update(stream)
            except BaseException:
                state.cancel(stream)
                raise

            async def chunks() -> AsyncIterator[str]:
                try:
                    async for p in updates:
                        if p.output_ids or p.finished:
                            yield sse(generate_payload(p))
                except RequestError as err:
                    yield sse({"error": {"message": str(err), "field": err.field, "code": err.status_code}})
                yield SSE_DONE

            return EventStream(chunks(), lambda: state.cancel(stream))
        try:
            results = [await s.result() for s in streams]
        finally:
            for s in streams:
                state.cancel(s)  # no-op for finished ones; a dropped handler must not leave work behind
        payloads = [generate_payload(p) for p in results]
        return JSONResponse(payloads if batched else payloads[0])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        job, body = parse_completion(await read_body(request), state.limits)
        stream = _submit_all(state, [job])[0]
        model = body.model or state.args.served_model_name or state.args.model_path
        created = int(time.time())

        def usage(p: Progress) -> dict[str, int]:
            prompt = len(p.request.prompt_ids)
            return {"prompt_tokens": prompt, "completion_tokens": len(p.output_ids), "total_tokens": prompt + len(p.output_ids)}

        def spec_details(p: Progress) -> dict[str, Any]:
            meta = p.meta_info(state.engine.eos_token_id)
            keys = ("spec_verify_ct", "spec_accept_length", "spec_accept_histogram", "spec_num_correct_drafts", "e2e_latency")
            return {k: meta[k] for k in keys}

        base = {"id": job.request.request_id, "object": "text_completion", "created": created, "model": model}
        if job.stream:
            try:
                updates = await first_update(stream)
            except BaseException:
                state.cancel(stream)
                raise

            async def chunks() -> AsyncIterator[str]:
                sent = 0
                try:
                    async for p in updates:
                        text = decode(p.output_ids)
                        delta, sent = text[sent:], len(text)
                        if not delta and not p.finished:
                            continue
                        chunk = dict(base, choices=[{"index": 0, "text": delta, "logprobs": None, "finish_reason": p.finish_reason}])
                        if p.finished:
                            chunk["usage"] = usage(p)
                            chunk["sglext"] = {"spec_tokens_details": spec_details(p)}
                        yield sse(chunk)
                except RequestError as err:
                    yield sse({"error": {"message": str(err), "field": err.field, "code": err.status_code}})
                yield SSE_DONE

            return EventStream(chunks(), lambda: state.cancel(stream))
        try:
            p = await stream.result()
        finally:
            state.cancel(stream)
        return JSONResponse(
            dict(
                base,
                choices=[{"index": 0, "text": decode(p.output_ids), "logprobs": None, "finish_reason": p.finish_reason}],
                usage=usage(p),
                sglext={"spec_tokens_details": spec_details(p), "output_ids": list(p.output_ids)},
            )
        )


def _submit_all(state: ServerState, jobs: list[Job]) -> list[RequestStream]:
    """Queue every job or none: a refused one (e.g. a duplicate rid) cancels those already queued."""
    streams: list[RequestStream] = []
    try:
        for job in jobs:
            streams.append(state.submit(job.request))
    except RequestError:
        for s in streams:
            state.cancel(s)
        raise
    return streams


async def _prepend(first: Progress, rest: AsyncIterator[Progress]) -> AsyncIterator[Progress]:
    yield first
    async for p in rest:
        yield p
