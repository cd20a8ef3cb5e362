"""The engine process's request pipe as the scheduler's inbox (engine_worker.RequestPipe): an idle scheduler
thread reads and admits a submit itself; a busy one leaves the reading to the main thread (cancels and later
arrivals still arrive while rounds run); Stop and the pipe's EOF end both."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

from ddtree.serving import engine_worker as ep
from ddtree.serving.scheduler import Scheduler
from ddtree.serving.wire import Cancel, FrameReader, Message, Stop, Submit, write_frame
from tests.unit.test_scheduler_burst import GroupBatch, request


class ThreadBatch(GroupBatch):
    """A GroupBatch that notes which thread cancelled each request."""

    def __init__(self, round_s: float) -> None:
        super().__init__(round_s=round_s)
        self.cancelled_on: dict[str, str] = {}

    def cancel(self, request_id: str) -> Any:
        self.cancelled_on[request_id] = threading.current_thread().name
        return super().cancel(request_id)


class ThreadPipe(ep.RequestPipe):
    """A RequestPipe that notes which thread read each message: (kind, rid) -> thread name."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read_on: dict[tuple[str, str], str] = {}

    def _handle(self, messages: list[Message]) -> None:
        for m in messages:
            rid = m.request.request_id if isinstance(m, Submit) else m.request_id if isinstance(m, Cancel) else ""
            self.read_on[(type(m).__name__.lower(), rid)] = threading.current_thread().name
        super()._handle(messages)


