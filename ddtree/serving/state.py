"""One served model: the scheduler, the per-request streams back into asyncio, and the response fields.

`ServerState` is what the routes talk to. A `RequestStream` turns the scheduler thread's events
into an async iterator on the event loop (via `loop.call_soon_threadsafe`) and accumulates what
the response reports: output ids, verify steps, accept lengths, the finish reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddtree import __version__
from ddtree.config import SpecConfig
from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError
from ddtree.serving.args import ServerArgs
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.scheduler import DecodeBatchLike, Event, Failure, Scheduler
from ddtree.serving.validation import Limits, new_rid
from ddtree.text import TextCodec

log = logging.getLogger("ddtree.server")

HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
READY_LINE = "The server is fired up and ready to roll!"


class EngineLike(Protocol):
    """What the server needs of ddtree.engine.Engine (and what the test fake provides)."""

    eos_token_id: int | None
    max_context: int
    vocab_size: int

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int) -> DecodeBatchLike: ...


@dataclass
class Progress:
    """Everything one request has produced so far."""

    request: Request
    started: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_latency: float | None = None

    def apply(self, out: StepOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        if out.new_token_ids and self.first_token_latency is None:
            self.first_token_latency = time.perf_counter() - self.started
        self.verify_steps = max(self.verify_steps, out.verify_steps)
        self.accept_lengths.extend(out.accept_lengths)
        if out.finished:
            self.finish_reason = out.finish_reason or "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish_dict(self, eos_token_id: int | None) -> dict[str, Any] | None:
        reason = self.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": len(self.output_ids)}
        if reason == "stop":
            matched = self.output_ids[-1] if self.output_ids else eos_token_id
            return {"type": "stop", "matched": matched}
        return {"type": reason, "message": "request aborted"}

    def meta_info(self, eos_token_id: int | None) -> dict[str, Any]:
        completion = len(self.output_ids)
        histogram = [0] * (max(self.accept_lengths, default=0) + 1)
        for length in self.accept_lengths:
            histogram[length] += 1
        verify = self.verify_steps
        return {
            "id": self.request.request_id,
            "prompt_tokens": len(self.request.prompt_ids),
            "completion_tokens": completion,
            "cached_tokens": 0,
            "finish_reason": self.finish_dict(eos_token_id),
            "e2e_latency": time.perf_counter() - self.started,
            "first_token_latency": self.first_token_latency,
            "spec_verify_ct": verify,
            "spec_accept_length": completion / verify if verify else 0.0,
            "spec_accept_histogram": histogram,
            "spec_num_correct_drafts": sum(max(a - 1, 0) for a in self.accept_lengths),
        }


class RequestStream:
    """The event-loop side of one request: scheduler events arrive through a thread-safe queue."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.progress = Progress(request)
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:
        """Called on the scheduler thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def updates(self) -> AsyncIterator[Progress]:
        """Yield the progress after every round that touched this request; raise RequestError on failure."""
        while not self.progress.finished:
            event = await self._queue.get()
            if isinstance(event, Failure):
                raise RequestError(event.message, field=event.field, status_code=event.status_code)
            self.progress.apply(event)
            yield self.progress

    async def result(self) -> Progress:
        async for _ in self.updates():
            pass
        return self.progress


class ServerState:
    """The served model and everything the routes share."""

    def __init__(
        self, engine: EngineLike, spec: SpecConfig, args: ServerArgs, codec: TextCodec | None = None
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.args = args
        self.codec = codec
        self.context_length = args.context_length or engine.max_context
        self.limits = Limits(self.context_length, engine.vocab_size, codec)
        self.metrics = ServerMetrics()
        # the batch's rows also hold one round's tree (max_nodes) past the committed tokens
        batch = engine.open_batch(spec, args.max_running_requests, self.context_length + spec.max_nodes)
        self.scheduler = Scheduler(batch, args.max_running_requests, self.metrics)
        self.ready = False
        self.draining = False
        self.fatal: str | None = None  # set when warm-up fails; the process exits with status 1
        self.started_at = time.time()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def begin_drain(self) -> None:
        self.draining = True
        log.info("Draining: new requests get 503; %d request(s) in flight", self.scheduler.in_flight)

    @property
    def serving(self) -> bool:
        return self.ready and not self.draining and self.scheduler.alive

    async def warm_up(self) -> None:
        """One tiny generation through the batch; /health stays 503 until it has run."""
        token = next(t for t in range(self.engine.vocab_size) if t != self.engine.eos_token_id)
        request = Request(f"warmup-{new_rid()}", [token], max_new_tokens=min(2, self.context_length - 1), ignore_eos=True)
        try:
            await self.submit(request, counted=False).result()
        except Exception as err:
            self.fatal = f"warm-up generation failed: {err}"
            log.error(self.fatal)
            return
        self.ready = True
        log.info(READY_LINE)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Request, counted: bool = True) -> RequestStream:
        stream = RequestStream(request, asyncio.get_running_loop())
        self.scheduler.submit(request, stream.sink, counted)
        return stream

    def cancel(self, stream: RequestStream) -> None:
        if not stream.progress.finished:
            self.scheduler.cancel(stream.progress.request.request_id)

    async def health_generate(self) -> bool:
        """Like SGLang: when idle, a 1-token generation must come back; when busy, rounds must be moving."""
        if not self.serving:
            return False
        if self.scheduler.in_flight > 0:
            return time.monotonic() - self.scheduler.last_round_at < HEALTH_TIMEOUT_S
        token = next(t for t in range(self.engine.vocab_size) if t != self.engine.eos_token_id)
        stream = self.submit(Request(f"health-{new_rid()}", [token], max_new_tokens=1, ignore_eos=True), counted=False)
        try:
            await asyncio.wait_for(stream.result(), HEALTH_TIMEOUT_S)
        except (TimeoutError, RequestError):
            self.cancel(stream)
            return False
        return True

    def server_info(self) -> dict[str, Any]:
        info = self.args.to_dict()
        info["context_length"] = self.context_length
        info["spec_config_id"] = self.spec.id
        info["version"] = __version__
        info["startup_time"] = self.started_at
        info["internal_states"] = [
            {
                "avg_spec_accept_length": self.metrics.avg_spec_accept_length,
                "last_gen_throughput": self.metrics.last_gen_throughput,
                "running_requests": self.scheduler.in_flight - self.scheduler.queued,
                "queued_requests": self.scheduler.queued,
            }
        ]
        batch = self.scheduler.batch
        if self.spec.auto_budget and getattr(batch, "budget_rounds", 0):  # the budget chosen per round
            info["internal_states"][0] |= {"last_spec_budget": batch.last_budget,
                                           "avg_spec_budget": batch.budget_total / batch.budget_rounds}
        return info
