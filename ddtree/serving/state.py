"""One served model: the scheduler, the per-request streams back into asyncio, and the response fields.

`ServerState` is what the routes talk to. Its scheduler runs in the engine process
(ddtree.serving.engine_client, whose events arrive on the loop as its pipe is read) or, for an engine
object handed to create_app, on a thread of this process (each round's events in one
`loop.call_soon_threadsafe`). A `RequestStream` turns the events into an async iterator on the event loop
and accumulates what the response reports: output ids, verify steps, accept lengths, the finish reason.
A stream that has not caught up yields once for every round that
arrived meanwhile (a slow client gets fewer, larger chunks, and the loop's work stays bounded by
what it can send), and a non-streaming request wakes only when it has finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ddtree import __version__
from ddtree.config import SpecConfig
from ddtree.errors import RequestError
from ddtree.request import Request, StepOutput
from ddtree.serving.args import ServerArgs
from ddtree.serving.engine_client import EngineInfo, EngineProcess
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.validation import Limits, new_rid
from ddtree.serving.wire import Event, Failure, Sink
from ddtree.text import TextCodec

if TYPE_CHECKING:  # the scheduler imports torch: this process imports it only when it runs the engine itself
    from ddtree.serving.scheduler import DecodeBatchLike, Scheduler

log = logging.getLogger("ddtree.server")

HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
# How often a stream sends: after a chunk it waits max(STREAM_MIN_INTERVAL_S, open streams /
# STREAM_CHUNKS_PER_S) before the next, which holds every round since (the first chunk and the last
# are never held back). One stream gets a chunk every 2 ms, 32 streams one every 16 ms. A chunk costs
# the event loop ~50-100 us under the GIL the scheduler's rounds need, and a Python client about as
# much: on the H200 a chunk per round per stream (32 streams, ~1 ms AR rounds) saturated both, and a
# chunk every 0.5 ms at one stream slowed its rounds by 12% (python -m ddtree.profiling.http_vs_engine).
STREAM_CHUNKS_PER_S = 2000.0
STREAM_MIN_INTERVAL_S = 0.002
READY_LINE = "The server is fired up and ready to roll!"


class EngineLike(Protocol):
    """What the server needs of ddtree.engine.Engine (and what the test fake provides)."""

    eos_token_id: int | None
    max_context: int
    vocab_size: int

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int, run_ahead: bool = True) -> DecodeBatchLike: ...


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
    accept_histogram: list[int] = field(default_factory=lambda: [0])  # [n]: rounds that accepted n tokens
    output_logprobs: list[float] = field(default_factory=list)  # one per output id when the request asked
    correct_drafts: int = 0  # sum of (accepted length - 1) over rounds, kept as it grows

    def apply(self, out: StepOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        self.output_logprobs.extend(out.logprobs)
        if out.new_token_ids and self.first_token_latency is None:
            self.first_token_latency = time.perf_counter() - self.started
        self.verify_steps = max(self.verify_steps, out.verify_steps)
        lengths = out.accept_lengths
        if lengths:  # kept as it grows: every streamed chunk reports it
            self.accept_lengths.extend(lengths)
            # counted, not walked one by one in Python: a plain request's last event holds ~80 rounds (20 ms of
            # them); list.count per distinct length (at most block_size + 1 of them), each a pass in C
            histogram = self.accept_histogram
            top = max(lengths)
            if top >= len(histogram):
                histogram.extend([0] * (top + 1 - len(histogram)))
            for length in set(lengths):
                histogram[length] += lengths.count(length)
            self.correct_drafts += sum(lengths) - len(lengths) + lengths.count(0)  # sum of max(length - 1, 0)
        if out.finished:
            self.finish_reason = out.finish_reason or "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """The event-loop side of one request: `push` (on the loop) applies the scheduler's events.

    every_round: wake the consumer for every round that touched the request (streaming), else only when
    it has finished or failed (a plain answer needs nothing in between). pace: seconds the consumer
    waits after an update before the next one (the first and the last are never held back); on_done:
    called once when the request has finished or failed. `on_event`, when set, is called after each event is
    applied, before the consumer is woken (a plain answer's text decoded as its events arrive)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, every_round: bool = True,
                 pace: Callable[[], float] | None = None, on_done: Callable[[], None] | None = None) -> None:
        self.progress = Progress(request)
        self.every_round = every_round
        self._loop = loop
        self._pace = pace
        self._on_done = on_done
        self.on_event: Callable[[], None] | None = None
        self._failure: Failure | None = None
        self._fresh = False  # progress the consumer has not seen yet
        self._not_before = 0.0  # loop time before which a running request's next update waits
        self._waiter: asyncio.Future[None] | None = None

    def push(self, event: Event) -> None:
        """Called on the event loop."""
        if isinstance(event, Failure):
            self._failure = event
        else:
            self.progress.apply(event)
            if self.on_event is not None:
                self.on_event()
        self._fresh = True
        if self._on_done is not None and (self._failure is not None or self.progress.finished):
            self._on_done()
            self._on_done = None
        if self._ready():
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _ready(self) -> bool:
        if not self._fresh:
            return False
        if self._failure is not None or self.progress.finished:
            return True
        return self.every_round and self._loop.time() >= self._not_before

    async def updates(self) -> AsyncIterator[Progress]:
        """Yield the progress once per wake-up (every round since the last one applied); raise RequestError
        on failure."""
        while True:
            while not self._ready():
                self._waiter = self._loop.create_future()
                # fresh progress held back only by the pace: wake when the pace allows
                timer = self._loop.call_at(self._not_before, self._wake) if self._fresh and self.every_round else None
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
            self._fresh = False
            if self._failure is not None:
                failure = self._failure
                raise RequestError(failure.message, field=failure.field, status_code=failure.status_code)
            if self._pace is not None:
                self._not_before = self._loop.time() + self._pace()
            yield self.progress
            if self.progress.finished and not self._fresh:  # a finish that landed during the yield is yielded next
                return

    async def result(self) -> Progress:
        async for _ in self.updates():
            pass
        return self.progress


