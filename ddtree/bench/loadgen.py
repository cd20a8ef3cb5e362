"""Load generator: fires token-id prompts at an SGLang-style /generate endpoint and records each.

It owns concurrency (exactly `concurrency` requests in flight, closed loop; or, open loop, each
request sent at its own arrival time whatever is in flight: `run_open_loop`), timing (TTFT, ITL,
TPOT, E2E) and error capture; it knows nothing about configs, services or result files. A failed
request never raises: it becomes a RequestRecord with ok=False and the reason in `error`.

Streaming follows SGLang: SSE lines `data: {json}` whose output_ids/meta_info are cumulative,
ending with `data: [DONE]`. Incremental chunks (SGLang's --incremental-streaming-output) are
recognised by their length and accumulated.

The client is ddtree.bench.http_client (an asyncio protocol on httptools' parser, keep-alive
connections): a load generator must cost far less than the server it measures, and aiohttp's
Python per request was about the server's whole HTTP overhead (that module says by how much).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import json
import multiprocessing
import os
import ssl
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from ddtree.bench.http_client import ConnectError, ConnectionClosed, ConnectionPool, HTTPClientError, split_url
from ddtree.errors import ConfigError

MAX_ERROR_BODY = 500  # characters of an error body kept in a record
T = TypeVar("T")


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `started_at` is wall-clock (time.time())."""

    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # first chunk that brought tokens (streaming only)
    e2e_s: float | None = None  # send to last byte, also set for failures (time spent)
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks that brought tokens
    tpot_s: float | None = None  # (e2e - ttft) / (completion - 1); None below 2 tokens
    spec_verify_ct: int | None = None  # verify rounds; None when the server does not speculate
    server_ttft_s: float | None = None  # meta_info's first_token_latency: the server's own, from queueing on
    server_e2e_s: float | None = None  # meta_info's e2e_latency
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started_at: float = 0.0
    rid: str | None = None  # meta_info's id: the server's name for the request
    # with timeline=True: CLOCK_MONOTONIC ns at c_send, c_first, c_last (tokens), c_done ([DONE] or the body), c_end
    stamps: dict[str, int] = field(default_factory=dict)
    scheduled_at: float | None = None  # open loop: when the arrival was due (wall clock); started_at - this = lag


@functools.cache
def _default_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def tls_verify(base_url: str) -> ssl.SSLContext | bool:
    """Certificate checks for an https URL (one context per process), none for plain http.

    A context reads the CA bundle (20-40 ms): built once, not inside the timed wall clock of every
    closed-loop run (a 32-request wave on the H200 lasts ~120 ms).
    """
    return _default_tls() if base_url.startswith("https://") else False


def _check_args(prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int,
                timeout_s: float) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency: {concurrency!r} must be an integer >= 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens: {max_new_tokens!r} must be an integer >= 1")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s: {timeout_s!r} must be > 0 seconds")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompts[{i}]: empty prompt; every prompt needs >= 1 token id")


def _finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type")
    return reason if isinstance(reason, str) else None


def _apply_meta(record: RequestRecord, meta: dict[str, Any]) -> None:
    if record.rid is None and isinstance(meta.get("id"), str):
        record.rid = meta["id"]
    if "prompt_tokens" in meta:
        record.prompt_tokens = int(meta["prompt_tokens"])
    if meta.get("spec_verify_ct") is not None:
        record.spec_verify_ct = int(meta["spec_verify_ct"])
    if meta.get("finish_reason") is not None:
        record.finish_reason = _finish_reason(meta)
    if isinstance(meta.get("first_token_latency"), (int, float)):
        record.server_ttft_s = float(meta["first_token_latency"])
    if isinstance(meta.get("e2e_latency"), (int, float)):
        record.server_e2e_s = float(meta["e2e_latency"])


def _finish(record: RequestRecord, t0: float) -> None:
    record.e2e_s = time.perf_counter() - t0
    n = record.completion_tokens
    if record.ttft_s is not None and n > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (n - 1)


