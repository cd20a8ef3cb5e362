"""The in-process side of ddtree.bench.http_vs_engine: a closed loop over a batch, and where it runs.

    run_in_process(engine, batch, prompts, concurrency, max_new_tokens) -> [RequestRecord]
    write_plan(path, cells, repeats, max_new_tokens)   # the bench: what the server's engine process measures
    measuring(factory, plan, results) -> SchedulerFactory  # that process: measure its batch, then serve it
    read_results(path) -> {(context, concurrency): [{"records": [RequestRecord], "round_ms": float | None}]}

Why the server's own engine process (`--in-process same`, the default): on the H200 host a fixture
round's time moves by up to ~8% from one process start to the next (ddtree.bench.fresh_runs), the
in-process batch's and the server's alike, so a batch in the bench's process against the server's batch
in its engine process compares two starts as much as it measures HTTP. Measured in the engine process,
on the batch it then serves (same graphs, same memory, same CPUs), in the state it serves in (after the
scheduler's graph warm-up, the heap frozen, the scheduler's GIL switch interval), before it serves, the
ratio compares one process with itself. The price: its repeats all come first, not interleaved with the
HTTP ones.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddtree.bench.loadgen import RequestRecord
from ddtree.bench.round_overhead import on_a_thread
from ddtree.engine import Request, StepOutput
from ddtree.serving.engine_process import freeze_heap


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
            outputs = batch.add_many(requests)
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


def write_plan(path: Path, cells: Sequence[tuple[int, int, Sequence[Sequence[int]]]], repeats: int,
               max_new_tokens: int) -> None:
    """cells: (context, concurrency, the timed prompts) in the order they are measured."""
    plan = {"repeats": repeats, "max_new_tokens": max_new_tokens,
            "cells": [{"context": c, "concurrency": k, "prompts": [list(p) for p in ps]} for c, k, ps in cells]}
    _write_json(path, plan)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # a reader never sees half a file


def measuring(factory: Any, plan: Path, results: Path) -> Any:
    """A SchedulerFactory (ddtree.serving.engine_process) that opens the server's scheduler with `factory`, runs
    `plan`'s cells in process on its batch, writing `results` after each, and then hands the scheduler over to
    serve. Runs in the engine process before it reports itself loaded: the server is not ready until the
    measurement is done, and what it raises stops the server with its message."""

    def open_measured(engine: Any, context_length: int, metrics: Any, deliver: Any) -> Any:
        scheduler = factory(engine, context_length, metrics, deliver)
        # the state the batch serves in: the scheduler's warm-up (every row bucket's graphs, largest first; its own
        # run later finds them captured), the heap frozen (engine_main's freeze_heap), the GIL's switch interval
        on_a_thread(scheduler._warm_up)
        freeze_heap()
        if scheduler.switch_interval_s is not None:
            sys.setswitchinterval(scheduler.switch_interval_s)
        spec = json.loads(Path(plan).read_text())
        done: list[dict[str, Any]] = []
        for cell in spec["cells"]:
            reps = measure_cell(engine, scheduler.batch, cell["prompts"], cell["concurrency"],
                                spec["max_new_tokens"], spec["repeats"])
            done.append({"context": cell["context"], "concurrency": cell["concurrency"],
                         "repeats": [{"records": [asdict(r) for r in rep["records"]], "round_ms": rep["round_ms"]}
                                     for rep in reps]})
            _write_json(Path(results), {"cells": done, "pid": os.getpid()})
        return scheduler

    return open_measured


def read_results(path: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    data = json.loads(Path(path).read_text())
    return {(c["context"], c["concurrency"]): [{"records": [RequestRecord(**r) for r in rep["records"]],
                                               "round_ms": rep["round_ms"]} for rep in c["repeats"]]
            for c in data["cells"]}
