r"""Paired timing of a few configs in one cell: `python -m ddtree.profiling.paired`.

    python -m ddtree.profiling.paired --configs ar dflash-w2048-bs8 b4-k4-w2048-bs8 --context 1024 \
        --concurrency 1 --pairs 10 --device cuda --out paired.json

`python -m ddtree.profiling.engine_bench` runs each config's repeats back to back, so a drift of the machine between two
configs (clocks, a busy host) lands in their ratio. Here every round times one generate of each config in
turn (each round starting one config later, so no config always follows the same one), and the ratios
(speed-up over AR, efficiency = speed-up / tau) are taken within a round, then summarised as median, min
and max over the rounds: the spread says how far one number can be trusted. Every config first runs once
untimed (graph capture, compiles). Outputs must equal AR's at T = 0; the exit status is 1 when one does
not. At most ddtree.engine.POOLED_BATCHES configs, AR included: each keeps its batch (and CUDA graphs)
alive across the rounds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import torch

from ddtree.config import SpecConfig
from ddtree.engine import POOLED_BATCHES, Engine
from ddtree.errors import ConfigError
from ddtree.profiling.engine_bench import Cell, cell_prompts, check_prompt_source, skip_reason
from ddtree.profiling.flags import (
    add_configs,
    add_context,
    add_device,
    add_dtype,
    add_max_new_tokens,
    add_models,
    add_out,
    check_positive,
    parse_configs,
    resolve_device,
    tool_parser,
    torch_dtype,
)


def _timed_generate(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new_tokens: int,
                    ) -> tuple[float, list[list[int]], list[int], list[int]]:
    """(output tok/s, outputs, accepted lengths, tree sizes) of one generate, the device synchronised around
    the clock."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens, spec=spec, ignore_eos=True)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    return (tokens / wall, [r.token_ids for r in results], [a for r in results for a in r.accept_lengths],
            [b for r in results for b in r.budgets])


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_pairs(engine: Engine, prompts: list[list[int]], specs: list[SpecConfig], max_new_tokens: int,
              pairs: int) -> list[dict[str, Any]]:
    """One untimed generate per config, then `pairs` rounds of one timed generate per config (round r starts
    at config r mod n: a config that warms or slows the device for the next does not always precede the
    same one); a row per config with tok/s, tau, and the in-round speed-up and efficiency against AR (the
    first config; its first timed outputs are the reference)."""
    for spec in specs:
        engine.generate(prompts, max_new_tokens, spec=spec, ignore_eos=True)
    speed: dict[str, list[float]] = {s.id: [] for s in specs}
    accepts: dict[str, list[int]] = {s.id: [] for s in specs}
    sizes: dict[str, list[int]] = {s.id: [] for s in specs}  # tree size per row and round (budget auto's vary)
    mismatched: dict[str, set[int]] = {s.id: set() for s in specs}
    reference: list[list[int]] | None = None
    for round_ in range(pairs):
        start = round_ % len(specs)
        for spec in specs[start:] + specs[:start]:
            tps, outputs, accepted, built = _timed_generate(engine, prompts, spec, max_new_tokens)
            reference = outputs if reference is None else reference  # round 0 starts with AR
            speed[spec.id].append(tps)
            accepts[spec.id] += accepted
            sizes[spec.id] += built
            mismatched[spec.id] |= {i for i, out in enumerate(outputs) if out != reference[i]}
        print(f"  [round {round_ + 1}/{pairs}] " + ", ".join(f"{s.id} {speed[s.id][-1]:.1f}" for s in specs) + " tok/s",
              flush=True)
    ar = speed[specs[0].id]
    rows = []
    for spec in specs:
        tau = statistics.fmean(accepts[spec.id]) if accepts[spec.id] else 1.0
        speedups = [t / a for t, a in zip(speed[spec.id], ar)]
        rows.append({"config": spec.id, "tok_per_s": _spread(speed[spec.id]), "tau": tau,
                     "tree_size": statistics.fmean(sizes[spec.id]) if sizes[spec.id] else None,
                     "tree_sizes": dict(sorted(Counter(sizes[spec.id]).items())),
                     "speedup": _spread(speedups), "efficiency": _spread([s / tau for s in speedups]),
                     "tok_per_s_rounds": speed[spec.id], "lossless": not mismatched[spec.id],
                     "mismatched_prompts": sorted(mismatched[spec.id])})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = f"{'config':22} {'tok/s median':>12} {'min':>9} {'max':>9} {'tau':>5} {'size':>5} {'speed-up':>8} " \
           f"{'eff median':>10} {'min':>5} {'max':>5}  lossless"
    lines = [head]
    for r in rows:
        t, s, e = r["tok_per_s"], r["speedup"], r["efficiency"]
        size = f"{r['tree_size']:5.1f}" if r.get("tree_size") is not None else f"{'-':>5}"
        lines.append(f"{r['config']:22} {t['median']:12.1f} {t['min']:9.1f} {t['max']:9.1f} {r['tau']:5.2f} {size} "
                     f"{s['median']:8.2f} {e['median']:10.3f} {e['min']:5.3f} {e['max']:5.3f}  "
                     f"{'yes' if r['lossless'] else 'NO'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    add_models(p)
    add_configs(p, ["ar", "dflash-w2048-bs8", "b4-k4-w2048-bs8"],
                help="config ids; AR is added first when missing (every ratio is against it)")
    add_context(p)
    p.add_argument("--concurrency", type=int, default=1, help="prompts decoded together")
    p.add_argument("--pairs", type=int, default=10, help="timed rounds (each times every config once)")
    add_max_new_tokens(p)
    add_device(p)
    add_dtype(p)
    add_out(p, "JSON file of the rows and every round's tok/s")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    try:  # every argument is checked before a model is loaded
        specs = parse_configs(args.configs)
        for flag, value in (("--context", args.context), ("--concurrency", args.concurrency),
                            ("--pairs", args.pairs), ("--max-new-tokens", args.max_new_tokens)):
            check_positive(flag, [value])
        if len(specs) > POOLED_BATCHES:
            raise ConfigError(f"--configs: {len(specs)} configs (AR included) is out of range (allowed 1..{POOLED_BATCHES}: "
                              "each keeps its batch and graphs alive across the rounds)")
        check_prompt_source(args.target)
        engine = Engine.from_pretrained(args.target, args.drafter, device=args.device, dtype=torch_dtype(args.dtype))
        cell = Cell(args.context, args.concurrency)
        reason = skip_reason(engine, cell, args.max_new_tokens)
        if reason:
            raise ConfigError(reason)
        prompts = cell_prompts(args.target, cell)
        if not prompts:
            raise ConfigError(f"--context: no held-out file of {args.context}+ tokens under {args.target}")
    except ConfigError as err:
        return parser.fail(err)
    rows = run_pairs(engine, prompts, specs, args.max_new_tokens, args.pairs)
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    print(f"context {args.context}, concurrency {args.concurrency}, {args.pairs} rounds, {name}\n{format_rows(rows)}")
    if args.out:
        meta = {"command": shlex.join(["python", "-m", "ddtree.profiling.paired", *argv]), "device_name": name,
                "torch": torch.__version__, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "context": args.context, "concurrency": args.concurrency, "pairs": args.pairs,
                "max_new_tokens": args.max_new_tokens}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    bad = [r["config"] for r in rows if not r["lossless"]]
    if bad:
        print(f"NOT LOSSLESS against AR at T=0: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
