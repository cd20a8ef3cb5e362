"""The load generator against a small in-process /generate server on a real socket."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ddtree.bench import loadgen
from ddtree.bench.arrivals import arrival_stats, poisson_offsets
from ddtree.bench.loadgen import RequestRecord, run_arrivals, run_load, run_requests
from ddtree.errors import ConfigError
from tests.unit.threaded_uvicorn import uvicorn_in_thread

FAIL_TOKEN = 666  # a prompt starting with it gets HTTP 500
HANG_TOKEN = 777  # a prompt starting with it never answers
SPLIT_TOKEN = 888  # a prompt starting with it gets each event in two writes, split inside its JSON
CUT_TOKEN = 999  # a prompt starting with it gets a stream that ends without [DONE]
LATE_END_TOKEN = 555  # a prompt starting with it gets a stream whose body ends well after its [DONE]
AWKWARD_TOKEN = 444  # a prompt starting with it gets its stream in pieces cut at awkward places
INCREMENTAL_TOKEN = 333  # a prompt starting with it gets incremental chunks (only the new tokens)
ERROR_CHUNK_TOKEN = 222  # a prompt starting with it gets an error event after its first chunk
CLOSE_TOKEN = 111  # a prompt starting with it gets its answer with `Connection: close`
# where AWKWARD_TOKEN's stream (`data:{json}`, no space) is cut: inside "data:", after it, between an event's two
# newlines, inside "[DONE]"
AWKWARD_CUTS = (2, 5, 6, -2, -1)
TOKENS_PER_CHUNK = 3  # like speculative decoding: several tokens per streamed chunk
STEP_S = 0.01


class FakeState:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen: list[dict[str, Any]] = []
        self.client_ports: list[int] = []  # one per request: the connection it came over
        self.lock = threading.Lock()


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def meta(prompt: list[int], n: int, done: bool, max_new: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "spec_verify_ct": -(-n // TOKENS_PER_CHUNK),
            "finish_reason": {"type": "length", "length": max_new} if done else None,
        }

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        state.seen.append(body)
        state.client_ports.append(request.scope["client"][1])
        prompt = body["input_ids"]
        max_new = body["sampling_params"]["max_new_tokens"]
        if prompt[0] == FAIL_TOKEN:
            return JSONResponse({"error": "boom: prompt rejected"}, status_code=500)
        with state.lock:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)

        def leave() -> None:
            with state.lock:
                state.in_flight -= 1

        if prompt[0] == HANG_TOKEN:
            try:
                await asyncio.sleep(30)
            finally:
                leave()
        output = [(prompt[0] + i) % 1000 for i in range(max_new)]
        if not body.get("stream"):
            try:
                await asyncio.sleep(STEP_S * 3)
            finally:
                leave()
            answer = {"text": "", "output_ids": output, "meta_info": meta(prompt, max_new, True, max_new)}
            return JSONResponse(answer, headers={"connection": "close"} if prompt[0] == CLOSE_TOKEN else None)

        async def events() -> AsyncIterator[str]:
            try:
                n = 0
                while n < max_new:
                    await asyncio.sleep(STEP_S)
                    n, old = min(n + TOKENS_PER_CHUNK, max_new), n
                    chunk = {"text": "", "output_ids": output[old:n] if prompt[0] == INCREMENTAL_TOKEN else output[:n],
                             "meta_info": meta(prompt, n, n == max_new, max_new)}
                    event = f": a comment line\ndata: {json.dumps(chunk)}\n\n"
                    if prompt[0] == ERROR_CHUNK_TOKEN and old > 0:
                        event = 'data: {"error": {"message": "engine gone", "code": 500}}\n\n'
                    if prompt[0] == SPLIT_TOKEN:
                        yield event[:25]
                        await asyncio.sleep(STEP_S)
                    if prompt[0] == AWKWARD_TOKEN:
                        event = event.removeprefix(": a comment line\n").replace("data: ", "data:")  # no space: SSE allows it
                        pieces = [event[a:b] for a, b in zip((0, *AWKWARD_CUTS), (*AWKWARD_CUTS, None))]
                        for piece in pieces[:-1]:
                            yield piece
                            await asyncio.sleep(STEP_S / 5)
                        event = pieces[-1]
                    yield event[25:] if prompt[0] == SPLIT_TOKEN else event
                if prompt[0] == AWKWARD_TOKEN:
                    yield "data: [DO"
                    await asyncio.sleep(STEP_S / 5)
                    yield "NE]\n"
                    await asyncio.sleep(STEP_S / 5)
                    yield "\n"
                elif prompt[0] != CUT_TOKEN:
                    yield "data: [DONE]\n\n"
                if prompt[0] == LATE_END_TOKEN:
                    await asyncio.sleep(STEP_S)  # the chunked body's terminator a while after [DONE]
            finally:
                leave()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with uvicorn_in_thread(make_app(state), ws="none", timeout_graceful_shutdown=1) as (port, _):
        yield f"http://127.0.0.1:{port}", state


@pytest.fixture
def server(fake_server: tuple[str, FakeState]) -> tuple[str, FakeState]:
    url, state = fake_server
    state.max_in_flight = 0
    state.seen.clear()
    state.client_ports.clear()
    return url, state


def test_streaming_keeps_exactly_concurrency_in_flight(server: tuple[str, FakeState]) -> None:
    url, state = server
    prompts = [[i + 1, 2, 3] for i in range(12)]
    records = run_load(url, prompts, concurrency=4, max_new_tokens=10, timeout_s=20)
    assert state.max_in_flight == 4, f"max in flight {state.max_in_flight}, limit 4"
    assert len(set(state.client_ports)) == 4, state.client_ports  # one keep-alive connection per slot
    assert all(r.ok for r in records), [r.error for r in records]
    r = records[0]
    assert r.completion_tokens == 10 and r.prompt_tokens == 3
    assert r.output_ids == [(1 + i) % 1000 for i in range(10)]
    assert r.finish_reason == "length"
    assert r.spec_verify_ct == 4  # ceil(10 / 3)
    # 10 tokens in chunks of 3 -> 4 chunks bring tokens -> 3 gaps.
    assert len(r.itl_s) == 3 and all(g > 0 for g in r.itl_s)
    assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s < r.e2e_s
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 9)
    sent = state.seen[0]
    assert sent["stream"] is True
    assert sent["sampling_params"] == {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def test_concurrency_one_is_sequential(server: tuple[str, FakeState]) -> None:
    url, state = server
    records = run_load(url, [[5, 6]] * 3, concurrency=1, max_new_tokens=4, timeout_s=20)
    assert state.max_in_flight == 1
    starts = [r.started_at for r in records]
    assert starts == sorted(starts)


def test_non_streaming_and_seed(server: tuple[str, FakeState]) -> None:
    url, state = server
    records = run_load(url, [[7, 8], [9, 10]], concurrency=2, max_new_tokens=5, stream=False,
                       seed=100, temperature=0.5, timeout_s=20)
    assert [r.completion_tokens for r in records] == [5, 5]
    assert records[1].output_ids == [9, 10, 11, 12, 13]
    assert records[0].ttft_s is None and records[0].tpot_s is None and records[0].e2e_s
    seeds = sorted(b["sampling_params"]["seed"] for b in state.seen)
    assert seeds == [100, 101]


def test_failures_are_recorded_not_raised(server: tuple[str, FakeState]) -> None:
    url, _ = server
    prompts = [[1, 2], [FAIL_TOKEN, 1], [HANG_TOKEN, 1], [3, 4]]
    t0 = time.monotonic()
    records = run_load(url, prompts, concurrency=4, max_new_tokens=4, timeout_s=1.0)
    assert time.monotonic() - t0 < 10, "a hung request was not bounded by timeout_s"
    assert [r.ok for r in records] == [True, False, False, True]
    assert records[1].error is not None and "HTTP 500" in records[1].error and "boom" in records[1].error
    assert records[2].error is not None and "timeout" in records[2].error
    # the hung request ran until its timeout cut it; uvloop's millisecond clock may fire the timer a little early
    assert records[2].e2e_s is not None and records[2].e2e_s >= 0.95


def test_events_split_across_reads_and_a_stream_cut_short(server: tuple[str, FakeState]) -> None:
    """An event arriving in two pieces is read whole, once; a stream without [DONE] is a failed request."""
    url, _ = server
    records = run_load(url, [[SPLIT_TOKEN, 1], [CUT_TOKEN, 1]], concurrency=2, max_new_tokens=7, timeout_s=20)
    split, cut = records
    assert split.ok, split.error
    assert split.output_ids == [(SPLIT_TOKEN + i) % 1000 for i in range(7)] and split.completion_tokens == 7
    assert len(split.itl_s) == 2 and split.spec_verify_ct == 3 and split.finish_reason == "length"
    assert not cut.ok and cut.error == "stream ended without 'data: [DONE]'"
    assert cut.completion_tokens == 7  # what arrived before the cut is still counted


def test_a_stream_read_to_its_end_keeps_the_connection(server: tuple[str, FakeState]) -> None:
    """The client reads past [DONE] to the body's end, so the next request reuses the connection (the pool
    closes one whose response is unfinished)."""
    url, state = server
    records = run_load(url, [[LATE_END_TOKEN, i] for i in range(4)], concurrency=1, max_new_tokens=3, timeout_s=20)
    assert all(r.ok for r in records), [r.error for r in records]
    assert len(state.client_ports) == 4 and len(set(state.client_ports)) == 1, state.client_ports


def test_a_stream_cut_at_awkward_places_is_read_whole(server: tuple[str, FakeState]) -> None:
    """Reads ending inside "data:", between an event's two newlines and inside "[DONE]": each event is
    applied once, whole, and [DONE] is still seen."""
    url, _ = server
    (record,) = run_load(url, [[AWKWARD_TOKEN, 1]], concurrency=1, max_new_tokens=7, timeout_s=20, timeline=True)
    assert record.ok, record.error
    assert record.output_ids == [(AWKWARD_TOKEN + i) % 1000 for i in range(7)] and record.completion_tokens == 7
    assert len(record.itl_s) == 2 and record.spec_verify_ct == 3 and record.finish_reason == "length"
    assert "c_done" in record.stamps


def test_incremental_chunks_are_accumulated(server: tuple[str, FakeState]) -> None:
    url, _ = server
    (record,) = run_load(url, [[INCREMENTAL_TOKEN, 1]], concurrency=1, max_new_tokens=8, timeout_s=20)
    assert record.ok, record.error
    assert record.output_ids == [(INCREMENTAL_TOKEN + i) % 1000 for i in range(8)] and record.completion_tokens == 8
    assert len(record.itl_s) == 2


def test_an_error_event_fails_the_request_with_its_text(server: tuple[str, FakeState]) -> None:
    url, _ = server
    ok, failed = run_load(url, [[1, 2], [ERROR_CHUNK_TOKEN, 1]], concurrency=1, max_new_tokens=9, timeout_s=20)
    assert ok.ok, ok.error
    assert not failed.ok and failed.error == 'stream error: {"message": "engine gone", "code": 500}'
    assert failed.completion_tokens == 3  # the chunk before the error


def test_a_server_closing_each_connection_gets_a_new_one_per_request(server: tuple[str, FakeState]) -> None:
    url, state = server
    records = run_load(url, [[CLOSE_TOKEN, i] for i in range(3)] + [[1, 2]], concurrency=1, max_new_tokens=3,
                       timeout_s=20, stream=False)
    assert all(r.ok for r in records), [r.error for r in records]
    assert len(state.seen) == 4 and len(set(state.client_ports)) == 4, state.client_ports  # each request sent once


@pytest.mark.parametrize("stream", [True, False])
def test_timeline_stamps_are_in_order(server: tuple[str, FakeState], stream: bool) -> None:
    url, _ = server
    records = run_load(url, [[1, 2], [3, 4]], concurrency=1, max_new_tokens=7, timeout_s=20, stream=stream,
                       timeline=True)
    names = ["c_send", "c_first", "c_last", "c_done", "c_end"] if stream else ["c_send", "c_done", "c_end"]
    for r in records:
        assert r.ok, r.error
        assert set(r.stamps) == set(names), r.stamps
        times = [r.stamps[n] for n in names]
        assert times == sorted(times), r.stamps
    assert records[0].stamps["c_end"] <= records[1].stamps["c_send"]


def test_connection_error_is_recorded() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    records = run_load(f"http://127.0.0.1:{port}", [[1]], concurrency=1, max_new_tokens=2,
                       timeout_s=5)
    assert not records[0].ok
    assert records[0].error is not None and "connection error" in records[0].error


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"concurrency": 0}, "concurrency", id="zero-concurrency"),
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="zero-max-new-tokens"),
        pytest.param({"timeout_s": 0}, "timeout_s", id="zero-timeout"),
        pytest.param({"prompts": [[]]}, "prompts[0]", id="empty-prompt"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"prompts": [[1]], "concurrency": 1, "max_new_tokens": 1, "timeout_s": 5}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=re.escape(field)):
        asyncio.run(run_requests("http://127.0.0.1:9", **args))


def test_record_defaults() -> None:
    record = RequestRecord(ok=False)
    assert record.itl_s == [] and record.output_ids == [] and record.spec_verify_ct is None


@pytest.mark.parametrize("stream", [True, False])
def test_several_client_processes_share_the_prompts_and_the_concurrency(server: tuple[str, FakeState],
                                                                        stream: bool) -> None:
    """Prompt i goes from process i mod 2; records come back in prompt order; the seed is still seed + i."""
    url, state = server
    hung = state.in_flight  # requests an earlier test left hanging on purpose
    prompts = [[i + 1, 2, 3] for i in range(9)]
    records = run_load(url, prompts, concurrency=4, max_new_tokens=6, timeout_s=30, stream=stream, seed=100,
                       processes=2)
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.output_ids[:1] for r in records] == [[i + 1] for i in range(9)]  # each record is its own prompt's
    assert 2 <= state.max_in_flight - hung <= 4  # two processes keeping 2 in flight each
    seeds = {body["input_ids"][0]: body["sampling_params"]["seed"] for body in state.seen}
    assert seeds == {i + 1: 100 + i for i in range(9)}
    assert all(r.started_at > 0 and r.e2e_s for r in records)
    assert len(loadgen._POOLS[2]._processes) == 2  # the pool the run went through: two live client processes


def test_client_processes_must_be_a_positive_integer(server: tuple[str, FakeState]) -> None:
    url, _ = server
    with pytest.raises(ConfigError, match="processes"):
        run_load(url, [[1]], concurrency=1, max_new_tokens=2, processes=0)


def test_client_pool_starts_every_process_even_when_its_first_pauses_are_too_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause shorter than a spawn lets one process take two of the first tasks; the pool still comes up whole."""
    monkeypatch.setattr(loadgen, "POOL_PAUSE_S", 0.001)
    monkeypatch.setattr(loadgen, "_POOLS", {})
    pool = loadgen.client_pool(3)
    try:
        assert len(pool._processes) == 3
        assert all(p.is_alive() for p in pool._processes.values())
        assert loadgen._POOLS == {3: pool}
    finally:
        pool.shutdown(wait=True)


