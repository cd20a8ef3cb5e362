"""`python -m ddtree.server` as a real process on small random models.

The exact log lines, 32 concurrent requests that each equal their single-request output at T=0,
a bad request in the middle of a load, bad flags (exit 2 before loading) and a SIGTERM drain
(exit 0 after the running request finished).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.tiny_server import VOCAB, RunningServer, launched, save_tiny_pair

pytestmark = pytest.mark.slow

INIT_LINE = "Initialized DDTree worker. block_size=8, tree_budget=8, topk=4, draft_window_size=2048, compact_cache=True"
READY_LINE = "The server is fired up and ready to roll!"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ddtree_server(tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    target, drafter = tiny_models
    args = ["--model-path", str(target), "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(drafter), "--max-running-requests", "32"]
    with launched(args, tmp_path_factory.mktemp("log") / "server.log") as server:
        yield server


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def body(ids: list[int], max_new_tokens: int = 16) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}


async def post_all(url: str, payloads: list[Any]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(p: Any) -> httpx.Response:
            if isinstance(p, bytes):
                return await client.post("/generate", content=p, headers={"content-type": "application/json"})
            return await client.post("/generate", json=p)

        return await asyncio.gather(*(one(p) for p in payloads))


def aborts(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('ddtree_requests_total{outcome="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_log_lines_are_exact_and_in_order(ddtree_server: RunningServer) -> None:
    lines = ddtree_server.log().splitlines()
    init = [i for i, line in enumerate(lines) if line.endswith(INIT_LINE)]
    ready = [i for i, line in enumerate(lines) if line.endswith(READY_LINE)]
    assert len(init) == 1 and len(ready) == 1, "\n".join(lines[-20:])
    assert init[0] < ready[0]
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", lines[init[0]]), "log lines carry a timestamp"


def test_32_concurrent_requests_equal_their_single_outputs(ddtree_server: RunningServer) -> None:
    url = ddtree_server.url
    ps = prompts(32)
    single = [httpx.post(url + "/generate", json=body(p), timeout=60).json() for p in ps]
    together = asyncio.run(post_all(url, [body(p) for p in ps]))
    for p, alone, r in zip(ps, single, together, strict=True):
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == alone["output_ids"], f"prompt {p}: batched output differs from single"
        meta = got["meta_info"]
        assert meta["completion_tokens"] == len(got["output_ids"]) == 16
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] == pytest.approx(16 / meta["spec_verify_ct"])
        assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    info = httpx.get(url + "/server_info").json()
    assert info["speculative_ddtree_budget"] == 8 and info["internal_states"][0]["avg_spec_accept_length"] >= 1


def test_bad_requests_in_a_load_leave_the_others_intact(ddtree_server: RunningServer) -> None:
    url = ddtree_server.url
    good = prompts(8, seed=1)
    single = [httpx.post(url + "/generate", json=body(p), timeout=60).json()["output_ids"] for p in good]
    bad: list[Any] = [b"{oops", body([VOCAB + 5]), body([2] * 600), {"input_ids": [3], "sampling_params": {"frequency_penalty": 0.5}}]
    payloads: list[Any] = [body(p) for p in good[:4]] + bad + [body(p) for p in good[4:]]
    responses = asyncio.run(post_all(url, payloads))
    codes = [r.status_code for r in responses]
    assert codes == [200] * 4 + [400] * 4 + [200] * 4, codes
    outs = [r.json()["output_ids"] for r in responses[:4] + responses[8:]]
    assert outs == single
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


def test_sampled_requests_depend_on_their_seed_not_the_batch(ddtree_server: RunningServer) -> None:
    url = ddtree_server.url
    ps = prompts(6, seed=2)

    def sampled(p: list[int], seed: int) -> dict[str, Any]:
        return {"input_ids": p, "sampling_params": {"max_new_tokens": 16, "temperature": 0.9, "seed": seed, "ignore_eos": True}}

    single = [httpx.post(url + "/generate", json=sampled(p, i), timeout=60).json()["output_ids"] for i, p in enumerate(ps)]
    together = asyncio.run(post_all(url, [sampled(p, i) for i, p in enumerate(ps)]))
    assert [r.json()["output_ids"] for r in together] == single


def test_stream_disconnect_cancels_the_request(ddtree_server: RunningServer) -> None:
    url = ddtree_server.url
    aborts_before = aborts(url)
    payload = dict(body([9, 10, 11], max_new_tokens=400), stream=True)
    with httpx.stream("POST", url + "/generate", json=payload, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["output_ids"]
    deadline = time.monotonic() + 20
    while True:
        state = httpx.get(url + "/server_info").json()["internal_states"][0]
        if state["running_requests"] == 0 and state["queued_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"the abandoned stream is still decoding: {state}"
        time.sleep(0.05)
    assert aborts(url) == aborts_before + 1, "the request ran to its end instead of being cancelled"
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


def test_bad_flag_exits_2_before_loading(tiny_models: tuple[Path, Path]) -> None:
    target, drafter = tiny_models
    cmd = [sys.executable, "-m", "ddtree.server", "--model-path", str(target), "--speculative-algorithm", "DDTREE",
           "--speculative-draft-model-path", str(drafter), "--speculative-draft-window-size", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--speculative-draft-window-size" in done.stderr
    assert "Initialized" not in done.stderr


def test_sigterm_drains_the_running_request_and_exits_0(tiny_models: tuple[Path, Path], tmp_path: Path) -> None:
    target, _ = tiny_models
    with launched(["--model-path", str(target), "--speculative-algorithm", "NONE"], tmp_path / "ar.log") as server:
        assert "Initialized AR worker." in server.log()
        result: dict[str, Any] = {}

        def long_request() -> None:
            r = httpx.post(server.url + "/generate", json=body([5, 6, 7], max_new_tokens=450), timeout=120)
            result["status"], result["json"] = r.status_code, r.json()

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/server_info").json()["internal_states"][0]["running_requests"] == 0:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            refused = httpx.post(server.url + "/generate", json=body([5], 2), timeout=10).status_code
        except httpx.TransportError:
            refused = 503  # already closed the listening socket: refused is also fine
        worker.join(120)
        assert server.proc.wait(60) == 0, server.log()[-2000:]
        assert refused == 503
        assert "Draining: new requests get 503; 1 request(s) in flight" in server.log()
        assert result["status"] == 200
        assert result["json"]["meta_info"]["completion_tokens"] == 450
        assert result["json"]["meta_info"]["finish_reason"]["type"] == "length"
