"""The batching thread: it alone owns the DecodeBatch; requests join between rounds and leave when done.

Continuous batching in one loop: admit waiting requests (FIFO) into free slots (a burst of arrivals
is held until it has arrived, so it is prefilled as one group: see BURST_GAP_S), apply
cancellations, run one round for everything running, then hand what that iteration produced
(every request's StepOutput or Failure) to `deliver` in ONE call: the server turns it into one
`loop.call_soon_threadsafe` per round, not one per request (each is a wake-up of the event loop
and a write to its self-pipe, under the GIL the round needs too), or the engine process's Relay
into a pipe. Without `deliver`, each event goes to its request's sink on this thread. Nothing here
knows about HTTP or text.

Three things keep a served round as fast as the engine's own:
- a batch that splits its round (DecodeBatch.launch / collect) gets round N + 1 launched before round
  N's outputs are handed out (metrics, events, the relay's pickle and write: ~1-2 us a row of Python),
  so that work runs while the device does, not between two rounds (_serve says when it cannot); a
  batch that runs ahead (its `run_ahead`; off with --disable-overlap-schedule) launches round N + 1
  before it reads round N's tokens, so the device does not wait for the host's bookkeeping or this
  loop between the two either; it is settled before requests join or leave;
- on a CUDA device the GIL's switch interval drops to SWITCH_INTERVAL_S while the thread runs: a round waits on the
  device with the GIL released and needs it back the moment the device is done; with CPython's
  default (5 ms) a busy event loop keeps it for up to 5 ms, several rounds' worth on a GPU;
- on a batch with CUDA graphs (`batch.graphs`), the thread first runs a short generation at every
  row bucket up to `max_running` and a lone prefill at every graphed width (`warm_token`), so no
  capture (~15 ms each, many for budget auto) is first met while serving.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ddtree.cuda_graphs import ROW_BUCKETS
from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError
from ddtree.prefill import prefill_chunks
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.wire import Deliver, Event, Failure, Sink

log = logging.getLogger("ddtree.server")

# The GIL switch interval while a scheduler runs (CPython's default is 5 ms). A thread that wants the GIL
# waits this long before the holder is asked to let go: the most a busy event loop delays a round that has
# finished waiting on the device. Measured with the emulated 1 ms round at 32 streams (docs/perf.md).
SWITCH_INTERVAL_S = 0.0005
WARM_PREFILL_WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096)  # lone prompts a graphed batch replays a prefill for
WARM_NEW_TOKENS = 40  # tokens per warm-up request: >= 3 rounds at block 16 (budget auto captures from its second)
# A burst of arrivals (each within BURST_GAP_S of the one before) is held back from admission until it stops
# (BURST_GAP_S with no arrival), fills one prefill forward (the batch's prefill_tokens), or its oldest has waited
# BURST_WAIT_S: then it is prefilled as one group, not as several, each a prefill of its own with decode rounds
# in between. An arrival with none in the BURST_GAP_S before it (a lone request: every one at concurrency 1)
# is never held. Rows already running keep running their rounds meanwhile.
BURST_GAP_S = 0.001
BURST_WAIT_S = 0.004


class DecodeBatchLike(Protocol):
    """What the scheduler needs of ddtree.engine.DecodeBatch (and what the test fake provides)."""

    @property
    def free_slots(self) -> int: ...

    @property
    def active(self) -> int: ...

    def add(self, request: Request) -> list[StepOutput] | None: ...  # the first token(s)

    # Optional (the scheduler looks them up): add_many(requests) -> list[StepOutput] prefills several
    # at once; validate(request) raises the RequestError add would, without a forward; graphs (not None:
    # rounds are CUDA graphs, captured when first met) and max_len, for the warm-up; launch() and collect()
    # (step() in two: the loop hands the last round out in between).

    def step(self) -> list[StepOutput]: ...

    def cancel(self, request_id: str) -> object: ...


class Inbox(Protocol):
    """Where a scheduler's arrivals come from when its own thread waits for them (the engine process's request
    pipe, engine_process.RequestPipe): an idle thread blocks in `wait`, which reads what arrives and queues it
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


