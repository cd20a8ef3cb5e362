"""How the scheduler admits a burst of arrivals: held while the burst arrives, then prefilled as one group, in
arrival order; a lone arrival is admitted at once, however long the hold's bounds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ddtree.config import SpecConfig
from ddtree.engine import Request, StepOutput
from ddtree.profiling.emulated import EmulatedBatch
from ddtree.serving.scheduler import Scheduler
from tests.unit.test_scheduler import Events

EMU = SpecConfig.from_id("ar")


class GroupBatch(EmulatedBatch):
    """An emulated batch (rounds of `round_s`, free prefills) that logs the request ids of every prefill."""

    def __init__(self, round_s: float, max_batch: int = 32) -> None:
        super().__init__(EMU, max_batch, 512, round_s=round_s, prefill_s=0.0, tokens_per_round=1)
        self.groups: list[list[str]] = []

    def add_many(self, requests: Any) -> list[StepOutput]:
        self.groups.append([r.request_id for r in requests])
        return super().add_many(requests)


def request(rid: str, length: int = 4, new: int = 6) -> Request:
    return Request(rid, list(range(1, length + 1)), new, ignore_eos=True)


def arrive(sched: Scheduler, events: Events, rids: list[str], spacing_s: float) -> None:
    for rid in rids:
        sched.submit(request(rid), events.sink(rid))
        time.sleep(spacing_s)


@pytest.mark.parametrize("gap_s", [0.3, 0.0])
def test_a_burst_arriving_between_rounds_is_prefilled_as_one_group_in_arrival_order(gap_s: float) -> None:
    """16 arrivals 2 ms apart while rounds of 4 ms run: held, they join in one prefill (the first, alone before
    them, with whatever came with it); with the hold off (gap 0) each round's look admits what has come."""
    batch = GroupBatch(round_s=0.004)
    rids = [f"r{i}" for i in range(16)]
    events = Events(rids)
    sched = Scheduler(batch, max_running=32, switch_interval_s=None, burst_gap_s=gap_s, burst_wait_s=5.0)
    sched.start()
    try:
        arrive(sched, events, rids, 0.002)
        assert events.done.wait(30)
    finally:
        sched.stop()
    assert [rid for group in batch.groups for rid in group] == rids  # first come, first prefilled
    assert all(events.tokens(rid) == [1, 2, 3, 4, 1, 2] for rid in rids)
    if gap_s:
        assert len(batch.groups) <= 2, batch.groups
    else:
        assert len(batch.groups) >= 3, batch.groups  # what the hold is for: the same arrivals, in pieces


def test_a_lone_arrival_is_admitted_at_once() -> None:
    """Bounds of a minute: a held lone request would not finish within the test's 10 s."""
    batch = GroupBatch(round_s=0.0)
    events = Events(["a"])
    sched = Scheduler(batch, max_running=4, switch_interval_s=None, burst_gap_s=60.0, burst_wait_s=60.0)
    sched.start()
    try:
        sched.submit(request("a"), events.sink("a"))
        assert events.done.wait(10), "a lone request was held back"
    finally:
        sched.stop()
    assert batch.groups == [["a"]]


def queued(sched: Scheduler, arrivals: list[tuple[str, float]], before: float, length: int) -> None:
    """Queue requests as if they arrived at these perf_counter times, the arrival before them at `before`
    (the scheduler's thread not started)."""
    prev = before
    for rid, at in arrivals:
        sched.submit(request(rid, length), lambda _: None)
        ticket = sched._pending[-1]
        ticket.in_burst = at - prev < sched.burst_gap_s
        ticket.arrived = prev = at
    sched._last_arrival = prev


def admission(arrivals: list[tuple[str, float]], now: float | list[float], before: float = -float("inf"), running: int = 0,
              max_running: int = 16, gap_s: float = 0.001, wait_s: float = 0.004, length: int = 4,
              prefill_tokens: int | None = None) -> tuple[int, float]:
    """_admission at `now` (or at each of several times: the last answer) for these arrivals on a batch of 16
    free slots (`running` rows counted as running)."""
    batch = GroupBatch(round_s=0.0, max_batch=16)
    batch.prefill_tokens = prefill_tokens  # type: ignore[assignment]  # DecodeBatch's bound on a forward (None: none)
    sched = Scheduler(batch, max_running=max_running, switch_interval_s=None, burst_gap_s=gap_s, burst_wait_s=wait_s)
    for i in range(running):
        sched._running[f"run{i}"] = None  # type: ignore[assignment]
    queued(sched, arrivals, before, length)
    for at in now if isinstance(now, list) else [now]:
        take, hold = sched._admission(at)
    return take, round(hold, 9)


