"""The wire between the server's two processes: the messages each way, their codec and the pipes' frames.

    HTTP -> engine:  Submit(request, counted, eager) | Cancel(request_id) | Stop()
    engine -> HTTP:  Loaded(info) | StartFailed(exit_code, message) | Events(updates, metrics, status)

Each message is a NamedTuple. On the pipe it is a plain tuple, `(code, *fields)`, pickled and framed with its
length: pickling a NamedTuple itself writes its class's reference and calls its Python `__getnewargs__` (and
`__new__` to load it), ~1.3 us more per Submit at each end and ~1 us more per Events item to pickle. An Events frame
carries each request's rounds since the last frame as an `Update` (a StepOutput's fields as a list, merged
where a request's rounds were held) or a Failure; `event` turns either into what the sinks take. Nothing
here imports torch: the HTTP process imports this module, and the engine process before it loads a model.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ddtree.request import Request, StepOutput

# -- what the scheduler hands out, and what the wire carries back --------------------------------------


@dataclass(frozen=True)
class Failure:
    """A request the batch refused or lost; the server turns it into a 4xx/5xx or an abort chunk."""

    request_id: str
    message: str
    status_code: int = 400
    field: str | None = None


Event = StepOutput | Failure
Sink = Callable[[Event], None]
Deliver = Callable[[list[tuple[Sink, Event]]], None]  # one call per loop iteration: every (sink, event) of it


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the engine (ServerState's `engine` when the engine runs in its own process)."""

    eos_token_id: int | None
    max_context: int
    vocab_size: int
    context_length: int
    device: str
    attention: str
    cuda_graphs: bool


# -- HTTP -> engine -----------------------------------------------------------------------------------------


class Submit(NamedTuple):
    """Queue `request`. counted: False for the server's own warm-up and health probes (kept out of the metrics);
    eager: its every round is wanted soon (a stream), so its frames are not held for LAZY_FLUSH_S."""

    request: Request
    counted: bool
    eager: bool


class Cancel(NamedTuple):
    """Abort a queued or running request (its client went away)."""

    request_id: str


class Stop(NamedTuple):
    """Abort what runs and exit."""


# -- engine -> HTTP -----------------------------------------------------------------------------------------


class Loaded(NamedTuple):
    """The engine is loaded and its batch open: the first message, once."""

    info: EngineInfo


class StartFailed(NamedTuple):
    """The engine could not start (the first and last message); exit_code is the server's: 1 model load, 2 a setting."""

    exit_code: int
    message: str


# A request's rounds since the last frame, as sent: [request_id, new_token_ids, finished, finish_reason,
# verify_steps, accept_lengths (bytes where each fits one), logprobs]. A list, not a NamedTuple: the relay
# merges held rounds into it in place, and it pickles without a class reference (see the module's docstring).
Update = list[Any]


class MetricsDelta(NamedTuple):
    """ServerMetrics' recordings in the engine process since the last frame (summed by MetricsRelay)."""

    prompt_tokens: int
    tokens: int
    steps: int
    drafts: int
    round_tokens: int
    round_s: float
    rounds: int
    outcomes: dict[str, int]
    load: tuple[int, int] | None  # (running, queued) as last set


class Status(NamedTuple):
    """The scheduler's state as of a frame: what /server_info and /health_generate read."""

    rounds: int
    last_round_at: float
    queued: int
    budget: tuple[int, float] | None  # (last, mean) budget auto chose; None when it is off


class Events(NamedTuple):
    """One flush of the engine's relay: its held updates and failures, in order, then the metrics and status."""

    updates: list[Update | Failure]
    metrics: MetricsDelta
    status: Status | None  # None before the scheduler runs


ToEngine = Submit | Cancel | Stop
FromEngine = Loaded | StartFailed | Events
Message = ToEngine | FromEngine


# -- an Update: a StepOutput in the form an Events frame carries it -------------------------------------


def update(event: StepOutput) -> Update:
    """The fields sent of `event`. No budgets: nothing on the HTTP side reads them (/server_info's come with the
    status), and a plain request's last frame held ~80 rounds of them as one more list of ints to pickle."""
    return [event.request_id, event.new_token_ids, event.finished, event.finish_reason, event.verify_steps,
            event.accept_lengths, event.logprobs]