def _error_text(err: BaseException, timeout_s: float) -> str:
    if isinstance(err, TimeoutError):
        return f"timeout after {timeout_s:g} s ({type(err).__name__})"
    if isinstance(err, (ConnectError, ConnectionClosed)):
        return f"connection error: {err}"
    return f"{type(err).__name__}: {err}"


async def _send_plain(pool: ConnectionPool, path: str, body: bytes, record: RequestRecord) -> None:
    async with pool.post(path, body) as response:
        content = await response.read()
        if response.status != 200:
            record.error = f"HTTP {response.status}: {content.decode('utf-8', 'replace')[:MAX_ERROR_BODY]}"
            return
    if record.stamps:
        record.stamps["c_done"] = time.monotonic_ns()
    data = orjson.loads(content)
    meta = data.get("meta_info") or {}
    record.output_ids = list(data.get("output_ids") or [])
    record.completion_tokens = int(meta.get("completion_tokens", len(record.output_ids)))
    _apply_meta(record, meta)
    record.ok = True


def _apply_chunk(record: RequestRecord, chunk: dict[str, Any], now: float, t0: float, last_token_at: float | None) -> float | None:
    """One streamed chunk into the record; the time of the last chunk that brought tokens."""
    meta = chunk.get("meta_info") or {}
    ids = chunk.get("output_ids") or []
    count = int(meta.get("completion_tokens", len(ids)))
    if count > record.completion_tokens:
        # Cumulative chunks replace; incremental ones carry only the new tokens.
        if len(ids) == count:
            record.output_ids = list(ids)
        elif len(ids) == count - record.completion_tokens:
            record.output_ids.extend(ids)
        record.completion_tokens = count
        if last_token_at is None:
            record.ttft_s = now - t0
        else:
            record.itl_s.append(now - last_token_at)
        last_token_at = now
        if record.stamps:
            record.stamps.setdefault("c_first", time.monotonic_ns())
            record.stamps["c_last"] = time.monotonic_ns()
    _apply_meta(record, meta)
    return last_token_at


async def _send_stream(pool: ConnectionPool, path: str, body: bytes, record: RequestRecord, t0: float) -> None:
    last_token_at: float | None = None
    async with pool.post(path, body) as response:
        if response.status != 200:
            text = (await response.read()).decode("utf-8", "replace")
            record.error = f"HTTP {response.status}: {text[:MAX_ERROR_BODY]}"
            return
        # Events are split here rather than line by line: one pass of Python per network read, however many
        # events it holds (SSE: events end with a blank line; a server's chunk may end inside one).
        pending = b""
        while data := await response.read_chunk():
            now = time.perf_counter()
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # SSE comments and other fields
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        record.ok = True
                        if record.stamps:
                            record.stamps["c_done"] = time.monotonic_ns()
                        # read the body to its end, so that the connection is reused (the pool closes one whose
                        # response is unfinished); a server that ends its body with [DONE] has nothing left to send
                        while await response.read_chunk():
                            pass
                        return
                    chunk = orjson.loads(payload)
                    if "error" in chunk:
                        record.error = f"stream error: {json.dumps(chunk['error'])[:MAX_ERROR_BODY]}"
                        return
                    last_token_at = _apply_chunk(record, chunk, now, t0, last_token_at)
    record.error = "stream ended without 'data: [DONE]'"