def test_the_hold_lasts_while_the_burst_arrives_and_within_its_bounds() -> None:
    t = 100.0
    # a lone arrival (none in the gap before it): never held, nor what came right behind it
    assert admission([("a", t), ("b", t + 0.0002)], now=t + 0.0003) == (2, 0)
    # the second of a burst, first in the queue: held until the gap after the latest passes...
    burst = [("b", t + 0.0005), ("c", t + 0.0008)]
    assert admission(burst, before=t, now=t + 0.0009) == (0, 0.0009)
    assert admission(burst, before=t, now=t + 0.0018) == (2, 0)  # 1 ms without an arrival: the burst is over
    # ... and the oldest is never held back longer than wait_s (from the first look that held it), however the
    # burst goes on
    steady = [(f"r{i}", t + 0.0005 * i) for i in range(1, 12)]
    assert admission(steady[:8], before=t, now=[t + 0.0006, t + 0.0041]) == (0, 0.0005)
    assert admission(steady[:9], before=t, now=[t + 0.0006, t + 0.0047]) == (9, 0)
    assert admission(steady[:9], before=t, now=t + 0.0047) == (0, 0.0008)  # first held at 4.7 ms: 0.8 ms of gap
    # the queue holds as many as may join now (8 running at most, 2 running): waiting gains nothing
    assert admission(steady[:6], before=t, now=t + 0.0031, running=2, max_running=8) == (6, 0)
    assert admission(steady[:7], before=t, now=t + 0.0036, running=2, max_running=8) == (6, 0)  # the oldest 6
    assert admission(steady[:5], before=t, now=t + 0.0026, running=2, max_running=8) == (0, 0.0009)
    # gap 0: no hold at all
    assert admission(steady[:3], before=t, now=t + 0.0016, gap_s=0.0) == (3, 0)


def test_while_a_burst_arrives_only_whole_prefill_forwards_join() -> None:
    t = 100.0
    burst = [(f"r{i}", t + 0.0002 * i) for i in range(1, 11)]
    # forwards of 400 padded tokens: 4 prompts of 100; 3 leave room in one, 4 fill it, 9 fill two and wait
    # with the ninth for the next, and once the burst is over everything joins
    kw: dict[str, Any] = dict(before=t, length=100, prefill_tokens=400)
    assert admission(burst[:3], now=t + 0.0007, **kw) == (0, 0.0009)
    assert admission(burst[:4], now=t + 0.0009, **kw) == (4, 0)
    assert admission(burst[:9], now=t + 0.0019, **kw) == (8, 0)
    assert admission(burst[:9], now=t + 0.0029, **kw) == (9, 0)


def test_submit_many_queues_together_and_refuses_each_bad_one_alone() -> None:
    batch = GroupBatch(round_s=0.0)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    sched.submit(request("dup"), lambda _: None)
    errors = sched.submit_many([(request("x"), lambda _: None, True), (request("dup"), lambda _: None, True),
                                (request("y"), lambda _: None, False)])
    assert errors[0] is None and errors[2] is None and errors[1] is not None and errors[1].field == "rid"
    assert [t.request.request_id for t in sched._pending] == ["dup", "x", "y"]
    assert [t.in_burst for t in sched._pending] == [False, True, True]  # one read's arrivals: one burst


def test_the_engine_process_queues_the_submits_of_one_read_together() -> None:
    """Three submits and a cancel written at once: one read, the submits queued under one lock (one burst,
    in order), the cancel after them."""
    import os
    import tempfile

    from ddtree.serving import engine_worker, wire

    batch = GroupBatch(round_s=0.0)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    read, write = os.pipe()
    try:
        frames: list[wire.Message] = [wire.Submit(request(rid), True, True) for rid in ("a", "b", "c")]
        frames.append(wire.Cancel("b"))
        for message in frames:
            wire.write_frame(write, message)
        os.close(write)
        batches = list(wire.read_batches(read))
    finally:
        os.close(read)
    assert batches == [frames]
    with tempfile.TemporaryFile() as sent:
        relay = engine_worker.Relay(sent.fileno())
        engine_worker.queue_arrivals(sched, relay, [(m.request, _drop, m.counted) for m in frames[:3]])
        engine_worker.queue_arrivals(sched, relay, [(request("a"), _drop, True)])  # in flight: refused, on its own
        sent.seek(0)
        (message,) = wire.FrameReader().feed(sent.read())
    assert [t.request.request_id for t in sched._pending] == ["a", "b", "c"]
    assert [t.in_burst for t in sched._pending] == [False, True, True]
    (failure,) = message.updates
    assert failure.request_id == "a" and "already in flight" in failure.message


def _drop(_: object) -> None:
    """A sink: the engine process's events leave through its relay."""