def merge(held: Update, event: StepOutput) -> None:
    """A later round of the same request into its held update: what the HTTP side would have applied in turn
    (tokens, accepted lengths, log-probs appended; the latest verify count and finish). A frame then carries one
    update a request however many rounds it holds (a plain request's ~80 rounds in 20 ms were ~80 events to
    unpickle and apply, on the way to its answer)."""
    # new lists (+, not +=): the engine's own are not changed
    held[1] = held[1] + event.new_token_ids
    held[2], held[3], held[4] = event.finished, event.finish_reason, event.verify_steps
    held[5] = held[5] + event.accept_lengths
    held[6] = held[6] + event.logprobs


def packed(items: list[Update | Failure]) -> list[Update | Failure]:
    """The items as they are sent: accepted lengths as bytes where they fit (one object to pickle, not one int
    per round)."""
    for item in items:
        if type(item) is list and item[5]:
            try:
                item[5] = bytes(item[5])
            except ValueError:
                pass  # a length over 255: the list
    return items


def event(item: Update | Failure) -> Event:
    """What the sinks take of one item of an Events frame."""
    if type(item) is not list:
        return item  # a Failure
    rid, tokens, finished, reason, verify_steps, accepted, logprobs = item
    return StepOutput(rid, tokens, finished, reason, verify_steps, list(accepted), [], logprobs)


# -- the codec ---------------------------------------------------------------------------------------------

KINDS: tuple[type[Any], ...] = (Submit, Cancel, Stop, Loaded, StartFailed, Events)
_CODES = {kind: code for code, kind in enumerate(KINDS)}
_EVENTS = _CODES[Events]


def encode(message: Message) -> tuple[Any, ...]:
    """`message` as plain tuples and lists (what is pickled)."""
    if type(message) is Events:
        status = message.status
        return (_EVENTS, message.updates, tuple(message.metrics), None if status is None else tuple(status))
    return (_CODES[type(message)], *message)


_new = tuple.__new__  # a NamedTuple from its fields without a Python call (its __new__ and _make are Python's)


def decode(data: tuple[Any, ...]) -> Message:
    """The message `encode` made `data` of (both ends run this module, so the fields match their class)."""
    kind = KINDS[data[0]]
    if kind is Events:
        _, updates, metrics, status = data
        return _new(Events, (updates, _new(MetricsDelta, metrics), None if status is None else _new(Status, status)))
    message: Message = _new(kind, data[1:])
    return message


# -- frames on a pipe --------------------------------------------------------------------------------------

FRAME = struct.Struct("!Q")  # each message on a pipe: its pickle's length, then the pickle
READ_BYTES = 1 << 20  # the most one read of the request pipe takes (its size: a burst's submits in one read)


def write_frame(fd: int, message: Message) -> None:
    """One message onto a (blocking) pipe."""
    data = pickle.dumps(encode(message), protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """The messages in a byte stream of frames, as its pieces arrive (the loop reads what a pipe holds)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | memoryview) -> list[Message]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(self._buffer)
            end = FRAME.size + size
            if len(self._buffer) < end:
                break
            messages.append(decode(pickle.loads(memoryview(self._buffer)[FRAME.size:end])))
            del self._buffer[:end]
        return messages


def read_frames(fd: int) -> Iterator[Message]:
    """The messages on a blocking pipe, until its writer closes it."""
    for messages in read_batches(fd):
        yield from messages


def read_batches(fd: int) -> Iterator[list[Message]]:
    """The messages on a blocking pipe, as lists of what each read brought, until its writer closes it."""
    reader, buffer = FrameReader(), bytearray(READ_BYTES)
    while size := os.readv(fd, [buffer]):
        if messages := reader.feed(memoryview(buffer)[:size]):
            yield messages


PIPE_BYTES = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
F_SETPIPE_SZ = 1031  # linux/fcntl.h (fcntl.F_SETPIPE_SZ from Python 3.10, on Linux only)


def pipe() -> tuple[int, int]:
    """A pipe that holds a burst: 32 arrivals of 1024 ids are ~100 KB of submits, more than the default 64 KiB,
    and a full pipe blocks the HTTP process's event loop in write() until the engine's reader drains it."""
    read, write = os.pipe()
    try:
        fcntl.fcntl(write, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # not Linux, or a lower pipe-max-size: the default size still works, only slower under bursts
    return read, write
