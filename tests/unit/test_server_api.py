"""The HTTP API of ddtree.server in process, against the fake engine of server_fakes.

Covers every endpoint's fields and their consistency, streaming (and cancellation when the client
goes away), continuous batching (joins between rounds, a cap on running requests, outputs that do
not depend on the batch), every bad-input case (4xx naming the field, and the server keeps
serving), warm-up gating of the health endpoints, draining, and the metrics counters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from tokenizers import Tokenizer, models, pre_tokenizers

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import Request
from ddtree.server import create_app, init_line
from ddtree.serving.args import ServerArgs
from ddtree.serving.scheduler import SWITCH_INTERVAL_S
from ddtree.serving.state import ServerState
from ddtree.text import TextCodec
from tests.unit.server_fakes import FakeEngine, expected_output

SPEC = SpecConfig()  # b8-k4-w2048-bs8
CONTEXT = 256


def make_args(spec: SpecConfig = SPEC, **over: Any) -> ServerArgs:
    base: dict[str, Any] = dict(
        model_path="fake-target",
        speculative_algorithm=spec.algorithm.value,
        speculative_draft_model_path=None if not spec.speculative else "fake-drafter",
        speculative_ddtree_budget=spec.budget,
        speculative_ddtree_topk=spec.topk,
        speculative_num_draft_tokens=spec.block_size,
        speculative_draft_window_size=spec.draft_window or 0,
        max_running_requests=8,
        context_length=CONTEXT,
    )
    base.update(over)
    return ServerArgs(**base)


def make_app(
    engine: FakeEngine | None = None, spec: SpecConfig = SPEC, codec: TextCodec | None = None, **over: Any
) -> tuple[FastAPI, FakeEngine]:
    engine = engine or FakeEngine()
    return create_app(engine, spec, make_args(spec, **over), codec), engine


def state_of(app: FastAPI) -> ServerState:
    return app.state.ddtree


@asynccontextmanager
async def serving(app: FastAPI, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ddtree", timeout=30) as client:
            if wait_ready:
                for _ in range(500):
                    if (await client.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the server never became ready")
            yield client


def run(app: FastAPI, body: Callable[[httpx.AsyncClient], Awaitable[None]], wait_ready: bool = True) -> None:
    async def main() -> None:
        async with serving(app, wait_ready) as client:
            await body(client)

    asyncio.run(main())


def gen(ids: list[int], **params: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": params}


def expected(ids: list[int], engine: FakeEngine, **params: Any) -> tuple[list[int], str]:
    req = Request(
        "x",
        ids,
        params.get("max_new_tokens", 128),
        params.get("temperature", 0.0),
        params.get("seed"),
        tuple(params.get("stop_token_ids", ())),
        params.get("ignore_eos", False),
    )
    return expected_output(req, engine.vocab_size, engine.eos_token_id)


def check_meta(payload: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    meta = payload["meta_info"]
    assert meta["completion_tokens"] == len(payload["output_ids"])
    assert meta["prompt_tokens"] == prompt_len
    assert meta["cached_tokens"] == 0
    assert meta["e2e_latency"] > 0
    verify = meta["spec_verify_ct"]
    assert verify > 0
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / verify)
    hist = meta["spec_accept_histogram"]
    assert sum(hist) == verify, f"histogram {hist} sums to {sum(hist)}, verify_ct {verify}"
    rounds = [length for length, count in enumerate(hist) for _ in range(count)]
    assert meta["spec_num_correct_drafts"] == sum(r - 1 for r in rounds)
    return meta


# -- /generate ------------------------------------------------------------------------------------
def test_generate_returns_the_engine_tokens_and_consistent_meta_info() -> None:
    app, engine = make_app()
    prompt = [11, 12, 13, 14]

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen(prompt, max_new_tokens=40, ignore_eos=True, temperature=0))
        assert r.status_code == 200, r.text
        payload = r.json()
        want, _ = expected(prompt, engine, max_new_tokens=40, ignore_eos=True)
        assert payload["output_ids"] == want
        assert payload["text"] == ""  # no tokenizer.json
        meta = check_meta(payload, len(prompt))
        assert meta["finish_reason"] == {"type": "length", "length": 40}
        assert meta["completion_tokens"] == 40

    run(app, body)


def test_generate_stops_on_a_stop_token_and_names_it() -> None:
    app, engine = make_app()
    prompt = [3, 1, 4, 1, 5]
    free, _ = expected(prompt, engine, max_new_tokens=30, ignore_eos=True)
    stop = free[6]

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop]))
        payload = r.json()
        cut = free.index(stop) + 1
        assert payload["output_ids"] == free[:cut]
        assert payload["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    run(app, body)


def test_generate_eos_finishes_unless_ignored() -> None:
    engine = FakeEngine(vocab_size=7, eos_token_id=2)  # small vocab: eos comes quickly
    app, _ = make_app(engine)
    prompt = [1, 3]

    async def body(c: httpx.AsyncClient) -> None:
        want, reason = expected(prompt, engine, max_new_tokens=60)
        assert reason == "stop", "test setup: eos must occur within 60 tokens"
        r = (await c.post("/generate", json=gen(prompt, max_new_tokens=60))).json()
        assert r["output_ids"] == want and r["output_ids"][-1] == 2
        assert r["meta_info"]["finish_reason"]["type"] == "stop"
        r = (await c.post("/generate", json=gen(prompt, max_new_tokens=60, ignore_eos=True))).json()
        assert len(r["output_ids"]) == 60 and r["meta_info"]["finish_reason"]["type"] == "length"

    run(app, body)


def test_sampling_depends_on_the_seed_only() -> None:
    app, engine = make_app()
    prompt = [7, 8, 9]

    async def body(c: httpx.AsyncClient) -> None:
        outs = []
        for seed in (1, 1, 2):
            r = await c.post("/generate", json=gen(prompt, max_new_tokens=16, temperature=0.8, seed=seed, ignore_eos=True))
            outs.append(r.json()["output_ids"])
        assert outs[0] == outs[1] == expected(prompt, engine, max_new_tokens=16, temperature=0.8, seed=1, ignore_eos=True)[0]
        assert outs[0] != outs[2]

    run(app, body)


def word_codec() -> TextCodec:
    words = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog"] + [f"w{i}" for i in range(88)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return TextCodec(tok, "inline")


def test_text_prompt_is_encoded_and_output_decoded() -> None:
    codec = word_codec()
    app, engine = make_app(codec=codec)

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "the cat sat", "sampling_params": {"max_new_tokens": 9, "ignore_eos": True}})
        payload = r.json()
        want, _ = expected([2, 3, 4], engine, max_new_tokens=9, ignore_eos=True)
        assert payload["output_ids"] == want
        assert payload["text"] == codec.decode(want) and payload["text"]
        assert payload["meta_info"]["prompt_tokens"] == 3

    run(app, body)


def test_a_byte_level_codec_s_answers_are_the_exact_text_plain_and_streamed() -> None:
    """The fixture's byte-level BPE (concatenative: a plain answer's text is decoded as its rounds arrive, a
    finished one decodes only what it had not confirmed): with single-byte ids, characters split across
    rounds, and the stop token's text trimmed, every answer is the full decode of its ids."""
    from pathlib import Path

    from ddtree.text import load_tokenizer

    codec = load_tokenizer(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target")
    assert codec is not None and codec.concatenative
    engine = FakeEngine(vocab_size=300, eos_token_id=7)  # the fixture's first ids are single bytes
    app, _ = make_app(engine, codec=codec)

    async def body(c: httpx.AsyncClient) -> None:
        stops = 0
        for prompt in ([1, 2], [3, 4, 5], [6], [9, 9], [200, 201, 202], [250]):
            free = expected(prompt, engine, max_new_tokens=40, ignore_eos=True)[0]
            for stop_ids in ([], [free[15]]):  # a length finish, and a stop token's
                params = {"max_new_tokens": 40, "ignore_eos": True, "stop_token_ids": stop_ids}
                plain = (await c.post("/generate", json=gen(prompt, **params))).json()
                ids = plain["output_ids"]
                stop = plain["meta_info"]["finish_reason"]["type"] == "stop"
                stops += stop
                assert ids == expected(prompt, engine, **params)[0]
                assert plain["text"] == codec.decode(ids[:-1] if stop else ids)
                r = await c.post("/generate", json={**gen(prompt, **params), "stream": True})
                assert parse_sse(r.text)[-1]["text"] == plain["text"]
        assert stops  # the stop token's trim was met

    run(app, body)


def test_a_plain_answer_whose_ids_do_not_decode_fails_alone() -> None:
    """A plain answer's text is decoded as its events arrive, in the dispatch that serves every request: a decode
    that raises there must not keep the round's other requests from their events; it fails its own request,
    when it finishes, as it did before."""
    from pathlib import Path

    from ddtree.text import load_tokenizer

    fixture = load_tokenizer(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target")
    assert fixture is not None
    engine = FakeEngine(vocab_size=300)
    engine.step_delay = 0.002
    params = {"max_new_tokens": 40, "ignore_eos": True}
    first, second = expected([1, 2], engine, **params)[0], expected([3, 4, 5], engine, **params)[0]
    bad = next(t for t in first[5:] if t not in second)

    class Breaking(TextCodec):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if bad in token_ids:
                raise OverflowError("an id the tokenizer cannot decode")
            return super().decode(token_ids, skip_special_tokens)

    codec = Breaking(fixture.tokenizer)
    assert codec.concatenative
    app, _ = make_app(engine, codec=codec)

    async def body(c: httpx.AsyncClient) -> None:
        failing = asyncio.create_task(c.post("/generate", json=gen([1, 2], **params)))
        await asyncio.sleep(0.01)  # its row first in every round: the other's events come after its own
        r = await c.post("/generate", json=gen([3, 4, 5], **params))
        assert r.status_code == 200 and r.json()["output_ids"] == second and r.json()["text"] == codec.decode(second)
        with pytest.raises(OverflowError):
            await failing

    run(app, body)


def test_batched_input_returns_a_list_in_order() -> None:
    app, engine = make_app()
    prompts = [[1, 2], [3, 4, 5], [6]]

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}, "rid": ["a", "b", "c"]})
        payload = r.json()
        assert isinstance(payload, list) and len(payload) == 3
        for p, out, rid in zip(prompts, payload, "abc", strict=True):
            assert out["output_ids"] == expected(p, engine, max_new_tokens=12, ignore_eos=True)[0]
            assert out["meta_info"]["id"] == rid

    run(app, body)


