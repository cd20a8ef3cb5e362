"""The engine process as the HTTP process sees it: EngineProcess, with the Scheduler's interface.

`python -m ddtree.server` forks, before either process has touched CUDA or imported torch, a child that loads
the engine, opens the batch and runs the Scheduler (ddtree.serving.engine_worker); this process parses,
validates, tokenizes, detokenizes and streams. In one process the event loop's work (an SSE chunk is ~100 us
of Python) and the round's host work took turns on one GIL: at 32 streams on the H200 rounds ran 25% slower
than the engine's and arrivals were parsed at the pace the rounds left over. SGLang splits its server the same
way (tokenizer manager, scheduler and detokenizer processes); two pipes of framed messages
(ddtree.serving.wire) are all this one needs.

EngineProcess offers what the routes use of a Scheduler (submit, cancel, in_flight, ...); its sinks are called
on the event loop as the Events frames arrive. A child that dies fails every request in flight with a 500, and
the server exits (status 1); a parent that dies closes the pipe, and the child stops.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ddtree.errors import RequestError
from ddtree.request import Request
from ddtree.serving import stamps
from ddtree.serving.engine_worker import SchedulerFactory, engine_main
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.polling import LoopPoller
from ddtree.serving.wire import (
    PIPE_BYTES,
    Cancel,
    EngineInfo,
    Events,
    Failure,
    FrameReader,
    Loaded,
    Message,
    MetricsDelta,
    Sink,
    StartFailed,
    Status,
    Stop,
    Submit,
    ToEngine,
    Update,
    event,
    pipe,
    write_frame,
)

__all__ = ["EngineInfo", "EngineProcess", "EngineStartError", "apply_delta"]

log = logging.getLogger("ddtree.server")

STOP_TIMEOUT_S = 15.0  # for the child to abort what runs and exit, before it is terminated


class EngineStartError(Exception):
    """The engine process could not start; `exit_code` is the server's (1: model load, 2: a bad setting)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def apply_delta(metrics: ServerMetrics, delta: MetricsDelta) -> None:
    """The engine process's recordings since its last frame, into this process's metrics."""
    if delta.prompt_tokens:
        metrics.record_admitted(delta.prompt_tokens)
    if delta.tokens or delta.steps:
        metrics.record_progress(delta.tokens, delta.steps, delta.drafts)
    if delta.rounds:
        metrics.record_round(delta.round_tokens, delta.round_s, delta.rounds)
    for outcome, count in delta.outcomes.items():
        metrics.record_outcome(outcome, count)
    if delta.load is not None:
        metrics.set_load(*delta.load)


_seen = stamps.FirstLast("h_first_event", "h_last_event") if stamps.ON else None


