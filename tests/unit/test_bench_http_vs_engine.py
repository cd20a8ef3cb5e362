"""The HTTP-vs-engine bench and the serving pieces it measures: one hand-over per round, coalesced and
paced streams, the graph warm-up, the closed in-process loop, and a whole emulated run through a server."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from pathlib import Path

import pytest

from ddtree.config import SpecConfig
from ddtree.cuda_graphs import ROW_BUCKETS
from ddtree.engine import Request, StepOutput
from ddtree.profiling import http_vs_engine as hve
from ddtree.profiling.emulated import EmulatedBatch
from ddtree.profiling.flags import FIXTURE_TARGET
from ddtree.profiling.in_process import EngineChannel, measuring, run_in_process, write_plan
from ddtree.serving.admission import WARM_PREFILL_WIDTHS
from ddtree.serving.scheduler import Failure, Scheduler
from ddtree.serving.state import RequestStream

AR = SpecConfig.from_id("ar")


@pytest.fixture(autouse=True)
def _temporary_folders_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's own temporary folders (the servers' logs without --out) go under the test's tmp_path,
    not the machine's /tmp, where every run of the suite would leave two."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))


def emulated(max_batch: int = 8, tokens: int = 1) -> EmulatedBatch:
    return EmulatedBatch(AR, max_batch, 512, round_s=0.0, prefill_s=0.0, tokens_per_round=tokens)


def test_in_process_loop_keeps_concurrency_and_times_every_request() -> None:
    batch = emulated(max_batch=8, tokens=3)
    steps: list[int] = []
    real_step = batch.step
    batch.step = lambda: steps.append(batch.active) or real_step()  # type: ignore[method-assign]
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    records = run_in_process(None, batch, prompts, concurrency=2, max_new_tokens=7)
    assert max(steps) == 2 and batch.active == 0
    for prompt, rec in zip(prompts, records):
        assert rec.ok and rec.completion_tokens == 7 and rec.finish_reason == "length"
        assert rec.output_ids == [prompt[(3 + i) % 3] for i in range(7)]  # the emulated batch reads its prompt on
        assert rec.ttft_s is not None and rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s
        assert rec.tpot_s is not None and rec.spec_verify_ct == 2  # 1 token at prefill, then 3 + 3


def test_scheduler_hands_each_round_over_in_one_call() -> None:
    batch = emulated(max_batch=4)
    calls: list[list[tuple[object, object]]] = []
    got: dict[str, list[int]] = {}
    done = threading.Event()

    def deliver(items: list) -> None:
        calls.append(items)
        for sink, event in items:
            sink(event)

    def sink_for(rid: str):
        def sink(ev: StepOutput | Failure) -> None:
            assert isinstance(ev, StepOutput)
            got.setdefault(rid, []).extend(ev.new_token_ids)
            if ev.finished and len(got) == 4 and sum(len(v) for v in got.values()) == 4 * 6:
                done.set()
        return sink

    sched = Scheduler(batch, max_running=4, deliver=deliver, switch_interval_s=None)
    for i in range(4):  # queued before the thread starts: one admission, then rounds of 4
        sched.submit(Request(f"r{i}", [i + 1, i + 2], 6, ignore_eos=True), sink_for(f"r{i}"))
    sched.start()
    try:
        assert done.wait(10)
    finally:
        sched.stop()
    assert sched.rounds == 5  # the prefill's token, then one a round
    # one hand-over per round, and the prefill's first tokens on their own before round 1 (TTFT)
    assert [len(items) for items in calls] == [4, 4, 4, 4, 4, 4]


class _GraphedBatch(EmulatedBatch):
    """An emulated batch that says its rounds are graphs, recording what it was asked to run."""

    graphs = object()

    def __init__(self) -> None:
        super().__init__(AR, 32, 8192, 0.0, 0.0, 1)
        self.rows_per_step: list[int] = []
        self.prompt_lengths: list[int] = []

    def add_many(self, requests):  # type: ignore[no-untyped-def]
        self.prompt_lengths += [len(r.prompt_ids) for r in requests]
        return super().add_many(requests)

    def launch(self) -> None:
        self.rows_per_step.append(self.active)
        super().launch()


def test_warm_up_meets_every_row_bucket_and_prefill_width_before_serving() -> None:
    batch = _GraphedBatch()
    sched = Scheduler(batch, max_running=20, warm_token=5, switch_interval_s=None)
    sched.warm_up()
    buckets = [b for b in ROW_BUCKETS if b < 20] + [20]
    assert sorted(set(batch.rows_per_step)) == buckets
    assert [n for n in batch.prompt_lengths if n > 1] == list(WARM_PREFILL_WIDTHS)
    assert batch.active == 0 and sched.warm_seconds is not None
    plain = emulated()
    none = Scheduler(plain, max_running=4, warm_token=5, switch_interval_s=None)
    none.warm_up()  # no graphs: nothing to warm
    assert none.warm_seconds is None


def _out(rid: str, tokens: list[int], finished: bool = False) -> StepOutput:
    return StepOutput(rid, tokens, finished, "length" if finished else None, 1, [len(tokens)])


def test_stream_coalesces_rounds_and_plain_wakes_once() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        stream = RequestStream(Request("s", [1], 9), loop)
        updates = stream.updates()
        for i in range(3):  # three rounds land before the consumer looks
            stream.push(_out("s", [i]))
        first = await anext(updates)
        assert first.output_ids == [0, 1, 2] and first.accept_histogram == [0, 3]
        stream.push(_out("s", [3, 4], finished=True))
        last = await anext(updates)
        assert last.finished and last.output_ids == [0, 1, 2, 3, 4] and last.accept_histogram == [0, 3, 1]
        with pytest.raises(StopAsyncIteration):
            await anext(updates)

        plain = RequestStream(Request("p", [1], 9), loop, every_round=False)
        woke: list[int] = []

        async def consume() -> None:
            async for p in plain.updates():
                woke.append(len(p.output_ids))

        task = asyncio.create_task(consume())
        for i in range(4):
            plain.push(_out("p", [i]))
            await asyncio.sleep(0)
        plain.push(_out("p", [9], finished=True))
        await task
        assert woke == [5]

        failing = RequestStream(Request("f", [1], 9), loop, every_round=False)
        failing.push(Failure("f", "no room", 503, "batch"))
        with pytest.raises(Exception, match="no room"):
            await failing.result()

    asyncio.run(body())


def test_paced_stream_holds_a_running_update_but_never_the_last() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        done: list[bool] = []
        stream = RequestStream(Request("s", [1], 9), loop, pace=lambda: 0.2, on_done=lambda: done.append(True))
        updates = stream.updates()
        stream.push(_out("s", [1]))
        assert (await anext(updates)).output_ids == [1]  # the first is never held back
        stream.push(_out("s", [2]))
        t0 = loop.time()
        second = await anext(updates)
        assert loop.time() - t0 >= 0.15 and second.output_ids == [1, 2]
        stream.push(_out("s", [3]))
        nxt = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.01)
        assert not nxt.done()  # held by the pace
        stream.push(_out("s", [4], finished=True))
        t1 = loop.time()
        last = await nxt
        assert loop.time() - t1 < 0.1 and last.finished and last.output_ids == [1, 2, 3, 4]
        assert done == [True]

    asyncio.run(body())


def test_cell_row_ratio_and_table() -> None:
    rep = {"tok_per_s": 100.0, "duration_s": 1.0, "failed": 0, "ttft_ms": 2.0, "p90_ttft_ms": 3.0,
           "tpot_ms": 1.0, "p90_tpot_ms": 1.5, "e2e_ms": 10.0, "p90_e2e_ms": 12.0}
    repeats = {"engine": [rep, dict(rep, tok_per_s=120.0), dict(rep, tok_per_s=110.0)],
               "stream": [dict(rep, tok_per_s=88.0)] * 3}
    row = hve.cell_row("ar", 1024, 32, repeats, {"engine": 0, "stream": 0})
    assert row["engine"]["tok_per_s"] == 110.0 and row["stream"]["ratio"] == pytest.approx(0.8)
    assert row["stream"]["p90_over_median_e2e"] == pytest.approx(1.2)
    failing = hve.cell_row("ar", 60, 1, {"engine": [rep] * 3, "stream": [rep, dict(rep, failed=2), rep]}, {})
    assert failing["stream"]["failed"] == 2  # one bad repeat is not outvoted by the median
    table = hve.format_rows([row])
    assert "0.800" in table and table.count("\n") == 2


def test_bad_arguments_exit_2_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert hve.main(["--engine", "emulated", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert hve.main(["--engine", "emulated", "--concurrency", "64", "--max-running-requests", "32"]) == 2
    assert hve.main(["--engine", "emulated", "--waves", "0"]) == 2
    assert "--waves" in capsys.readouterr().err


def test_server_flags_pass_the_bench_options_on() -> None:
    assert hve.server_flags(hve.build_parser().parse_args(["--engine", "emulated"])) == []
    args = hve.build_parser().parse_args(["--engine", "emulated", "--dtype", "bfloat16", "--sleep-on-idle",
                                          "--disable-overlap-schedule"])
    assert hve.server_flags(args) == ["--dtype", "bfloat16", "--sleep-on-idle", "--disable-overlap-schedule"]


def test_waves_lengthen_a_repeat_at_high_concurrency_only() -> None:
    args = hve.build_parser().parse_args(["--engine", "emulated", "--waves", "3"])
    assert [hve.requests_per_repeat(args, c) for c in (1, 8, 32)] == [8, 24, 96]
    assert hve.requests_per_repeat(hve.build_parser().parse_args(["--engine", "emulated"]), 32) == 32
    fixed = hve.build_parser().parse_args(["--engine", "emulated", "--waves", "3", "--requests", "5"])
    assert hve.requests_per_repeat(fixed, 32) == 5


@pytest.mark.parametrize("where", ["same", "separate"])
def test_emulated_run_through_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Engine, streaming and plain clients on the same prompts, through a real server process; T = 0
    outputs identical both ways (the exit status says so); the modes' repeats take turns. "same": each in-process
    repeat is asked of the server's engine process."""
    monkeypatch.setenv("DDTREE_COMMIT", "pinned-for-the-test")
    order: list[str] = []
    real_client, real_measure = hve.run_client, EngineChannel.measure

    def client(*args: object, **kwargs: object) -> object:
        order.append("http")
        return real_client(*args, **kwargs)

    def measure(self: EngineChannel, index: int) -> dict:
        order.append(f"engine {index}")
        return real_measure(self, index)

    monkeypatch.setattr(hve, "run_client", client)
    monkeypatch.setattr(EngineChannel, "measure", measure)
    out = tmp_path / "new" / "hve.json"  # a folder that does not exist yet
    code = hve.main(["--engine", "emulated", "--configs", "ar", "--contexts", "60", "--concurrency", "1", "3",
                     "--requests", "3", "--repeats", "2", "--warmup", "1", "--max-new-tokens", "12",
                     "--max-running-requests", "4", "--round-ms", "1", "--in-process", where, "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["meta"]["commit"] == "pinned-for-the-test"  # DDTREE_COMMIT: a copied tree names its commit
    assert data["meta"]["in_process"] == where
    assert [(r["context"], r["concurrency"]) for r in rows] == [(60, 1), (60, 3)]
    for row in rows:
        assert set(row["mismatched"].values()) == {0}
        for mode in ("engine", "stream", "plain"):
            assert row[mode]["failed"] == 0 and row[mode]["tok_per_s"] > 0
        assert row["stream"]["ttft_ms"] is not None and row["stream"]["ratio"] > 0
        assert len(row["engine"]["tok_per_s_repeats"]) == 2
    if where == "same":  # per cell: 2 warm-up clients, then engine, stream, plain twice
        turn = ["engine {}", "http", "http"] * 2
        assert order == ["http", "http", *[t.format(0) for t in turn], "http", "http", *[t.format(1) for t in turn]]
    else:
        assert not [o for o in order if o.startswith("engine")]


def test_the_engine_process_measures_between_served_requests_and_keeps_serving(tmp_path: Path) -> None:
    """measuring(): cells measured on request, each on the served batch on the scheduler's thread while
    nothing is served; a bad request is the bench's error, and the scheduler still serves after it."""
    batch = EmulatedBatch(AR, 4, 512, round_s=0.0005, prefill_s=0.0, tokens_per_round=1)
    sched = Scheduler(batch, max_running=4, switch_interval_s=None)
    prompts = [[5, 6, 7], [8, 9, 10]]
    address, key = write_plan(tmp_path / "plan.json", [(60, 2, prompts)], 5)
    assert measuring(lambda *_: sched, tmp_path / "plan.json")(None, 512, None, None) is sched
    sched.start()
    channel = EngineChannel(address, key)
    try:
        rep = channel.measure(0)
        assert [r.output_ids for r in rep["records"]] == [[(5, 6, 7)[(3 + i) % 3] for i in range(5)],
                                                          [(8, 9, 10)[(3 + i) % 3] for i in range(5)]]
        assert all(r.ok for r in rep["records"]) and rep["round_ms"] > 0
        with pytest.raises(RuntimeError, match="IndexError"):
            channel.measure(3)
        done = threading.Event()
        sched.submit(Request("served", [1, 2], 3, ignore_eos=True), lambda ev: ev.finished and done.set())
        assert done.wait(10)
        assert channel.measure(0)["records"][0].output_ids == rep["records"][0].output_ids
    finally:
        channel.close()
        sched.stop()


def test_a_call_run_idle_runs_on_the_scheduler_thread_with_nothing_admitted_meanwhile() -> None:
    batch = emulated(max_batch=2)
    sched = Scheduler(batch, max_running=2, switch_interval_s=None)
    sched.start()
    done = threading.Event()
    try:
        def while_idle() -> str:
            sched.submit(Request("r", [1, 2], 3, ignore_eos=True), lambda ev: ev.finished and done.set())
            assert not done.wait(0.2) and batch.active == 0  # queued, not admitted
            return threading.current_thread().name

        assert sched.run_idle(while_idle) == "ddtree-scheduler"
        assert done.wait(10)
        assert sched.run_idle(lambda: batch.active) == 0  # nothing runs or waits: the call runs at once
        with pytest.raises(ZeroDivisionError):
            sched.run_idle(lambda: 1 / 0)  # what the call raised, raised here; the scheduler serves on
        assert sched.alive and sched.run_idle(lambda: 1) == 1
    finally:
        sched.stop()
    with pytest.raises(RuntimeError, match="not running"):
        sched.run_idle(lambda: None)


def test_rows_are_handed_over_cell_by_cell_and_logs_stay_out_of_the_cwd(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """on_row sees the rows after every cell (main writes --out there: a run cut short keeps what it measured);
    without --out the servers' logs go to a folder of their own, not the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = hve.build_parser().parse_args(
        ["--engine", "emulated", "--configs", "ar", "--contexts", "60", "--concurrency", "1", "2",
         "--requests", "2", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "4",
         "--max-running-requests", "2", "--round-ms", "0.5", "--modes", "stream", "--device", "cpu"])
    seen: list[list[tuple[int, int]]] = []
    lines: list[str] = []
    rows = hve.run(args, log=lambda text, **_: lines.append(text),
                   on_row=lambda rows: seen.append([(r["context"], r["concurrency"]) for r in rows]))
    assert seen == [[(60, 1)], [(60, 1), (60, 2)]] and len(rows) == 2
    log_dir = Path(next(line for line in lines if line.startswith("server logs: ")).split(": ", 1)[1])
    assert log_dir != cwd and list(log_dir.glob("local-*.log")), list(log_dir.iterdir())
    assert list(cwd.iterdir()) == []


def test_emulated_round_overlaps_host_work_between_launch_and_collect() -> None:
    """What a caller does between launch() and collect() hides in the round's wait, as on a device."""
    import time

    batch = EmulatedBatch(AR, 2, 512, round_s=0.2, prefill_s=0.0, tokens_per_round=1)
    batch.add(Request("a", [1, 2, 3], 4, ignore_eos=True))
    batch.launch()
    with pytest.raises(RuntimeError, match="already launched"):
        batch.launch()
    time.sleep(0.25)  # "host work" longer than the round
    started = time.perf_counter()
    outputs = batch.collect()
    assert time.perf_counter() - started < 0.1  # nothing left to wait for
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [2])]
    with pytest.raises(RuntimeError, match="no round launched"):
        batch.collect()
    started = time.perf_counter()
    assert [o.new_token_ids for o in batch.step()] == [[3]]  # step() = launch() + collect(): the whole wait
    assert time.perf_counter() - started >= 0.2



def test_a_repeats_tok_per_s_is_over_its_requests_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mode's tok/s divides by its requests' own span (the sweep's records_duration_s), so a slow /metrics
    scrape around an HTTP repeat is not counted."""
    import time

    real = hve.server_rounds

    def slow_scrape(url: str) -> tuple[float, float] | None:
        time.sleep(0.3)
        return real(url)

    monkeypatch.setattr(hve, "server_rounds", slow_scrape)
    args = hve.build_parser().parse_args(
        ["--engine", "emulated", "--configs", "ar", "--contexts", "60", "--concurrency", "1", "--requests", "2",
         "--repeats", "1", "--warmup", "0", "--max-new-tokens", "8", "--max-running-requests", "2",
         "--round-ms", "1", "--modes", "stream", "--device", "cpu"])
    (row,) = hve.run(args, log=lambda *_, **__: None)
    for mode in ("engine", "stream"):
        assert row[mode]["duration_s"] < 0.25, (mode, row[mode]["duration_s"])  # 2 x 8 rounds of 1 ms, not 0.6 s
        assert row[mode]["tok_per_s"] == pytest.approx(16 / row[mode]["duration_s"])


def test_a_failed_in_process_measurement_stops_the_server_with_its_reason(tmp_path: Path) -> None:
    """What the engine process's measurement raises is the server's start-up failure (exit 1, the reason logged),
    not a server that comes up without the numbers."""
    import subprocess
    import sys

    plan = tmp_path / "plan.json"
    hve.write_plan(plan, [(60, 1, [[5, 6, 7]])], 4)
    broken = json.loads(plan.read_text())
    del broken["max_new_tokens"]
    plan.write_text(json.dumps(broken))
    target = FIXTURE_TARGET
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree.profiling.http_vs_engine", "serve-emulated", "--round-ms", "1", "--prefill-ms", "1",
         "--tokens-per-round", "1", "--engine-plan", str(plan), "--model-path", str(target), "--port", "0",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the engine failed to start: KeyError: 'max_new_tokens'" in proc.stderr
