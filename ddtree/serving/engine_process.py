"""The engine in a process of its own: the HTTP process and the decode rounds never wait for each other's GIL.

`python -m ddtree.server` forks, before either process has touched CUDA, a child that loads the engine, opens
the batch and runs the Scheduler; the HTTP process parses, validates, tokenizes, detokenizes and streams. In one
process the event loop's work (an SSE chunk is ~100 us of Python) and the round's host work took turns on one
GIL: at 32 streams on the H200 rounds ran 25% slower than the engine's and arrivals were parsed at the pace the
rounds left over. SGLang splits its server the same way (tokenizer manager, scheduler and detokenizer
processes); two pipes of pickled tuples are all this one needs:

    HTTP -> engine:  ("submit", Request, counted, eager) | ("cancel", request_id) | ("stop",)
    engine -> HTTP:  ("loaded", EngineInfo) | ("failed", exit_code, message)
                     | ("events", [event tuple], metrics delta, status)

The engine side holds a round's outputs until a request finishes or gets its first token (TTFT and E2E are
never held back), or EAGER_FLUSH_S has passed while a streamed request runs or a lone request does
(LAZY_FLUSH_S while only plain ones do, more than LAZY_MIN_RUNNING of them): each send pickles and writes
from the round's own thread, ~10-30 us, which at one row per 0.26 ms round would cost more than a tenth of the
round if paid every round.

EngineProcess is the HTTP side: the Scheduler's interface (submit, cancel, in_flight, ...), sinks called on
the event loop as the events arrive. A child that dies fails every request in flight with a 500, and the
server exits (status 1); a parent that dies closes the pipe, and the child stops.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import gc
import logging
import multiprocessing
import os
import pickle
import select
import signal
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree.engine import Request, StepOutput
from ddtree.errors import ConfigError, ModelLoadError, RequestError
from ddtree.serving import stamps
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.polling import LoopPoller, PollWindow
from ddtree.serving.scheduler import Event, Failure, Scheduler, Sink

log = logging.getLogger("ddtree.server")

# the most a streamed request's tokens wait in the engine process: the HTTP side sends a stream's chunks at
# most every 2 ms (state.STREAM_MIN_INTERVAL_S), so a frame every 1 ms woke its loop twice per chunk (each
# wake-up ~50-100 us of uvloop and unpickling on 2 cores)
EAGER_FLUSH_S = 0.002
LAZY_FLUSH_S = 0.02  # likewise when every running request is plain: only /metrics and /server_info read them
# ... and more than this many run. A plain answer decodes its text as its events arrive, so a frame that held
# 20 ms of rounds left that decoding and unpickling for after the last token (~0.25 ms on 2 cores, at
# concurrency 1); a lone request's frames every 2 ms cost it nothing, while at 4 plain requests on 2 cores
# they slowed the rounds by ~7% (docs/perf.md, "The HTTP server")
LAZY_MIN_RUNNING = 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_TIMEOUT_S = 15.0  # for the child to abort what runs and exit, before it is terminated
ENGINE_CPUS_ENV = "DDTREE_ENGINE_CPUS"  # CPUs the engine process runs on (taskset's list: "15", "12-15", "1,3")


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the engine (ServerState's `engine` in this mode)."""

    eos_token_id: int | None
    max_context: int
    vocab_size: int
    context_length: int
    device: str
    attention: str
    cuda_graphs: bool


