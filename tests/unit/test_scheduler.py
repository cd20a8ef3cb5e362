"""The scheduler's round loop: a round's outputs are handed out while the next round runs on the device, and
nothing a request sees changes for it (order, finish against cancel, failures, metrics, T = 0 outputs)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ddtree.config import SpecConfig
from ddtree.engine import Engine, Request, StepOutput
from ddtree.profiling.emulated import EmulatedBatch
from ddtree.serving.scheduler import Failure, Scheduler
from tests.unit.test_engine import AR, make_engine, prompts
from tests.unit.test_engine_paths import EagerGraphs, with_attention

EMU = SpecConfig.from_id("ar")


class SplitBatch(EmulatedBatch):
    """An emulated batch with DecodeBatch's launch()/collect(), logging every call the scheduler makes.

    on_collect(round index) runs inside collect(), as an arrival or a cancel would land while the device
    works; fail_at: the round whose launch ("launch", k) or collect ("collect", k) raises (once)."""

    def __init__(self, max_batch: int = 4, tokens: int = 1) -> None:
        super().__init__(EMU, max_batch, 512, round_s=0.0, prefill_s=0.0, tokens_per_round=tokens)
        self.log: list[tuple[str, Any]] = []
        self.launched = False
        self.collected = 0
        self.on_collect: Any = None
        self.fail_at: tuple[str, int] | None = None

    def launch(self) -> None:
        assert not self.launched, "launched twice"
        if self.fail_at == ("launch", self.collected):
            self.fail_at = None
            raise RuntimeError("launch blew up")
        self.launched = True
        self.log.append(("launch", self.collected))

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        assert self.launched, "collect without a launch"
        self.launched = False
        k = self.collected
        self.collected += 1
        if self.fail_at == ("collect", k):
            self.fail_at = None
            raise RuntimeError("collect blew up")
        outputs = []
        for row in self.rows.values():  # EmulatedBatch's round, with no wait
            row[2] += 1
            outputs.append(self._emit(row, self.tokens_per_round, self.tokens_per_round))
        outputs = self._retire(outputs)
        self.log.append(("collect", k))
        if self.on_collect is not None:
            self.on_collect(k)
        return outputs

    def add_many(self, requests):  # type: ignore[no-untyped-def]
        assert not self.launched, "prefill while a round is launched"
        return super().add_many(requests)

    def cancel(self, request_id: str) -> bool:
        assert not self.launched, "cancel while a round is launched"
        self.log.append(("cancel", request_id))
        return super().cancel(request_id)

    def step(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a batch that splits its rounds is launched and collected, never stepped")


class AheadBatch(SplitBatch):
    """A SplitBatch that runs ahead as DecodeBatch does: collect(run_ahead=True) launches the next round before
    it returns ("ahead", k), unless rows finished in the round before it or every row may reach max_new_tokens
    in this one (`by_length`: False stands for rows that end on stop tokens, which nothing foresees); launch()
    then takes that round ("take", k) and settle() collects it ("settle", k). A row that finishes is handed out
    at once (the emulation drops it at once: its share of the round ahead is never seen). Rows may not join or
    leave while a round is ahead."""

    run_ahead = True

    def __init__(self, max_batch: int = 4, tokens: int = 1) -> None:
        super().__init__(max_batch, tokens)
        self.ahead = False
        self.leaving: set[str] = set()
        self.by_length = True

    @property
    def round_ahead(self) -> bool:
        return self.ahead

    def launch(self) -> None:
        if not self.ahead:
            return super().launch()
        assert not self.launched, "launched twice"
        self.ahead, self.launched = False, True
        self.log.append(("take", self.collected))

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        leaving, self.leaving = self.leaving, set()
        runs_on = any(len(out) + self.tokens_per_round < req.max_new_tokens or not self.by_length
                      for req, out, _ in self.rows.values())
        outputs = super().collect()
        if run_ahead and runs_on and not leaving:
            self.ahead = True
            self.leaving = {o.request_id for o in outputs if o.finished}
            self.log.append(("ahead", self.collected))
        return outputs

    def settle(self) -> list[StepOutput]:
        if not self.ahead:
            return []
        self.ahead, self.launched = False, True
        self.log.append(("settle", self.collected))
        return self.collect()

    def add_many(self, requests):  # type: ignore[no-untyped-def]
        assert not self.ahead, "prefill while a round is ahead"
        return super().add_many(requests)

    def cancel(self, request_id: str) -> bool:
        assert not self.ahead, "cancel while a round is ahead"
        return super().cancel(request_id)


class Events:
    """Every event per request id, as sinks; `done` once every watched request has its last event."""

    def __init__(self, rids: list[str], log: list[tuple[str, Any]] | None = None) -> None:
        self.got: dict[str, list[StepOutput | Failure]] = {rid: [] for rid in rids}
        self.log = log
        self.done = threading.Event()

    def sink(self, rid: str):  # type: ignore[no-untyped-def]
        def push(ev: StepOutput | Failure) -> None:
            self.got[rid].append(ev)
            if self.log is not None:
                self.log.append(("event", rid))
            if all(evs and (isinstance(evs[-1], Failure) or evs[-1].finished) for evs in self.got.values()):
                self.done.set()
        return push

    def tokens(self, rid: str) -> list[int]:
        return [t for ev in self.got[rid] if isinstance(ev, StepOutput) for t in ev.new_token_ids]

    def last(self, rid: str) -> StepOutput | Failure:
        return self.got[rid][-1]


def run(sched: Scheduler, events: Events, requests: list[Request], timeout: float = 30) -> None:
    for r in requests:  # queued before the thread starts: one admission takes them together
        sched.submit(r, events.sink(r.request_id))
    sched.start()
    try:
        assert events.done.wait(timeout), {rid: evs[-1:] for rid, evs in events.got.items()}
    finally:
        sched.stop()


def test_a_round_is_handed_out_while_the_next_one_runs() -> None:
    batch = SplitBatch()
    events = Events(["a"], batch.log)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    run(sched, events, [Request("a", [1, 2, 3], 5, ignore_eos=True)])
    assert events.tokens("a") == [1, 2, 3, 1, 2]  # the emulated batch reads its prompt on
    # the prefill's token before round 0; round k's after round k + 1 is launched; the last round's
    # (nothing left to launch) right after it
    assert batch.log == [("event", "a"), ("launch", 0), ("collect", 0),
                         ("launch", 1), ("event", "a"), ("collect", 1),
                         ("launch", 2), ("event", "a"), ("collect", 2),
                         ("launch", 3), ("event", "a"), ("collect", 3), ("event", "a")]
    assert sched.rounds == 4 and not batch.rows


def test_a_batch_that_runs_ahead_has_its_next_round_in_flight_when_a_round_is_handed_out() -> None:
    """Each collect launches the next round before it returns; the next launch takes it, and the round's
    outputs are handed out while it runs. The last round (where the only request may reach max_new_tokens) is
    not run ahead."""
    batch = AheadBatch()
    events = Events(["a"], batch.log)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    run(sched, events, [Request("a", [1, 2, 3], 5, ignore_eos=True)])
    assert events.tokens("a") == [1, 2, 3, 1, 2]
    assert batch.log == [("event", "a"), ("launch", 0), ("collect", 0), ("ahead", 1),
                         ("take", 1), ("event", "a"), ("collect", 1), ("ahead", 2),
                         ("take", 2), ("event", "a"), ("collect", 2), ("ahead", 3),
                         ("take", 3), ("event", "a"), ("collect", 3), ("event", "a")]
    assert sched.rounds == 4 and sched.metrics.rounds._value.get() == 4  # type: ignore[attr-defined]


def test_an_arrival_after_an_idle_spell_settles_the_round_ahead_uncounted() -> None:
    """A request finishes with the round ahead of it in flight; the thread idles; the next arrival settles that
    round first (nothing to hand out), and neither the round nor the idle time counts as a served round."""
    batch = AheadBatch()
    batch.by_length = False  # "a" ends as if on a stop token: its round ahead runs, for nobody
    events, later = Events(["a"]), Events(["b"])
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    sched.submit(Request("a", [1, 2, 3], 3, ignore_eos=True), events.sink("a"))
    sched.start()
    try:
        assert events.done.wait(30) and events.tokens("a") == [1, 2, 3]
        time.sleep(0.3)
        assert batch.ahead and not batch.rows
        sched.submit(Request("b", [4, 5], 2, ignore_eos=True), later.sink("b"))
        assert later.done.wait(30) and later.tokens("b") == [4, 5]
    finally:
        sched.stop()
    assert ("settle", 2) in batch.log and sched.rounds == 3  # a's rounds 0 and 1, b's one round
    assert sched.metrics.round_seconds._value.get() < 0.25  # type: ignore[attr-defined]


CANCEL_AROUND = {  # the log from round 1's collect on, around the cancel (its index: the first number)
    # the batch drops the row before round 2 is launched; round 1's outputs go out before the abort
    "split": (1, [("collect", 1), ("cancel", "a"), ("launch", 2), ("event", "a"), ("event", "b"), ("event", "a")]),
    # round 2, launched ahead, is settled first; round 1's outputs, then round 2's, then the abort
    "ahead": (4, [("collect", 1), ("ahead", 2), ("settle", 2), ("collect", 2), ("cancel", "a"), ("launch", 3),
                  ("event", "a"), ("event", "b"), ("event", "a"), ("event", "b"), ("event", "a")]),
}


@pytest.mark.parametrize(("kind", "b_len"), [("split", 5), ("ahead", 9)])
def test_a_cancel_gets_the_rounds_before_it_then_abort_and_leaves_the_batch(kind: str, b_len: int) -> None:
    """The cancel lands while round 1 runs (with round 2 launched ahead, on a batch that runs ahead): "a" gets
    every round before the row leaves, then the abort; the other row runs on."""
    batch = SplitBatch() if kind == "split" else AheadBatch()
    events = Events(["a", "b"], batch.log)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    batch.on_collect = lambda k: sched.cancel("a") if k == 1 else None
    run(sched, events, [Request("a", [1, 2], 50, ignore_eos=True), Request("b", [4, 5], b_len, ignore_eos=True)])
    before, around = CANCEL_AROUND[kind]
    rounds = 2 if kind == "split" else 3  # rounds 0 and 1, and the one settled
    assert [len(ev.new_token_ids) for ev in events.got["a"]] == [1] * (1 + rounds) + [0]  # prefill ... abort
    assert events.last("a").finish_reason == "abort"  # type: ignore[union-attr]
    i = batch.log.index(("cancel", "a"))
    assert batch.log[i - before:i - before + len(around)] == around
    assert events.tokens("b") == ([4, 5] * 5)[:b_len]


ARRIVAL_AROUND = {  # the log around the late request's first token: (entries before it, the window)
    "split": (2, [("collect", 0), ("event", "a"), ("event", "late"), ("launch", 1)]),
    # round 1, launched ahead, is settled and handed out before "late" is prefilled
    "ahead": (6, [("collect", 0), ("ahead", 1), ("settle", 1), ("collect", 1), ("event", "a"), ("event", "a"),
                  ("event", "late"), ("launch", 2)]),
}


@pytest.mark.parametrize(("kind", "a_len"), [("split", 4), ("ahead", 9)])
def test_an_arrival_joins_after_the_rounds_before_it_are_handed_out(kind: str, a_len: int) -> None:
    batch = SplitBatch() if kind == "split" else AheadBatch()
    events = Events(["a", "late"], batch.log)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None, burst_gap_s=0)  # no burst held back
    batch.on_collect = lambda k: sched.submit(Request("late", [7, 8, 9], 2, ignore_eos=True),
                                              events.sink("late")) if k == 0 else None
    run(sched, events, [Request("a", [1, 2], a_len, ignore_eos=True)])
    assert events.tokens("late") == [7, 8] and events.tokens("a") == ([1, 2] * 5)[:a_len]
    before, around = ARRIVAL_AROUND[kind]
    i = batch.log.index(("event", "late"))  # its first token, from the prefill
    assert batch.log[i - before:i - before + len(around)] == around


def test_stop_settles_the_round_ahead_then_aborts() -> None:
    batch = AheadBatch(max_batch=1)
    events = Events(["a"], batch.log)
    sched = Scheduler(batch, max_running=1, switch_interval_s=None)
    batch.on_collect = lambda k: threading.Thread(target=sched.stop).start() if k == 3 else None
    run(sched, events, [Request("a", [1], 400, ignore_eos=True)])
    assert events.last("a").finish_reason == "abort" and not batch.ahead  # type: ignore[union-attr]
    rounds = sum(1 for entry in batch.log if entry[0] == "collect")
    assert len(events.tokens("a")) == 1 + rounds  # the prefill's token and every round's, the last settled one's
    i = batch.log.index(("cancel", "a"))  # the abort, after the round ahead was collected
    assert batch.log[i - 2:] == [("settle", rounds - 1), ("collect", rounds - 1), ("cancel", "a"),
                                 ("event", "a"), ("event", "a"), ("event", "a")]


def test_a_request_that_finished_is_not_reported_as_cancelled_after_it() -> None:
    """The cancel lands while the round that finishes the request runs: it finishes ("length")."""
    batch = SplitBatch()
    events = Events(["a", "b"])
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    batch.on_collect = lambda k: sched.cancel("a") if k == 1 else None  # a's last round is round 1
    run(sched, events, [Request("a", [1, 2], 3, ignore_eos=True), Request("b", [4, 5], 6, ignore_eos=True)])
    last = events.last("a")
    assert isinstance(last, StepOutput) and last.finish_reason == "length" and events.tokens("a") == [1, 2, 1]
    assert [ev.finish_reason for ev in events.got["a"]] == [None, None, "length"]
    assert events.tokens("b") == [4, 5, 4, 5, 4, 5]
    assert sched.metrics.requests.labels(outcome="length")._value.get() == 2  # type: ignore[attr-defined]
    assert sched.metrics.requests.labels(outcome="abort")._value.get() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_round_fails_what_runs_after_handing_out_the_round_before(where: str) -> None:
    batch = SplitBatch()
    batch.fail_at = (where, 2)
    events = Events(["a", "b"])
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    later = Events(["c"])
    for r in (Request("a", [1, 2], 9, ignore_eos=True), Request("b", [3, 4], 9, ignore_eos=True)):
        sched.submit(r, events.sink(r.request_id))
    sched.start()
    try:
        assert events.done.wait(30)
        for rid in "ab":
            last = events.last(rid)
            assert isinstance(last, Failure) and last.status_code == 500 and "blew up" in last.message
            assert len(events.tokens(rid)) == 3  # the prefill's token, rounds 0 and 1
        assert not batch.rows and not batch.launched
        sched.submit(Request("c", [5, 6], 3, ignore_eos=True), later.sink("c"))  # it keeps serving
        assert later.done.wait(30) and later.tokens("c") == [5, 6, 5]
    finally:
        sched.stop()


def test_metrics_count_every_round_once() -> None:
    batch = SplitBatch(tokens=2)
    events = Events(["a", "b"])
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    run(sched, events, [Request("a", [1, 2], 7, ignore_eos=True), Request("b", [3], 4, ignore_eos=True)])
    m = sched.metrics
    assert m.rounds._value.get() == sched.rounds == 3  # type: ignore[attr-defined]
    assert m.generation_tokens._value.get() == 7 + 4  # type: ignore[attr-defined]
    # rounds of 2 tokens (accept length 2: one accepted draft each), the last ones cut by max_new_tokens
    assert m.verify_steps._value.get() == 3 + 2  # type: ignore[attr-defined]
    assert m.accepted_drafts._value.get() == 5  # type: ignore[attr-defined]
    assert m.round_seconds._value.get() > 0  # type: ignore[attr-defined]


def test_stop_aborts_what_runs_and_what_waits() -> None:
    batch = SplitBatch(max_batch=1)
    events = Events(["a", "b"])
    sched = Scheduler(batch, max_running=1, switch_interval_s=None)
    batch.on_collect = lambda k: threading.Thread(target=sched.stop).start() if k == 3 else None
    run(sched, events, [Request("a", [1], 400, ignore_eos=True), Request("b", [2], 5, ignore_eos=True)])
    assert events.last("a").finish_reason == "abort" and len(events.tokens("a")) >= 5  # type: ignore[union-attr]
    assert events.tokens("b") == [] and events.last("b").finish_reason == "abort"  # type: ignore[union-attr]


# -- the engine's own batch ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def test_decode_batch_launch_then_collect_is_step(engine: Engine) -> None:
    spec = SpecConfig(budget=6, topk=3, block_size=6)
    reqs = [Request(str(i), p, 12) for i, p in enumerate(prompts(3, seed=21))]
    stepped, split = engine.open_batch(spec, max_batch=3, max_len=128), engine.open_batch(spec, max_batch=3, max_len=128)
    assert [o.new_token_ids for o in stepped.add_many(reqs)] == [o.new_token_ids for o in split.add_many(reqs)]
    while stepped.active:
        split.launch()
        with pytest.raises(RuntimeError, match="launched"):
            split.cancel("0")
        with pytest.raises(RuntimeError, match="launched"):
            split.add(Request("x", [1, 2], 3))
        with pytest.raises(RuntimeError, match="already launched"):
            split.launch()
        assert split.collect() == stepped.step()
    assert split.active == 0
    with pytest.raises(RuntimeError, match="no round launched"):
        split.collect()
    split.launch()  # an empty batch's round: nothing
    assert split.collect() == []


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_decode_batch_round_that_raises_leaves_the_batch_usable(engine: Engine, where: str) -> None:
    """A round that raises (in launch or in collect) leaves nothing launched: cancel and add work again."""
    spec = SpecConfig(budget=6, topk=3, block_size=6)
    batch = engine.open_batch(spec, max_batch=2, max_len=128)
    batch.add_many([Request("a", prompts(1, seed=3)[0], 8), Request("b", prompts(1, seed=4)[0], 8)])
    if where == "launch":
        batch.runner.run = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="device lost"):
            batch.launch()
        del batch.runner.run
    else:
        batch.launch()
        batch.slots.clear_padding = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="device lost"):
            batch.collect()
        del batch.slots.clear_padding
    # not wedged: what ran is cancelled (the scheduler aborts every running request), a new one runs
    assert batch.cancel("a") and batch.cancel("b") and batch.active == 0
    out = batch.add(Request("c", [5, 6, 7], 6))[0].new_token_ids
    while batch.active:
        batch.launch()
        out += [t for o in batch.collect() for t in o.new_token_ids]
    assert out == engine.generate([[5, 6, 7]], 6, spec=AR)[0].token_ids


@pytest.mark.parametrize("config", ["b8-k4-w2048-bs8", "dflash-w2048-bs8", "bauto-k4-w2048-bs8", "ar"])
def test_served_outputs_equal_ar_at_t0(engine: Engine, config: str) -> None:
    """Through the scheduler (rounds launched and collected, stop tokens, lengths, a late arrival) the
    committed tokens are AR's own."""
    spec = SpecConfig.from_id(config)
    texts = prompts(5, seed=31)
    ref = engine.generate(texts, 16, spec=AR)
    stop = ref[1].token_ids[5]  # request 1 stops at its sixth token
    ref_stop = engine.generate([texts[1]], 16, spec=AR, stop_token_ids=[stop])[0]
    reqs = [Request(str(i), p, 16 - i, stop_token_ids=(stop,) if i == 1 else ()) for i, p in enumerate(texts)]
    batch = engine.open_batch(spec, max_batch=3, max_len=128)  # 5 requests, 3 slots: two wait for a slot
    events = Events([r.request_id for r in reqs])
    run(Scheduler(batch, max_running=3, switch_interval_s=None), events, reqs, timeout=120)
    for i, r in enumerate(ref):
        want = ref_stop.token_ids if i == 1 else r.token_ids[:16 - i]
        assert events.tokens(str(i)) == want, i
        assert events.last(str(i)).finish_reason == ("stop" if i == 1 else "length")  # type: ignore[union-attr]


