"""The batching thread: it alone owns the DecodeBatch; requests join between rounds and leave when done.

Continuous batching in one loop: admit waiting requests (FIFO) into free slots, apply
cancellations, run one `step()` for everything running, hand each StepOutput to the request's
sink. Sinks are called on this thread; the server wraps them with `loop.call_soon_threadsafe`.
Nothing here knows about HTTP or text.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError
from ddtree.serving.metrics import ServerMetrics

log = logging.getLogger("ddtree.server")


class DecodeBatchLike(Protocol):
    """What the scheduler needs of ddtree.engine.DecodeBatch (and what the test fake provides)."""

    @property
    def free_slots(self) -> int: ...

    @property
    def active(self) -> int: ...

    def add(self, request: Request) -> list[StepOutput] | None: ...  # the first token(s)

    # Optional (the scheduler looks them up): add_many(requests) -> list[StepOutput] prefills several
    # at once; validate(request) raises the RequestError add would, without a forward.

    def step(self) -> list[StepOutput]: ...

    def cancel(self, request_id: str) -> object: ...


@dataclass(frozen=True)
class Failure:
    """A request the batch refused or lost; the server turns it into a 4xx/5xx or an abort chunk."""

    request_id: str
    message: str
    status_code: int = 400
    field: str | None = None


Event = StepOutput | Failure
Sink = Callable[[Event], None]


@dataclass
class _Ticket:
    request: Request
    sink: Sink
    counted: bool = True  # False for the server's own warm-up and health probes: kept out of metrics
    verify_steps: int = 0  # last cumulative count seen, to turn it into per-round deltas


def abort_output(request_id: str, verify_steps: int) -> StepOutput:
    return StepOutput(request_id, [], True, "abort", verify_steps, [])


class Scheduler:
    """Run `batch` on a background thread, at most `max_running` requests at a time."""

    def __init__(
        self, batch: DecodeBatchLike, max_running: int, metrics: ServerMetrics | None = None
    ) -> None:
        self.batch = batch
        self.max_running = max_running
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        self._pending: collections.deque[_Ticket] = collections.deque()
        self._running: dict[str, _Ticket] = {}
        self._known: set[str] = set()  # ids queued or running (guarded by _cond)
        self._cancels: set[str] = set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.last_round_at = time.monotonic()
        self.rounds = 0

    # -- called from any thread ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddtree-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: Request, sink: Sink, counted: bool = True) -> None:
        with self._cond:
            if self._stop:
                raise RequestError("server is shutting down", status_code=503)
            if request.request_id in self._known:
                raise RequestError(f"rid: {request.request_id!r} is already in flight", field="rid")
            self._known.add(request.request_id)
            self._pending.append(_Ticket(request, sink, counted))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """Abort a queued or running request; its sink gets finish_reason "abort". No-op if done."""
        with self._cond:
            for ticket in self._pending:
                if ticket.request.request_id == request_id:
                    self._pending.remove(ticket)
                    self._known.discard(request_id)
                    break
            else:
                if request_id in self._known:
                    self._cancels.add(request_id)
                    self._cond.notify_all()
                return
        ticket.sink(abort_output(request_id, 0))
        if ticket.counted:
            self.metrics.record_outcome("abort")

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._known)

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._pending)

    # -- the scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._pending or self._cancels or self._running):
                    self._cond.wait()
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, set()
                room = min(self.batch.free_slots, self.max_running - len(self._running))
                admit = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            for request_id in cancels:
                self._cancel_running(request_id)
            self._admit_all(admit)
            self.metrics.set_load(len(self._running), self.queued)
            if self._running:
                self._round()
        for request_id in list(self._running):
            self._cancel_running(request_id)
        with self._cond:
            left, self._pending = list(self._pending), collections.deque()
        for ticket in left:
            self._finish(ticket, abort_output(ticket.request.request_id, 0))

    def _admit_all(self, tickets: list[_Ticket]) -> None:
        """Prefill the admitted requests together where the batch can (one padded forward, not one each).

        Each request is validated on its own first, so a bad one fails alone; only the valid ones are
        batched. A batch without add_many/validate (e.g. a test fake) gets them one at a time.
        """
        add_many = getattr(self.batch, "add_many", None)
        validate = getattr(self.batch, "validate", None)
        if len(tickets) < 2 or add_many is None or validate is None:
            for ticket in tickets:
                self._admit(ticket)
            return
        valid = []
        for ticket in tickets:
            try:
                validate(ticket.request)
            except RequestError as err:
                self._fail(ticket, Failure(ticket.request.request_id, str(err), err.status_code, err.field))
            else:
                valid.append(ticket)
        if len(valid) < 2:
            for ticket in valid:
                self._admit(ticket)
            return
        try:
            first = add_many([t.request for t in valid])
        except Exception:
            # Whatever went wrong, give each request its own chance and its own error: undo any that
            # joined before the failure, then admit them one at a time.
            log.exception("batched prefill of %d requests failed; admitting them one by one", len(valid))
            for ticket in valid:
                try:
                    self.batch.cancel(ticket.request.request_id)
                except Exception:
                    log.exception("cancel after a failed batched prefill failed for %s", ticket.request.request_id)
            for ticket in valid:
                self._admit(ticket)
            return
        for ticket in valid:
            self._running[ticket.request.request_id] = ticket
            if ticket.counted:
                self.metrics.record_admitted(len(ticket.request.prompt_ids))
        self._dispatch(first or [])

    def _admit(self, ticket: _Ticket) -> None:
        request = ticket.request
        try:
            first = self.batch.add(request)  # the prefill; it yields the first token
        except RequestError as err:
            self._fail(ticket, Failure(request.request_id, str(err), err.status_code, err.field))
            return
        except Exception as err:  # an engine bug must not take the server down with it
            log.exception("prefill failed for request %s", request.request_id)
            self._fail(ticket, Failure(request.request_id, f"prefill failed: {err}", 500))
            return
        self._running[request.request_id] = ticket
        if ticket.counted:
            self.metrics.record_admitted(len(request.prompt_ids))
        self._dispatch(first or [])

    def _round(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.batch.step()
        except Exception as err:
            log.exception("decode round failed; aborting %d running request(s)", len(self._running))
            for request_id, ticket in list(self._running.items()):
                try:
                    self.batch.cancel(request_id)
                except Exception:
                    log.exception("cancel after a failed round failed for %s", request_id)
                self._running.pop(request_id)
                self._fail(ticket, Failure(request_id, f"decode failed: {err}", 500))
            return
        self.rounds += 1
        self.last_round_at = time.monotonic()
        tokens = self._dispatch(outputs)
        self.metrics.record_round(tokens, time.perf_counter() - started)

    def _dispatch(self, outputs: list[StepOutput]) -> int:
        """Hand each output to its request; returns the number of tokens handed out."""
        tokens = 0
        for out in outputs:
            ticket = self._running.get(out.request_id)
            if ticket is None:
                continue  # cancelled between rounds
            tokens += len(out.new_token_ids)
            new_steps = max(out.verify_steps - ticket.verify_steps, 0)
            ticket.verify_steps = out.verify_steps
            drafts = sum(max(a - 1, 0) for a in out.accept_lengths)
            if ticket.counted:
                self.metrics.record_progress(len(out.new_token_ids), new_steps, drafts)
            if out.finished:
                self._running.pop(out.request_id)
                self._finish(ticket, out)
            else:
                ticket.sink(out)
        return tokens

    def _cancel_running(self, request_id: str) -> None:
        ticket = self._running.pop(request_id, None)
        if ticket is None:
            return  # finished in the round before the cancel was applied
        try:
            self.batch.cancel(request_id)
        except Exception:
            log.exception("cancel failed for request %s", request_id)
        self._finish(ticket, abort_output(request_id, ticket.verify_steps))

    def _finish(self, ticket: _Ticket, out: StepOutput) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome(out.finish_reason or "abort")
        ticket.sink(out)

    def _fail(self, ticket: _Ticket, failure: Failure) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome("error" if failure.status_code >= 500 else "rejected")
        ticket.sink(failure)