async def _one(pool: ConnectionPool, path: str, prompt: Sequence[int],
               sampling: dict[str, Any], stream: bool, timeout_s: float, timeline: bool = False) -> RequestRecord:
    # orjson: the client's own encoding and parsing stay small beside the server's (a 32-request wave is ~0.1 s)
    body = orjson.dumps({"input_ids": list(prompt), "sampling_params": sampling, "stream": stream})
    record = RequestRecord(ok=False, prompt_tokens=len(prompt), started_at=time.time())
    if timeline:
        record.stamps["c_send"] = time.monotonic_ns()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):  # bounds the whole request, stream included
            if stream:
                await _send_stream(pool, path, body, record, t0)
            else:
                await _send_plain(pool, path, body, record)
    except (HTTPClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as err:
        # ValueError covers bad JSON from the server; a broken answer is a failed request.
        record.ok = False
        record.error = _error_text(err, timeout_s)
    if not record.ok and record.error is None:
        record.error = "no answer"
    _finish(record, t0)
    if timeline:
        record.stamps["c_end"] = time.monotonic_ns()
    return record


async def run_requests(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    stream: bool = True,
    timeout_s: float = 600,
    seed: int | None = None,
    processes: int = 1,
    timeline: bool = False,
) -> list[RequestRecord]:
    """Send every prompt once, keeping `concurrency` in flight; records in prompt order.

    Each request is bounded by `timeout_s` (connect to last byte), so the whole run takes at most
    ceil(len(prompts) / concurrency) * timeout_s. With `seed`, request i samples with seed + i.

    processes > 1: that many client processes (`client_pool`) send the prompts, prompt i from process
    i mod processes, each keeping its share of `concurrency` in flight. One client process spends CPU on every
    request (on 2 cores at C = 32, 1024-id prompts, 128 tokens: ~0.25 ms a plain request, ~1.1 ms a stream,
    most of it its chunks), so 32 arrivals leave it one after another: at high concurrency on a fast server
    the client, not the server, can set the pace.

    timeline: each record's `stamps` get the client's CLOCK_MONOTONIC times (ddtree.profiling.timeline).
    """
    _check_args(prompts, concurrency, max_new_tokens, timeout_s)
    split_url(base_url)  # a ConfigError naming base_url before any request
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"processes: {processes!r} must be an integer >= 1")
    items = list(enumerate(prompts))
    procs = min(processes, concurrency, len(items))
    settings = (max_new_tokens, temperature, ignore_eos, stream, timeout_s, seed, timeline)
    if procs <= 1:
        return await _run_indexed(base_url, items, concurrency, *settings)
    shares = [items[k::procs] for k in range(procs)]
    in_flight = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    pool = client_pool(procs)
    loop = asyncio.get_running_loop()
    parts = await asyncio.gather(*(loop.run_in_executor(pool, _run_share, (base_url, share, conc, *settings))
                                   for share, conc in zip(shares, in_flight)))
    records: list[RequestRecord] = [RequestRecord(ok=False)] * len(items)
    for share, part in zip(shares, parts):
        for (i, _), record in zip(share, part):
            records[i] = record
    return records


async def _run_indexed(base_url: str, items: Sequence[tuple[int, Sequence[int]]], concurrency: int,
                       max_new_tokens: int, temperature: float, ignore_eos: bool, stream: bool, timeout_s: float,
                       seed: int | None, timeline: bool = False) -> list[RequestRecord]:
    """(index, prompt) pairs, `concurrency` in flight from one client; the index picks the seed."""
    path = split_url(base_url).path.rstrip("/") + "/generate"
    records: list[RequestRecord] = [RequestRecord(ok=False)] * len(items)
    queue = iter(enumerate(items))
    # `concurrency` senders, each taking the next prompt as soon as its request has ended: the closed loop
    # without a semaphore's hand-over (a loop turn between one request's end and the next one's send), and so
    # at most `concurrency` connections, each reused while the server keeps it
    async with ConnectionPool(base_url, ssl=tls_verify(base_url)) as pool:

        async def sender() -> None:
            for k, (i, prompt) in queue:
                sampling: dict[str, Any] = {
                    "max_new_tokens": max_new_tokens,
                    "temperature": temperature,
                    "ignore_eos": ignore_eos,
                }
                if seed is not None:
                    sampling["seed"] = seed + i
                records[k] = await _one(pool, path, prompt, sampling, stream, timeout_s, timeline)

        await asyncio.gather(*(sender() for _ in range(min(concurrency, len(items)))))
    return records


