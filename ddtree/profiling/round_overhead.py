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

How the same scheduler admits a burst of arrivals, and what a prefill costs: ddtree.profiling.burst.

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
from collections.abc import Callable
from typing import Any

from ddtree.engine import Request, StepOutput
from ddtree.errors import ConfigError
from ddtree.profiling.flags import (
    ToolParser,
    add_configs,
    add_context,
    add_device,
    add_max_new_tokens,
    add_models,
    add_repeats,
    resolve_device,
    tool_parser,
)
from ddtree.serving.engine_worker import Relay, freeze_heap
from ddtree.serving.scheduler import SWITCH_INTERVAL_S, Scheduler

MODES = ("in process", "served", "served, no overlap", "served, to a pipe")


class ZeroBatch:
    """The DecodeBatch protocol at no cost: one token per row per round, nothing else."""

    max_len = 1 << 30
    prefill_tokens: int | None = None
    forward_cost = 0
    graphs = None
    last_budget: int | None = None
    budget_rounds = budget_total = 0
    round_ahead = False

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

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        self._launched = False
        return self._emit(list(self.rows.values()), verify=True)

    def settle(self) -> list[StepOutput]:
        return []

    def clear(self) -> None:
        self.rows.clear()

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
    """A batch whose launch() does nothing and whose collect() is its whole step(): the scheduler then hands a
    round out before the next one runs."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch

    def launch(self) -> None:
        pass

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        return self._batch.step()

    def __getattr__(self, name: str) -> Any:
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


def sync_device(device: Any) -> None:
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
    budget = getattr(batch, "budget", None)  # a DecodeBatch's (ddtree.round_costs); other batches have none
    return budget.snapshot() if budget is not None else None


def restore_choice_state(batch: Any, state: tuple[Any, ...] | None) -> None:
    if state is not None:
        batch.budget.restore(state)


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
            sync_device(device)
            clock.reset()
            if mode == "in process":
                tokens = on_a_thread(in_process, batch, requests)
            else:
                tokens = served(StepOnly(batch) if mode == "served, no overlap" else batch, requests, on_gpu,
                                to_pipe=mode == "served, to a pipe")
            sync_device(device)
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


# -- the batch both round_overhead and burst drive -------------------------------------------------------
def add_batch_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose the batch (this tool's and ddtree.profiling.burst's)."""
    p.add_argument("--engine", choices=("model", "zero", "emulated"), default="model",
                   help="emulated: ddtree.profiling.emulated's batch (--round-ms, --prefill-ms, --prefill-token-us)")
    p.add_argument("--round-ms", type=float, default=1.0, help="emulated: a round's GIL-free wait")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="emulated: a prefill forward's fixed wait")
    p.add_argument("--prefill-token-us", type=float, default=0.0, help="emulated: a prefill's wait per padded token")
    add_models(p)
    add_configs(p, ["ar", "b8-k4-w2048-bs8", "bauto-k4-w2048-bs8"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 32], help="requests running together")
    add_context(p)
    add_max_new_tokens(p)
    add_repeats(p)
    p.add_argument("--batch-rows", type=int, default=0, help="model: slots of the batch (at least --rows; the server's: 32)")
    p.add_argument("--warm", choices=("no", "yes", "both"), default="no",
                   help="model: run the server's graph warm-up on the batch first (its captures, in its order); "
                        "both: each config on a fresh batch without, then on one with")
    add_device(p)


def check_batch_flags(args: argparse.Namespace) -> None:
    bad = [f"{flag}: {v}" for flag, vals in (("--rows", args.rows), ("--repeats", [args.repeats]),
                                              ("--context", [args.context]),
                                              ("--max-new-tokens", [args.max_new_tokens])) for v in vals if v < 1]
    if bad:
        raise ConfigError(f"{', '.join(bad)} out of range (allowed >= 1)")


# measure(label, rows, batch, device, prompts, requests, on_gpu) -> whether every output matched
Measure = Callable[[str, int, Any, Any, list[list[int]], list[Request], bool], bool]