def test_default_max_new_tokens_is_128() -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"ignore_eos": True}})
        assert r.json()["meta_info"]["completion_tokens"] == 128

    run(app, body)


# -- streaming --------------------------------------------------------------------------------------
def parse_sse(text: str) -> list[Any]:
    events = [block for block in text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_stream_chunks_are_cumulative_and_end_with_done() -> None:
    engine = FakeEngine()
    engine.step_delay = 0.005  # rounds slower than the client reads: one chunk a round (a faster engine coalesces)
    app, _ = make_app(engine)
    prompt = [21, 22, 23]

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=dict(gen(prompt, max_new_tokens=50, ignore_eos=True), stream=True))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = parse_sse(r.text)
        assert len(chunks) > 2
        for before, after in zip(chunks, chunks[1:]):
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            assert len(after["output_ids"]) > len(before["output_ids"])
        assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
        last = chunks[-1]
        assert last["output_ids"] == expected(prompt, engine, max_new_tokens=50, ignore_eos=True)[0]
        check_meta(last, len(prompt))
        assert last["meta_info"]["finish_reason"]["type"] == "length"

    run(app, body)


async def asgi_messages(app: FastAPI, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """What the app sends for one request, message by message (as uvicorn would write them)."""
    body = json.dumps(payload).encode()
    sent: list[dict[str, Any]] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
        "server": ("ddtree", 80), "state": {},
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("path, payload", [
    ("/generate", dict(gen([5, 6], max_new_tokens=9, ignore_eos=True), stream=True)),
    ("/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                   "stream": True}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 5, "stream": True}),
])
def test_a_stream_ends_its_body_with_done_in_one_message(path: str, payload: dict[str, Any]) -> None:
    """[DONE] leaves with the body's end (one write: a client that stops reading there finds the response
    complete, and keeps its connection); on /generate the last data chunk travels with it."""
    app, _ = make_app()

    async def body(_: httpx.AsyncClient) -> None:
        sent = await asgi_messages(app, path, payload)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        assert [m.get("more_body", False) for m in bodies] == [True] * (len(bodies) - 1) + [False]
        last = bodies[-1]["body"]
        assert last.endswith(b"data: [DONE]\n\n") and last.count(b"[DONE]") == 1
        assert b"".join(m["body"] for m in bodies).count(b"[DONE]") == 1
        if path == "/generate":
            final = json.loads(last.split(b"\n\n")[0][len(b"data: "):])
            assert final["meta_info"]["finish_reason"]["type"] == "length"

    run(app, body)


def test_client_disconnect_mid_stream_cancels_the_request() -> None:
    engine = FakeEngine()
    engine.step_delay = 0.01
    app, _ = make_app(engine)
    batch = engine.batches[0]

    async def main() -> None:
        async with serving(app) as client:
            body = json.dumps(dict(gen([9, 9, 9], max_new_tokens=200, ignore_eos=True), stream=True, rid="gone")).encode()
            received: list[dict[str, Any]] = []
            disconnect = asyncio.Event()
            sent_request = False

            async def receive() -> dict[str, Any]:
                nonlocal sent_request
                if not sent_request:
                    sent_request = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await disconnect.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                received.append(message)
                if message["type"] == "http.response.body" and message.get("body"):
                    disconnect.set()  # the client reads one chunk and goes away

            scope = {
                "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/generate", "raw_path": b"/generate",
                "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1), "server": ("ddtree", 80), "state": {},
            }
            await asyncio.wait_for(app(scope, receive, send), 10)
            for _ in range(200):
                if "gone" in batch.cancelled and state_of(app).scheduler.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert "gone" in batch.cancelled
            assert "gone" not in batch.rows
            assert state_of(app).scheduler.in_flight == 0
            bodies = [m for m in received if m["type"] == "http.response.body" and m.get("body")]
            assert b"[DONE]" not in b"".join(m["body"] for m in bodies)
            # the server keeps serving
            r = await client.post("/generate", json=gen([1], max_new_tokens=3, ignore_eos=True))
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
            metrics = (await client.get("/metrics")).text
            assert 'ddtree_requests_total{outcome="abort"} 1.0' in metrics

    asyncio.run(main())


# -- continuous batching -----------------------------------------------------------------------------
def test_concurrent_requests_match_their_single_outputs_and_respect_the_cap() -> None:
    engine = FakeEngine()
    engine.step_delay = 0.002
    app, _ = make_app(engine, max_running_requests=4)
    batch = engine.batches[0]
    prompts = [[i, i + 1, (3 * i) % 50] for i in range(12)]
    lengths = [5 + 7 * i for i in range(12)]  # different lengths: rows leave and others join

    async def body(c: httpx.AsyncClient) -> None:
        solo = []
        for p, n in zip(prompts, lengths, strict=True):
            solo.append((await c.post("/generate", json=gen(p, max_new_tokens=n, ignore_eos=True))).json()["output_ids"])
        steps_before = len(batch.step_sizes)
        results = await asyncio.gather(
            *(c.post("/generate", json=gen(p, max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths, strict=True))
        )
        together = [r.json()["output_ids"] for r in results]
        assert together == solo
        sizes = batch.step_sizes[steps_before:]
        assert max(sizes) == 4, f"rows per round {sizes}: the batch never filled to max_running_requests=4"
        assert len(sizes) < sum(lengths), "requests were not decoded together"

    run(app, body)


# -- other endpoints ---------------------------------------------------------------------------------
def test_v1_completions_shape_and_usage() -> None:
    app, engine = make_app(codec=word_codec())

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [2, 3, 4], "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out = r.json()
        want, _ = expected([2, 3, 4], engine, max_new_tokens=10, ignore_eos=True)
        assert out["object"] == "text_completion" and out["id"]
        assert out["choices"][0]["text"] == word_codec().decode(want)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
        spec = out["sglext"]["spec_tokens_details"]
        assert spec["spec_accept_length"] == pytest.approx(10 / spec["spec_verify_ct"])
        r = await c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 10, "temperature": 0, "stream": True, "ignore_eos": True})
        chunks = parse_sse(r.text)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == word_codec().decode(
            expected([2, 3], engine, max_new_tokens=10, ignore_eos=True)[0]
        )
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 10

    run(app, body)


def test_server_info_reports_every_resolved_argument() -> None:
    spec = SpecConfig(budget=12, topk=3, block_size=8, draft_window=1024)
    app, _ = make_app(spec=spec)

    async def body(c: httpx.AsyncClient) -> None:
        await c.post("/generate", json=gen([1, 2, 3], max_new_tokens=20, ignore_eos=True))
        info = (await c.get("/server_info")).json()
        assert info["speculative_algorithm"] == "DDTREE"
        assert info["speculative_ddtree_budget"] == 12
        assert info["speculative_ddtree_topk"] == 3
        assert info["speculative_num_draft_tokens"] == 8
        assert info["speculative_draft_window_size"] == 1024
        assert info["spec_config_id"] == "b12-k3-w1024-bs8"
        for key in ("model_path", "speculative_draft_model_path", "device", "dtype", "max_running_requests",
                    "context_length", "host", "port", "launch_command", "version"):
            assert key in info, key
        assert info["context_length"] == CONTEXT
        state = info["internal_states"][0]
        assert state["avg_spec_accept_length"] >= 1.0
        assert "last_gen_throughput" in state
        assert (await c.get("/get_server_info")).json()["speculative_ddtree_budget"] == 12
        model = (await c.get("/model_info")).json()
        assert model["model_path"] == "fake-target" and model["is_generation"] is True
        assert model["vocab_size"] == 97

    run(app, body)


def test_server_info_reports_an_auto_budget_and_the_budgets_chosen() -> None:
    """budget auto on a real (tiny) engine: the resolved flag is "auto" and internal_states carry the choice."""
    from tests.unit.test_engine import make_engine

    spec = SpecConfig(budget="auto", max_budget=12, topk=4, block_size=8)
    app = create_app(make_engine(), spec, make_args(spec, speculative_ddtree_max_budget=12))

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen([1, 2, 3], max_new_tokens=20, ignore_eos=True))
        assert r.status_code == 200 and r.json()["meta_info"]["spec_verify_ct"] > 0
        info = (await c.get("/server_info")).json()
        assert info["speculative_ddtree_budget"] == "auto"
        assert info["speculative_ddtree_max_budget"] == 12
        assert info["spec_config_id"] == "bauto12-k4-w2048-bs8"
        state = info["internal_states"][0]
        assert 1 <= state["last_spec_budget"] <= 12
        assert 1 <= state["avg_spec_budget"] <= 12

    run(app, body)


