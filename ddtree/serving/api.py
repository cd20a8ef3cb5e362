"""HTTP routes with SGLang's API shape: /generate, /tokenize, /detokenize, /server_info, /model_info, health,
cache and metrics here; the OpenAI routes (/v1/...) in ddtree.serving.openai_api.

Errors are always `{"error": {"message": str, "field": str | null, "code": int}}` with a 4xx/5xx
status: the message names the field and the allowed range. Validation happens before anything is
queued, and a bad request never disturbs the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ddtree.errors import RequestError
from ddtree.serving import stamps
from ddtree.serving.args import read_config
from ddtree.serving.openai_api import install_openai_routes
from ddtree.serving.replies import (
    SSE_DONE,
    FastJSONResponse,
    Reply,
    collect,
    error_response,
    follow_all,
    sse,
    sse_response,
    submit_all,
)
from ddtree.serving.state import ServerState
from ddtree.serving.validation import StrictBody, parse_generate, parse_json, split_known, tokenize, validate

__all__ = ["ServingApp", "error_response", "install_routes"]


class ServingApp(FastAPI):
    """FastAPI, except that the routes in `direct` ((method, path) -> ASGI app) are called straight from the
    server, before FastAPI's and Starlette's middleware (error and exception handlers, telemetry, body limit,
    exit stack, the router's walk over every route): ~80 us of a request's way in on 2 cores, and a wrapper
    around every chunk it sends. Such a route handles its own errors."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct: dict[tuple[str, str], ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self.direct.get((scope["method"], scope["path"]))
            if route is not None:
                scope["app"] = self
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class TokenizeBody(StrictBody):
    model: str | None = None
    prompt: str | list[str] | None = None
    add_special_tokens: bool = True


class DetokenizeBody(StrictBody):
    model: str | None = None
    tokens: list[int] | list[list[int]] | None = None
    skip_special_tokens: bool = True


def install_routes(app: FastAPI, state: ServerState) -> None:  # noqa: C901 - one closure per route
    def generate_payload(r: Reply) -> dict[str, Any]:
        return {"text": r.text, "output_ids": list(r.ids), "meta_info": r.meta_info()}

    def reject(err: RequestError) -> JSONResponse:
        state.metrics.record_outcome("invalid" if err.status_code < 500 else "error")
        return error_response(err.status_code, str(err), err.field)

    async def read_body(request: Request) -> dict[str, Any]:
        if state.draining:
            raise RequestError("server is shutting down", status_code=503)
        raw = await request.body()
        if stamps.ON:
            stamps.mark(request.scope, "h_body")
        return parse_json(raw)

    def codec_or_400(field: str) -> Any:
        if state.codec is None:
            raise RequestError(f"{field}: this model folder has no tokenizer.json", field=field)
        return state.codec

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
            "tokenizer_path": state.args.model_path if state.codec else None,  # a folder, as SGLang reports it
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": cfg.get("architectures"),
            "model_type": cfg.get("model_type"),
            "vocab_size": state.engine.vocab_size,
            "eos_token_id": state.engine.eos_token_id,
            "context_length": state.context_length,
        }

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        body = validate(TokenizeBody, split_known(await read_body(request), TokenizeBody, "", noop={}))
        if body.prompt is None:
            raise RequestError("prompt: missing (a string or a list of strings)", field="prompt")
        codec = codec_or_400("prompt")
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        tokens = [codec.encode(t, add_special_tokens=body.add_special_tokens) for t in texts]
        if isinstance(body.prompt, str):
            return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": state.context_length}
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": state.context_length}

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        body = validate(DetokenizeBody, split_known(await read_body(request), DetokenizeBody, "", noop={}))
        if body.tokens is None:
            raise RequestError("tokens: missing (a list of token ids, or a list of such lists)", field="tokens")
        codec = codec_or_400("tokens")
        batched = bool(body.tokens) and isinstance(body.tokens[0], list)
        lists = body.tokens if batched else [body.tokens]
        for ids in lists:
            tokenize(None, ids or [0], state.limits, "tokens")  # range check only (an empty list decodes to "")
        texts = [codec.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]  # type: ignore[arg-type]
        return {"text": texts if batched else texts[0]}

    async def generate(request: Request) -> Response:
        if stamps.ON:
            stamps.mark(request.scope, "h_asgi")
        jobs, as_list = parse_generate(await read_body(request), state.limits)
        if stamps.ON:
            stamps.mark(request.scope, "h_parsed")
            stamps.attach(request.scope, [job.request.request_id for job in jobs])
        pairs = submit_all(state, jobs)
        if jobs[0].stream:
            position = {id(reply): i for i, (_, reply) in enumerate(pairs)}

            async def chunks() -> AsyncIterator[bytes]:
                ended: set[int] = set()  # an interleaved stream may hand a finished reply over again
                async for r in updates:
                    i = position[id(r)]
                    if i in ended or not (r.ids or r.finished):
                        continue
                    chunk = dict(generate_payload(r), text=r.stream_text())
                    if as_list:
                        chunk["index"] = i  # SGLang's batch stream: which prompt (and sample) a chunk is of
                    if r.finished:
                        ended.add(i)
                    if stamps.ON:
                        stamps.stamp(r.job.request.request_id, "h_last_chunk" if r.finished else "h_first_chunk")
                    # the stream's last chunk carries [DONE] (one write, the response's end with it)
                    yield sse(chunk) + SSE_DONE if len(ended) == len(pairs) else sse(chunk)

            # built while the prefill runs, not after its first token has come (chunks() reads `updates` only
            # once the response streams); a refused prefill still raises here, before anything is sent
            response = sse_response(state, pairs, chunks())
            updates = await follow_all(state, pairs)
            return response
        payloads = [generate_payload(r) for r in await collect(state, pairs)]
        if stamps.ON:
            for _, reply in pairs:
                stamps.stamp(reply.job.request.request_id, "h_answer")
        return FastJSONResponse(payloads if as_list else payloads[0])

    async def generate_direct(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await generate(Request(scope, receive, send))
        except RequestError as err:
            response = reject(err)
        await response(scope, receive, send)

    # A plain Starlette route, not FastAPI's: the endpoint reads its own body, and FastAPI's parameter
    # solving cost ~50-70 us a request on a 2-core machine (a wave of 32 arrivals is parsed one by one).
    # A ServingApp calls it directly, past the middleware.
    app.add_route("/generate", generate, methods=["POST"])
    if isinstance(app, ServingApp):
        app.direct[("POST", "/generate")] = generate_direct

    install_openai_routes(app, state, read_body)