class EngineProcess:
    """The engine process, seen from the event loop as the Scheduler is (ServerState's `scheduler`).

    Construct before anything in this process starts threads or touches CUDA (the child is forked);
    `wait_loaded()` blocks until the engine is up; `start()` on the serving event loop. Every other method
    runs on that loop, except `stop()`, which may run on any thread.
    """

    def __init__(self, load: Callable[[], tuple[Any, int]], serve: SchedulerFactory, log_level: str = "info",
                 poll_window_s: float = 0.0) -> None:
        """load() -> (engine, context_length), in the child; serve(engine, context_length, metrics, deliver)
        -> the Scheduler it runs there. poll_window_s: how long both processes poll after activity
        (ddtree.serving.polling.polling_window; 0: they block)."""
        context = multiprocessing.get_context("fork")
        child_requests, self._requests = pipe()
        self._events, child_events = pipe()
        self._process = context.Process(
            target=engine_main, name="ddtree-engine", daemon=True,
            args=(child_requests, child_events, (self._requests, self._events), load, serve, log_level,
                  poll_window_s))
        self._process.start()
        os.close(child_requests)  # only the child's copies stay open: its death is an EOF here
        os.close(child_events)
        self._frames = FrameReader()
        self._inbox = bytearray(PIPE_BYTES)  # what one read of the events pipe brings
        self._early: list[Message] = []  # messages read with Loaded
        self.metrics = ServerMetrics()
        self.info: EngineInfo | None = None
        self.on_death: Callable[[str], None] | None = None
        self._send_lock = threading.Lock()  # stop() may run on another thread than the loop's sends
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, Sink] = {}
        self._status: Status | None = None
        self._stopping = False
        self._closed = False
        self._dead: str | None = None
        self.poll_window_s = poll_window_s
        self.poller: LoopPoller | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (what a test kills, or reads /proc of)."""
        return self._process.pid

    # -- start and stop --------------------------------------------------------------------------------
    def wait_loaded(self, timeout: float | None = None) -> EngineInfo:
        """Block until the child has loaded the engine and opened the batch; EngineStartError if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        messages: list[Message] = []
        while not messages:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([self._events], [], [], left)[0]:
                self.stop()
                raise EngineStartError(1, f"the engine did not load within {timeout:g} s")
            data = os.read(self._events, 1 << 16)
            if not data:
                self._process.join(5)
                raise EngineStartError(1, f"the engine process exited while loading ({self._exit_text()})")
            messages = self._frames.feed(data)
        message, self._early = messages[0], messages[1:]
        if type(message) is StartFailed:
            self._process.join(5)
            raise EngineStartError(message.exit_code, message.message)
        if type(message) is not Loaded:
            raise EngineStartError(1, f"the engine process sent {type(message).__name__} before it loaded")
        self.info = message.info
        return message.info

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._events, False)  # the loop reads whatever the pipe holds
        self._loop.add_reader(self._events, self._on_readable)
        if self.poll_window_s:
            self.poller = LoopPoller(self._loop, self.poll_window_s, lambda: bool(self._sinks))
        self._handle(self._early)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to abort what runs and exit; terminate it if it does not."""
        self._stopping = True
        if self._closed:
            return
        try:
            self._send(Stop())
        except RequestError:
            pass  # already gone
        deadline = time.monotonic() + timeout
        while self._process.is_alive() and time.monotonic() < deadline:
            if not self._loop_reads():
                self._discard_events()  # a full pipe would block the child's last sends
            self._process.join(0.05)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; terminating it", timeout)
            self._process.kill()
            self._process.join(5)
        if not self._loop_reads() and not self._closed:  # a loop still running may still read the events pipe
            self._closed = True
            os.close(self._requests)
            os.close(self._events)

    def _loop_reads(self) -> bool:
        loop = self._loop
        return loop is not None and loop.is_running() and self._dead is None

    def _discard_events(self) -> None:
        try:
            os.set_blocking(self._events, False)
            while os.read(self._events, 1 << 20):
                pass
        except OSError:
            pass  # empty (BlockingIOError) or closed

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    # -- requests --------------------------------------------------------------------------------------
    def submit(self, request: Request, sink: Sink, counted: bool = True, eager: bool = True) -> None:
        rid = request.request_id
        if self._stopping or self._dead is not None:
            raise RequestError("server is shutting down", status_code=503)
        if rid in self._sinks:
            raise RequestError(f"rid: {rid!r} is already in flight", field="rid")
        self._sinks[rid] = sink
        if self.poller is not None:
            self.poller.touch()
        if stamps.ON:
            stamps.stamp(rid, "h_submit")
        try:
            self._send(Submit(request, counted, eager))
        except RequestError:
            self._sinks.pop(rid, None)
            raise

    def cancel(self, request_id: str) -> None:
        if request_id in self._sinks and self._dead is None:
            try:
                self._send(Cancel(request_id))
            except RequestError:
                pass  # the death handler fails it

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    @property
    def queued(self) -> int:
        return 0 if self._status is None else self._status.queued

    @property
    def rounds(self) -> int:
        return 0 if self._status is None else self._status.rounds

    @property
    def last_round_at(self) -> float:
        return time.monotonic() if self._status is None else self._status.last_round_at

    def budget_state(self) -> tuple[int, float] | None:
        return None if self._status is None else self._status.budget

    def _send(self, message: ToEngine) -> None:
        try:
            with self._send_lock:
                write_frame(self._requests, message)
        except OSError as err:
            raise RequestError(f"the engine process is gone ({err})", status_code=503) from err

    # -- events, on the loop ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        # into one buffer allocated once (os.read(fd, 1 MiB) allocated 1 MiB a call, ~20 us each, and a second
        # call found the pipe empty); a read shorter than the buffer emptied the pipe, and the (level-triggered)
        # reader wakes this again for whatever comes after it
        inbox = self._inbox
        while True:
            try:
                size = os.readv(self._events, (inbox,))
            except BlockingIOError:
                return
            except OSError as err:
                log.debug("reading the engine's events failed: %r", err)
                size = 0
            if not size:
                self._died()
                return
            self._handle(self._frames.feed(memoryview(inbox)[:size]))
            if size < len(inbox):
                return

    def _handle(self, messages: list[Message]) -> None:
        loop = self._loop
        if self.poller is not None and messages:
            self.poller.touch()
        for message in messages:
            if type(message) is Events:
                self._dispatch(message.updates)
                self._status = message.status or self._status
                # the metrics after the woken requests' next step (a chunk or an answer written), not before it:
                # ~10 us of Prometheus counters (warm) that no reply waits for
                if loop is not None:
                    loop.call_soon(apply_delta, self.metrics, message.metrics)
                else:
                    apply_delta(self.metrics, message.metrics)

    def _dispatch(self, items: list[Update | Failure]) -> None:
        sinks = self._sinks
        for item in items:
            out = event(item)
            rid = out.request_id
            if _seen is not None:
                _seen(rid, bool(getattr(out, "new_token_ids", None)), getattr(out, "finished", True))
            sink = sinks.get(rid)
            if sink is None:
                continue  # a cancelled request's last round
            if isinstance(out, Failure) or out.finished:
                del sinks[rid]
            sink(out)

    def _died(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._events)
        self._process.join(2)
        reason = f"the engine process exited ({self._exit_text()})"
        self._dead = reason
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink(Failure(rid, reason, 500))
        if not self._stopping:
            log.error(reason)
            if self.on_death is not None:
                self.on_death(reason)

    def _exit_text(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"