@pytest.mark.parametrize("config", ["b8-k4-w2048-bs8", "ar"])
def test_served_rounds_run_ahead_equal_ar_at_t0(engine: Engine, config: str) -> None:
    """A batch that runs ahead (no profiling timer, as on CUDA) through the scheduler: rounds are launched
    inside the collect before them, settled for the late arrivals and the stopped and finished rows, and
    every request gets AR's tokens."""
    spec = SpecConfig.from_id(config)
    texts = prompts(5, seed=37)
    ref = engine.generate(texts, 30, spec=AR)
    stop = ref[1].token_ids[12]  # request 1 stops at its thirteenth token
    ref_stop = engine.generate([texts[1]], 30, spec=AR, stop_token_ids=[stop])[0]
    reqs = [Request(str(i), p, 30 - 2 * i, stop_token_ids=(stop,) if i == 1 else ()) for i, p in enumerate(texts)]
    batch = engine.open_batch(spec, max_batch=3, max_len=128, profile=False)
    events = Events([r.request_id for r in reqs])
    run(Scheduler(batch, max_running=3, switch_interval_s=None), events, reqs, timeout=120)
    for i, r in enumerate(ref):
        want = ref_stop.token_ids if i == 1 else r.token_ids[:30 - 2 * i]
        assert events.tokens(str(i)) == want, i
    assert batch.rounds_run_ahead > 0 and not batch.round_ahead and not batch.rows


