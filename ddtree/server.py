"""`python -m ddtree.server`: the engine behind SGLang's HTTP API, with continuous batching.

    create_app(engine, spec, args, codec=None, scheduler=None) -> FastAPI
        # an engine with open_batch, served by a thread (tests pass a fake); or an EngineProcess's report
    start_engine(load, args, factory=None) -> EngineProcess   # fork the engine process; serve(engine, args, codec) -> status
    build_parser() -> argparse.ArgumentParser   # SGLang's flag names
    main(argv=None) -> int                      # 0 after a clean SIGTERM drain, 2 on a bad flag

Start-up: parse and check flags (exit 2 before loading anything), load the engine, log the init
line, serve; a warm-up generation runs through the batch and only then do /health and
/health_generate answer 200 and "The server is fired up and ready to roll!" is logged.
SIGTERM: new requests get 503, running ones finish (bounded by --drain-timeout), exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError, ModelLoadError
from ddtree.serving import stamps
from ddtree.serving.api import ServingApp, install_routes
from ddtree.serving.args import ServerArgs, build_parser, resolve_args
from ddtree.serving.engine_client import EngineInfo, EngineProcess, EngineStartError
from ddtree.serving.engine_worker import SchedulerFactory, freeze_heap, open_scheduler
from ddtree.serving.polling import describe, polling_window
from ddtree.serving.state import READY_LINE, EngineLike, ServerState
from ddtree.text import TextCodec, load_tokenizer

__all__ = ["READY_LINE", "build_parser", "create_app", "init_line", "main"]

log = logging.getLogger("ddtree.server")


def init_line(spec: SpecConfig) -> str:
    """The worker line that service verification reads from the log (SGLang's wording)."""
    if spec.algorithm is Algorithm.NONE:
        return "Initialized AR worker."
    return (
        f"Initialized DDTree worker. block_size={spec.block_size}, tree_budget={spec.budget}, "
        f"topk={spec.topk}, draft_window_size={spec.draft_window}, "
        f"compact_cache={spec.draft_window is not None}"
    )


def create_app(
    engine: EngineLike | EngineInfo, spec: SpecConfig, args: ServerArgs, codec: TextCodec | None = None,
    scheduler: EngineProcess | None = None,
) -> FastAPI:
    """An app serving `engine`: run by a scheduler thread of this process, or by `scheduler`, the engine process
    that runs it (then `engine` is what that process reported). Its lifespan starts either and the warm-up."""
    state = ServerState(engine, spec, args, codec, scheduler)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if scheduler is not None:
            freeze_heap()  # this process only serves from now on (see freeze_heap)
        if stamps.ON:
            loop = asyncio.get_running_loop()
            stamps.set_role("http")
            stamps.meta("loop", f"{type(loop).__module__}.{type(loop).__qualname__}")
        state.start()
        warm_up = asyncio.create_task(state.warm_up())
        try:
            yield
        finally:
            warm_up.cancel()
            await asyncio.to_thread(state.stop)
            if stamps.ON:
                stamps.dump()

    app = ServingApp(title="ddtree", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ddtree = state
    install_routes(app, state)
    return app


class _HeadWithBody:
    """A connection's transport that holds a response's status line and headers until its first body write and
    sends both in one: uvicorn writes them apart, and on loopback each write is a send that wakes the client
    (~0.1 ms on 2 cores, before a stream's first chunk and a plain answer's body alike). A head with no body
    write right after it (a 100 Continue, a response whose body comes later) goes out at the loop's next turn."""

    HEAD = b"HTTP/1."

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""

    def write(self, data: bytes) -> None:
        if self._head:
            data, self._head = self._head + data, b""
        elif data.startswith(self.HEAD):
            self._head = data
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self._transport.write(data)

    def _flush(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with _HeadWithBody's writes; with
    DDTREE_TIMELINE set it also stamps each request's first bytes (ddtree.serving.stamps)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class OneWriteHead(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_HeadWithBody(transport))  # type: ignore[arg-type]

    if stamps.ON:
        stamps.meta("http", AutoHTTPProtocol.__name__)
        return stamps.stamped_protocol(OneWriteHead)
    return OneWriteHead


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains: 503 for new requests, wait for running ones, exit 0.

    uvicorn's own handler re-raises the signal after shutdown (exit status -15); a drain that
    completed is a clean exit, so the signal is not re-raised here.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is not None:  # a second signal: stop waiting
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        log.info("Received %s; draining for up to %.0f s", signal.Signals(sig).name, self.drain_timeout)
        self._deadline = time.monotonic() + self.drain_timeout
        self.state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.state.fatal is not None:
            return True
        if self._deadline is not None:
            left = self.state.scheduler.in_flight
            if left == 0:
                return True
            if time.monotonic() > self._deadline:
                log.warning("Drain timeout: aborting %d request(s)", left)
                await asyncio.to_thread(self.state.stop)
                return True
        return await super().on_tick(counter)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _torch_dtype(name: str) -> object | None:
    if name == "auto":
        return None
    import torch

    return getattr(torch, name)


def load_engine(args: ServerArgs) -> tuple[Any, int]:
    """The engine the flags name and the context it serves (in the engine process). ModelLoadError: exit 1;
    ConfigError (its message names the flag): exit 2."""
    from ddtree.engine import Engine

    try:
        engine = Engine.from_pretrained(
            args.model_path, args.speculative_draft_model_path, device=args.device, dtype=_torch_dtype(args.dtype),
            attention=args.attention_backend, cuda_graphs=False if args.disable_cuda_graph else None,
        )
    except ConfigError as err:  # e.g. --attention-backend triton without the triton package
        raise ConfigError(f"--attention-backend: {err}") from err
    log.info("Decode path: attention=%s, cuda_graphs=%s, norms=%s", engine.attention, engine.cuda_graphs,
             "folded" if engine.norms_folded else "unfolded")
    if args.context_length is not None and args.context_length > engine.max_context:
        raise ConfigError(f"--context-length: {args.context_length} exceeds the engine's limit {engine.max_context}")
    if args.spec.auto_budget and args.speculative_ddtree_cost_profile:
        from ddtree.budget import VerifyCostModel

        engine.cost_model = VerifyCostModel.load(args.speculative_ddtree_cost_profile)
    return engine, args.context_length or engine.max_context


def start_engine(load: Callable[[], tuple[Any, int]], args: ServerArgs,
                 factory: SchedulerFactory | None = None) -> EngineProcess:
    """Fork the engine process (before this one starts a thread or touches CUDA); `load` runs there, then `factory`
    (default: open_scheduler for `args`) opens the batch and the Scheduler it serves."""
    return EngineProcess(load, factory or partial(open_scheduler, spec=args.spec, args=args), args.log_level,
                         polling_window(args.sleep_on_idle))


def serve(engine: EngineProcess, args: ServerArgs, codec: TextCodec | None) -> int:
    """Wait for the engine process, then serve until SIGTERM; the exit status of `main`."""
    try:
        info = engine.wait_loaded()
    except EngineStartError as err:
        if err.exit_code == 2:
            print(f"error: {err}", file=sys.stderr)
        else:
            log.error("%s", err)
        return err.exit_code
    app = create_app(info, args.spec, args, codec, scheduler=engine)
    log.info(init_line(args.spec))
    log.info("Polling: %s", describe(engine.poll_window_s, args.sleep_on_idle))
    state: ServerState = app.state.ddtree
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # our root handler formats uvicorn's lines too
        access_log=False,
        lifespan="on",
        http=http_protocol(),  # (the loop: uvicorn's "auto", uvloop where installed)
        timeout_graceful_shutdown=5,
    )
    server = _DrainingServer(config, state, args.drain_timeout)
    try:
        server.run()
    finally:
        engine.stop()
    if state.fatal is not None:
        return 1  # the warm-up failure or the engine's death is already logged
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = resolve_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a malformed flag (2, message already printed)
        return int(exc.code or 0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    engine = start_engine(partial(load_engine, args), args)
    try:
        codec = load_tokenizer(args.model_path)  # while the engine loads
    except ModelLoadError as err:
        log.error("%s", err)
        engine.stop()
        return 1
    return serve(engine, args, codec)


if __name__ == "__main__":
    sys.exit(main())