def test_flush_cache_and_metrics_counters_move() -> None:
    app, _ = make_app()

    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{name} missing from /metrics")

    async def body(c: httpx.AsyncClient) -> None:
        assert (await c.get("/flush_cache")).status_code == 200
        assert (await c.post("/flush_cache")).status_code == 200
        before = (await c.get("/metrics")).text
        assert value(before, "ddtree_prompt_tokens_total") == 0, "warm-up and health probes are not counted"
        assert (await c.get("/health_generate")).status_code == 200
        r = (await c.post("/generate", json=gen([4, 5, 6, 7], max_new_tokens=25, ignore_eos=True))).json()
        await c.post("/generate", json=gen([4], max_new_tokens=0))
        after = (await c.get("/metrics")).text
        meta = r["meta_info"]
        assert value(after, "ddtree_prompt_tokens_total") - value(before, "ddtree_prompt_tokens_total") == 4
        assert value(after, "ddtree_generation_tokens_total") - value(before, "ddtree_generation_tokens_total") == 25
        assert value(after, "ddtree_spec_verify_steps_total") - value(before, "ddtree_spec_verify_steps_total") == meta["spec_verify_ct"]
        drafts = value(after, "ddtree_spec_accepted_drafts_total") - value(before, "ddtree_spec_accepted_drafts_total")
        assert drafts == meta["spec_num_correct_drafts"]
        assert value(after, 'ddtree_requests_total{outcome="length"}') == 1
        info = (await c.get("/server_info")).json()["internal_states"][0]
        assert info["avg_spec_accept_length"] == pytest.approx(25 / meta["spec_verify_ct"])
        assert value(after, 'ddtree_requests_total{outcome="invalid"}') == 1

    run(app, body)


