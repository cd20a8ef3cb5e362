r"""How the server's scheduler admits a burst of arrivals, and what a prefill costs: `python -m ddtree.profiling.burst`.

    python -m ddtree.profiling.burst --device cuda --configs b8-k4-w2048-bs8 --rows 32 \
        --spacing-ms 0.15 0.3 --holds 0:0 1:4
    python -m ddtree.profiling.burst --prefill-costs --rows 1 8 32 --prefill-tokens 4096 8192

`--rows` requests arrive one every `--spacing-ms` (as the engine process's reader queues a burst of HTTP
arrivals) at an idle served Scheduler, once per `--holds` GAP:WAIT (its burst_gap_s and burst_wait_s in ms;
0:0 admits whatever is queued at every look), in turns with "in process" (all prefilled at once): the prefill
groups and their ms, TTFT (submit to first token handed out) median and p90, the last first token and the last
finish after the first submit. Outputs must be the same in every case (exit status 1 otherwise).

`--prefill-costs`: instead, one prefill of k prompts for every k in `--rows` (on one batch of the most rows),
once per `--prefill-tokens` bound on a forward's padded tokens: ms and forwards, what the burst hold weighs (a
fixed cost per forward against the tokens').

The batch (`--engine model|zero|emulated`, `--warm`) is chosen as in ddtree.profiling.round_overhead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from ddtree.engine import Request, StepOutput
from ddtree.errors import ConfigError
from ddtree.profiling.flags import tool_parser
from ddtree.profiling.round_overhead import (
    add_batch_flags,
    check_batch_flags,
    choice_state,
    frame_tokens,
    in_process,
    on_a_thread,
    restore_choice_state,
    run_batches,
    sync_device,
)
from ddtree.serving.engine_worker import Relay
from ddtree.serving.scheduler import BURST_GAP_S, BURST_WAIT_S, SWITCH_INTERVAL_S, Scheduler


def burst(batch: Any, requests: list[Request], spacing_s: float, gap_s: float, wait_s: float,
          on_gpu: bool) -> dict[str, Any]:
    """`requests` submitted to a served Scheduler one every `spacing_s` (as the engine process's reader queues
    a burst of HTTP arrivals), the scheduler gathering bursts with (gap_s, wait_s): how they were admitted
    (each prefill group's size and seconds), each request's TTFT (submit to first token handed out), the
    time from the first submit to the last first token and to the last finish, and the tokens."""
    from ddtree.serving.wire import FrameReader

    groups: list[tuple[float, int, float]] = []  # (start, requests, seconds) per prefill
    add_many = batch.add_many

    def timed_add_many(reqs: list[Request]) -> list[StepOutput]:
        started = time.perf_counter()
        outputs = add_many(reqs)  # ends with the prefill's one sync (its first tokens read back)
        groups.append((started, len(reqs), time.perf_counter() - started))
        return outputs

    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    with tempfile.TemporaryFile() as sent:
        relay = Relay(sent.fileno())

        def deliver(items: list[tuple[Any, Any]]) -> None:
            now = time.perf_counter()
            for _, event in items:
                rid = event.request_id
                if rid not in first and getattr(event, "new_token_ids", None):
                    first[rid] = now
                if not isinstance(event, StepOutput) or event.finished:
                    done[rid] = now
            relay.deliver(items)

        sched = Scheduler(batch, len(requests), relay.metrics, deliver=deliver,
                          switch_interval_s=SWITCH_INTERVAL_S if on_gpu else None, burst_gap_s=gap_s,
                          burst_wait_s=wait_s)
        relay.scheduler = sched
        batch.add_many = timed_add_many
        try:
            sched.start()
            time.sleep(0.02)  # the thread idle, waiting for work, as a server between bursts
            start = time.perf_counter()
            for i, r in enumerate(requests):
                time.sleep(max(start + i * spacing_s - time.perf_counter(), 0.0))
                relay.submitted(r.request_id, True)
                submitted[r.request_id] = time.perf_counter()
                sched.submit(r, lambda _: None)
            while sched.in_flight:
                time.sleep(0.005)
            sched.stop()
        finally:
            del batch.add_many  # the class's own again
        relay.flush()
        sent.seek(0)
        tokens = frame_tokens(FrameReader().feed(sent.read()), {r.request_id: [] for r in requests})
    t0 = min(submitted.values())
    ttft = [first[rid] - submitted[rid] for rid in submitted if rid in first]
    return {"groups": [n for _, n, _ in groups], "prefill_ms": [1e3 * sec for _, _, sec in groups],
            "ttft_ms": 1e3 * statistics.median(ttft), "p90_ttft_ms": 1e3 * _quantile(ttft, 0.9),
            "last_first_ms": 1e3 * (max(first.values()) - t0), "span_ms": 1e3 * (max(done.values()) - t0),
            "arrivals_ms": 1e3 * (max(submitted.values()) - t0), "tokens": tokens}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process_burst(batch: Any, requests: list[Request]) -> dict[str, Any]:
    """burst()'s numbers for the in-process loop: every request prefilled at once, then stepped to the end."""
    start = time.perf_counter()
    outputs = batch.add_many(requests)
    prefilled = time.perf_counter()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while True:
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
        if not batch.active:
            break
        outputs = batch.step()
    end = time.perf_counter()
    ms = 1e3 * (prefilled - start)
    return {"groups": [len(requests)], "prefill_ms": [ms], "ttft_ms": ms, "p90_ttft_ms": ms, "last_first_ms": ms,
            "span_ms": 1e3 * (end - start), "arrivals_ms": 0.0, "tokens": tokens}


def run_bursts(batch: Any, device: Any, requests: list[Request], spacings_s: list[float],
               holds: list[tuple[float, float]], repeats: int, on_gpu: bool) -> list[dict[str, Any]]:
    """Per arrival spacing and hold (gap_s, wait_s), the medians over `repeats` of burst()'s numbers (the
    groups of the median-span repeat), in turns with the in-process reference; tokens checked against it."""
    on_a_thread(in_process, batch, requests)  # untimed: graphs captured, caches warm
    auto = choice_state(batch)
    cases: list[tuple[float | None, tuple[float, float] | None]] = [(None, None)]
    cases += [(sp, hold) for sp in spacings_s for hold in holds]
    results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cases))}
    reference = None
    for _ in range(repeats):
        for i, (spacing, hold) in enumerate(cases):
            restore_choice_state(batch, auto)
            sync_device(device)
            if spacing is None or hold is None:
                r = on_a_thread(in_process_burst, batch, requests)
            else:
                r = burst(batch, requests, spacing, hold[0], hold[1], on_gpu)
            reference = r["tokens"] if reference is None else reference
            r["mismatched"] = sum(1 for rid, t in r.pop("tokens").items() if t != reference[rid])
            results[i].append(r)
    rows = []
    for i, (spacing, hold) in enumerate(cases):
        reps = results[i]
        mid = sorted(reps, key=lambda r: r["span_ms"])[len(reps) // 2]
        row = {k: statistics.median(r[k] for r in reps) for k in ("ttft_ms", "p90_ttft_ms", "last_first_ms", "span_ms", "arrivals_ms")}
        row.update(mode="in process" if spacing is None else "served", spacing_ms=None if spacing is None else 1e3 * spacing,
                   gap_ms=None if hold is None else 1e3 * hold[0], wait_ms=None if hold is None else 1e3 * hold[1],
                   groups=mid["groups"], prefill_ms=[round(x, 2) for x in mid["prefill_ms"]],
                   mismatched=sum(r["mismatched"] for r in reps))
        rows.append(row)
    return rows


def prefill_costs(batch: Any, device: Any, prompts: list[list[int]], sizes: list[int], bounds: list[int],
                  repeats: int) -> list[dict[str, Any]]:
    """What one prefill (add_many) of k of `prompts` takes, for k in `sizes`, with the batch's bound on a
    forward's padded tokens set to each of `bounds` (DecodeBatch.prefill_tokens): median ms of `repeats`
    (after one untimed), and the forwards it was cut into. The batch is emptied after each."""
    from ddtree.prefill import prefill_chunks

    rows = []
    for bound in bounds:
        for k in sizes:
            requests = [Request(f"p{i}", list(prompts[i % len(prompts)]), 1, ignore_eos=True) for i in range(k)]
            batch.prefill_tokens = bound
            times = []
            for rep in range(repeats + 1):
                sync_device(device)
                started = time.perf_counter()
                batch.add_many(requests)  # its first tokens read back: the one sync
                if rep:
                    times.append(time.perf_counter() - started)
                batch.clear()
            forwards = len(prefill_chunks([len(r.prompt_ids) for r in requests], bound, batch.forward_cost))
            rows.append({"prefill_tokens": bound, "requests": k, "forwards": forwards,
                         "ms": 1e3 * statistics.median(times)})
    return rows


def parse_hold(text: str) -> tuple[float, float]:
    try:
        gap, wait = (float(x) / 1e3 for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--holds: {text!r} is not GAP:WAIT in ms (e.g. 1:4)") from None
    if gap < 0 or wait < 0:
        raise ConfigError(f"--holds: {text!r} out of range (allowed >= 0)")
    return gap, wait


def print_bursts(config_id: str, rows: int, results: list[dict[str, Any]]) -> None:
    for r in results:
        how = "at once" if r["mode"] == "in process" else f"{r['spacing_ms']:g} ms, {r['gap_ms']:g}:{r['wait_ms']:g}"
        print(f"{config_id:20} {rows:4} {r['mode']:10} {how:18} {r['arrivals_ms']:8.2f} {r['ttft_ms']:8.2f} "
              f"{r['p90_ttft_ms']:8.2f} {r['last_first_ms']:9.2f} {r['span_ms']:8.1f}  {r['groups']} {r['prefill_ms']}",
              flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    add_batch_flags(p)
    p.add_argument("--spacing-ms", nargs="+", type=float, default=[0.3], help="between two arrivals")
    p.add_argument("--holds", nargs="+", default=["0:0", f"{1e3 * BURST_GAP_S:g}:{1e3 * BURST_WAIT_S:g}"],
                   metavar="GAP:WAIT", help="the scheduler's burst_gap_s and burst_wait_s, in ms (0:0: none)")
    p.add_argument("--prefill-costs", action="store_true",
                   help="instead: one prefill of k prompts for k in --rows, per --prefill-tokens bound (model only)")
    p.add_argument("--prefill-tokens", nargs="+", type=int, default=[8192], help="prefill costs: padded tokens a forward")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_batch_flags(args)
        holds = [parse_hold(h) for h in args.holds]
        if any(sp < 0 for sp in args.spacing_ms):
            raise ConfigError("--spacing-ms out of range (allowed >= 0)")
        if args.prefill_costs and args.engine != "model":
            raise ConfigError(f"--prefill-costs: needs --engine model (a batch that prefills), not {args.engine!r}")
    except ConfigError as err:
        return parser.fail(err)

    def measure(label: str, rows: int, batch: Any, device: Any, prompts: list[list[int]], requests: list[Request],
                on_gpu: bool) -> bool:
        if args.prefill_costs:
            for c in on_a_thread(prefill_costs, batch, device, prompts, sorted(args.rows), args.prefill_tokens,
                                 args.repeats):
                print(f"{label:20} prefill of {c['requests']:3} x {args.context} tokens, bound "
                      f"{c['prefill_tokens']:6}: {c['forwards']:2} forwards, {c['ms']:8.2f} ms", flush=True)
            return True
        results = run_bursts(batch, device, requests, [sp / 1e3 for sp in args.spacing_ms], holds, args.repeats,
                             on_gpu)
        print_bursts(label, rows, results)
        return not any(r["mismatched"] for r in results)

    if not args.prefill_costs:  # prefill costs: one line per prefill
        print(f"{'config':20} {'rows':>4} {'mode':10} {'spacing, gap:wait':18} {'arrivals':>8} {'TTFT ms':>8} {'p90':>8} "
              f"{'last 1st':>9} {'span ms':>8}  groups, prefill ms")
    # prefill costs: one batch of the most rows, every size prefilled on it
    return run_batches(args, parser, [max(args.rows)] if args.prefill_costs else args.rows, measure)


if __name__ == "__main__":
    raise SystemExit(main())