async def run_open_loop(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    offsets_s: Sequence[float],
    max_new_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    stream: bool = True,
    timeout_s: float = 600,
    seed: int | None = None,
) -> list[RequestRecord]:
    """Open loop: prompt i leaves `offsets_s[i]` seconds after the start, whatever is still in flight.

    Nothing caps the requests in flight: a service slower than the arrivals builds a queue, and that queue
    is what an arrival rate measures. Each record's `scheduled_at` is when its arrival was due, so the
    client's own lateness (started_at - scheduled_at) shows. Records in prompt order.
    """
    _check_args(prompts, 1, max_new_tokens, timeout_s)
    split_url(base_url)
    offsets = list(offsets_s)
    if len(offsets) != len(prompts):
        raise ConfigError(f"offsets_s: {len(offsets)} arrival times for {len(prompts)} prompts (need one each)")
    if any(o < 0 for o in offsets) or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ConfigError("offsets_s: arrival times must be >= 0 seconds and in ascending order")
    path = split_url(base_url).path.rstrip("/") + "/generate"
    loop = asyncio.get_running_loop()
    async with ConnectionPool(base_url, ssl=tls_verify(base_url)) as pool:
        start, wall = loop.time(), time.time()
        tasks = []
        for i, (prompt, offset) in enumerate(zip(prompts, offsets)):
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                        "ignore_eos": ignore_eos}
            if seed is not None:
                sampling["seed"] = seed + i
            tasks.append(asyncio.create_task(_one(pool, path, prompt, sampling, stream, timeout_s)))
        records = list(await asyncio.gather(*tasks))
    for record, offset in zip(records, offsets):
        record.scheduled_at = wall + offset
    return records


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on every platform: asyncio's own loop
        return None
    return uvloop.new_event_loop


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on uvloop's event loop where it is installed, as the server runs: the client's own
    Python per request is less there (with aiohttp, a round trip to a bare uvicorn app ~0.52 -> ~0.45 ms on
    2 cores)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)


def _run_share(args: tuple[Any, ...]) -> list[RequestRecord]:
    """One client process's share of a run (in a `client_pool` worker)."""
    return run_client(_run_indexed(*args))


_POOLS: dict[int, concurrent.futures.ProcessPoolExecutor] = {}


@atexit.register
def _close_pools() -> None:
    """Shut the pools down while the interpreter is whole (collected at teardown, they complain on stderr)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown(wait=True, cancel_futures=True)


POOL_PAUSE_S = 0.2  # each of the pool's first tasks holds its worker this long (doubled until all have answered)
POOL_START_S = 60.0  # past a pause this long the pool has not started


def _ready(pause_s: float) -> int:
    time.sleep(pause_s)  # holds this worker, so each of the pool's first tasks starts its own process
    return os.getpid()


def client_pool(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    """`processes` client processes, started once per process and all running before this returns, so no
    timed run pays for their start. Spawned, not forked: the caller may hold a CUDA context."""
    pool = _POOLS.get(processes)
    if pool is None:
        pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        pids: set[int] = set()
        pause = POOL_PAUSE_S
        # The executor starts a process per waiting task, but one that is up first may finish its pause and take a
        # second task before the slowest has started (spawning takes seconds on a busy machine): longer pauses
        # until every process has answered.
        while len(pids) < processes:
            if pause > POOL_START_S:
                pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError(f"client pool: {len(pids)} of {processes} processes started")
            pids |= set(pool.map(_ready, [pause] * processes))
            pause *= 2
        _POOLS[processes] = pool
    return pool


def run_arrivals(base_url: str, prompts: Sequence[Sequence[int]], offsets_s: Sequence[float],
                 max_new_tokens: int, **kwargs: Any) -> list[RequestRecord]:
    """Synchronous wrapper of run_open_loop (starts its own event loop, run_client's)."""
    return run_client(run_open_loop(base_url, prompts, offsets_s, max_new_tokens, **kwargs))


def run_load(base_url: str, prompts: Sequence[Sequence[int]], concurrency: int,
             max_new_tokens: int, **kwargs: Any) -> list[RequestRecord]:
    """Synchronous wrapper of run_requests (starts its own event loop, run_client's; not for use inside one)."""
    return run_client(run_requests(base_url, prompts, concurrency, max_new_tokens, **kwargs))