def run_batches(args: argparse.Namespace, parser: ToolParser, row_counts: list[int], measure: Measure) -> int:
    """measure() on every batch the flags name: each config (or the batch of no model), without and/or with the
    server's warm-up, at each of `row_counts`; exit status 1 when a measure's outputs differed, 2 on a bad id."""
    engine = device = codec = None
    if args.engine == "model":
        from ddtree.engine import Engine
        from ddtree.text import load_tokenizer

        args.device = resolve_device(args.device)
        engine = Engine.from_pretrained(args.target, args.drafter, device=args.device)
        device, codec = engine.device, load_tokenizer(args.target)
    on_gpu = getattr(device, "type", None) == "cuda"
    freeze_heap()  # as the engine process does once loaded: no full collection walks the start-up heap
    failed = []
    warms = {"no": [False], "yes": [True], "both": [False, True]}[args.warm] if engine is not None else [False]
    for config_id, warmed in [(c, w) for c in (args.configs if engine is not None else [args.engine]) for w in warms]:
        label = f"{config_id} warmed" if warmed else config_id
        for rows in row_counts:
            if args.engine == "zero":
                batch: Any = ZeroBatch(rows)
                prompts = [[1]] * rows
            elif args.engine == "emulated":
                from ddtree.config import SpecConfig
                from ddtree.profiling.emulated import EmulatedBatch

                batch = EmulatedBatch(SpecConfig.from_id("ar"), rows, args.context + args.max_new_tokens,
                                      args.round_ms / 1e3, args.prefill_ms / 1e3, 1, args.prefill_token_us / 1e6)
                prompts = [[1 + (i + j) % 101 for j in range(args.context)] for i in range(rows)]
            else:
                from ddtree.bench.prompts import code_prompts
                from ddtree.config import SpecConfig

                try:
                    spec = SpecConfig.from_id(config_id)
                except ConfigError as err:
                    return parser.fail(err)
                slots = max(rows, args.batch_rows)
                batch = engine.open_batch(spec, slots, args.context + args.max_new_tokens + spec.max_nodes)
                if warmed:  # the server's graph warm-up first: every row bucket, largest first, and the prefills
                    warm = Scheduler(batch, slots, warm_token=next(t for t in range(engine.vocab_size)
                                                                    if t != engine.eos_token_id))
                    on_a_thread(warm.warm_up)
                prompts = code_prompts(codec, args.context, rows)
            requests = [Request(f"r{i}", list(p), args.max_new_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
            if not measure(label, rows, batch, device, prompts, requests, on_gpu):
                failed.append(f"{label} rows {rows}")
    if failed:
        print(f"outputs differ between the modes: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


# -- entry ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    add_batch_flags(p)
    p.add_argument("--modes", nargs="+", choices=MODES[1:], default=list(MODES[1:]), help="served modes timed beside in process")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_batch_flags(args)
    except ConfigError as err:
        return parser.fail(err)
    modes = tuple(m for m in MODES if m == MODES[0] or m in args.modes)

    def measure(label: str, rows: int, batch: Any, device: Any, prompts: list[list[int]], requests: list[Request],
                on_gpu: bool) -> bool:
        row = run_config(batch, device, requests, args.repeats, on_gpu, modes)
        for mode in modes:
            m = row[mode]
            excess = f"{m['excess_us']:9.1f}" if "excess_us" in m else f"{'':9}"
            print(f"{label:20} {rows:4} {mode:20} {m['period_us']:10.1f} {m['round_us']:9.1f} {excess} "
                  f"{m['rounds']:6.0f}", flush=True)
        return not any(row["mismatched"].values())

    print(f"{'config':20} {'rows':>4} {'mode':20} {'period us':>10} {'round us':>9} {'excess us':>9} {'rounds':>6}")
    return run_batches(args, parser, args.rows, measure)


if __name__ == "__main__":
    raise SystemExit(main())
