"""Aggregate output tokens/s and per-request latency of `python -m ddtree.server` at concurrency 1, 8, 32.

Runs on the fixture models under fixtures/models/{target,drafter} when they exist, else on small
random ones. Numbers are printed and written to server_throughput.json (under --results-dir when
the suite's option is set, else the test's tmp dir). No timing floor here: the sweep owns floors;
this only requires that every request completes.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.tiny_server import launched, save_tiny_pair

pytestmark = pytest.mark.bench

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
CONCURRENCY = (1, 8, 32)
MAX_NEW_TOKENS = 32
PROMPT_TOKENS = 32


def _models(tmp_path: Path) -> tuple[Path, Path, str]:
    target, drafter = FIXTURES / "target", FIXTURES / "drafter"
    if (target / "config.json").is_file() and (drafter / "config.json").is_file():
        return target, drafter, "fixtures"
    t, d = save_tiny_pair(tmp_path / "tiny")
    return t, d, "random-tiny"


async def _measure(url: str, vocab: int, concurrency: int) -> dict[str, Any]:
    rng = random.Random(concurrency)
    n = max(2 * concurrency, 4)
    payloads = [
        {
            "input_ids": [rng.randrange(2, vocab - 1) for _ in range(PROMPT_TOKENS)],
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        for _ in range(n)
    ]
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for p in payloads:
        queue.put_nowait(p)
    latencies: list[float] = []
    completed = failed = tokens = 0

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker() -> None:
            nonlocal completed, failed, tokens
            while not queue.empty():
                payload = queue.get_nowait()
                t0 = time.perf_counter()
                r = await client.post("/generate", json=payload)
                latencies.append(time.perf_counter() - t0)
                if r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS:
                    completed += 1
                    tokens += MAX_NEW_TOKENS
                else:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": n,
        "completed": completed,
        "failed": failed,
        "duration_s": duration,
        "output_throughput": tokens / duration,
        "median_e2e_latency_ms": 1000 * statistics.median(latencies),
        "p90_e2e_latency_ms": 1000 * latencies[int(0.9 * (len(latencies) - 1))],
    }


def test_server_throughput(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    target, drafter, source = _models(tmp_path)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    args = ["--model-path", str(target), "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(drafter), "--max-running-requests", "32"]
    with launched(args, tmp_path / "server.log") as server:
        rows = [asyncio.run(_measure(server.url, vocab, c)) for c in CONCURRENCY]
        info = httpx.get(server.url + "/server_info").json()
    report = {"models": source, "spec": info["spec_config_id"], "device": info["device"],
              "avg_spec_accept_length": info["internal_states"][0]["avg_spec_accept_length"], "cells": rows}
    out_dir = request.config.getoption("ddtree_results_dir", default=None)  # --results-dir, None unless given
    out = Path(out_dir) if out_dir else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_throughput.json").write_text(json.dumps(report, indent=2))
    for row in rows:
        print(f"c={row['concurrency']:>2}: {row['output_throughput']:8.1f} tok/s, "
              f"p50 {row['median_e2e_latency_ms']:.0f} ms, p90 {row['p90_e2e_latency_ms']:.0f} ms "
              f"({row['completed']}/{row['requests']} completed)")
    for row in rows:
        assert row["failed"] == 0 and row["completed"] == row["requests"], row