def test_health_is_503_until_the_warm_up_generation_has_run() -> None:
    engine = FakeEngine()
    engine.gate.clear()  # hold every round: the warm-up cannot finish
    app, _ = make_app(engine)

    async def body(c: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.05)
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/health_generate")).status_code == 503
        assert "error" in (await c.get("/health")).json()
        engine.gate.set()
        for _ in range(200):
            if (await c.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/health_generate")).status_code == 200

    run(app, body, wait_ready=False)


def test_draining_refuses_new_work_with_503() -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        state_of(app).begin_drain()
        r = await c.post("/generate", json=gen([1], max_new_tokens=2))
        assert r.status_code == 503 and r.json()["error"]["message"]
        assert (await c.get("/health_generate")).status_code == 503

    run(app, body)


def test_a_stream_whose_prefill_is_refused_is_a_4xx_answer_not_a_stream() -> None:
    """The SSE response is built before the first round comes, but nothing of it is sent before: a refused
    prefill is still an error status with the JSON error, on /generate and on /v1."""
    engine = FakeEngine()
    app, _ = make_app(engine)

    async def body(c: httpx.AsyncClient) -> None:
        engine.fail_add = True
        r = await c.post("/generate", json={**gen([1, 2], max_new_tokens=4), "stream": True})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input_ids"
        r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input_ids"
        engine.fail_add = False
        r = await c.post("/generate", json={**gen([1, 2], max_new_tokens=4, ignore_eos=True), "stream": True})
        assert r.status_code == 200 and parse_sse(r.text)[-1]["meta_info"]["completion_tokens"] == 4

    run(app, body)


def test_engine_failures_answer_with_an_error_and_the_server_recovers() -> None:
    engine = FakeEngine()
    app, _ = make_app(engine)

    async def body(c: httpx.AsyncClient) -> None:
        engine.fail_add = True
        r = await c.post("/generate", json=gen([1, 2], max_new_tokens=4))
        assert r.status_code == 422 and r.json()["error"]["field"] == "input_ids"
        engine.fail_add = False
        engine.fail_step = True
        r = await c.post("/generate", json=gen([1, 2], max_new_tokens=4))
        assert r.status_code == 500 and "decode failed" in r.json()["error"]["message"]
        engine.fail_step = False
        r = await c.post("/generate", json=gen([1, 2], max_new_tokens=4, ignore_eos=True))
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4

    run(app, body)


# -- bad input ---------------------------------------------------------------------------------------
BAD = [
    pytest.param(b"{not json", "body", id="malformed-json"),
    pytest.param(b"[1, 2]", "body", id="not-an-object"),
    pytest.param({"sampling_params": {"max_new_tokens": 4}}, "text", id="missing-prompt"),
    pytest.param({"text": "a", "input_ids": [1]}, "input_ids", id="text-and-input-ids"),
    pytest.param({"input_ids": []}, "input_ids", id="empty-input-ids"),
    pytest.param({"text": ""}, "text", id="empty-text"),
    pytest.param({"text": "no tokenizer here"}, "text", id="text-without-tokenizer"),
    pytest.param(gen([1], foo=1), "sampling_params.foo", id="unknown-sampling-field"),
    pytest.param({"input_ids": [1], "bogus": True}, "bogus", id="unknown-top-level-field"),
    pytest.param(gen([1], max_new_tokens=-3), "sampling_params.max_new_tokens", id="negative-max-new-tokens"),
    pytest.param(gen([1], max_new_tokens=0), "sampling_params.max_new_tokens", id="zero-max-new-tokens"),
    pytest.param(gen([1], max_new_tokens=10**9), "sampling_params.max_new_tokens", id="absurd-max-new-tokens"),
    pytest.param(gen([1], max_new_tokens=2.5), "sampling_params.max_new_tokens", id="fractional-max-new-tokens"),
    pytest.param(gen([1], max_new_tokens="8"), "sampling_params.max_new_tokens", id="string-max-new-tokens"),
    pytest.param(gen([1, 97]), "input_ids", id="token-past-vocab"),
    pytest.param(gen([-1]), "input_ids", id="negative-token"),
    pytest.param(gen([1] * CONTEXT), "input_ids", id="prompt-longer-than-context"),
    pytest.param(gen([1] * 200, max_new_tokens=100), "sampling_params.max_new_tokens", id="prompt-plus-output-past-context"),
    pytest.param(gen([1], temperature=-0.1), "sampling_params.temperature", id="negative-temperature"),
    pytest.param(gen([1], top_p=0.0), "sampling_params.top_p", id="zero-top-p"),
    pytest.param(gen([1], top_k=0), "sampling_params.top_k", id="zero-top-k"),
    pytest.param(gen([1], min_p=1.5), "sampling_params.min_p", id="min-p-past-one"),
    pytest.param(gen([1], max_new_tokens=4, min_new_tokens=5), "sampling_params.min_new_tokens", id="min-past-max"),
    pytest.param(gen([1], seed=-1), "sampling_params.seed", id="negative-seed"),
    pytest.param(gen([1], stop_token_ids=[1000]), "sampling_params.stop_token_ids", id="stop-token-past-vocab"),
    pytest.param({"input_ids": [1], "stream": "yes"}, "stream", id="stream-not-bool"),
]


@pytest.mark.parametrize(("payload", "field"), BAD)
def test_bad_generate_input_is_a_4xx_naming_the_field(payload: Any, field: str) -> None:
    app, engine = make_app()
    batch = engine.batches[0]

    async def body(c: httpx.AsyncClient) -> None:
        added_before = len(batch.added)
        if isinstance(payload, bytes):
            r = await c.post("/generate", content=payload, headers={"content-type": "application/json"})
        else:
            r = await c.post("/generate", json=payload)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == field, err
        assert err["message"].startswith(field + ":"), err["message"]
        assert len(batch.added) == added_before, "a bad request reached the batch"
        ok = await c.post("/generate", json=gen([1, 2], max_new_tokens=3, ignore_eos=True))
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3

    run(app, body)


def test_generate_answers_only_post_in_the_error_shape() -> None:
    """/generate is a plain route (no FastAPI parameters): a GET is still a 405 in the server's error shape."""
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.get("/generate")
        assert r.status_code == 405, r.text
        assert r.json()["error"]["code"] == 405
        ok = await c.post("/generate", json=gen([1, 2], max_new_tokens=3, ignore_eos=True))
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3

    run(app, body)


def test_prompt_past_context_names_both_numbers() -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen([1] * 200, max_new_tokens=100))
        message = r.json()["error"]["message"]
        assert "200" in message and "100" in message and str(CONTEXT) in message

    run(app, body)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        pytest.param({"max_tokens": 4}, "prompt", id="missing-prompt"),
        pytest.param({"prompt": [1], "max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"prompt": [1], "n": 0}, "n", id="zero-n"),
        pytest.param({"prompt": [1], "temperature": -1}, "temperature", id="negative-temperature"),
        pytest.param({"prompt": [1], "logit_bias": {"5": 1.0}}, "logit_bias", id="unsupported-field-set"),
        pytest.param({"prompt": [1], "bogus": 1}, "bogus", id="unknown-field"),
    ],
)
def test_bad_completion_input_is_a_400_naming_the_field(payload: dict[str, Any], field: str) -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json=payload)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text

    run(app, body)