@dataclass
class _Ticket:
    request: Request
    sink: Sink
    counted: bool = True  # False for the server's own warm-up and health probes: kept out of metrics
    verify_steps: int = 0  # last cumulative count seen, to turn it into per-round deltas
    arrived: float = 0.0  # time.perf_counter() at submit
    in_burst: bool = False  # it arrived within burst_gap_s of the arrival before it
    held_at: float | None = None  # when the scheduler first held it back for the rest of its burst


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
        self._pending: collections.deque[_Ticket] = collections.deque()
        self._running: dict[str, _Ticket] = {}
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
        # freezes its heap again there, the graphs' Python objects with it (engine_process.freeze_heap)
        self.after_warm_up: Callable[[], None] | None = None
        self.inbox: Inbox | None = None  # set before start(): the idle thread waits on it, not on the Condition

    # -- called from any thread ------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self, poll_s: float = 0.001) -> Iterator[None]:
        """Hold the scheduler between requests: wait until nothing runs, waits or is being cancelled, then keep its
        thread from admitting or running anything until the block ends. Meanwhile the caller may drive the batch
        itself (ddtree.bench.in_process measures it in process between served requests); arrivals queue up."""
        while True:
            self._cond.acquire()
            # _running empties at the last request's hand-out, after which the thread touches the batch again
            # only once it has taken _cond
            if not self._running and not self._pending and not self._cancels:
                break
            self._cond.release()
            time.sleep(poll_s)
        try:
            yield
        finally:
            self._cond.release()

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
                    self._pending.append(_Ticket(request, sink, counted, arrived=now,
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
        batch = self.batch
        rounds = getattr(batch, "budget_rounds", 0)
        if not rounds:
            return None
        return batch.last_budget, batch.budget_total / rounds  # type: ignore[attr-defined]

    # -- the scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self.inbox is not None:
                self.inbox.busy()  # however the loop ended, arrivals are read elsewhere again

    def _serve(self) -> None:
        """The loop. Each iteration: take the cancels and the arrivals, launch a round, hand out the round
        before it, collect the new one (held until the next iteration).

        While nothing joins or leaves, the previous round's outputs are handed out (metrics, events, the
        relay's pickle and pipe write) after the next round is launched, while the device runs it; otherwise
        they go first, so a request that finished in a round is never reported as cancelled after it, and a
        cancel or a prefill sees what the rounds before it produced. A batch that runs ahead has the next
        round in flight when a collect returns: the next launch takes it, and before cancels or prefills
        it is settled (collected and handed out, after the round before it). Either way every request sees
        its own events in order, each once, and the batch runs the same rounds."""
        self._warm_up()
        if self.after_warm_up is not None:
            self.after_warm_up()
        batch, cond, pending = self.batch, self._cond, self._pending
        launch = getattr(batch, "launch", None)
        collect = getattr(batch, "collect", None)
        split = launch is not None and collect is not None
        settle = getattr(batch, "settle", None)
        # a batch that runs ahead (DecodeBatch's run_ahead) launches round N + 1 inside round N's collect;
        # one seen through step() alone may run ahead inside step() (either is settled before rows change)
        ahead = split and settle is not None and getattr(batch, "run_ahead", False)
        collect_round = functools.partial(collect, run_ahead=True) if ahead else collect
        held: tuple[list[StepOutput], float] | None = None  # the last round's outputs, and its seconds
        read_at = time.perf_counter()  # when the last round's outputs were read
        load = None
        inbox = self.inbox
        while True:
            waited = False  # on the inbox: this thread read the arrivals, and hands the reading back after them
            with cond:
                while True:
                    take, hold = self._admission(time.perf_counter()) if pending else (0, 0.0)
                    if self._stop or self._cancels or held or self._running or take:
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
                cancels = admit = None
                if self._cancels:
                    cancels, self._cancels = self._cancels, set()
                if take:
                    admit = [pending.popleft() for _ in range(take)]
            if held is not None and (cancels or admit):
                self._hand_out(*held)  # before the cancels and the prefills, as they came
                held = None
            if (cancels or admit) and settle is not None and getattr(batch, "round_ahead", False):
                read_at = self._settle(settle, read_at)  # rows join or leave with no round in flight
            if cancels:
                for request_id in cancels:
                    self._cancel_running(request_id)
            if admit:
                self._admit_all(admit)
                self._flush()  # first tokens leave before the round, not after it (TTFT)
            if waited:
                inbox.busy()  # type: ignore[union-attr]  # after the first tokens: the reader's wake-up waits for them
            # a round launched ahead has run since the last read: its time counts from there
            started = read_at if ahead and batch.round_ahead else time.perf_counter()  # type: ignore[attr-defined]
            launched = batch.active > 0
            if launched and split:
                try:
                    launch()
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
                if not split:
                    started = time.perf_counter()  # a whole step() from here
                outputs = self._collect(collect_round if split else batch.step)
                read_at = time.perf_counter()
                if outputs is not None:
                    held = (outputs, read_at - started)
        if held is not None:
            self._hand_out(*held)
        if settle is not None and getattr(batch, "round_ahead", False):
            self._settle(settle, read_at)
        for request_id in list(self._running):
            self._cancel_running(request_id)
        with self._cond:
            left, self._pending = list(self._pending), collections.deque()
        for ticket in left:
            self._finish(ticket, abort_output(ticket.request.request_id, 0))
        self._flush()

    def _admission(self, now: float) -> tuple[int, float]:
        """How many of the queued arrivals join now (the oldest first), and, when none, how much longer they
        wait for the rest of their burst; under _cond, with something queued.

        All that fits joins unless the oldest came within burst_gap_s of an arrival before it, the latest came
        less than burst_gap_s ago, the oldest has been held back less than burst_wait_s (time spent queued
        behind a prefill or a round, when it could not have joined anyway, does not count) and more could
        still fit. Then only whole prefill forwards join (the batch's prefill_tokens over the longest prompt,
        in rows), the rest waiting for more of the burst to fill theirs; none where the batch has no such
        bound."""
        pending = self._pending
        room = min(self.batch.free_slots, self.max_running - len(self._running))
        take = min(room, len(pending))
        first = pending[0]
        if not first.in_burst or take == room:
            return take, 0.0  # a lone arrival, or all the room's worth: waiting gains nothing
        if first.held_at is None:
            first.held_at = now
        left = min(self._last_arrival + self.burst_gap_s, first.held_at + self.burst_wait_s) - now
        if left <= 0:
            return take, 0.0  # the burst is over, or its oldest has waited long enough
        bound = getattr(self.batch, "prefill_tokens", None)
        if bound is not None:
            rows = max(1, bound // max(len(t.request.prompt_ids) for t in pending))  # a forward's
            if take >= rows:
                return take - take % rows, 0.0  # the full forwards; the rest waits to fill its own
        return 0, left

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            self.deliver(items)

    def _warm_up(self) -> None:
        """On a graphed batch: a generation at every row bucket up to max_running (largest first) and a lone
        prefill at every width a graph serves, so serving meets no capture. Greedy rounds only: a sampled
        round's graphs (temperature > 0) are still captured when first met."""
        batch, token = self.batch, self.warm_token
        if token is None or getattr(batch, "graphs", None) is None:
            return
        started = time.perf_counter()
        max_len = getattr(batch, "max_len", 0)
        buckets = sorted({b for b in ROW_BUCKETS if b < self.max_running} | {self.max_running}, reverse=True)
        widths = [w for w in WARM_PREFILL_WIDTHS if w + WARM_NEW_TOKENS < max_len]
        runs = [[Request(f"warm-{rows}-{i}", [token], WARM_NEW_TOKENS, ignore_eos=True) for i in range(rows)]
                for rows in buckets if rows <= batch.free_slots]
        runs += [[Request(f"warm-prefill-{w}", [token] * w, 1, ignore_eos=True)] for w in widths]
        try:
            for requests in runs:
                self._warm_batch(requests)
        except Exception:  # a failed warm-up costs speed, not service: what it missed is captured when met
            log.exception("warm-up of the batch's CUDA graphs failed; serving without it")
            batch.clear()  # the warm-up's rows (nothing else runs yet), a round launched ahead with them
        self.warm_seconds = time.perf_counter() - started
        log.info("Warmed the batch's CUDA graphs (row buckets %s, prefill widths %s) in %.1f s",
                 buckets[::-1], widths, self.warm_seconds)

    def _warm_batch(self, requests: list[Request]) -> None:
        """Prefill `requests` together (one alone: the lone prefill) and step until every one has finished."""
        add_many = getattr(self.batch, "add_many", None)
        first = add_many(requests) if add_many is not None and len(requests) > 1 else self.batch.add(requests[0])
        left = {r.request_id for r in requests} - {o.request_id for o in first or [] if o.finished}
        while left:
            left -= {o.request_id for o in self.batch.step() if o.finished}
        settle = getattr(self.batch, "settle", None)
        if settle is not None:
            settle()  # the round launched ahead of the last finish (theirs only: nothing to hand out)

    def _admit_all(self, tickets: list[_Ticket]) -> None:
        """Prefill the admitted requests together where the batch can (one padded forward, not one each).

        Each request is validated on its own first, so a bad one fails alone; only the valid ones are
        batched, cut into forwards as the batch would cut them (ddtree.prefill.prefill_chunks, on a batch
        with `prefill_tokens`), each forward's first tokens handed out as soon as it is done rather than
        after the last. A batch without add_many/validate (e.g. a test fake) gets them one at a time.
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
        bound = getattr(self.batch, "prefill_tokens", None)
        if bound is None or len(valid) < 2:
            self._admit_group(valid, add_many)
            return
        lengths = [len(t.request.prompt_ids) for t in valid]
        for chunk in prefill_chunks(lengths, bound, getattr(self.batch, "forward_cost", 0)):
            self._admit_group([valid[i] for i in chunk], add_many)
            self._flush()  # this forward's first tokens leave before the next forward runs (TTFT)

    def _admit_group(self, valid: list[_Ticket], add_many: Callable[[list[Request]], list[StepOutput]]) -> None:
        """Prefill validated requests in one add_many (one alone: add, a graphed batch's lone prefill)."""
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

    def _collect(self, collect: Callable[[], list[StepOutput]]) -> list[StepOutput] | None:
        """The launched round's outputs (or a whole step()'s); None if it failed."""
        try:
            outputs = collect()
        except Exception as err:
            self._round_failed(err)
            return None
        self.rounds += 1
        self.last_round_at = time.monotonic()
        return outputs

    def _settle(self, settle: Callable[[], list[StepOutput]], read_at: float) -> float:
        """Collect the round the batch launched ahead and hand it out (its time counted from `read_at`, the
        read of the round before it); returns when its outputs were read. A round ahead of finished rows only
        (the thread may have idled since) has no outputs, and is not counted as a served round."""
        try:
            outputs = settle()
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

    def _finish(self, ticket: _Ticket, out: StepOutput) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome(out.finish_reason or "abort")
        self._outbox.append((ticket.sink, out))

    def _fail(self, ticket: _Ticket, failure: Failure) -> None:
        with self._cond:
            self._known.discard(ticket.request.request_id)
        if ticket.counted:
            self.metrics.record_outcome("error" if failure.status_code >= 500 else "rejected")
        self._outbox.append((ticket.sink, failure))