class EngineStartError(Exception):
    """The engine process could not start; `exit_code` is the server's (1: model load, 2: a bad setting)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SchedulerFactory(Protocol):
    """How the child turns a loaded engine into the Scheduler it runs (ddtree.serving.state.open_scheduler)."""

    def __call__(self, engine: Any, context_length: int, metrics: Any, deliver: Any) -> Scheduler: ...


# -- the engine side ------------------------------------------------------------------------------------


def _encode(event: Event) -> tuple[Any, ...] | list[Any]:
    # tuples/lists, not the dataclasses: pickling a dataclass costs ~5x its fields'. No budgets: nothing on the
    # HTTP side reads them (/server_info's come with the status), and a plain request's last frame held ~80
    # rounds of them as one more list of ints to pickle and unpickle
    if isinstance(event, Failure):
        return (event.request_id, event.message, event.status_code, event.field)
    return [event.request_id, event.new_token_ids, event.finished, event.finish_reason, event.verify_steps,
            event.accept_lengths, event.logprobs]


def _merge(held: list[Any], event: StepOutput) -> None:
    """A later round of the same request into its held event: what the HTTP side would have applied in turn
    (tokens, accepted lengths, budgets, log-probs appended; the latest verify count and finish). A frame then
    carries one event a request however many rounds it holds (a plain request's ~80 rounds in 20 ms were ~80
    events to unpickle and apply, on the way to its answer)."""
    # new lists (+, not +=): the engine's own are not changed
    held[1] = held[1] + event.new_token_ids
    held[2], held[3], held[4] = event.finished, event.finish_reason, event.verify_steps
    held[5] = held[5] + event.accept_lengths
    held[6] = held[6] + event.logprobs


def _packed(items: list[Any]) -> list[Any]:
    """The events as they are sent: accepted lengths as bytes where they fit (one object to pickle, not one
    int per round)."""
    for item in items:
        if len(item) != 4 and item[5]:
            try:
                item[5] = bytes(item[5])
            except ValueError:
                pass  # a length over 255: the list
    return items


def _decode(item: tuple[Any, ...]) -> Event:
    if len(item) == 4:
        return Failure(*item)
    rid, tokens, finished, reason, verify_steps, accepted, logprobs = item
    return StepOutput(rid, tokens, finished, reason, verify_steps, list(accepted), [], logprobs)


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

    def take(self) -> tuple[Any, ...]:
        with self._lock:
            delta = (self.prompt_tokens, self.tokens, self.steps, self.drafts, self.round_tokens, self.round_s,
                     self.rounds, dict(self.outcomes), self.load)
            self._reset()
        return delta


def apply_delta(metrics: ServerMetrics, delta: tuple[Any, ...]) -> None:
    prompt, tokens, steps, drafts, round_tokens, round_s, rounds, outcomes, load = delta
    if prompt:
        metrics.record_admitted(prompt)
    if tokens or steps:
        metrics.record_progress(tokens, steps, drafts)
    if rounds:
        metrics.record_round(round_tokens, round_s, rounds)
    for outcome, count in outcomes.items():
        metrics.record_outcome(outcome, count)
    if load is not None:
        metrics.set_load(*load)


FRAME = struct.Struct("!Q")  # each message on the events pipe: its pickle's length, then the pickle


def write_frame(fd: int, message: Any) -> None:
    """One message onto the (blocking) events pipe."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """The messages in a byte stream of frames, as its pieces arrive (the loop reads what a pipe holds)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(self._buffer)
            end = FRAME.size + size
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(memoryview(self._buffer)[FRAME.size:end]))
            del self._buffer[:end]
        return messages


class Relay:
    """The child's side of the events pipe: the Scheduler's `deliver`, batched into one send per flush."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.metrics = MetricsRelay()
        self.scheduler: Scheduler | None = None
        self._lock = threading.Lock()
        self._buffer: list[Any] = []  # encoded events; a running request's held rounds merged into one
        self._open: dict[str, list[Any]] = {}  # rid -> its merged event in the buffer, while it may still grow
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
                held = self._open.get(rid)
                if held is not None and not isinstance(event, Failure):
                    _merge(held, event)
                else:
                    item = _encode(event)
                    self._buffer.append(item)
                    if isinstance(item, list):
                        self._open[rid] = item
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
            write_frame(self.fd, ("events", _packed(items), self.metrics.take(), self._status()))
        except OSError:
            pass  # the HTTP process is gone; the request pipe's EOF stops this process

    def _status(self) -> dict[str, Any]:
        s = self.scheduler
        if s is None:
            return {}
        return {"rounds": s.rounds, "last_round_at": s.last_round_at, "warm_seconds": s.warm_seconds,
                "queued": s.queued, "budget": s.budget_state()}


PIPE_BYTES = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
F_SETPIPE_SZ = 1031  # linux/fcntl.h (fcntl.F_SETPIPE_SZ from Python 3.10, on Linux only)


def _pipe() -> tuple[int, int]:
    """A pipe that holds a burst: 32 arrivals of 1024 ids are ~100 KB of submits, more than the default 64 KiB,
    and a full pipe blocks the HTTP process's event loop in write() until the engine's reader drains it."""
    read, write = os.pipe()
    try:
        fcntl.fcntl(write, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # not Linux, or a lower pipe-max-size: the default size still works, only slower under bursts
    return read, write


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
    """
    gc.collect()
    gc.freeze()


def _no_sink(_: Event) -> None:
    """Events leave through the Relay, not through per-request sinks."""


def read_frames(fd: int) -> Iterator[Any]:
    """The messages on a blocking pipe, until its writer closes it."""
    for messages in read_batches(fd):
        yield from messages


READ_BYTES = 1 << 20  # the most one read of the request pipe takes (its size: a burst's submits in one read)


def read_batches(fd: int) -> Iterator[list[Any]]:
    """The messages on a blocking pipe, as lists of what each read brought, until its writer closes it."""
    reader, buffer = FrameReader(), bytearray(READ_BYTES)
    while size := os.readv(fd, [buffer]):
        if messages := reader.feed(memoryview(buffer)[:size]):
            yield messages