def test_duplicate_rid_in_flight_is_rejected() -> None:
    engine = FakeEngine()
    engine.step_delay = 0.01
    app, _ = make_app(engine)

    async def body(c: httpx.AsyncClient) -> None:
        first = asyncio.create_task(c.post("/generate", json=dict(gen([1], max_new_tokens=30, ignore_eos=True), rid="same")))
        while state_of(app).scheduler.in_flight == 0:
            await asyncio.sleep(0.005)
        r = await c.post("/generate", json=dict(gen([2], max_new_tokens=3), rid="same"))
        assert r.status_code == 400 and r.json()["error"]["field"] == "rid"
        assert (await first).status_code == 200

    run(app, body)


# -- log lines --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "line"),
    [
        pytest.param(SpecConfig(), "Initialized DDTree worker. block_size=8, tree_budget=8, topk=4, draft_window_size=2048, compact_cache=True", id="ddtree"),
        pytest.param(SpecConfig(budget=16, topk=2, block_size=16, draft_window=None), "Initialized DDTree worker. block_size=16, tree_budget=16, topk=2, draft_window_size=None, compact_cache=False", id="ddtree-no-window"),
        pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8), "Initialized DDTree worker. block_size=8, tree_budget=7, topk=1, draft_window_size=2048, compact_cache=True", id="dflash"),
        pytest.param(SpecConfig(Algorithm.NONE), "Initialized AR worker.", id="ar"),
        pytest.param(SpecConfig(budget="auto"), "Initialized DDTree worker. block_size=8, tree_budget=auto, topk=4, draft_window_size=2048, compact_cache=True", id="ddtree-auto"),
    ],
)
def test_init_line(spec: SpecConfig, line: str) -> None:
    assert init_line(spec) == line


