"""The in-process side of ddtree.profiling.http_vs_engine: a closed loop over a batch, and where it runs.

    run_in_process(engine, batch, prompts, concurrency, max_new_tokens) -> [RequestRecord]
    write_plan(path, cells, max_new_tokens) -> address, key   # the bench: the cells the engine process measures
    measuring(factory, plan) -> SchedulerFactory  # that process: warm its batch, then measure it on request
    EngineChannel(address, key).measure(i) -> {"records": [RequestRecord], "round_ms": float | None}

Why the server's own engine process (`--in-process same`, the default): on the H200 host a fixture
round's time moves by up to ~8% from one process start to the next (ddtree.profiling.fresh_runs), the
in-process batch's and the server's alike, so a batch in the bench's process against the server's batch
in its engine process compares two starts as much as it measures HTTP. Measured in the engine process,
on the batch it serves (same graphs, same memory, same CPUs), in the state it serves in (after the
scheduler's graph warm-up, the heap frozen, the scheduler's GIL switch interval), the ratio compares one
process with itself. Each in-process repeat runs when the bench asks for it, between its HTTP repeats
(run on the scheduler's thread while it is idle: Scheduler.run_idle), so a host that drifts moves both sides alike.
Why multiprocessing.connection: a framed, authenticated request/reply over a Unix socket is what it is
for; the socket is in Linux's abstract namespace, so there is no file to clean up or path to outgrow.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

from ddtree.bench.loadgen import RequestRecord
from ddtree.engine import Request, StepOutput
from ddtree.profiling.round_overhead import on_a_thread
from ddtree.serving.engine_worker import freeze_heap


def sync(engine: Any) -> None:
    device = getattr(engine, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_in_process(engine: Any, batch: Any, prompts: Sequence[Sequence[int]], concurrency: int,
                   max_new_tokens: int, step_seconds: list[float] | None = None) -> list[RequestRecord]:
    """Every prompt once through `batch`, `concurrency` in flight (closed loop, FIFO), greedy, ignore_eos;
    a RequestRecord per prompt with the times a client would see (TTFT at the first token handed back).
    step_seconds: each decode round's time is appended to it."""
    records = [RequestRecord(ok=False, prompt_tokens=len(p)) for p in prompts]
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    index = {f"in-{i}": i for i in range(len(prompts))}
    waiting = list(index)

    def absorb(outputs: list[StepOutput], now: float) -> None:
        for out in outputs:
            rec = records[index[out.request_id]]
            if out.new_token_ids:
                if rec.ttft_s is None:
                    rec.ttft_s = now - sent[out.request_id]
                else:
                    rec.itl_s.append(now - last[out.request_id])
                last[out.request_id] = now
            rec.output_ids.extend(out.new_token_ids)
            rec.completion_tokens = len(rec.output_ids)
            if out.accept_lengths:
                rec.spec_verify_ct = out.verify_steps
            if out.finished:
                rec.ok, rec.finish_reason = True, out.finish_reason
                rec.e2e_s = now - sent[out.request_id]
                n = rec.completion_tokens
                if rec.ttft_s is not None and n > 1:
                    rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (n - 1)

    sync(engine)
    running = 0
    while waiting or running:
        room = min(concurrency - running, batch.free_slots, len(waiting))
        if room:
            joining, waiting = waiting[:room], waiting[room:]
            now = time.perf_counter()
            for rid in joining:
                sent[rid] = now
                records[index[rid]].started_at = time.time()
            requests = [Request(rid, list(prompts[index[rid]]), max_new_tokens, ignore_eos=True) for rid in joining]
            outputs = batch.settle()  # a round step() launched ahead comes back before anyone joins
            outputs += batch.add_many(requests)
            running += len(joining)
        else:
            started = time.perf_counter()
            outputs = batch.step()
            if step_seconds is not None:
                step_seconds.append(time.perf_counter() - started)
        now = time.perf_counter()
        absorb(outputs, now)
        running -= sum(1 for o in outputs if o.finished)
    return records