def test_a_batch_seen_through_step_alone_is_settled_before_rows_join(engine: Engine) -> None:
    """A batch whose step() runs ahead, seen with step() as its collect (ddtree.profiling.round_overhead's "no overlap"
    mode): a request that arrives while another runs joins after the round step() left in flight is settled;
    both get AR's tokens."""
    from ddtree.profiling.round_overhead import StepOnly

    texts = prompts(2, seed=43)
    ref = engine.generate(texts, 60, spec=AR)
    batch = engine.open_batch(SpecConfig.from_id("b8-k4-w2048-bs8"), max_batch=2, max_len=160, profile=False)
    events = Events(["0", "1"])
    sched = Scheduler(StepOnly(batch), max_running=2, switch_interval_s=None)
    sched.submit(Request("0", texts[0], 60), events.sink("0"))
    sched.start()
    try:
        deadline = time.monotonic() + 60
        while len(events.got["0"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        sched.submit(Request("1", texts[1], 6), events.sink("1"))  # "0" has rounds to go: one is in flight
        assert events.done.wait(120)
    finally:
        sched.stop()
    assert [events.tokens("0"), events.tokens("1")] == [ref[0].token_ids, ref[1].token_ids[:6]]
    assert batch.rounds_run_ahead > 0 and not batch.round_ahead


def test_round_overhead_bench_reads_the_same_tokens_back_through_the_relay() -> None:
    """ddtree.profiling.round_overhead: in process, served (overlapped) and served one round at a time give
    every request the same tokens, and each mode's rounds are timed."""
    from ddtree.profiling import round_overhead as ro

    batch = ro.ZeroBatch(3)
    assert ro.StepOnly(batch).active == 0
    requests = [Request(f"r{i}", [1], 20 + i, ignore_eos=True) for i in range(3)]
    assert ro.served(batch, requests, on_gpu=False) == ro.in_process(batch, requests) == {
        f"r{i}": [t % 101 for t in range(1, 21 + i)] for i in range(3)}
    row = ro.run_config(batch, None, requests, repeats=1, on_gpu=False)
    assert row["mismatched"] == dict.fromkeys(ro.MODES, 0)
    for mode in ro.MODES:
        assert row[mode]["rounds"] == 21 and row[mode]["period_us"] > 0 and row[mode]["round_us"] > 0


@pytest.mark.parametrize("config", ["b6-k3-wnone-bs6", "bauto12-k3-wnone-bs6"])
def test_served_graphed_rounds_equal_ar_at_t0(engine: Engine, config: str) -> None:
    """The graphed batch's rounds (replays, row buckets, budget auto choosing the next size on the device)
    run eagerly on the CPU through the scheduler, the graph warm-up first: AR's tokens."""
    spec = SpecConfig.from_id(config)
    texts = prompts(4, seed=41)
    ref = engine.generate(texts, 14, spec=AR)
    batch = with_attention(engine, "reference").open_batch(spec, max_batch=3, max_len=200)
    batch.runner.graphs = graphs = EagerGraphs()  # type: ignore[assignment]
    reqs = [Request(str(i), p, 14) for i, p in enumerate(texts)]
    events = Events([r.request_id for r in reqs])
    run(Scheduler(batch, max_running=3, warm_token=5, switch_interval_s=None), events, reqs, timeout=300)
    assert [events.tokens(str(i)) for i in range(4)] == [r.token_ids for r in ref]
    assert any(k[0] == "round" for k in graphs.keys) and not batch.rows
