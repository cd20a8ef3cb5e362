"""`python -m ddtree.server`: the engine behind SGLang's HTTP API, with continuous batching.

    create_app(engine, spec, args, codec=None) -> FastAPI   # any engine with open_batch (tests pass a fake)
    build_parser() -> argparse.ArgumentParser               # SGLang's flag names
    main(argv=None) -> int                                  # 0 after a clean SIGTERM drain, 2 on a bad flag

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError, ModelLoadError
from ddtree.serving.api import install_routes
from ddtree.serving.args import ServerArgs, build_parser, resolve_args
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
    engine: EngineLike, spec: SpecConfig, args: ServerArgs, codec: TextCodec | None = None
) -> FastAPI:
    """An app serving `engine`; its lifespan starts the scheduler thread and the warm-up."""
    state = ServerState(engine, spec, args, codec)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start()
        warm_up = asyncio.create_task(state.warm_up())
        try:
            yield
        finally:
            warm_up.cancel()
            await asyncio.to_thread(state.stop)

    app = FastAPI(title="ddtree", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ddtree = state
    install_routes(app, state)
    return app


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


def _setup_logging(level: str) -> None:
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = resolve_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a malformed flag (2, message already printed)
        return int(exc.code or 0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    spec = args.spec
    from ddtree.engine import Engine

    try:
        engine = Engine.from_pretrained(
            args.model_path, args.speculative_draft_model_path, device=args.device, dtype=_torch_dtype(args.dtype),
            attention=args.attention_backend, cuda_graphs=False if args.disable_cuda_graph else None,
        )
        codec = load_tokenizer(args.model_path)
    except ModelLoadError as err:
        log.error("%s", err)
        return 1
    except ConfigError as err:  # e.g. --attention-backend triton without the triton package
        print(f"error: --attention-backend: {err}", file=sys.stderr)
        return 2
    log.info("Decode path: attention=%s, cuda_graphs=%s", engine.attention, engine.cuda_graphs)
    if args.context_length is not None and args.context_length > engine.max_context:
        print(f"error: --context-length: {args.context_length} exceeds the engine's limit {engine.max_context}", file=sys.stderr)
        return 2
    if spec.auto_budget and args.speculative_ddtree_cost_profile:
        from ddtree.budget import VerifyCostModel

        try:
            engine.cost_model = VerifyCostModel.load(args.speculative_ddtree_cost_profile)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    try:
        app = create_app(engine, spec, args, codec)  # opens the batch: the engine checks the spec
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log.info(init_line(spec))
    state: ServerState = app.state.ddtree
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # our root handler formats uvicorn's lines too
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = _DrainingServer(config, state, args.drain_timeout)
    server.run()
    if state.fatal is not None:
        return 1  # the warm-up failure is already logged
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