# -- command line -----------------------------------------------------------------------------------
def _folders(tmp_path: Any, drafter_cfg: dict[str, Any] | None = None) -> tuple[str, str]:
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir()
    drafter.mkdir()
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    (drafter / "config.json").write_text(json.dumps(drafter_cfg or {}))
    return str(target), str(drafter)


def test_resolve_args_defaults_follow_sglang(tmp_path: Any) -> None:
    from ddtree.server import build_parser
    from ddtree.serving.args import resolve_args

    target, drafter = _folders(tmp_path, {"block_size": 16})
    ns = build_parser().parse_args(["--model-path", target])
    assert (ns.host, ns.port, ns.max_running_requests, ns.speculative_ddtree_budget, ns.speculative_ddtree_topk) == (
        "127.0.0.1", 30000, 32, 8, 4
    )
    args = resolve_args(["--model-path", target, "--speculative-algorithm", "ddtree",
                         "--speculative-draft-model-path", drafter, "--device", "cpu"])
    assert args.speculative_num_draft_tokens == 16, "block size comes from the drafter config"
    assert args.speculative_draft_window_size == 2048
    assert args.spec.id == "b8-k4-w2048-bs16"
    assert "--speculative-draft-model-path" in args.launch_command
    args = resolve_args(["--model-path", target, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                         drafter, "--speculative-num-draft-tokens", "8", "--speculative-draft-window-size", "0", "--device", "cpu"])
    assert (args.speculative_ddtree_budget, args.speculative_ddtree_topk, args.spec.draft_window) == (7, 1, None)


