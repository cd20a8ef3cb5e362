"""The batching thread: it alone owns the DecodeBatch; requests join between rounds and leave when done.

Continuous batching in one loop: admit waiting requests (FIFO) into free slots (a burst of arrivals
is held until it has arrived, so it is prefilled as one group: see BURST_GAP_S), apply
cancellations, run one round for everything running, then hand what that iteration produced
(every request's StepOutput or Failure) to `deliver` in ONE call: the server turns it into one
`loop.call_soon_threadsafe` per round, not one per request (each is a wake-up of the event loop
and a write to its self-pipe, under the GIL the round needs too), or the engine process's Relay
into a pipe. Without `deliver`, each event goes to its request's sink on this thread. Nothing here
knows about HTTP or text; the batch is seen through DecodeBatchLike (ddtree.serving.admission) alone.

Three things keep a served round as fast as the engine's own:
- round N + 1 is launched before round N's outputs are handed out (metrics, events, the relay's pickle
  and write: ~1-2 us a row of Python), so that work runs while the device does (_serve says when it
  cannot); a batch that runs ahead (DecodeBatch's `run_ahead`; off with --disable-overlap-schedule)
  launches round N + 1 inside round N's `collect(run_ahead=True)`, before it reads round N's tokens, so
  the device does not wait for this loop between the two either; it is settled before rows join or leave;
- on a CUDA device the GIL's switch interval drops to SWITCH_INTERVAL_S while the thread runs: a round waits on the
  device with the GIL released and needs it back the moment the device is done; with CPython's
  default (5 ms) a busy event loop keeps it for up to 5 ms, several rounds' worth on a GPU;
- on a batch with CUDA graphs (`batch.graphs`), the thread first runs a short generation at every
  row bucket up to `max_running` and a lone prefill at every graphed width (`warm_token`), so no
  capture (~15 ms each, many for budget auto) is first met while serving.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError
from ddtree.serving.admission import (
    BURST_GAP_S,
    BURST_WAIT_S,
    DecodeBatchLike,
    Ticket,
    admit_now,
    prefill,
    warm_up,
)
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.wire import Deliver, Event, Failure, Sink

log = logging.getLogger("ddtree.server")

# The GIL switch interval while a scheduler runs (CPython's default is 5 ms). A thread that wants the GIL
# waits this long before the holder is asked to let go: the most a busy event loop delays a round that has
# finished waiting on the device. Measured with the emulated 1 ms round at 32 streams
# (python -m ddtree.profiling.http_vs_engine --engine emulated).
SWITCH_INTERVAL_S = 0.0005
T = TypeVar("T")


class Inbox(Protocol):
    """Where a scheduler's arrivals come from when its own thread waits for them (the engine process's request
    pipe, engine_worker.RequestPipe): an idle thread blocks in `wait`, which reads what arrives and queues it
    (submit_many, cancel, shutdown) on this thread. A thread asleep on the Condition instead is woken by the
    one that queued it, after that one was woken by the pipe: two wake-ups and a GIL hand-over a request at
    concurrency 1 where this has one."""

    # until something was queued, `timeout` passed or wake(); at once where changed() (something was queued by
    # another thread since the scheduler last looked)
    def wait(self, timeout: float | None, changed: Callable[[], bool]) -> None: ...
    def busy(self) -> None: ...  # the thread has work: arrivals are read elsewhere until its next wait
    def wake(self) -> None: ...  # any thread: a wait in progress returns


class Recorder(Protocol):
    """What the scheduler records into: ServerMetrics, or the engine process's MetricsRelay."""

    def record_admitted(self, prompt_tokens: int) -> None: ...
    def record_progress(self, new_tokens: int, new_verify_steps: int, accepted_drafts: int) -> None: ...
    def record_round(self, tokens: int, seconds: float) -> None: ...
    def record_outcome(self, outcome: str) -> None: ...
    def set_load(self, running: int, queued: int) -> None: ...


def deliver_inline(items: list[tuple[Sink, Event]]) -> None:
    """Each event to its sink, on the calling thread (the default)."""
    for sink, event in items:
        sink(event)


def abort_output(request_id: str, verify_steps: int) -> StepOutput:
    return StepOutput(request_id, [], True, "abort", verify_steps, [])