class Served:
    """A scheduler with a RequestPipe inbox on a real pipe; the pipe's main-thread reader runs on `reader`."""

    def __init__(self, batch: GroupBatch, poll_window_s: float = 0.0) -> None:
        self.read, self.write = os.pipe()
        self.events = tempfile.TemporaryFile()
        self.relay = ep.Relay(self.events.fileno())
        self.scheduler = Scheduler(batch, max_running=8, metrics=self.relay.metrics, deliver=self.relay.deliver,
                                   switch_interval_s=None)
        self.relay.scheduler = self.scheduler
        self.pipe = ThreadPipe(self.read, self.scheduler, self.relay, poll_window_s)
        self.scheduler.inbox = self.pipe
        self.scheduler.start()
        self.reader = threading.Thread(target=self.pipe.run, name="pipe-main")
        self.reader.start()

    def send(self, *messages: Message) -> None:
        frames = b"".join(self._frame(m) for m in messages)  # one write: one read, read together
        os.write(self.write, frames)

    @staticmethod
    def _frame(message: Message) -> bytes:
        r, w = os.pipe()
        try:
            write_frame(w, message)
            return os.read(r, 1 << 20)
        finally:
            os.close(r)
            os.close(w)

    def finished(self) -> dict[str, str]:
        """rid -> finish reason of every request whose finish (or failure) has left through the relay."""
        self.relay.flush()
        # pread: the relay's writes (another thread) share the file's offset, which a seek(0) + read would move
        # back to 0 for a moment, and a write in that moment lands over the first frames
        fd = self.events.fileno()
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        out: dict[str, str] = {}
        for message in FrameReader().feed(data):
            for item in message.updates:
                if not isinstance(item, list):  # a Failure
                    out[item.request_id] = "failed"
                elif item[2]:  # an Update that finished
                    out[item[0]] = item[3]
        return out

    def wait_finished(self, rids: set[str], timeout: float = 10.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.finished()
            if rids <= done.keys():
                return done
            time.sleep(0.01)
        raise AssertionError(f"not finished in {timeout} s: {rids - self.finished().keys()}")

    def close(self) -> None:
        try:
            os.close(self.write)
        except OSError:
            pass
        self.reader.join(10)
        self.scheduler.stop()
        self.pipe.close()
        os.close(self.read)
        self.events.close()


def test_an_idle_scheduler_reads_and_admits_a_submit_on_its_own_thread() -> None:
    served = Served(ThreadBatch(round_s=0.001))
    try:
        time.sleep(0.05)  # idle: the scheduler's turn at the pipe
        served.send(Submit(request("a"), True, False))
        assert served.wait_finished({"a"}) == {"a": "length"}
        time.sleep(0.05)
        served.send(Submit(request("b"), True, True))
        assert served.wait_finished({"a", "b"})["b"] == "length"
    finally:
        served.close()
    assert served.pipe.read_on == {("submit", "a"): "ddtree-scheduler", ("submit", "b"): "ddtree-scheduler"}


def test_submits_of_one_read_join_together_and_a_busy_scheduler_still_gets_cancels() -> None:
    batch = ThreadBatch(round_s=0.005)
    served = Served(batch)
    try:
        time.sleep(0.05)
        long = request("long", new=400)  # ~2 s of 5 ms rounds: running while the rest arrives
        served.send(Submit(long, True, True), Submit(request("x"), True, True),
                    Submit(request("y"), True, True))
        served.wait_finished({"x", "y"})
        served.send(Cancel("long"))  # read by the main thread: the scheduler runs rounds meanwhile
        done = served.wait_finished({"long"}, timeout=1.5)
    finally:
        served.close()
    assert done == {"long": "abort", "x": "length", "y": "length"}
    assert batch.groups == [["long", "x", "y"]]  # one read, one burst, one prefill
    assert served.pipe.read_on == {**{("submit", rid): "ddtree-scheduler" for rid in ("long", "x", "y")},  # idle
                                   ("cancel", "long"): "pipe-main"}  # busy: the main thread's turn at the pipe
    assert batch.cancelled_on == {"long": "ddtree-scheduler"}  # the batch itself is the scheduler thread's alone


def test_stop_and_eof_end_the_reader_and_the_scheduler() -> None:
    served = Served(ThreadBatch(round_s=0.001))
    try:
        time.sleep(0.05)
        served.send(Stop())  # read by the idle scheduler thread itself
        served.reader.join(5)
        assert served.pipe.read_on == {("stop", ""): "ddtree-scheduler"}
        assert not served.reader.is_alive() and served.pipe.done
        served.scheduler._thread.join(5)  # type: ignore[union-attr]
        assert not served.scheduler.alive
    finally:
        served.close()
    served = Served(ThreadBatch(round_s=0.001))
    try:
        served.send(Submit(request("a", new=200), True, True))
        time.sleep(0.05)  # running: the main thread's turn at the pipe
        os.close(served.write)  # the HTTP process is gone
        served.reader.join(5)
        assert not served.reader.is_alive() and served.pipe.done
        served.scheduler._thread.join(5)  # type: ignore[union-attr]
        assert not served.scheduler.alive
        assert served.finished()["a"] == "abort"
    finally:
        served.close()


def test_a_wait_returns_at_once_when_another_thread_queued_something_meanwhile() -> None:
    """The scheduler looked, found nothing, and the main thread queued an arrival before the scheduler's turn
    at the pipe began: wait() must not block on an empty pipe with that arrival queued."""
    read, write = os.pipe()
    scheduler = Scheduler(ThreadBatch(round_s=0.0), max_running=2, switch_interval_s=None)
    with tempfile.TemporaryFile() as events:
        pipe = ep.RequestPipe(read, scheduler, ep.Relay(events.fileno()))
        try:
            started = time.perf_counter()
            pipe.wait(5.0, lambda: True)
            assert time.perf_counter() - started < 1.0
            pipe.wait(0.0, lambda: False)  # takes the wake-up byte the first turn left (a spurious return is fine)
            started = time.perf_counter()
            pipe.wait(0.05, lambda: False)  # nothing changed, nothing arrives: the timeout
            assert 0.04 < time.perf_counter() - started < 2.0
        finally:
            pipe.close()
            os.close(read)
            os.close(write)


def test_an_idle_scheduler_polls_for_a_submit_inside_the_window_and_blocks_after_it() -> None:
    """With a poll window the idle scheduler thread finds a submit by polling (no blocking wait) while the window
    since its last work is open; once it has closed, the next submit is found by a blocking wait."""
    served = Served(ThreadBatch(round_s=0.001), poll_window_s=0.5)
    try:
        time.sleep(0.05)  # idle for 50 ms: inside the window that opened when the scheduler first waited
        served.send(Submit(request("a"), True, True))
        served.wait_finished({"a"})
        assert served.pipe.polled == 1
        time.sleep(0.05)  # the window opened again when "a" was read and when its rounds ended
        served.send(Submit(request("b"), True, True))
        served.wait_finished({"a", "b"})
        assert served.pipe.polled == 2
        time.sleep(0.8)  # past the window: the thread blocks
        served.send(Submit(request("c"), True, True))
        assert served.wait_finished({"a", "b", "c"}) == {"a": "length", "b": "length", "c": "length"}
        assert served.pipe.polled == 2
    finally:
        served.close()
    assert {thread for thread in served.pipe.read_on.values()} == {"ddtree-scheduler"}


def test_a_polling_wait_still_returns_at_its_timeout() -> None:
    """A burst hold waits with a timeout: polling inside an open window must not outlast it."""
    read, write = os.pipe()
    scheduler = Scheduler(ThreadBatch(round_s=0.0), max_running=2, switch_interval_s=None)
    with tempfile.TemporaryFile() as events:
        pipe = ep.RequestPipe(read, scheduler, ep.Relay(events.fileno()), 5.0)
        try:
            pipe.wait(0.0, lambda: False)  # the first wait opens the window (and takes its own wake-up byte)
            started = time.perf_counter()
            pipe.wait(0.05, lambda: False)
            assert 0.04 < time.perf_counter() - started < 1.0
            assert pipe.window.left() > 3.0 and pipe.polled == 0
        finally:
            pipe.close()
            os.close(read)
            os.close(write)
