"""The engine process: it loads the engine, opens the batch and runs the Scheduler; the HTTP process only talks to it.

`engine_main` is the child's whole life: load, report `Loaded` (or `StartFailed`), then run the Scheduler
until `Stop` or until the HTTP process is gone. The `RequestPipe` reads the requests (Submit, Cancel, Stop)
and queues them on the Scheduler; the `Relay` is the Scheduler's `deliver`, batching its events, metrics
(`MetricsRelay`) and status into one `Events` frame per flush.

The Relay holds a round's outputs until a request finishes or gets its first token (TTFT and E2E are never
held back), or EAGER_FLUSH_S has passed while a streamed request runs or a lone request does (LAZY_FLUSH_S
while only plain ones do, more than LAZY_MIN_RUNNING of them): each send pickles and writes from the round's
own thread, ~10-30 us, which at one row per 0.26 ms round would cost more than a tenth of the round if paid
every round.

This module imports no torch: the HTTP process imports it to fork the child, and the child imports torch when
it loads the engine (`load`) and opens the Scheduler (`open_scheduler`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import select
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ModelLoadError
from ddtree.request import Request
from ddtree.serving import stamps
from ddtree.serving.args import ServerArgs
from ddtree.serving.polling import PollWindow
from ddtree.serving.wire import (
    READ_BYTES,
    Cancel,
    Deliver,
    EngineInfo,
    Event,
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
    Update,
    merge,
    packed,
    update,
    write_frame,
)

if TYPE_CHECKING:
    from ddtree.serving.scheduler import Recorder, Scheduler

log = logging.getLogger("ddtree.server")

# the most a streamed request's tokens wait in the engine process: the HTTP side sends a stream's chunks at
# most every 2 ms (state.STREAM_MIN_INTERVAL_S), so a frame every 1 ms woke its loop twice per chunk (each
# wake-up ~50-100 us of uvloop and unpickling on 2 cores)
EAGER_FLUSH_S = 0.002
LAZY_FLUSH_S = 0.02  # likewise when every running request is plain: only /metrics and /server_info read them
# ... and more than this many run. A plain answer decodes its text as its events arrive, so a frame that held
# 20 ms of rounds left that decoding and unpickling for after the last token (~0.25 ms on 2 cores, at
# concurrency 1); a lone request's frames every 2 ms cost it nothing, while at 4 plain requests on 2 cores
# they slowed the rounds by ~7% (docs/perf.md, "Findings that explain the code")
LAZY_MIN_RUNNING = 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
ENGINE_CPUS_ENV = "DDTREE_ENGINE_CPUS"  # CPUs the engine process runs on (taskset's list: "15", "12-15", "1,3")


class SchedulerFactory(Protocol):
    """How the child turns a loaded engine into the Scheduler it runs (open_scheduler with the server's flags)."""

    def __call__(self, engine: Any, context_length: int, metrics: Any, deliver: Any) -> Scheduler: ...


def open_scheduler(engine: Any, context_length: int, metrics: Recorder, deliver: Deliver, *,
                   spec: SpecConfig, args: ServerArgs) -> Scheduler:
    """The batch the server serves and the Scheduler that runs it (in the engine process, or on a thread of the
    one process when create_app is handed an engine)."""
    from ddtree.serving.scheduler import SWITCH_INTERVAL_S, Scheduler  # torch: only where the engine runs

    # the batch's rows also hold one round's tree (max_nodes) past the committed tokens
    batch = engine.open_batch(spec, args.max_running_requests, context_length + spec.max_nodes,
                              run_ahead=not args.disable_overlap_schedule)
    if stamps.ON:  # python -m ddtree.profiling.timeline: each request's prefill, last round and hand-out
        batch, deliver = stamps.StampedBatch(batch), stamps.stamped_deliver(deliver)
    warm_token = next(t for t in range(engine.vocab_size) if t != engine.eos_token_id)
    # A shorter GIL switch interval pays where a round waits on the GPU with the GIL released; on the
    # CPU the round itself needs the GIL, and forced switches slowed the smoke sweep's cells by ~25%.
    on_gpu = getattr(getattr(engine, "device", None), "type", None) == "cuda"
    return Scheduler(batch, args.max_running_requests, metrics, deliver=deliver, warm_token=warm_token,
                     switch_interval_s=SWITCH_INTERVAL_S if on_gpu else None)


# -- what leaves: events, metrics and status, one frame per flush -------------------------------------------


class MetricsRelay:
    """ServerMetrics' recording calls, summed until the next send; the HTTP process applies them to its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the scheduler thread and the pipe reader (cancel of a queued request)
        self._reset()

    def _reset(self) -> None:
        self.prompt_tokens = self.tokens = self.steps = self.drafts = self.round_tokens = self.rounds = 0
        self.round_s = 0.0
        self.outcomes: Counter[str] = Counter()
        self.load: tuple[int, int] | None = None

    def record_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def record_progress(self, new_tokens: int, new_verify_steps: int, accepted_drafts: int) -> None:
        with self._lock:
            self.tokens += new_tokens
            self.steps += new_verify_steps
            self.drafts += accepted_drafts

    def record_round(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.round_tokens += tokens
            self.round_s += seconds
            self.rounds += 1

    def record_outcome(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def set_load(self, running: int, queued: int) -> None:
        self.load = (running, queued)

    def take(self) -> MetricsDelta:
        with self._lock:
            delta = MetricsDelta(self.prompt_tokens, self.tokens, self.steps, self.drafts, self.round_tokens,
                                 self.round_s, self.rounds, dict(self.outcomes), self.load)
            self._reset()
        return delta


class Relay:
    """The child's side of the events pipe: the Scheduler's `deliver`, batched into one Events frame per flush."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.metrics = MetricsRelay()
        self.scheduler: Scheduler | None = None
        self._lock = threading.Lock()
        self._buffer: list[Update | Failure] = []  # a running request's held rounds merged into one update
        self._open: dict[str, Update] = {}  # rid -> its update in the buffer, while it may still grow
        self._eager: set[str] = set()  # running requests whose every round the HTTP side wants soon
        self._started: set[str] = set()  # requests that have had their first token
        self._last_send = time.perf_counter()

    def submitted(self, request_id: str, eager: bool) -> None:
        if eager:
            with self._lock:
                self._eager.add(request_id)

    def deliver(self, items: list[tuple[Sink, Event]]) -> None:
        with self._lock:
            urgent = False
            for _, event in items:
                rid = event.request_id
                if isinstance(event, Failure):
                    self._buffer.append(event)
                else:
                    held = self._open.get(rid)
                    if held is not None:
                        merge(held, event)
                    else:
                        self._open[rid] = held = update(event)
                        self._buffer.append(held)
                if isinstance(event, Failure) or event.finished:
                    self._open.pop(rid, None)
                    urgent = True
                    self._eager.discard(rid)
                    self._started.discard(rid)
                elif rid not in self._started:
                    self._started.add(rid)
                    urgent = True
            now = time.perf_counter()
            lazy = not self._eager and len(self._started) > LAZY_MIN_RUNNING
            if urgent or now - self._last_send >= (LAZY_FLUSH_S if lazy else EAGER_FLUSH_S):
                self._send(now)

    def flush(self) -> None:
        with self._lock:
            self._send(time.perf_counter())

    def _send(self, now: float) -> None:
        items, self._buffer = self._buffer, []
        self._open.clear()
        self._last_send = now
        try:
            write_frame(self.fd, Events(packed(items), self.metrics.take(), self._status()))
        except OSError:
            pass  # the HTTP process is gone; the request pipe's EOF stops this process

    def _status(self) -> Status | None:
        s = self.scheduler
        if s is None:
            return None
        return Status(s.rounds, s.last_round_at, s.queued, s.budget_state())


# -- what arrives: the request pipe --------------------------------------------------------------------------


def _no_sink(_: Event) -> None:
    """Events leave through the Relay, not through per-request sinks."""


def queue_arrivals(scheduler: Scheduler, relay: Relay, arrivals: list[tuple[Request, Sink, bool]]) -> None:
    """Submits read together, queued together: the scheduler sees all of them or none (one burst, one prefill)."""
    if arrivals:
        for (request, _, _), err in zip(arrivals, scheduler.submit_many(arrivals), strict=True):
            if err is not None:
                relay.deliver([(_no_sink, Failure(request.request_id, str(err), err.status_code, err.field))])


class RequestPipe:
    """The engine process's end of the request pipe: reads its messages and queues them on the Scheduler.

    Two threads take turns at it (under `_reading`): the scheduler's own while it is idle (its Inbox: the
    submit that it waits for is read, unpickled and admitted on one thread, one wake-up after the write) and
    the main thread (`run`) while the scheduler is busy (arrivals are read while rounds run, as they come,
    each queued with its arrival time). A wait that begins while the main thread sits in poll wakes it through
    a pipe of its own (one write per busy-to-idle change, none per round). Reads go into one preallocated
    buffer: os.read(fd, 1 MiB) allocated, and released, a 1 MiB bytes object a read (~20 us). With
    `poll_window_s` the idle scheduler thread polls the pipe for that long after its last work or arrival
    before it blocks (ddtree.serving.polling).
    """

    def __init__(self, fd: int, scheduler: Scheduler, relay: Relay, poll_window_s: float = 0.0) -> None:
        self.fd = fd
        self.scheduler = scheduler
        self.relay = relay
        self.done = False  # Stop read, the HTTP process gone, or the pipe failed
        self._frames = FrameReader()
        self._buffer = bytearray(READ_BYTES)
        self._reading = threading.Lock()  # held by the thread that polls and reads the pipe now
        self._turn = threading.Condition()  # guards _idle and done
        self._idle = False  # the scheduler thread reads (from its first wait until busy())
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._watched = [fd, self._wake_read]
        self.window = PollWindow(poll_window_s)
        self.polled = 0  # request-pipe reads found by polling, not by a blocking wait (what the tests read)

    def close(self) -> None:
        os.close(self._wake_read)
        os.close(self._wake_write)

    # -- the scheduler thread (ddtree.serving.scheduler.Inbox) --------------------------------------------
    def wait(self, timeout: float | None, changed: Callable[[], bool]) -> None:
        with self._turn:
            if self.done:
                return
            if not self._idle:
                self._idle = True
                self.wake()  # the main thread's select returns and it lets go of the pipe
                self.window.touch()  # the scheduler's work just ended
        with self._reading:
            if not changed():  # else the main thread queued something after the scheduler last looked
                self._select_and_read(timeout, poll=True)

    def busy(self) -> None:
        with self._turn:
            if self._idle:
                self._idle = False
                self._turn.notify_all()

    def wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except OSError:
            pass  # closed at the end

    # -- the main thread -------------------------------------------------------------------------------------
    def run(self) -> None:
        """Read while the scheduler is busy, until Stop, the pipe's EOF or a failed read."""
        while True:
            with self._turn:
                while self._idle and not self.done:
                    self._turn.wait()
                if self.done:
                    return
            with self._reading:
                with self._turn:
                    if self._idle:
                        continue  # the scheduler's turn began meanwhile
                self._select_and_read(None)

    # -- either, under _reading ----------------------------------------------------------------------------
    def _poll(self, timeout: float | None) -> tuple[list[int], float | None]:
        """Poll the pipes until one is ready or the window (or `timeout`) runs out: (ready, the timeout left)."""
        left = self.window.left()
        if timeout is not None:
            left = min(left, timeout)
        if left <= 0:
            return [], timeout
        watched, clock = self._watched, time.perf_counter
        start = clock()
        end = start + left
        while True:
            ready = select.select(watched, [], [], 0)[0]  # releases the GIL, as a blocking select would
            if ready:
                self.polled += self.fd in ready
                return ready, timeout
            now = clock()
            if now >= end:
                return [], None if timeout is None else max(timeout - (now - start), 0.0)

    def _select_and_read(self, timeout: float | None, poll: bool = False) -> None:
        ready: list[int] = []
        if poll:
            ready, timeout = self._poll(timeout)
        if not ready:
            ready = select.select(self._watched, [], [], timeout)[0]
        if self._wake_read in ready:
            try:
                os.read(self._wake_read, 4096)
            except BlockingIOError:
                pass
        if self.fd not in ready or self.done:
            return
        try:
            size = os.readv(self.fd, [self._buffer])
        except OSError as err:
            log.warning("reading requests failed (%s); stopping the engine", err)
            self._finish()
            return
        if not size:
            log.warning("the HTTP process is gone; stopping the engine")
            self._finish()
            return
        self.window.touch()
        self._handle(self._frames.feed(memoryview(self._buffer)[:size]))

    def _handle(self, messages: list[Message]) -> None:
        scheduler, relay = self.scheduler, self.relay
        arrivals: list[tuple[Request, Sink, bool]] = []
        for message in messages:
            if type(message) is Submit:
                request = message.request
                if stamps.ON:
                    stamps.stamp(request.request_id, "e_read")
                relay.submitted(request.request_id, message.eager)
                arrivals.append((request, _no_sink, message.counted))
                continue
            queue_arrivals(scheduler, relay, arrivals)  # what came before a cancel or a stop, first
            arrivals = []
            if type(message) is Cancel:
                scheduler.cancel(message.request_id)
            elif type(message) is Stop:
                self._finish()
                return
        queue_arrivals(scheduler, relay, arrivals)

    def _finish(self) -> None:
        with self._turn:
            self.done = True
            self._turn.notify_all()
        self.scheduler.shutdown()


# -- the process ---------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL this process when the HTTP process dies, even while it loads (when nothing reads the pipe yet).
    Linux's prctl(PR_SET_PDEATHSIG); elsewhere the pipe's EOF after loading is the only sign."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def engine_cpus(value: str, cpu_count: int) -> set[int]:
    """The CPU numbers of a list like taskset's ("15", "12-15", "0,2-3"); ConfigError naming the variable if bad."""
    allowed = f"allowed: CPU numbers 0-{cpu_count - 1} as N, A-B or a comma-separated list of them"
    cpus: set[int] = set()
    try:
        for item in value.split(","):
            low, _, high = item.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ConfigError(f"{ENGINE_CPUS_ENV}: {value!r} is not a CPU list ({allowed})") from None
    if not cpus or min(cpus) < 0 or max(cpus) >= cpu_count:
        raise ConfigError(f"{ENGINE_CPUS_ENV}: {value!r} is out of range ({allowed})")
    return cpus


def pin_to_cpus() -> None:
    """Keep this process (and every thread it starts after: the scheduler's, CUDA's) on the CPUs that
    DDTREE_ENGINE_CPUS names, if it names any: a round's host work then never shares a CPU with the HTTP
    process or a client woken by its events. Unset: the kernel places it."""
    value = os.environ.get(ENGINE_CPUS_ENV, "").strip()
    if value:
        cpus = engine_cpus(value, os.cpu_count() or 1)
        os.sched_setaffinity(0, cpus)
        log.info("engine process pinned to CPUs %s", sorted(cpus))


def freeze_heap() -> None:
    """Move every object alive now (modules, weights' wrappers, the tokenizer) out of the garbage collector's reach.

    With torch imported a full collection walks ~200k objects: ~90 ms on a 2-core machine, a stall of every
    round (or every stream) whenever the collector decides it is due. What serving allocates is still collected.
    Both processes call it once they only serve.
    """
    gc.collect()
    gc.freeze()


def engine_main(requests: int, events: int, parent_ends: tuple[int, int],
                load: Callable[[], tuple[Any, int]], serve: SchedulerFactory, log_level: str,
                poll_window_s: float = 0.0) -> None:
    """The child: load, report, then run the Scheduler until Stop or until the HTTP process is gone."""
    for fd in parent_ends:  # forked copies of the HTTP side's ends: kept open, they would hide its death
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the HTTP process drains and then stops this one
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    logging.getLogger().setLevel(log_level.upper())
    if stamps.ON:
        stamps.reset()  # the HTTP process's, inherited
        stamps.set_role("engine")
    relay = Relay(events)
    try:
        pin_to_cpus()
        engine, context_length = load()
        scheduler = serve(engine, context_length, relay.metrics, relay.deliver)
    except ModelLoadError as err:
        write_frame(events, StartFailed(1, str(err)))
        return
    except ConfigError as err:
        write_frame(events, StartFailed(2, str(err)))
        return
    except Exception as err:
        log.exception("the engine failed to start")
        write_frame(events, StartFailed(1, f"the engine failed to start: {type(err).__name__}: {err}"))
        return
    relay.scheduler = scheduler
    freeze_heap()
    scheduler.after_warm_up = freeze_heap  # and what the graph warm-up made: captured graphs live as long
    device = getattr(engine, "device", None)
    write_frame(events, Loaded(EngineInfo(
        eos_token_id=engine.eos_token_id, max_context=engine.max_context, vocab_size=engine.vocab_size,
        context_length=context_length, device=str(device) if device is not None else "cpu",
        attention=str(getattr(engine, "attention", "")), cuda_graphs=bool(getattr(engine, "cuda_graphs", False)))))
    pipe = RequestPipe(requests, scheduler, relay, poll_window_s)
    scheduler.inbox = pipe
    scheduler.start()
    try:
        pipe.run()
    finally:
        scheduler.stop()
        relay.flush()
        pipe.close()
        if stamps.ON:
            stamps.dump()