def test_the_emulated_prefill_costs_a_fixed_wait_per_forward_plus_its_padded_tokens() -> None:
    """What the burst benches' emulated batch charges: DecodeBatch's forwards (8192 padded tokens at most)."""
    batch = EmulatedBatch(EMU, 32, 2048, round_s=0.0, prefill_s=0.003, tokens_per_round=1, prefill_token_s=1e-6)
    assert batch.prefill_seconds([1024] * 32) == pytest.approx(4 * (0.003 + 8 * 1024e-6))  # 4 forwards of 8
    assert batch.prefill_seconds([1024] * 3) == pytest.approx(0.003 + 3 * 1024e-6)
    assert batch.prefill_seconds([100, 1000]) == pytest.approx(0.003 + 2 * 1000e-6)  # padded to the longest
    flat = EmulatedBatch(EMU, 32, 2048, round_s=0.0, prefill_s=0.003, tokens_per_round=1)
    assert flat.prefill_seconds([1024] * 32) == 0.003  # no per-token cost: one wait per prefill, as before


def test_the_prefill_cost_bench_times_each_size_per_bound_and_empties_the_batch() -> None:
    from ddtree.profiling.burst import prefill_costs
    from tests.unit.test_engine import make_engine, prompts

    engine = make_engine()
    batch = engine.open_batch(SpecConfig.from_id("b4-k4-w2048-bs8"), 4, 64)
    same = [p[:3] * 7 for p in prompts(4, seed=5)]  # 21 ids each: 4 fit one forward of 4096 padded tokens, not of 16
    rows = prefill_costs(batch, None, same, [1, 4], [16, 4096], repeats=1)
    assert [(r["prefill_tokens"], r["requests"]) for r in rows] == [(16, 1), (16, 4), (4096, 1), (4096, 4)]
    assert [r["forwards"] for r in rows] == [1, 4, 1, 1] and all(r["ms"] > 0 for r in rows)
    assert batch.active == 0


def run_to_end(sched: Scheduler, events: Events, timeout_s: float = 10.0) -> None:
    """Start the scheduler on what is queued, wait for every request's end, stop it."""
    sched.start()
    try:
        assert events.done.wait(timeout_s)
    finally:
        sched.stop()

def test_after_warm_up_runs_once_on_the_thread_before_anything_is_admitted() -> None:
    batch = GroupBatch(round_s=0.0)
    calls: list[int] = []
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    sched.after_warm_up = lambda: calls.append(len(batch.groups))
    events = Events(["a", "b"])
    for rid in ("a", "b"):  # queued before the thread starts
        sched.submit(request(rid), events.sink(rid))
    run_to_end(sched, events)
    assert calls == [0] and batch.groups == [["a", "b"]]


def test_each_prefill_forward_hands_out_its_first_tokens_before_the_next_runs() -> None:
    """Four arrivals, forwards of two (prefill_tokens): two prefills, the first's tokens out in between."""
    log: list[Any] = []

    class Logged(GroupBatch):
        def add_many(self, requests: Any) -> list[StepOutput]:
            log.append(("prefill", [r.request_id for r in requests]))
            return super().add_many(requests)

    batch = Logged(round_s=0.0)
    batch.prefill_tokens = 2 * 4  # type: ignore[attr-defined]  # two prompts of 4 ids a forward
    events = Events(["a", "b", "c", "d"])

    def deliver(items: list[tuple[Any, Any]]) -> None:
        log.extend(("out", ev.request_id) for _, ev in items if ev.new_token_ids and len(events.got[ev.request_id]) == 0)
        for sink, ev in items:
            sink(ev)

    sched = Scheduler(batch, max_running=4, deliver=deliver, switch_interval_s=None)
    for rid in "abcd":
        sched.submit(request(rid), events.sink(rid))
    run_to_end(sched, events)
    assert log[:6] == [("prefill", ["a", "b"]), ("out", "a"), ("out", "b"),
                       ("prefill", ["c", "d"]), ("out", "c"), ("out", "d")]


def test_the_burst_tool_admits_a_burst_of_the_zero_batch_with_every_hold(capsys: pytest.CaptureFixture[str]) -> None:
    """python -m ddtree.profiling.burst on a batch of no model: every hold gives the in-process tokens (exit 0)."""
    from ddtree.profiling import burst

    assert burst.main(["--engine", "zero", "--rows", "4", "--repeats", "1", "--spacing-ms", "0.1",
                       "--holds", "0:0", "1:4"]) == 0
    out = capsys.readouterr().out
    assert out.count(" served ") == 2 and " in process " in out
    assert burst.main(["--engine", "zero", "--prefill-costs"]) == 2
    assert "--prefill-costs: needs --engine model" in capsys.readouterr().err