def _queue(scheduler: Scheduler, relay: Relay, arrivals: list[tuple[Request, Sink, bool]]) -> None:
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
        self.done = False  # "stop" read, the HTTP process gone, or the pipe failed
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
        """Read while the scheduler is busy, until "stop", the pipe's EOF or a failed read."""
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

    def _handle(self, messages: list[Any]) -> None:
        scheduler, relay = self.scheduler, self.relay
        arrivals: list[tuple[Request, Sink, bool]] = []
        for message in messages:
            kind = message[0]
            if kind == "submit":
                _, request, counted, eager = message
                if stamps.ON:
                    stamps.stamp(request.request_id, "e_read")
                relay.submitted(request.request_id, eager)
                arrivals.append((request, _no_sink, counted))
                continue
            _queue(scheduler, relay, arrivals)  # what came before a cancel or a stop, first
            arrivals = []
            if kind == "cancel":
                scheduler.cancel(message[1])
            elif kind == "stop":
                self._finish()
                return
        _queue(scheduler, relay, arrivals)

    def _finish(self) -> None:
        with self._turn:
            self.done = True
            self._turn.notify_all()
        self.scheduler.shutdown()


def engine_main(requests: int, events: int, parent_ends: tuple[int, int],
                load: Callable[[], tuple[Any, int]], serve: SchedulerFactory, log_level: str,
                poll_window_s: float = 0.0) -> None:
    """The child: load, report, then run the Scheduler until "stop" or until the HTTP process is gone."""
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
        write_frame(events, ("failed", 1, str(err)))
        return
    except ConfigError as err:
        write_frame(events, ("failed", 2, str(err)))
        return
    except Exception as err:
        log.exception("the engine failed to start")
        write_frame(events, ("failed", 1, f"the engine failed to start: {type(err).__name__}: {err}"))
        return
    relay.scheduler = scheduler
    freeze_heap()
    scheduler.after_warm_up = freeze_heap  # and what the graph warm-up made: captured graphs live as long
    device = getattr(engine, "device", None)
    write_frame(events, ("loaded", EngineInfo(
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


# -- the HTTP side --------------------------------------------------------------------------------------

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
        child_requests, self._requests = _pipe()
        self._events, child_events = _pipe()
        self._process = context.Process(
            target=engine_main, name="ddtree-engine", daemon=True,
            args=(child_requests, child_events, (self._requests, self._events), load, serve, log_level,
                  poll_window_s))
        self._process.start()
        os.close(child_requests)  # only the child's copies stay open: its death is an EOF here
        os.close(child_events)
        self._frames = FrameReader()
        self._inbox = bytearray(PIPE_BYTES)  # what one read of the events pipe brings
        self._early: list[Any] = []  # messages read with the "loaded" one
        self.metrics = ServerMetrics()
        self.info: EngineInfo | None = None
        self.on_death: Callable[[str], None] | None = None
        self._send_lock = threading.Lock()  # stop() may run on another thread than the loop's sends
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, Sink] = {}
        self._status: dict[str, Any] = {}
        self._stopping = False
        self._closed = False
        self._dead: str | None = None
        self.poll_window_s = poll_window_s
        self.poller: LoopPoller | None = None

    # -- start and stop --------------------------------------------------------------------------------
    def wait_loaded(self, timeout: float | None = None) -> EngineInfo:
        """Block until the child has loaded the engine and opened the batch; EngineStartError if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        messages: list[Any] = []
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
        if message[0] == "failed":
            self._process.join(5)
            raise EngineStartError(message[1], message[2])
        self.info = message[1]
        return self.info

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
            self._send(("stop",))
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
            self._send(("submit", request, counted, eager))
        except RequestError:
            self._sinks.pop(rid, None)
            raise

    def cancel(self, request_id: str) -> None:
        if request_id in self._sinks and self._dead is None:
            try:
                self._send(("cancel", request_id))
            except RequestError:
                pass  # the death handler fails it

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    @property
    def queued(self) -> int:
        return int(self._status.get("queued", 0))

    @property
    def rounds(self) -> int:
        return int(self._status.get("rounds", 0))

    @property
    def last_round_at(self) -> float:
        return float(self._status.get("last_round_at", time.monotonic()))

    @property
    def warm_seconds(self) -> float | None:
        return self._status.get("warm_seconds")

    def budget_state(self) -> tuple[int, float] | None:
        return self._status.get("budget")

    def _send(self, message: tuple[Any, ...]) -> None:
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

    def _handle(self, messages: list[Any]) -> None:
        loop = self._loop
        if self.poller is not None and messages:
            self.poller.touch()
        for message in messages:
            if message[0] == "events":
                self._dispatch(message[1])
                self._status = message[3] or self._status
                # the metrics after the woken requests' next step (a chunk or an answer written), not before it:
                # ~10 us of Prometheus counters (warm) that no reply waits for
                if loop is not None:
                    loop.call_soon(apply_delta, self.metrics, message[2])
                else:
                    apply_delta(self.metrics, message[2])

    def _dispatch(self, items: list[tuple[Any, ...]]) -> None:
        sinks = self._sinks
        for item in items:
            event = _decode(item)
            rid = event.request_id
            if _seen is not None:
                _seen(rid, bool(getattr(event, "new_token_ids", None)), getattr(event, "finished", True))
            sink = sinks.get(rid)
            if sink is None:
                continue  # a cancelled request's last round
            if isinstance(event, Failure) or event.finished:
                del sinks[rid]
            sink(event)

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