def test_resolve_args_accepts_an_auto_budget(tmp_path: Any) -> None:
    from ddtree.serving.args import resolve_args

    target, drafter = _folders(tmp_path, {"block_size": 8})
    base = ["--model-path", target, "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", drafter,
            "--device", "cpu"]
    args = resolve_args([*base, "--speculative-ddtree-budget", "auto"])
    assert args.speculative_ddtree_budget == "auto" and args.spec.id == "bauto-k4-w2048-bs8"
    assert resolve_args([*base, *args.spec.server_args()]).spec == args.spec, "server_args() round-trips"
    capped = resolve_args([*base, "--speculative-ddtree-budget", "AUTO", "--speculative-ddtree-max-budget", "16"])
    assert capped.spec.id == "bauto16-k4-w2048-bs8" and capped.to_dict()["speculative_ddtree_max_budget"] == 16
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    with_profile = resolve_args([*base, "--speculative-ddtree-budget", "auto", "--speculative-ddtree-cost-profile",
                                 str(profile)])
    assert with_profile.speculative_ddtree_cost_profile == str(profile)


def test_resolve_args_decode_path_flags(tmp_path: Any) -> None:
    from ddtree.errors import ConfigError
    from ddtree.serving.args import resolve_args

    target, _ = _folders(tmp_path, {"block_size": 8})
    args = resolve_args(["--model-path", target, "--device", "cpu"])
    assert (args.attention_backend, args.disable_cuda_graph) == ("auto", False)
    args = resolve_args(["--model-path", target, "--device", "cpu", "--attention-backend", "sdpa", "--disable-cuda-graph"])
    assert (args.attention_backend, args.disable_cuda_graph) == ("sdpa", True)
    assert args.to_dict()["disable_cuda_graph"] is True  # reported by /server_info
    with pytest.raises(ConfigError, match="--attention-backend: 'triton' needs --device cuda"):
        resolve_args(["--model-path", target, "--device", "cpu", "--attention-backend", "triton"])
    assert args.disable_overlap_schedule is False
    args = resolve_args(["--model-path", target, "--device", "cpu", "--disable-overlap-schedule"])
    assert args.disable_overlap_schedule is True and args.to_dict()["disable_overlap_schedule"] is True