class Scheduler:
    """Run `batch` on a background thread, at most `max_running` requests at a time."""

    def __init__(
        self, batch: DecodeBatchLike, max_running: int, metrics: Recorder | None = None,
        deliver: Deliver = deliver_inline, warm_token: int | None = None,
        switch_interval_s: float | None = SWITCH_INTERVAL_S,
        burst_gap_s: float = BURST_GAP_S, burst_wait_s: float = BURST_WAIT_S,
    ) -> None:
        """warm_token: a token id the warm-up generations may use (None: no warm-up); switch_interval_s:
        None leaves the process's GIL switch interval alone; burst_gap_s, burst_wait_s: how a burst of
        arrivals is gathered into one prefill (BURST_GAP_S; 0 admits whatever is queued at every look)."""
        if burst_gap_s < 0 or burst_wait_s < 0:
            raise ValueError(f"burst_gap_s, burst_wait_s: {burst_gap_s}, {burst_wait_s} out of range (allowed >= 0)")
        self.batch = batch
        self.max_running = max_running
        self.metrics: Recorder = metrics or ServerMetrics()
        self.deliver = deliver
        self.warm_token = warm_token
        self.switch_interval_s = switch_interval_s
        self.burst_gap_s, self.burst_wait_s = burst_gap_s, burst_wait_s
        self._last_arrival = -float("inf")  # time.perf_counter() of the latest submit (guarded by _cond)
        self._cond = threading.Condition()
        self._pending: collections.deque[Ticket] = collections.deque()
        self._running: dict[str, Ticket] = {}
        self._known: set[str] = set()  # ids queued or running (guarded by _cond)
        self._cancels: set[str] = set()
        self._stop = False
        self._changes = 0  # counts what may end an idle wait: arrivals, cancels, stop (guarded by _cond)
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Sink, Event]] = []  # this iteration's events (scheduler thread only)
        self.last_round_at = time.monotonic()
        self.rounds = 0
        self.warm_seconds: float | None = None  # how long the warm-up took (None: none ran)
        # called on the thread once the warm-up is done, before anything is admitted: the engine process
        # freezes its heap again there, the graphs' Python objects with it (engine_worker.freeze_heap)
        self.after_warm_up: Callable[[], None] | None = None
        self.inbox: Inbox | None = None  # set before start(): the idle thread waits on it, not on the Condition
        # run_idle's calls, each with the future its caller waits on (guarded by _cond)
        self._idle_calls: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()
        self._ended = False  # the thread has left its loop: no run_idle call will be taken

    # -- called from any thread ------------------------------------------------------------------
    def start(self) -> None:
        if self.switch_interval_s is not None and sys.getswitchinterval() > self.switch_interval_s:
            sys.setswitchinterval(self.switch_interval_s)
        self._thread = threading.Thread(target=self._run, name="ddtree-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
        self.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def shutdown(self) -> None:
        """stop() without the join: the thread aborts whatever is left and ends (any thread, its own too)."""
        with self._cond:
            self._stop = True
            self._changes += 1
            self._cond.notify_all()
        if self.inbox is not None:
            self.inbox.wake()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: Request, sink: Sink, counted: bool = True, eager: bool = True) -> None:
        """Queue `request`; its events go to `sink`. eager: whether its consumer wants every round (a stream)
        or only the end; the engine process's relay holds lazy requests' rounds longer."""
        error = self.submit_many([(request, sink, counted)])[0]
        if error is not None:
            raise error

    def submit_many(self, arrivals: list[tuple[Request, Sink, bool]]) -> list[RequestError | None]:
        """Queue (request, sink, counted) arrivals together (the scheduler looks at them all or at none);
        per arrival None, or the RequestError that refused it."""
        errors: list[RequestError | None] = []
        with self._cond:
            now = time.perf_counter()
            for request, sink, counted in arrivals:
                if self._stop:
                    errors.append(RequestError("server is shutting down", status_code=503))
                elif request.request_id in self._known:
                    errors.append(RequestError(f"rid: {request.request_id!r} is already in flight", field="rid"))
                else:
                    self._known.add(request.request_id)
                    self._pending.append(Ticket(request, sink, counted, arrived=now,
                                                 in_burst=now - self._last_arrival < self.burst_gap_s))
                    self._last_arrival = now
                    errors.append(None)
            self._changes += 1
            self._cond.notify_all()
        return errors

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
                    self._changes += 1
                    self._cond.notify_all()
                return
        if ticket.counted:
            self.metrics.record_outcome("abort")
        self.deliver([(ticket.sink, abort_output(request_id, 0))])

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._known)

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._pending)

    def budget_state(self) -> tuple[int, float] | None:
        """Budget auto's last chosen tree size and its mean since start; None for a fixed budget."""
        b = self.batch
        return (b.last_budget, b.budget_total / b.budget_rounds) if b.budget_rounds and b.last_budget else None

    def run_idle(self, fn: Callable[[], T]) -> T:
        """fn() on the scheduler's thread (the batch's one owner) once nothing runs or is being cancelled, before
        anything more is admitted (arrivals queue up meanwhile); its result, or what it raised."""
        done: Future[T] = Future()
        with self._cond:
            if self._stop or self._ended or not self.alive:
                raise RuntimeError("the scheduler is not running")
            self._idle_calls.append((fn, done))
            self._changes += 1
            self._cond.notify_all()
        if self.inbox is not None:
            self.inbox.wake()
        return done.result()

    # -- the scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self.inbox is not None:
                self.inbox.busy()  # however the loop ended, arrivals are read elsewhere again
            with self._cond:  # a run_idle after this sees _ended (the thread is still alive until it returns)
                self._ended = True
                calls, self._idle_calls = list(self._idle_calls), collections.deque()
            for _, done in calls:
                done.set_exception(RuntimeError("the scheduler stopped"))

    def _serve(self) -> None:
        """The loop. Each iteration: take the cancels and the arrivals, launch a round, hand out the round
        before it, collect the new one (held until the next iteration).

        While nothing joins or leaves, the previous round's outputs are handed out (metrics, events, the
        relay's pickle and pipe write) after the next round is launched, while the device runs it; otherwise
        they go first, so a request that finished in a round is never reported as cancelled after it, and a
        cancel or a prefill sees what the rounds before it produced. A batch that runs ahead has the next
        round in flight when a collect returns: the next launch takes it, and before cancels or prefills
        it is settled (collected and handed out, after the round before it). Either way every request sees
        its own events in order, each once, and the batch runs the same rounds. A run_idle call runs when
        nothing runs or is cancelled, before the arrivals queued with it."""
        self.warm_up()
        if self.after_warm_up is not None:
            self.after_warm_up()
        batch, cond, pending = self.batch, self._cond, self._pending
        held: tuple[list[StepOutput], float] | None = None  # the last round's outputs, and its seconds
        read_at = time.perf_counter()  # when the last round's outputs were read
        load = None
        inbox = self.inbox
        while True:
            waited = False  # on the inbox: this thread read the arrivals, and hands the reading back after them
            with cond:
                while True:
                    idle = not (self._running or self._cancels or held)
                    calling = idle and bool(self._idle_calls)  # a run_idle call goes before the arrivals
                    take, hold = self._admission(time.perf_counter()) if pending and not calling else (0, 0.0)
                    if self._stop or not idle or take or calling:
                        break  # with a burst held, the rows' rounds still run while it gathers
                    if inbox is None:
                        cond.wait(hold or None)
                        continue
                    waited, changes = True, self._changes
                    cond.release()  # what the inbox reads is queued through submit_many / cancel, under cond
                    try:
                        inbox.wait(hold or None, lambda seen=changes: self._changes != seen)
                    finally:
                        cond.acquire()
                if self._stop:
                    break
                call = self._idle_calls.popleft() if calling else None
                cancels = admit = None
                if self._cancels:
                    cancels, self._cancels = self._cancels, set()
                if take:
                    admit = [pending.popleft() for _ in range(take)]
            if held is not None and (cancels or admit):
                self._hand_out(*held)  # before the cancels and the prefills, as they came
                held = None
            if (cancels or admit or call) and batch.round_ahead:
                read_at = self._settle(read_at)  # rows join or leave (or a run_idle call runs) with no round in flight
            if call is not None:
                if waited:
                    inbox.busy()  # type: ignore[union-attr]  # arrivals are read elsewhere while the call runs
                    waited = False
                fn, done = call
                try:
                    done.set_result(fn())
                except BaseException as err:  # raised on the caller's thread instead
                    done.set_exception(err)
            if cancels:
                for request_id in cancels:
                    self._cancel_running(request_id)
            if admit:
                self._admit_all(admit)
                self._flush()  # first tokens leave before the round, not after it (TTFT)
            if waited:
                inbox.busy()  # type: ignore[union-attr]  # after the first tokens: the reader's wake-up waits for them
            # a round launched ahead has run since the last read: its time counts from there
            started = read_at if batch.round_ahead else time.perf_counter()
            launched = batch.active > 0
            if launched:
                try:
                    batch.launch()
                except Exception as err:
                    if held is not None:
                        self._hand_out(*held)
                        held = None
                    self._round_failed(err)
                    launched = False
            if held is not None:
                self._hand_out(*held)  # while the device runs the round just launched
                held = None
            if (len(self._running), len(pending)) != load:
                load = (len(self._running), len(pending))
                self.metrics.set_load(*load)
            self._flush()
            if launched:
                outputs = self._collect()
                read_at = time.perf_counter()
                if outputs is not None:
                    held = (outputs, read_at - started)
        if held is not None:
            self._hand_out(*held)
        if batch.round_ahead:
            self._settle(read_at)
        for request_id in list(self._running):
            self._cancel_running(request_id)
        with self._cond:
            left, self._pending = list(self._pending), collections.deque()
        for ticket in left:
            self._finish(ticket, abort_output(ticket.request.request_id, 0))
        self._flush()

    def _admission(self, now: float) -> tuple[int, float]:
        """How many queued arrivals join now and, when none, how long they wait for the rest of their burst
        (ddtree.serving.admission.admit_now); under _cond, with something queued."""
        room = min(self.batch.free_slots, self.max_running - len(self._running))
        return admit_now(self._pending, room, self._last_arrival, self.burst_gap_s, self.burst_wait_s,
                         self.batch.prefill_tokens, now)

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            self.deliver(items)

    def warm_up(self) -> None:
        """On a graphed batch, before serving: the warm-up generations (ddtree.serving.admission.warm_up), so
        serving meets no capture. The thread runs it first; call it only before start()."""
        if self.warm_token is None or self.batch.graphs is None:
            return
        started = time.perf_counter()
        buckets, widths = warm_up(self.batch, self.max_running, self.warm_token)
        self.warm_seconds = time.perf_counter() - started
        log.info("Warmed the batch's CUDA graphs (row buckets %s, prefill widths %s) in %.1f s",
                 buckets, widths, self.warm_seconds)

    def _admit_all(self, tickets: list[Ticket]) -> None:
        """Prefill the admitted requests, together where they may be (ddtree.serving.admission.prefill)."""
        prefill(self.batch, tickets, self._joined, self._refused, between=self._flush)

    def _joined(self, tickets: list[Ticket], first: list[StepOutput]) -> None:
        for ticket in tickets:
            self._running[ticket.request.request_id] = ticket
            if ticket.counted:
                self.metrics.record_admitted(len(ticket.request.prompt_ids))
        self._dispatch(first)

    def _refused(self, ticket: Ticket, message: str, status_code: int, field: str | None) -> None:
        self._fail(ticket, Failure(ticket.request.request_id, message, status_code, field))

    def _collect(self) -> list[StepOutput] | None:
        """The launched round's outputs; None if it failed. A batch that runs ahead (DecodeBatch's run_ahead)
        launches the next round inside this collect."""
        try:
            outputs = self.batch.collect(run_ahead=True)
        except Exception as err:
            self._round_failed(err)
            return None
        self.rounds += 1
        self.last_round_at = time.monotonic()
        return outputs

    def _settle(self, read_at: float) -> float:
        """Collect the round the batch launched ahead and hand it out (its time counted from `read_at`, the
        read of the round before it); returns when its outputs were read. A round ahead of finished rows only
        (the thread may have idled since) has no outputs, and is not counted as a served round."""
        try:
            outputs = self.batch.settle()
        except Exception as err:
            self._round_failed(err)
            return time.perf_counter()
        now = time.perf_counter()
        if outputs:
            self.rounds += 1
            self.last_round_at = time.monotonic()
            self._hand_out(outputs, now - read_at)
        return now

    def _hand_out(self, outputs: list[StepOutput], seconds: float) -> None:
        """A collected round's outputs to their requests, and the round to the metrics (`seconds`: from its
        launch to its outputs, what DecodeBatch.step() takes)."""
        self.metrics.record_round(self._dispatch(outputs), seconds)

    def _round_failed(self, err: Exception) -> None:
        log.error("decode round failed; aborting %d running request(s)", len(self._running), exc_info=err)
        for request_id, ticket in list(self._running.items()):
            try:
                self.batch.cancel(request_id)
            except Exception:
                log.exception("cancel after a failed round failed for %s", request_id)
            self._running.pop(request_id)
            self._fail(ticket, Failure(request_id, f"decode failed: {err}", 500))
        self._flush()

    def _dispatch(self, outputs: list[StepOutput]) -> int:
        """Queue each output for its request (metrics summed over the outputs); returns the tokens handed out.
        Once per row per round: kept to plain loops and local names."""
        running, outbox = self._running, self._outbox
        tokens = counted_tokens = steps = drafts = 0
        for out in outputs:
            ticket = running.get(out.request_id)
            if ticket is None:
                continue  # cancelled between rounds
            new = len(out.new_token_ids)
            tokens += new
            if ticket.counted:
                counted_tokens += new
                if out.verify_steps > ticket.verify_steps:
                    steps += out.verify_steps - ticket.verify_steps
                for a in out.accept_lengths:
                    if a > 1:
                        drafts += a - 1
            ticket.verify_steps = out.verify_steps
            if out.finished:
                del running[out.request_id]
                self._finish(ticket, out)
            else:
                outbox.append((ticket.sink, out))
        if counted_tokens or steps:
            self.metrics.record_progress(counted_tokens, steps, drafts)
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

    def _finish(self, ticket: Ticket, out: StepOutput) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome(out.finish_reason or "abort")
        self._outbox.append((ticket.sink, out))

    def _fail(self, ticket: Ticket, failure: Failure) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome("error" if failure.status_code >= 500 else "rejected")
        self._outbox.append((ticket.sink, failure))
