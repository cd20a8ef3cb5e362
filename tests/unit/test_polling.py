"""Polling between requests (ddtree.serving.polling): when it is on, that the event loop keeps turning while
requests run and for the window after, and stops then; the server's flag. The engine process's side is in
test_scheduler_inbox.py."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from ddtree.serving.args import resolve_args
from ddtree.serving.engine_client import EngineProcess
from ddtree.serving.engine_worker import open_scheduler
from ddtree.serving.polling import POLL_MIN_CPUS, POLL_WINDOW_S, LoopPoller, PollWindow, describe, polling_window
from tests.unit.test_engine_client import FIXTURE_TARGET, Collector, emulated_engine, emulator_args, make_request


@pytest.mark.parametrize(("sleep_on_idle", "cpus", "window"), [
    (False, POLL_MIN_CPUS, POLL_WINDOW_S),
    (False, 128, POLL_WINDOW_S),
    (False, POLL_MIN_CPUS - 1, 0.0),  # the 2-core CI machine: a polling process would take a needed CPU
    (True, 128, 0.0),
])
def test_polling_is_on_with_enough_cpus_unless_the_server_sleeps_on_idle(sleep_on_idle: bool, cpus: int,
                                                                         window: float) -> None:
    assert polling_window(sleep_on_idle, cpus) == window
    words = describe(window, sleep_on_idle)
    assert words.startswith("on" if window else "off")
    assert ("--sleep-on-idle" in words) == (sleep_on_idle or bool(window))


def test_sleep_on_idle_is_a_server_flag_reported_with_the_rest() -> None:
    base = ["--model-path", FIXTURE_TARGET, "--device", "cpu"]
    assert resolve_args(base).sleep_on_idle is False
    args = resolve_args([*base, "--sleep-on-idle"])
    assert args.sleep_on_idle is True and args.to_dict()["sleep_on_idle"] is True


def test_a_window_rejects_a_negative_length_and_a_zero_one_never_opens() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PollWindow(-1.0)
    window = PollWindow(0.0)
    window.touch()
    assert window.left() <= 0


def test_the_loop_turns_while_busy_then_for_the_window_and_then_sleeps() -> None:
    async def run() -> tuple[int, int, int, bool, bool]:
        loop = asyncio.get_running_loop()
        busy = [True]
        poller = LoopPoller(loop, 0.05, lambda: busy[0])
        poller.touch()
        await asyncio.sleep(0.15)  # busy: past the window, still turning
        while_busy = poller.turns
        running_while_busy = poller.running
        busy[0] = False
        await asyncio.sleep(0.02)  # the window (opened 150 ms ago) has closed: the next turn stops
        stopped = poller.turns
        await asyncio.sleep(0.1)
        after = poller.turns  # nothing turned while asleep
        poller.touch()
        await asyncio.sleep(0.01)
        return while_busy, stopped, after, running_while_busy, poller.running and poller.turns > after

    while_busy, stopped, after, running_while_busy, restarted = asyncio.run(run())
    assert running_while_busy and while_busy > 100  # a turn is ~1-10 us; 150 ms held at least this many
    assert after == stopped
    assert restarted


def test_a_zero_window_never_polls() -> None:
    async def run() -> int:
        poller = LoopPoller(asyncio.get_running_loop(), 0.0, lambda: True)
        poller.touch()
        await asyncio.sleep(0.02)
        return poller.turns

    assert asyncio.run(run()) == 0


def test_the_http_side_polls_while_requests_run_and_stops_after_the_window() -> None:
    """A forked engine with polling on: the requests' events reach their sinks as without it, the loop turned
    while they ran, and it sleeps once the window after the last event has closed."""
    args = emulator_args()
    engine = EngineProcess(emulated_engine, partial(open_scheduler, spec=args.spec, args=args), "warning",
                              poll_window_s=0.05)
    engine.wait_loaded(60)

    async def run() -> tuple[Collector, int, int, bool]:
        engine.start()
        assert engine.poller is not None and not engine.poller.running
        got = Collector(2)
        engine.submit(make_request("a", [5, 6, 7], 20), got.sink("a"))
        engine.submit(make_request("b", [9, 10], 20), got.sink("b"), eager=False)
        await asyncio.wait_for(got.done.wait(), 20)
        during = engine.poller.turns
        await asyncio.sleep(0.2)
        stopped = engine.poller.turns
        await asyncio.sleep(0.1)
        return got, during, stopped, engine.poller.running or engine.poller.turns != stopped

    try:
        got, during, stopped, still = asyncio.run(run())
    finally:
        engine.stop()
    assert got.tokens("a") == [[5, 6, 7][(3 + i) % 3] for i in range(20)]
    assert got.tokens("b") == [[9, 10][(2 + i) % 2] for i in range(20)]
    assert during > 100  # 20 rounds of 2 ms each: the loop turned all along
    assert stopped > during and not still

