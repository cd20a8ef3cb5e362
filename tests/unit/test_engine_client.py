"""The engine process seen from the HTTP side (ddtree.serving.engine_client, engine_worker): batching of events,
metrics, start-up failures, and what happens when either side dies. The engine is the profiling tools' EmulatedEngine (a round is a short sleep), so
every test forks a real child and talks to it over the real pipes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

import ddtree.serving.engine_worker as worker
from ddtree.errors import ConfigError, ModelLoadError, RequestError
from ddtree.profiling.emulated import EmulatedEngine
from ddtree.request import Request, StepOutput
from ddtree.serving import wire
from ddtree.serving.args import resolve_args
from ddtree.serving.engine_client import EngineProcess, EngineStartError
from ddtree.serving.engine_worker import open_scheduler
from ddtree.serving.wire import Failure

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE_TARGET = os.path.join(REPO, "fixtures", "models", "target")

# -- a forked engine -----------------------------------------------------------------------------------


def emulator_args(spec: str = "ar", **flags: Any) -> Any:
    argv = ["--model-path", FIXTURE_TARGET, "--max-running-requests", "4", "--device", "cpu"]
    if spec != "ar":
        argv += ["--speculative-algorithm", "DDTREE"]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return resolve_args(argv)


def emulated_engine(round_s: float = 0.002) -> tuple[EmulatedEngine, int]:
    return EmulatedEngine(4096, 512, round_s, 0.001, 1), 512


def _start(load: Callable[[], tuple[Any, int]] = emulated_engine, args: Any = None) -> EngineProcess:
    args = args or emulator_args()
    return EngineProcess(load, partial(open_scheduler, spec=args.spec, args=args), "warning")


@pytest.fixture
def engine() -> Iterator[EngineProcess]:
    proc = _start()
    proc.wait_loaded(60)
    yield proc
    proc.stop()


class Collector:
    """Sinks that record every event per request and wake the test when `expect` requests have ended."""

    def __init__(self, expect: int) -> None:
        self.events: dict[str, list[StepOutput | Failure]] = {}
        self.arrived: dict[str, list[float]] = {}
        self.expect = expect
        self.done = asyncio.Event()

    def sink(self, rid: str) -> Callable[[StepOutput | Failure], None]:
        def push(event: StepOutput | Failure) -> None:
            self.events.setdefault(rid, []).append(event)
            self.arrived.setdefault(rid, []).append(time.monotonic())
            ended = sum(1 for evs in self.events.values() if isinstance(evs[-1], Failure) or evs[-1].finished)
            if ended >= self.expect:
                self.done.set()
        return push

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events[rid] if isinstance(e, StepOutput) for t in e.new_token_ids]


def make_request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, prompt, n, ignore_eos=True)


def test_requests_run_in_the_child_and_their_events_reach_the_sinks(engine: EngineProcess) -> None:
    info = engine.info
    assert info is not None and (info.vocab_size, info.context_length, info.device) == (4096, 512, "cpu")
    prompts = {"a": [5, 6, 7], "b": [9, 10], "c": [11, 12, 13, 14]}

    async def run() -> Collector:
        engine.start()
        got = Collector(3)
        for i, (rid, prompt) in enumerate(prompts.items()):
            engine.submit(make_request(rid, prompt, 12), got.sink(rid), eager=i == 0)
        with pytest.raises(RequestError, match="already in flight"):
            engine.submit(make_request("a", [1], 2), got.sink("a"))
        await asyncio.wait_for(got.done.wait(), 20)
        return got

    got = asyncio.run(run())
    for rid, prompt in prompts.items():  # the emulated batch reads each prompt on, one token a round
        assert got.tokens(rid) == [prompt[(len(prompt) + i) % len(prompt)] for i in range(12)]
        assert got.events[rid][-1].finish_reason == "length"
    assert engine.in_flight == 0
    assert engine.metrics.generation_tokens._value.get() == 36  # the relayed counters
    assert engine.metrics.prompt_tokens._value.get() == 9
    assert engine.rounds >= 11
    assert engine.metrics.rounds._value.get() == engine.rounds  # every round's time relayed, none twice
    assert engine.metrics.round_seconds._value.get() >= engine.rounds * 0.002  # each round sleeps 2 ms


def test_a_lazy_requests_rounds_are_held_until_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds are held until the request ends unless it is streamed (its first token is never held)."""
    monkeypatch.setattr(worker, "LAZY_FLUSH_S", 100.0)  # inherited by the forked child
    monkeypatch.setattr(worker, "EAGER_FLUSH_S", 0.0)
    monkeypatch.setattr(worker, "LAZY_MIN_RUNNING", 0)  # held however few run
    proc = _start()
    try:
        proc.wait_loaded(60)

        async def run(eager: bool) -> float:
            """How far apart the 2nd to 10th tokens arrived (9 rounds of >= 2 ms when sent as they come)."""
            got = Collector(1)
            proc.submit(make_request(f"r{eager}", [3, 4], 10), got.sink("x"), eager=eager)
            await asyncio.wait_for(got.done.wait(), 20)
            assert len(got.tokens("x")) == 10
            return got.arrived["x"][-1] - got.arrived["x"][1]

        async def both() -> tuple[float, float]:
            proc.start()
            return await run(False), await run(True)

        lazy, eager = asyncio.run(both())
    finally:
        proc.stop()
    assert eager >= 0.015
    assert lazy < 0.002  # one send at the end