class ServerState:
    """The served model and everything the routes share."""

    def __init__(
        self, engine: EngineLike | EngineInfo, spec: SpecConfig, args: ServerArgs, codec: TextCodec | None = None,
        scheduler: EngineProcess | None = None,
    ) -> None:
        """engine: the model, run by a Scheduler thread in this process; or, with `scheduler` (the engine
        process that runs it), only what it reported of itself."""
        self.engine = engine
        self.spec = spec
        self.args = args
        self.codec = codec
        self.context_length = args.context_length or engine.max_context
        self.limits = Limits(self.context_length, engine.vocab_size, codec)
        self._loop: asyncio.AbstractEventLoop | None = None
        if scheduler is None:
            # the engine runs on a thread of this process (an engine object handed to create_app)
            from ddtree.serving.engine_worker import open_scheduler

            metrics = ServerMetrics()
            self.scheduler: Scheduler | EngineProcess = open_scheduler(
                engine, self.context_length, metrics, self._deliver, spec=spec, args=args)
            self.metrics = metrics
        else:
            self.scheduler = scheduler
            self.metrics = scheduler.metrics
            scheduler.on_death = self._engine_died
        self._open_streams = 0  # streaming requests not yet finished (they share STREAM_CHUNKS_PER_S)
        self.ready = False
        self.draining = False
        self.fatal: str | None = None  # set when warm-up fails or the engine dies; the process exits with status 1
        self.started_at = time.time()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread; called on the event loop that will serve (its events go there)."""
        self._loop = asyncio.get_running_loop()
        self.scheduler.start()

    def _engine_died(self, reason: str) -> None:
        self.fatal = reason

    def _deliver(self, items: list[tuple[Sink, Event]]) -> None:
        """The scheduler thread's events of one iteration, onto the loop in one hop."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the loop has closed: nobody is waiting for these any more
            pass

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
    def submit(self, request: Request, counted: bool = True, stream: bool = True) -> RequestStream:
        """Queue `request`; stream=False: its consumer only wants the finished result."""
        if not stream:
            out = RequestStream(request, asyncio.get_running_loop(), every_round=False)
        else:
            out = RequestStream(request, asyncio.get_running_loop(), pace=self._stream_pace, on_done=self._stream_done)
            self._open_streams += 1
        try:
            self.scheduler.submit(request, out.push, counted, eager=stream)
        except RequestError:
            if stream:
                self._stream_done()
            raise
        return out

    def _stream_pace(self) -> float:
        return max(STREAM_MIN_INTERVAL_S, self._open_streams / STREAM_CHUNKS_PER_S)

    def _stream_done(self) -> None:
        self._open_streams -= 1

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
        budget = self.scheduler.budget_state() if self.spec.auto_budget else None
        if budget is not None:  # the budget chosen per round
            info["internal_states"][0] |= {"last_spec_budget": budget[0], "avg_spec_budget": budget[1]}
        return info


def _push_all(items: list[tuple[Sink, Event]]) -> None:
    for push, event in items:
        push(event)
