r"""What the server's round loop adds to a decode round: `python -m ddtree.profiling.round_overhead`.

    python -m ddtree.profiling.round_overhead --device cuda --configs ar b8-k4-w2048-bs8 bauto-k4-w2048-bs8
    python -m ddtree.profiling.round_overhead --engine zero      # a batch whose rounds cost nothing: the loop alone

The same requests (greedy, ignore_eos, all joining at once) run on one batch three ways, in turns:
"in process" is a closed loop over DecodeBatch.step() (ddtree.profiling.http_vs_engine's in-process mode);
"served" is the engine process's Scheduler with its Relay writing every event into a file (no HTTP, no
text, no reader to wait for): round N's outputs are handed out while round N + 1 runs on the device;
"served, no overlap" is the same with the batch seen as step() only (each round's outputs handed out
before the next is launched); "served, to a pipe" is "served" with the Relay writing into a pipe that
another process reads and decodes as it fills (the HTTP process's hop, without HTTP). Per mode: the mean
period between two round launches (what a token costs a request), the mean round (launch to outputs:
step()'s time, the quantity the server's ddtree_decode_round_seconds sums), and the period's excess over in process. Medians of `--repeats`.
Outputs must be the same in every mode (exit status 1 otherwise).

`--burst`: instead, `--rows` requests arrive one every `--spacing-ms` (as the engine process's reader
queues a burst of HTTP arrivals) at an idle served Scheduler, once per `--holds` GAP:WAIT (its burst_gap_s
and burst_wait_s in ms; 0:0 admits whatever is queued at every look), in turns with "in process" (all
prefilled at once): the prefill groups and their ms, TTFT (submit to first token handed out) median and
p90, the last first token and the last finish after the first submit.

    python -m ddtree.profiling.round_overhead --device cuda --configs b8-k4-w2048-bs8 --rows 32 --burst \
        --spacing-ms 0.15 0.3 --holds 0:0 1:4

`--prefill-costs`: instead, one prefill of k prompts for every k in `--rows` (on one batch of the most
rows), once per `--prefill-tokens` bound on a forward's padded tokens: ms and forwards, what the burst
hold weighs (a fixed cost per forward against the tokens').

`--engine zero`: a batch of no device and no model (each round makes one token per row and nothing else),
so a period is the loop's own Python: the scheduler's per-round cost at `--rows` rows on this CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddtree.engine import Request, StepOutput
from ddtree.errors import ConfigError
from ddtree.serving.engine_worker import Relay, freeze_heap
from ddtree.serving.scheduler import BURST_GAP_S, BURST_WAIT_S, SWITCH_INTERVAL_S, Scheduler

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
MODES = ("in process", "served", "served, no overlap", "served, to a pipe")


class ZeroBatch:
    """The DecodeBatch protocol at no cost: one token per row per round, nothing else."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.rows: dict[str, list[Any]] = {}  # id -> [request, tokens so far]
        self._launched = False

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.rows)

    def add(self, request: Request) -> list[StepOutput]:
        return self.add_many([request])

    def validate(self, request: Request) -> None:
        """Every request fits (DecodeBatch.validate's place: the scheduler then prefills arrivals together)."""

    def add_many(self, requests: list[Request]) -> list[StepOutput]:
        for r in requests:
            self.rows[r.request_id] = [r, 0]
        return self._emit(list(self.rows.values())[-len(requests):], verify=False)

    def launch(self) -> None:
        self._launched = True

    def collect(self) -> list[StepOutput]:
        self._launched = False
        return self._emit(list(self.rows.values()), verify=True)

    def step(self) -> list[StepOutput]:
        self._launched = False
        return self._emit(list(self.rows.values()), verify=True)

    def cancel(self, request_id: str) -> bool:
        return self.rows.pop(request_id, None) is not None

    def _emit(self, rows: list[list[Any]], verify: bool) -> list[StepOutput]:
        outputs = []
        for row in rows:
            request, row[1] = row[0], row[1] + 1
            done = row[1] >= request.max_new_tokens
            outputs.append(StepOutput(request.request_id, [row[1] % 101], done, "length" if done else None,
                                      row[1] - 1, [1] if verify else []))
            if done:
                del self.rows[request.request_id]
        return outputs


