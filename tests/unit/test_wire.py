"""The wire between the server's processes (ddtree.serving.wire): frames, the messages' codec, the pipes."""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.request import Request, StepOutput
from ddtree.serving import wire
from ddtree.serving.wire import (
    Cancel,
    EngineInfo,
    Events,
    Failure,
    Loaded,
    MetricsDelta,
    StartFailed,
    Status,
    Stop,
    Submit,
)

INFO = EngineInfo(eos_token_id=2, max_context=512, vocab_size=4096, context_length=512, device="cpu",
                  attention="sdpa", cuda_graphs=False)
DELTA = MetricsDelta(3, 5, 2, 1, 5, 0.004, 2, {"length": 1}, (1, 0))
MESSAGES = [
    pytest.param(Submit(Request("r", [5, 6, 7], 8, temperature=0.5), True, False), id="submit"),
    pytest.param(Cancel("r"), id="cancel"),
    pytest.param(Stop(), id="stop"),
    pytest.param(Loaded(INFO), id="loaded"),
    pytest.param(StartFailed(2, "--context-length: 9999 exceeds the engine's limit 512"), id="start-failed"),
    pytest.param(Events([["a", [1, 2], False, None, 1, b"\x02", []], Failure("b", "gone", 500)], DELTA,
                        Status(7, 12.5, 1, (16, 14.5))), id="events"),
    pytest.param(Events([], DELTA, None), id="events-before-the-scheduler-runs"),
]


@pytest.mark.parametrize("message", MESSAGES)
def test_every_message_comes_back_as_its_own_type(message: Any) -> None:
    back = wire.decode(pickle.loads(pickle.dumps(wire.encode(message))))
    assert type(back) is type(message) and back == message
    if isinstance(message, Events):
        assert type(back.metrics) is MetricsDelta and (message.status is None or type(back.status) is Status)


@pytest.mark.parametrize("message", MESSAGES)
def test_the_pickle_holds_no_class_of_the_wire(message: Any) -> None:
    """Messages travel as plain tuples: no class reference to write and look up for each (see the module)."""
    data = pickle.dumps(wire.encode(message), protocol=pickle.HIGHEST_PROTOCOL)
    for name in ("Submit", "Cancel", "Stop", "Loaded", "StartFailed", "Events", "MetricsDelta", "Status"):
        assert name.encode() not in data


def test_an_update_is_a_step_output_without_its_budgets() -> None:
    out = StepOutput("s", [1, 2], True, "length", 2, [1, 255, 0], [9, 9, 9], [-0.5, -0.25])
    (sent,) = wire.packed([wire.update(out)])
    assert isinstance(sent[5], bytes)
    assert wire.event(sent) == StepOutput("s", [1, 2], True, "length", 2, [1, 255, 0], [], [-0.5, -0.25])
    failure = Failure("t", "refused", 400, "rid")
    assert wire.event(failure) is failure


messages = st.lists(st.builds(Cancel, st.text(max_size=8)) | st.builds(
    StartFailed, st.integers(0, 2), st.text(max_size=40)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(messages, st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_frames_come_out_whole_however_the_pipe_splits_them(items: list[Any], cuts: list[int]) -> None:
    stream = b"".join(wire.FRAME.pack(len(p)) + p for p in (pickle.dumps(wire.encode(m)) for m in items))
    reader, out, at, i = wire.FrameReader(), [], 0, 0
    while at < len(stream):
        step = cuts[i % len(cuts)]
        out += reader.feed(stream[at:at + step])
        at, i = at + step, i + 1
    assert out == items


@pytest.mark.skipif(sys.platform != "linux", reason="F_SETPIPE_SZ is Linux's")
def test_the_pipes_hold_a_burst_of_arrivals_without_a_reader() -> None:
    """32 submits of 1024 ids (~100 KB) fit in the pipe at once: the HTTP side's loop never waits for the engine's
    reader to drain the default 64 KiB."""
    read, write = wire.pipe()
    try:
        os.set_blocking(write, False)  # a full pipe raises instead of hanging the test
        request = Request("r", list(range(1000, 2024)), 8)
        for _ in range(32):
            wire.write_frame(write, Submit(request, True, True))
    finally:
        os.close(read)
        os.close(write)


def test_write_frame_and_read_frames_round_trip_through_a_pipe() -> None:
    r, w = os.pipe()
    big = Submit(Request("big", list(range(100_000)), 8), True, True)  # larger than a pipe's buffer: in pieces
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the writer
            os.close(r)
            wire.write_frame(w, Cancel("a"))
            wire.write_frame(w, big)
            os._exit(0)
        os.close(w)
        assert list(wire.read_frames(r)) == [Cancel("a"), big]
        os.waitpid(pid, 0)
    finally:
        os.close(r)