def measure_cell(engine: Any, batch: Any, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int,
                 repeats: int, warm: bool = True) -> list[dict[str, Any]]:
    """With `warm`, one untimed pass (the captures it meets are made); then `repeats` timed ones: their records and
    mean round time."""
    # on a thread, as the server's scheduler runs its rounds (on the 2-core CPU torch ran the fixture's rounds up
    # to ~5x slower on the main thread, with its two intra-op threads)
    if warm:
        on_a_thread(run_in_process, engine, batch, prompts, concurrency, max_new_tokens)
    out = []
    for _ in range(repeats):
        sync(engine)
        steps: list[float] = []
        records = on_a_thread(run_in_process, engine, batch, prompts, concurrency, max_new_tokens, steps)
        out.append({"records": records, "round_ms": 1000.0 * statistics.fmean(steps) if steps else None})
    return out


# -- in the server's engine process ------------------------------------------------------------------------

SETTLE_S = 0.1  # after pausing: the idle scheduler thread stops polling its pipe (POLL_WINDOW_S) before rounds run


def write_plan(path: Path, cells: Sequence[tuple[int, int, Sequence[Sequence[int]]]],
               max_new_tokens: int) -> tuple[str, bytes]:
    """cells: (context, concurrency, the timed prompts), measured by index. Returns the channel's address and key."""
    address, key = f"\0ddtree-in-process-{os.getpid()}-{secrets.token_hex(4)}", secrets.token_hex(16)
    plan = {"max_new_tokens": max_new_tokens, "address": address, "key": key,
            "cells": [{"context": c, "concurrency": k, "prompts": [list(p) for p in ps]} for c, k, ps in cells]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, path)  # a reader never sees half a file
    return address, key.encode()


def measuring(factory: Any, plan: Path) -> Any:
    """A SchedulerFactory (ddtree.serving.engine_worker) that opens the server's scheduler with `factory`, warms it
    as it serves, runs each of `plan`'s cells once untimed (the captures they meet are made), and listens at the
    plan's address: each request (a cell's index) is one timed repeat, run on the scheduler's thread while it is
    idle (Scheduler.run_idle). Runs in the engine process before it reports itself loaded, so what it raises
    stops the server with its message."""

    def open_measured(engine: Any, context_length: int, metrics: Any, deliver: Any) -> Any:
        scheduler = factory(engine, context_length, metrics, deliver)
        spec = json.loads(Path(plan).read_text())
        cells, max_new = spec["cells"], spec["max_new_tokens"]
        on_a_thread(scheduler.warm_up)
        freeze_heap()
        if scheduler.switch_interval_s is not None:
            sys.setswitchinterval(scheduler.switch_interval_s)
        for cell in cells:
            measure_cell(engine, scheduler.batch, cell["prompts"], cell["concurrency"], max_new, 0)
        listener = Listener(spec["address"], family="AF_UNIX", authkey=spec["key"].encode())
        threading.Thread(target=_answer, args=(listener, engine, scheduler, cells, max_new), daemon=True,
                         name="in-process-bench").start()
        return scheduler

    return open_measured


def _answer(listener: Any, engine: Any, scheduler: Any, cells: list[dict[str, Any]], max_new: int) -> None:
    with listener, listener.accept() as conn:
        while True:
            try:
                index = conn.recv()
            except EOFError:  # the bench is done
                return
            try:
                cell = cells[index]
                def measure(cell: dict[str, Any] = cell) -> Any:
                    time.sleep(SETTLE_S)
                    return measure_cell(engine, scheduler.batch, cell["prompts"], cell["concurrency"], max_new, 1,
                                        warm=False)

                (rep,) = scheduler.run_idle(measure)
                conn.send(rep)  # pickled: RequestRecords and all
            except Exception as err:  # the bench raises it; the server goes on serving
                conn.send({"error": f"{type(err).__name__}: {err}"})


class EngineChannel:
    """The bench's end: one in-process repeat of a cell, measured in the server's engine process."""

    def __init__(self, address: str, key: bytes) -> None:
        self._conn = Client(address, family="AF_UNIX", authkey=key)

    def measure(self, index: int) -> dict[str, Any]:
        self._conn.send(index)
        reply = self._conn.recv()
        if "error" in reply:
            raise RuntimeError(f"the engine process's in-process repeat failed: {reply['error']}")
        return reply

    def close(self) -> None:
        self._conn.close()