@pytest.mark.parametrize("disable", [False, True])
def test_disable_overlap_schedule_opens_a_batch_that_does_not_run_ahead(disable: bool) -> None:
    """--disable-overlap-schedule reaches the batch (run_ahead off) and /server_info."""
    app, engine = make_app(disable_overlap_schedule=disable)

    async def body(client: httpx.AsyncClient) -> None:
        info = (await client.get("/server_info")).json()
        assert info["disable_overlap_schedule"] is disable

    run(app, body)
    assert engine.run_ahead is (not disable)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        pytest.param(["--speculative-ddtree-budget", "0"], "--speculative-ddtree-budget", id="budget-zero"),
        pytest.param(["--speculative-ddtree-topk", "0"], "--speculative-ddtree-topk", id="topk-zero"),
        pytest.param(["--speculative-ddtree-budget", "most"], "--speculative-ddtree-budget", id="budget-word"),
        pytest.param(["--speculative-ddtree-budget", "auto", "--speculative-ddtree-max-budget", "64"],
                     "--speculative-ddtree-max-budget", id="auto-cap-past-63"),
        pytest.param(["--speculative-ddtree-budget", "auto", "--speculative-ddtree-cost-profile", "/no/such.json"],
                     "--speculative-ddtree-cost-profile", id="auto-missing-profile"),
        pytest.param(["--speculative-draft-window-size", "4"], "--speculative-draft-window-size", id="window-below-block"),
        pytest.param(["--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens", id="block-one"),
        pytest.param(["--max-running-requests", "0"], "--max-running-requests", id="no-running-requests"),
        pytest.param(["--context-length", "5000"], "--context-length", id="context-past-positions"),
    ],
)
def test_main_rejects_bad_flags_with_status_2_before_loading(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str
) -> None:
    from ddtree.server import main

    target, drafter = _folders(tmp_path)
    argv = ["--model-path", target, "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", drafter,
            "--device", "cpu", *extra]
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


def test_main_requires_a_drafter_for_speculation(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from ddtree.server import main

    target, _ = _folders(tmp_path)
    assert main(["--model-path", target, "--speculative-algorithm", "DDTREE", "--device", "cpu"]) == 2
    assert "--speculative-draft-model-path" in capsys.readouterr().err
    assert main(["--model-path", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert main(["--model-path", target, "--speculative-algorithm", "EAGLE"]) == 2


def test_load_tokenizer_reads_tokenizer_json_or_returns_none(tmp_path: Any) -> None:
    from ddtree.errors import ModelLoadError
    from ddtree.text import load_tokenizer

    assert load_tokenizer(tmp_path) is None
    word_codec().tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = load_tokenizer(tmp_path)
    assert codec is not None and codec.encode("the cat") == [2, 3] and codec.decode([2, 3]) == "the cat"
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(("device", "expected"), [("cuda", SWITCH_INTERVAL_S), ("cpu", None), (None, None)])
def test_the_gil_switch_interval_is_shortened_only_for_a_gpu_engine(device: str | None, expected: float | None) -> None:
    engine = FakeEngine()
    if device is not None:
        engine.device = torch.device(device)  # a device object is only read, never used, by the state
    app, _ = make_app(engine)
    assert state_of(app).scheduler.switch_interval_s == expected