class StepOnly:
    """A batch seen through step() alone (no launch/collect): the scheduler then hands a round out before
    launching the next."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch

    def __getattr__(self, name: str) -> Any:
        if name in ("launch", "collect"):
            raise AttributeError(name)
        return getattr(self._batch, name)


class RoundClock:
    """Timestamps of each round's start (step() or launch()) and of its outputs (step() or collect()
    returning), taken on the batch itself, so every mode is timed alike."""

    def __init__(self, batch: Any) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        step, launch, collect = batch.step, batch.launch, batch.collect

        def timed_step() -> list[StepOutput]:
            self.starts.append(time.perf_counter())
            out = step()
            self.ends.append(time.perf_counter())
            return out

        def timed_launch() -> None:
            self.starts.append(time.perf_counter())
            launch()

        def timed_collect(**kwargs: Any) -> list[StepOutput]:  # the scheduler's collect(run_ahead=True) too
            out = collect(**kwargs)
            self.ends.append(time.perf_counter())
            return out

        batch.step, batch.launch, batch.collect = timed_step, timed_launch, timed_collect

    def reset(self) -> None:
        self.starts.clear()
        self.ends.clear()

    def summary(self, skip: int = 2) -> dict[str, float]:
        """Mean period between launches and mean round (launch to outputs), in us, past the first `skip`."""
        starts, ends = self.starts[skip:], self.ends[skip:]
        periods = [b - a for a, b in zip(starts, starts[1:])]
        rounds = [e - s for s, e in zip(starts, ends)]
        return {"period_us": 1e6 * statistics.fmean(periods), "round_us": 1e6 * statistics.fmean(rounds),
                "rounds": len(self.starts)}


def _sync(device: Any) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def in_process(batch: Any, requests: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    outputs = batch.add_many(requests)
    while True:
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
        if not batch.active:
            return out
        outputs = batch.step()


def frame_tokens(frames: list[Any], out: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each request's tokens in the Relay's "events" frames (what the HTTP process would decode), into `out`."""
    for message in frames:
        for item in message.updates:
            if isinstance(item, list):  # an Update, not a Failure
                out.setdefault(item[0], []).extend(item[1])
    return out


# The HTTP process's part in "served, to a pipe": a process that reads the events pipe as it fills (woken by
# every frame, as the server's event loop is), decodes every frame and prints the tokens at the pipe's end.
PIPE_READER = """
import json, os, sys
from ddtree.profiling.round_overhead import frame_tokens
from ddtree.serving.wire import FrameReader
reader, out = FrameReader(), {}
print("ready", flush=True)
while data := os.read(0, 1 << 20):
    frame_tokens(reader.feed(data), out)
print(json.dumps(out), flush=True)
"""


def served(batch: Any, requests: list[Request], on_gpu: bool, to_pipe: bool = False) -> dict[str, list[int]]:
    """Through a Scheduler whose Relay writes its frames into a file (a write never waits for a reader) or,
    `to_pipe`, into a pipe read by another process; the tokens each request got, read back from the frames."""
    from ddtree.serving.wire import FrameReader, pipe

    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    with tempfile.TemporaryFile() as sent:
        reader = None
        fd = sent.fileno()
        if to_pipe:
            read_end, fd = pipe()
            reader = subprocess.Popen([sys.executable, "-c", PIPE_READER], stdin=read_end, stdout=subprocess.PIPE,
                                      text=True)
            os.close(read_end)
            assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        relay = Relay(fd)
        sched = Scheduler(batch, len(requests), relay.metrics, deliver=relay.deliver,
                          switch_interval_s=SWITCH_INTERVAL_S if on_gpu else None)
        relay.scheduler = sched
        for r in requests:  # queued before the thread starts: one admission, as in process
            relay.submitted(r.request_id, True)
            sched.submit(r, lambda _: None)
        sched.start()
        while sched.in_flight:  # seldom: each look takes the GIL from the scheduler's thread
            time.sleep(0.02)
        sched.stop()
        relay.flush()
        if reader is not None:
            os.close(fd)
            text, _ = reader.communicate(timeout=60)
            for rid, tokens in json.loads(text).items():
                out[rid].extend(tokens)
            return out
        sent.seek(0)
        return frame_tokens(FrameReader().feed(sent.read()), out)


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
            _sync(device)
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
                _sync(device)
                started = time.perf_counter()
                batch.add_many(requests)  # its first tokens read back: the one sync
                if rep:
                    times.append(time.perf_counter() - started)
                batch.clear()
            forwards = len(prefill_chunks([len(r.prompt_ids) for r in requests], bound, batch.forward_cost))
            rows.append({"prefill_tokens": bound, "requests": k, "forwards": forwards,
                         "ms": 1e3 * statistics.median(times)})
    return rows


# One thread for the loops timed in process, kept across calls (ddtree.profiling.http_vs_engine uses it too)
_ROUND_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="in-process-rounds")


def on_a_thread(fn: Any, *args: Any) -> Any:
    """fn(*args) on a thread of its own, as the scheduler's rounds run (what fn raises is raised here): on the
    2-core CPU the fixture's AR round took ~5x longer on the main thread (torch's two intra-op threads) than
    on another thread, or on the main thread after torch.set_num_threads(1)."""
    return _ROUND_THREAD.submit(fn, *args).result()