def test_a_lone_plain_requests_rounds_go_as_they_come_and_several_are_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """With LAZY_MIN_RUNNING plain requests or fewer running, their rounds are not held (a plain answer decodes
    its text as events arrive: a last frame of 20 ms of rounds left that work for after the last token)."""
    monkeypatch.setattr(worker, "LAZY_FLUSH_S", 100.0)
    monkeypatch.setattr(worker, "EAGER_FLUSH_S", 0.0)
    assert worker.LAZY_MIN_RUNNING == 1
    proc = _start()
    try:
        proc.wait_loaded(60)

        async def frames(rids: list[str]) -> list[int]:
            """How many events each request's 10 tokens came in (all submitted together, plain)."""
            got = Collector(len(rids))
            for rid in rids:
                proc.submit(make_request(rid, [3, 4], 10), got.sink(rid), eager=False)
            await asyncio.wait_for(got.done.wait(), 20)
            assert all(len(got.tokens(rid)) == 10 for rid in rids)
            return [len(got.arrived[rid]) for rid in rids]

        async def both() -> tuple[list[int], list[int]]:
            proc.start()
            return await frames(["lone"]), await frames(["a", "b"])

        lone, pair = asyncio.run(both())
    finally:
        proc.stop()
    assert lone == [10]  # the first token, then each of the 9 rounds as it came
    # two running: the first token, the rest held to the end (a round of "a" may leave before "b" has started)
    assert max(pair) <= 3