def test_the_client_runs_on_uvloop_where_installed() -> None:
    import uvloop  # a dependency of the project on Linux

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(loadgen.run_client(loop_type()), uvloop.Loop)


def test_open_loop_sends_on_schedule_whatever_is_in_flight(server: tuple[str, FakeState]) -> None:
    """Each request leaves at its Poisson arrival time: the achieved rate is the schedule's, and requests
    that outlast the gaps overlap (a closed loop at concurrency 1 would have one in flight)."""
    url, state = server
    offsets = poisson_offsets(60.0, 60, seed=3)
    records = run_arrivals(url, [[i + 1, 2] for i in range(60)], offsets, max_new_tokens=4, stream=False, timeout_s=20)
    assert all(r.ok for r in records), [r.error for r in records]
    stats = arrival_stats(records, 60.0)
    # the client sends on time: within 10 % of the rate its seeded schedule asked for
    assert stats["achieved_request_rate"] == pytest.approx(stats["scheduled_request_rate"], rel=0.10)
    lags = [r.started_at - (r.scheduled_at or 0.0) for r in records]
    assert min(lags) > -0.005 and statistics.median(lags) < 0.02, lags  # never early, rarely late
    assert state.max_in_flight > 1 and stats["max_in_flight"] > 1  # each request takes 30 ms; gaps ~17 ms


def test_open_loop_checks_its_schedule() -> None:
    with pytest.raises(ConfigError, match="2 arrival times for 3 prompts"):
        run_arrivals("http://127.0.0.1:9", [[1]] * 3, [0.0, 1.0], max_new_tokens=1)
    with pytest.raises(ConfigError, match="ascending"):
        run_arrivals("http://127.0.0.1:9", [[1]] * 2, [1.0, 0.5], max_new_tokens=1)