def choice_state(batch: Any) -> tuple[Any, ...] | None:
    """Budget auto's state that carries from one run to the next on a batch (the size chosen ahead, the
    choosing rounds' phase, the running mean of gains), to start every run from the same one: then every
    mode verifies the same tree sizes (graphed; an eager batch also calibrates its costs as it goes)."""
    gains = getattr(batch, "_gains", None)
    if gains is None:
        return None
    return batch._next_budget, batch._rounds_ahead, gains.clone()


def restore_choice_state(batch: Any, state: tuple[Any, ...] | None) -> None:
    if state is not None:
        batch._next_budget, batch._rounds_ahead = state[0], state[1]
        batch._gains.copy_(state[2])


def run_config(batch: Any, device: Any, requests: list[Request], repeats: int, on_gpu: bool,
               modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Every mode of `modes` (in process first) `repeats` times in turns; per mode the medians of
    RoundClock.summary, the excess over in process, and how many requests' tokens differed from the first run's."""
    clock = RoundClock(batch)
    on_a_thread(in_process, batch, requests)  # untimed: graphs captured, caches warm
    auto = choice_state(batch)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    reference, mismatched = None, {m: 0 for m in modes}
    for _ in range(repeats):
        for mode in modes:  # in turns: a drifting machine moves every mode alike
            restore_choice_state(batch, auto)
            _sync(device)
            clock.reset()
            if mode == "in process":
                tokens = on_a_thread(in_process, batch, requests)
            else:
                tokens = served(StepOnly(batch) if mode == "served, no overlap" else batch, requests, on_gpu,
                                to_pipe=mode == "served, to a pipe")
            _sync(device)
            results[mode].append(clock.summary())
            reference = tokens if reference is None else reference
            mismatched[mode] += sum(1 for rid in tokens if tokens[rid] != reference[rid])
    row: dict[str, Any] = {}
    for mode, reps in results.items():
        row[mode] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    base = row["in process"]["period_us"]
    for mode in modes[1:]:
        row[mode]["excess_us"] = row[mode]["period_us"] - base
    row["mismatched"] = mismatched
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddtree.profiling.round_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("model", "zero", "emulated"), default="model",
                   help="emulated: ddtree.profiling.http_vs_engine's batch (--round-ms, --prefill-ms, --prefill-token-us)")
    p.add_argument("--round-ms", type=float, default=1.0, help="emulated: a round's GIL-free wait")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="emulated: a prefill forward's fixed wait")
    p.add_argument("--prefill-token-us", type=float, default=0.0, help="emulated: a prefill's wait per padded token")
    p.add_argument("--target", type=Path, default=FIXTURES / "target")
    p.add_argument("--drafter", type=Path, default=FIXTURES / "drafter")
    p.add_argument("--configs", nargs="+", default=["ar", "b8-k4-w2048-bs8", "bauto-k4-w2048-bs8"], metavar="ID")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 32], help="requests running together")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (model)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES[1:], default=list(MODES[1:]), help="served modes timed beside in process")
    p.add_argument("--batch-rows", type=int, default=0, help="model: slots of the batch (at least --rows; the server's: 32)")
    p.add_argument("--warm", choices=("no", "yes", "both"), default="no",
                   help="model: run the server's graph warm-up on the batch first (its captures, in its order); "
                        "both: each config on a fresh batch without, then on one with")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--prefill-costs", action="store_true",
                   help="instead: one prefill of k prompts for k in --rows, per --prefill-tokens bound (model only)")
    p.add_argument("--prefill-tokens", nargs="+", type=int, default=[8192], help="prefill costs: padded tokens a forward")
    p.add_argument("--burst", action="store_true",
                   help="instead: `--rows` requests arriving one every --spacing-ms, gathered per --holds")
    p.add_argument("--spacing-ms", nargs="+", type=float, default=[0.3], help="burst: between two arrivals")
    p.add_argument("--holds", nargs="+", default=["0:0", f"{1e3 * BURST_GAP_S:g}:{1e3 * BURST_WAIT_S:g}"],
                   metavar="GAP:WAIT", help="burst: the scheduler's burst_gap_s and burst_wait_s, in ms (0:0: none)")
    return p


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [f"{flag}: {v}" for flag, vals in (("--rows", args.rows), ("--repeats", [args.repeats]),
                                              ("--context", [args.context]),
                                              ("--max-new-tokens", [args.max_new_tokens])) for v in vals if v < 1]
    if bad:
        print(f"python -m ddtree.profiling.round_overhead: error: {', '.join(bad)} out of range (allowed >= 1)",
              file=sys.stderr)
        return 2
    engine = device = codec = None
    if args.engine == "model":
        import torch

        from ddtree.engine import Engine
        from ddtree.text import load_tokenizer

        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        engine = Engine.from_pretrained(args.target, args.drafter, device=args.device)
        device, codec = engine.device, load_tokenizer(args.target)
    try:
        holds = [parse_hold(h) for h in args.holds]
    except ConfigError as err:
        print(f"python -m ddtree.profiling.round_overhead: error: {err}", file=sys.stderr)
        return 2
    if any(sp < 0 for sp in args.spacing_ms):
        print("python -m ddtree.profiling.round_overhead: error: --spacing-ms out of range (allowed >= 0)", file=sys.stderr)
        return 2
    on_gpu = getattr(device, "type", None) == "cuda"
    freeze_heap()  # as the engine process does once loaded: no full collection walks the start-up heap
    if args.prefill_costs:
        pass  # one line per prefill
    elif args.burst:
        print(f"{'config':20} {'rows':>4} {'mode':10} {'spacing, gap:wait':18} {'arrivals':>8} {'TTFT ms':>8} {'p90':>8} "
              f"{'last 1st':>9} {'span ms':>8}  groups, prefill ms")
    else:
        print(f"{'config':20} {'rows':>4} {'mode':20} {'period us':>10} {'round us':>9} {'excess us':>9} {'rounds':>6}")
    failed = []
    warms = {"no": [False], "yes": [True], "both": [False, True]}[args.warm] if engine is not None else [False]
    for config_id, warmed in [(c, w) for c in (args.configs if engine is not None else [args.engine]) for w in warms]:
        label = f"{config_id} warmed" if warmed else config_id
        for rows in args.rows:
            if args.prefill_costs and rows != max(args.rows):
                continue  # one batch of the most rows: every size is prefilled on it
            if args.engine == "zero":
                batch: Any = ZeroBatch(rows)
                prompts = [[1]] * rows
            elif args.engine == "emulated":
                from ddtree.profiling.emulated import EmulatedBatch
                from ddtree.config import SpecConfig

                batch = EmulatedBatch(SpecConfig.from_id("ar"), rows, args.context + args.max_new_tokens,
                                      args.round_ms / 1e3, args.prefill_ms / 1e3, 1, args.prefill_token_us / 1e6)
                prompts = [[1 + (i + j) % 101 for j in range(args.context)] for i in range(rows)]
            else:
                from ddtree.bench.prompts import code_prompts
                from ddtree.config import SpecConfig

                try:
                    spec = SpecConfig.from_id(config_id)
                except ConfigError as err:
                    print(f"python -m ddtree.profiling.round_overhead: error: {err}", file=sys.stderr)
                    return 2
                slots = max(rows, args.batch_rows)
                batch = engine.open_batch(spec, slots, args.context + args.max_new_tokens + spec.max_nodes)
                if warmed:  # the server's graph warm-up first: every row bucket, largest first, and the prefills
                    warm = Scheduler(batch, slots, warm_token=next(t for t in range(engine.vocab_size)
                                                                    if t != engine.eos_token_id))
                    on_a_thread(warm._warm_up)
                prompts = code_prompts(codec, args.context, rows)
            requests = [Request(f"r{i}", list(p), args.max_new_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
            if args.prefill_costs:
                for c in on_a_thread(prefill_costs, batch, device, prompts, sorted(args.rows), args.prefill_tokens,
                                     args.repeats):
                    print(f"{label:20} prefill of {c['requests']:3} x {args.context} tokens, bound "
                          f"{c['prefill_tokens']:6}: {c['forwards']:2} forwards, {c['ms']:8.2f} ms", flush=True)
                continue
            if args.burst:
                results = run_bursts(batch, device, requests, [sp / 1e3 for sp in args.spacing_ms], holds,
                                     args.repeats, on_gpu)
                print_bursts(label, rows, results)
                if any(r["mismatched"] for r in results):
                    failed.append(f"{label} rows {rows}")
                continue
            modes = tuple(m for m in MODES if m == MODES[0] or m in args.modes)
            row = run_config(batch, device, requests, args.repeats, on_gpu, modes)
            for mode in modes:
                m = row[mode]
                excess = f"{m['excess_us']:9.1f}" if "excess_us" in m else f"{'':9}"
                print(f"{label:20} {rows:4} {mode:20} {m['period_us']:10.1f} {m['round_us']:9.1f} {excess} "
                      f"{m['rounds']:6.0f}", flush=True)
            if any(row["mismatched"].values()):
                failed.append(f"{label} rows {rows}")
    if failed:
        print(f"outputs differ between the modes: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