def test_a_frame_carries_one_event_a_request_whatever_rounds_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held rounds of one request go out merged (what applying them in turn gives); a failure stays after them."""
    monkeypatch.setattr(worker, "LAZY_FLUSH_S", 100.0)
    monkeypatch.setattr(worker, "LAZY_MIN_RUNNING", 0)
    read, write = os.pipe()
    relay = worker.Relay(write)
    a = [StepOutput("a", [1], False, None, 1, [1], [4], []),  # a first token: sent at once
         StepOutput("a", [2, 3], False, None, 2, [2], [4], []), StepOutput("a", [4], False, None, 3, [1], [4], []),
         StepOutput("a", [5], True, "length", 4, [1], [4], [])]  # a finish: sent at once
    b = [StepOutput("b", [7], False, None, 1, [], [], []), StepOutput("b", [8], False, None, 2, [], [], []),
         Failure("b", "gone", 500)]
    for event in [*a, *b]:
        relay.deliver([(None, event)])  # type: ignore[list-item]
    os.close(write)
    frames = [[wire.event(item) for item in m.updates] for m in wire.read_frames(read)]
    os.close(read)
    sent = [dataclasses.replace(e, budgets=[]) if isinstance(e, StepOutput) else e for e in [a[0], b[0], b[1], b[2]]]
    assert frames == [[sent[0]], [StepOutput("a", [2, 3, 4, 5], True, "length", 4, [2, 1, 1], [], [])],
                      [sent[1]], [sent[2], sent[3]]]  # budgets stay in the engine process
    assert a[1].new_token_ids == [2, 3] and a[1].accept_lengths == [2]  # the engine's lists untouched


def test_accepted_lengths_travel_as_bytes_or_as_the_list_when_one_is_over_255() -> None:
    read, write = os.pipe()
    relay = worker.Relay(write)
    events = [StepOutput("s", [1, 2], True, "length", 2, [1, 255, 0], [9, 9, 9], [-0.5, -0.25]),
              StepOutput("t", [3], True, "stop", 1, [300, 2], [8, 8], [])]
    for event in events:
        relay.deliver([(None, event)])  # type: ignore[list-item]
    os.close(write)
    messages = list(wire.read_frames(read))
    os.close(read)
    assert isinstance(messages[0].updates[0][5], bytes) and isinstance(messages[1].updates[0][5], list)
    assert [wire.event(m.updates[0]) for m in messages] == [dataclasses.replace(e, budgets=[]) for e in events]


def test_cancel_aborts_a_running_request(engine: EngineProcess) -> None:
    async def run() -> Collector:
        engine.start()
        got = Collector(1)
        engine.submit(make_request("long", [1, 2], 400), got.sink("long"))
        while "long" not in got.events:
            await asyncio.sleep(0.005)
        engine.cancel("long")
        await asyncio.wait_for(got.done.wait(), 20)
        return got

    got = asyncio.run(run())
    assert got.events["long"][-1].finish_reason == "abort"
    assert len(got.tokens("long")) < 400
    assert engine.metrics.requests.labels(outcome="abort")._value.get() == 1


def test_a_killed_engine_fails_what_is_in_flight_and_says_so(engine: EngineProcess) -> None:
    deaths: list[str] = []
    engine.on_death = deaths.append

    async def run() -> Collector:
        engine.start()
        got = Collector(2)
        for rid in ("x", "y"):
            engine.submit(make_request(rid, [1, 2], 300), got.sink(rid))
        while len(got.events) < 2:
            await asyncio.sleep(0.005)
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.wait_for(got.done.wait(), 20)
        return got

    got = asyncio.run(run())
    for rid in ("x", "y"):
        last = got.events[rid][-1]
        assert isinstance(last, Failure) and last.status_code == 500
        assert "killed by SIGKILL" in last.message
    assert deaths and "killed by SIGKILL" in deaths[0]
    assert not engine.alive
    with pytest.raises(RequestError) as err:
        engine.submit(make_request("z", [1], 2), lambda e: None)
    assert err.value.status_code == 503


def _raise(error: Exception) -> tuple[Any, int]:
    raise error


def _exit_hard() -> tuple[Any, int]:
    os._exit(3)


@pytest.mark.parametrize(("load", "code", "message"), [
    (partial(_raise, ConfigError("--context-length: 9999 exceeds the engine's limit 512")), 2, "--context-length: 9999"),
    (partial(_raise, ModelLoadError("target: no config.json in /nowhere")), 1, "no config.json"),
    (partial(_raise, RuntimeError("boom")), 1, "RuntimeError: boom"),
    (_exit_hard, 1, "exited while loading (exit code 3)"),
])
def test_start_up_failures_carry_the_servers_exit_status(load: Callable[[], tuple[Any, int]], code: int,
                                                          message: str) -> None:
    proc = _start(load)
    try:
        with pytest.raises(EngineStartError) as err:
            proc.wait_loaded(60)
    finally:
        proc.stop()
    assert err.value.exit_code == code and message in str(err.value)


def test_stop_ends_the_child_even_when_nothing_reads_its_events() -> None:
    """A child whose events pipe is full would block in its last sends; stop() drains it when no loop reads."""
    proc = _start(partial(emulated_engine, 0.0))
    proc.wait_loaded(60)
    for i in range(4):  # ~20k events, far more than a pipe holds, with nobody reading
        proc.submit(make_request(f"r{i}", [1, 2], 500), lambda e: None, eager=True)
    time.sleep(0.5)
    started = time.monotonic()
    proc.stop(timeout=10)
    assert time.monotonic() - started < 10
    assert proc._process.exitcode == 0


def test_the_child_dies_with_its_parent(tmp_path: Any) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from tests.unit.test_engine_client import _start
        proc = _start()
        proc.wait_loaded(60)
        print(proc.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
