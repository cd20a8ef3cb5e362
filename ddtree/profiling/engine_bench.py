r"""The engine-level benchmark: AR, DFLASH and DDTREE side by side, in one process, per (context, batch) cell.

    python -m ddtree.profiling.engine_bench --target fixtures/models/target --drafter fixtures/models/drafter \
        --concurrency 1 8 32 --contexts 60 1024 4096 --max-new-tokens 128 --repeats 3 --device cuda \
        --out results.json --markdown engine_bench.md

    # verify cost against tree size and batch on a random ~1B target (fits one 10-minute GPU call)
    python -m ddtree.profiling.engine_bench --shape 1b --random-model-dir /tmp/ddtree-random --device cuda \
        --configs ar dflash-w2048-bs8 b8-k4-w2048-bs8 b16-k4-w2048-bs8 b32-k8-w2048-bs8 b64-k8-w2048-bs8 \
        bauto-k4-w2048-bs8 --contexts 1024 4096 --concurrency 1 8 32 --max-new-tokens 64 --repeats 2 \
        --out engine_bench_1b.json --markdown engine_bench_1b.md

Every config of a cell decodes the same `concurrency` prompts (held-out code cut to `context` tokens,
tiled when there are fewer long-enough files) in one `Engine.generate` batch: one warm-up generate,
left out, then `repeats` timed runs (the device is synchronised before each clock read), median wall.
A row reports output tok/s, tau (mean accepted length per round), the speed-up over AR in the same
cell, efficiency = speed-up / tau, the round time split from the engine's stage timers (and the mean
round in ms), host syncs per round (CUDA: torch's sync debug mode over a few rounds) and, for an auto
budget, the mean chosen tree size. Every output must equal AR's at T = 0 ("lossless"); the exit
status is 1 when one does not. `--shape 1b` benchmarks a random-weight ~1B pair instead (built once
by ddtree.profiling.random_models): there only the timings mean something.

Not here: the HTTP service sweep (ddtree.suite) and acceptance over prompt sets (ddtree.profiling.acceptance).
On CUDA the timed runs do not synchronise between stages; the round split comes from one extra run
with the engine's stage profiling on (a device sync at every stage boundary; with CUDA graphs each
stage is then its own graph). `--cuda-graphs off` / `--attention sdpa` measure the eager paths.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ddtree.config import SpecConfig
from ddtree.engine import ATTENTION_BACKENDS, Engine, GenerationResult, Request
from ddtree.errors import ConfigError
from ddtree.profiling.acceptance import heldout_files, heldout_prompts
from ddtree.profiling.flags import (
    FIXTURE_TARGET,
    add_concurrency,
    add_configs,
    add_contexts,
    add_device,
    add_dtype,
    add_max_new_tokens,
    add_models,
    add_out,
    add_repeats,
    check_positive,
    parse_configs,
    resolve_device,
    tool_parser,
    torch_dtype,
)
from ddtree.profiling.hbm import copy_bandwidth, floors_ms, step_bytes
from ddtree.profiling.random_models import SHAPES, build_random_pair, parameter_count, random_models
from ddtree.profiling.syncs import round_syncs

DEFAULT_RANDOM_DIR = Path.home() / ".cache" / "ddtree" / "random-models"
# AR, the DFlash chain, DDTREE over budget x topk at window 2048 / block 8, and the auto budget.
DEFAULT_CONFIGS = ["ar", "dflash-w2048-bs8",
                   *[f"b{b}-k{k}-w2048-bs8" for b in (4, 8, 12, 16, 32, 64) for k in (4, 8)],
                   "bauto-k4-w2048-bs8"]
ROUND_STAGES = ("draft", "build", "verify", "walk", "compact")


@dataclass(frozen=True)
class Cell:
    context: int  # prompt tokens
    concurrency: int  # prompts decoded together in one batch


@cache
def _distinct_prompts(target_dir: Path, want: int, context: int) -> tuple[tuple[int, ...], ...]:
    """Up to `want` held-out prompts of exactly `context` tokens, one per file (fewer if files run out)."""
    count = min(want, len(heldout_files(target_dir)))
    while count >= 1:
        try:  # heldout_prompts exits when the files run short; ask for fewer
            return tuple(tuple(p) for p in heldout_prompts(target_dir, count, context))
        except SystemExit:
            count //= 2
    return ()


def cell_prompts(target_dir: Path, cell: Cell) -> list[list[int]]:
    """`cell.concurrency` prompts of `cell.context` tokens, tiling the distinct ones; [] if there are none."""
    distinct = _distinct_prompts(Path(target_dir), cell.concurrency, cell.context)
    return [list(distinct[i % len(distinct)]) for i in range(cell.concurrency)] if distinct else []


def check_prompt_source(target_dir: Path) -> None:
    """The prompts come from the held-out files named in the target's card, tokenized by its tokenizer."""
    if not (target_dir / "tokenizer.json").is_file():
        raise ConfigError(f"--target: {target_dir} has no tokenizer.json (the prompts are tokenized with it)")
    if not (target_dir / "README.md").is_file() or not heldout_files(target_dir):
        raise ConfigError(f"--target: {target_dir}/README.md names no held-out file of this Python's stdlib "
                          "(a '- Held out ...: a.py, b.py' line, as the fixture cards have)")


def skip_reason(engine: Engine, cell: Cell, max_new_tokens: int) -> str | None:
    """Why a cell cannot run on this engine, or None."""
    need = cell.context + max_new_tokens
    if need > engine.max_context:
        return (f"context {cell.context} + max_new_tokens {max_new_tokens} = {need} exceeds the model's "
                f"context length ({engine.max_context})")
    return None


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure_config(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new_tokens: int,
                   repeats: int, warmup_tokens: int) -> dict[str, Any]:
    """One warm-up generate (left out), then `repeats` timed ones; the row's numbers and every output."""
    # graphed engines reuse a batch whose cache is long enough: warm up on the timed length so the
    # timed runs replay graphs instead of capturing them
    warm = max_new_tokens if engine.cuda_graphs else min(warmup_tokens, max_new_tokens)
    engine.generate(prompts, warm, spec=spec, ignore_eos=True)
    walls: list[float] = []
    runs: list[list[GenerationResult]] = []
    for _ in range(repeats):
        _sync(engine)
        t0 = time.perf_counter()
        results = engine.generate(prompts, max_new_tokens, spec=spec, ignore_eos=True)
        _sync(engine)
        walls.append(time.perf_counter() - t0)
        runs.append(results)
    wall = statistics.median(walls)
    tokens = sum(len(r.token_ids) for r in runs[0])
    accepts = [a for results in runs for r in results for a in r.accept_lengths]
    budgets = [b for results in runs for r in results for b in r.budgets]
    # The timed runs do not synchronise per stage (on CUDA that would slow every round); one more,
    # profiled run gives the round split. A batch's timings are its totals.
    if engine.device.type == "cuda":
        if engine.cuda_graphs:  # profiling graphs each stage separately: capture them outside the timing
            engine.generate(prompts, max_new_tokens, spec=spec, ignore_eos=True, profile=True)
        split_runs = [engine.generate(prompts, max_new_tokens, spec=spec, ignore_eos=True, profile=True)]
    else:
        split_runs = runs  # the CPU's stage clocks are exact without extra syncs
    stage = {s: sum(results[0].timings.get(s, 0.0) for results in split_runs) / len(split_runs) * repeats
             for s in (*ROUND_STAGES, "prefill")}
    round_total = sum(stage[s] for s in ROUND_STAGES)
    rounds = max(max(len(r.accept_lengths) for r in runs[0]), 1) if spec.speculative else max_new_tokens - 1
    return {
        # the timed runs' wall less the profiled prefill, per round (per AR step): what a round costs as served
        "step_ms": 1000 * max(wall - stage["prefill"] / repeats, 0.0) / rounds,
        "config": spec.id,
        "algorithm": spec.algorithm.value,
        "tokens": tokens,
        "wall_s": wall,
        "wall_s_runs": walls,
        "tok_per_s": tokens / wall if wall > 0 else 0.0,
        "tau": sum(accepts) / len(accepts) if accepts else 1.0,
        "mean_budget": sum(budgets) / len(budgets) if budgets else None,
        # budget auto decides from this table: keep it with the row so a choice can be checked later
        "cost_model": engine.budget_cost_model(spec, len(prompts)).to_dict() if spec.auto_budget else None,
        "prefill_s": stage["prefill"] / repeats,
        "share": {s: (stage[s] / round_total if round_total > 0 else 0.0) for s in ROUND_STAGES},
        # the profiled run's mean round (every stage synchronised: exact device time per stage)
        "round_ms": {s: 1000 * stage[s] / repeats / rounds for s in ROUND_STAGES},
        "syncs_per_round": measure_syncs(engine, prompts, spec, max_new_tokens),
        "outputs": [[r.token_ids for r in results] for results in runs],
    }


def measure_syncs(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new_tokens: int) -> float | None:
    """Host syncs per decode round on CUDA (None elsewhere): a few rounds of this cell's batch, counted
    with torch's sync debug mode after the graphs are captured."""
    if engine.device.type != "cuda" or max_new_tokens < 48:
        return None
    longest = max(len(p) for p in prompts)
    batch = engine.pooled_batch(spec, len(prompts), longest + max_new_tokens + spec.max_nodes, None)
    try:
        batch.add_many([Request(str(i), p, max_new_tokens, ignore_eos=True) for i, p in enumerate(prompts)])
        counts = round_syncs(batch, rounds=3, warmup_rounds=2)
        return sum(counts) / len(counts)
    finally:
        batch.clear()


def bench_cell(engine: Engine, prompts: list[list[int]], specs: list[SpecConfig], cell: Cell,
               max_new_tokens: int, repeats: int, warmup_tokens: int,
               bandwidth: float | None = None) -> list[dict[str, Any]]:
    """Every config on the cell's prompts; AR (specs[0]) first, each row compared with it. bandwidth (bytes/s,
    ddtree.profiling.hbm): each row also gets its HBM floor (floor_ms) beside its step time."""
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    ar_tps = 0.0
    for spec in specs:
        row = measure_config(engine, prompts, spec, max_new_tokens, repeats, warmup_tokens)
        engine.release_pooled()  # a 1B pair's batch at 32 x 4096 holds ~11 GB of KV cache
        outputs = row.pop("outputs")
        if reference is None:  # AR: the reference output and speed of this cell
            reference, ar_tps = outputs[0], row["tok_per_s"]
        mismatched = sorted({i for run in outputs for i, out in enumerate(run) if out != reference[i]})
        speedup = row["tok_per_s"] / ar_tps if ar_tps > 0 else 0.0
        row.update(context=cell.context, concurrency=cell.concurrency, speedup=speedup,
                   efficiency=speedup / row["tau"], lossless=not mismatched, mismatched_prompts=mismatched)
        if bandwidth:  # the HBM floor of this row's step: AR reads the target, a round the drafter too
            floors = floors_ms(step_bytes(engine, cell.concurrency, cell.context), bandwidth)
            row["floor_ms"] = floors["round" if spec.speculative else "ar"]
        rows.append(row)
        floor = f"  step {row['step_ms']:.3f} ms (floor {row['floor_ms']:.3f})" if "floor_ms" in row else ""
        print(f"  [ctx {cell.context} x {cell.concurrency}] {row['config']:22} {row['tok_per_s']:9.1f} tok/s  "
              f"tau {row['tau']:5.2f}  x{speedup:5.2f}{floor}  {'lossless' if row['lossless'] else 'MISMATCH'}",
              flush=True)
    return rows


# -- output --------------------------------------------------------------------------------------
_COLUMNS = ("config", "tok/s", "tau", "speed-up", "eff", "budget", "round ms", "step ms", "floor ms",
            *[f"{s}%" for s in ROUND_STAGES], "syncs", "lossless")


def _cells(row: dict[str, Any]) -> list[str]:
    budget = "-" if row["mean_budget"] is None else f"{row['mean_budget']:.1f}"
    shares = [f"{100 * row['share'][s]:.0f}" for s in ROUND_STAGES]
    round_ms = sum(row.get("round_ms", {}).values())
    syncs = row.get("syncs_per_round")
    step = f"{row['step_ms']:.3f}" if "step_ms" in row else "-"
    floor = f"{row['floor_ms']:.3f}" if row.get("floor_ms") is not None else "-"
    return [row["config"], f"{row['tok_per_s']:.1f}", f"{row['tau']:.2f}", f"{row['speedup']:.2f}",
            f"{row['efficiency']:.2f}", budget, f"{round_ms:.2f}", step, floor, *shares,
            "-" if syncs is None else f"{syncs:.1f}", "yes" if row["lossless"] else "NO"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """An aligned text table of one cell's rows."""
    table = [list(_COLUMNS), *[_cells(r) for r in rows]]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in table)


def format_markdown(report: dict[str, Any]) -> str:
    """Every cell as a markdown table, ready for docs/perf.md."""
    meta = report["meta"]
    lines = [f"Engine benchmark: {meta['shape_label']}; {meta['device_name']}, torch {meta['torch']}, "
             f"{meta['dtype']}, attention {meta.get('attention', 'sdpa')}, CUDA graphs "
             f"{'on' if meta.get('cuda_graphs') else 'off'}, norms {'folded' if meta.get('norms_folded') else 'unfolded'}, "
             f"{meta['max_new_tokens']} new tokens, median of "
             f"{meta['repeats']}, {meta['date']}."
             + (f" Floors: the bytes a step reads (weights, KV) over a {meta['copy_gbps']:.0f} GB/s copy bandwidth."
                if meta.get("copy_gbps") else ""),
             "", f"`{meta['command']}`", ""]
    for context, concurrency in sorted({(r["context"], r["concurrency"]) for r in report["rows"]}):
        rows = [r for r in report["rows"] if (r["context"], r["concurrency"]) == (context, concurrency)]
        lines += [f"#### context {context}, concurrency {concurrency}", "", "| " + " | ".join(_COLUMNS) + " |",
                  "|" + "|".join("---" if i == 0 else "---:" for i in range(len(_COLUMNS))) + "|"]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
        lines.append("")
    lines += [f"Skipped: context {s['context']} x {s['concurrency']}: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines).rstrip() + "\n"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# -- entry ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    add_models(p, help_suffix=" (--shape fixture)")
    p.add_argument("--shape", default="fixture", choices=["fixture", *SHAPES],
                   help="fixture: the --target/--drafter pair; 1b (or tiny): a random-weight pair of that shape")
    p.add_argument("--random-model-dir", type=Path, default=DEFAULT_RANDOM_DIR,
                   help="where random-weight pairs are built once and reused (one subfolder per shape)")
    p.add_argument("--in-memory", action="store_true",
                   help="build the random-weight pair on the device instead of a folder (8b: 16 GB not written)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="random pairs: the drafter's depth (default: the shape's, 2)")
    p.add_argument("--floors", default="auto", choices=["auto", "on", "off"],
                   help="HBM floor beside each row (a measured copy bandwidth; auto: on CUDA)")
    add_configs(p, DEFAULT_CONFIGS)
    add_concurrency(p, [1, 8, 32])
    add_contexts(p, [60, 1024, 4096])
    add_max_new_tokens(p)
    add_repeats(p)
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each warm-up generate")
    add_device(p)
    add_dtype(p)
    p.add_argument("--attention", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="verify attention: auto = the Triton tree-attention kernel on CUDA, SDPA on CPU")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="capture rounds as CUDA graphs (auto: on CUDA with the kernel attention)")
    p.add_argument("--fold-norms", default="auto", choices=["auto", "on", "off"],
                   help="the target's layer norms multiplied into its GEMMs (auto: 16-bit CUDA targets at real width)")
    add_out(p, "JSON file of every row (rewritten after each cell)")
    p.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    try:  # everything checkable is checked before a model is loaded
        specs = parse_configs(args.configs)
        check_positive("--concurrency", args.concurrency)
        check_positive("--contexts", args.contexts)
        check_positive("--max-new-tokens", [args.max_new_tokens])
        check_positive("--repeats", [args.repeats])
        check_positive("--warmup-tokens", [args.warmup_tokens])
    except ConfigError as err:
        return parser.fail(err)

    target_dir, drafter_dir = args.target, args.drafter
    shape_label = f"fixture pair ({target_dir.name})"
    graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
    fold = {"auto": None, "on": True, "off": False}[args.fold_norms]
    in_memory = None
    if args.shape != "fixture" and (args.in_memory or args.draft_layers is not None):
        # the pair's prompts come from the fixture tokenizer it shares
        target_dir, drafter_dir = FIXTURE_TARGET, None
        in_memory = random_models(args.shape, device=args.device, dtype=torch_dtype(args.dtype) or torch.bfloat16,
                                  draft_layers=args.draft_layers)
        n = sum(p.numel() for p in in_memory[0].parameters())
        print(f"random-weight {args.shape} pair built in memory on {args.device}", flush=True)
    elif args.shape != "fixture":
        folder = args.random_model_dir / args.shape
        print(f"random-weight {args.shape} pair: {folder} (built once)", flush=True)
        target_dir, drafter_dir = build_random_pair(folder, args.shape, device=args.device)
        n = parameter_count(folder)
    if args.shape != "fixture":
        size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
        layers = f", {args.draft_layers}-layer drafter" if args.draft_layers is not None else ""
        shape_label = (f"{args.shape}: RANDOM WEIGHTS, {size}-parameter target{layers} (acceptance means nothing; "
                       "timings only)")
    try:
        check_prompt_source(target_dir)
        if in_memory is not None:
            engine = Engine(*in_memory, attention=args.attention, cuda_graphs=graphs, fold_norms=fold)
        else:
            engine = Engine.from_pretrained(target_dir, drafter_dir, device=args.device, dtype=torch_dtype(args.dtype),
                                            attention=args.attention, cuda_graphs=graphs, fold_norms=fold)
    except ConfigError as err:
        return parser.fail(err)
    del in_memory
    floors = args.floors == "on" or (args.floors == "auto" and engine.device.type == "cuda")
    bandwidth = copy_bandwidth(engine.device) if floors else None
    dtype = str(next(engine.target.parameters()).dtype).removeprefix("torch.")
    report: dict[str, Any] = {
        "meta": {
            "device": str(engine.device), "device_name": _device_name(engine.device), "torch": torch.__version__,
            "dtype": dtype, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "ddtree.profiling.engine_bench", *argv]), "shape": args.shape,
            "shape_label": shape_label, "target": str(target_dir), "drafter": str(drafter_dir),
            "configs": [s.id for s in specs], "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "warmup_tokens": args.warmup_tokens, "attention": engine.attention, "cuda_graphs": engine.cuda_graphs,
            "norms_folded": engine.norms_folded,
            "copy_gbps": None if bandwidth is None else bandwidth / 1e9,
        },
        "rows": [], "skipped": [],
    }
    print(f"{shape_label}; {report['meta']['device_name']}, {dtype}; {len(specs)} configs", flush=True)
    for context in args.contexts:
        for concurrency in args.concurrency:
            cell = Cell(context, concurrency)
            reason = skip_reason(engine, cell, args.max_new_tokens)
            prompts = [] if reason else cell_prompts(target_dir, cell)
            if not reason and not prompts:
                reason = f"no held-out file of {context}+ tokens under {target_dir}"
            if reason:
                print(f"skip context {context} x {concurrency}: {reason}", flush=True)
                report["skipped"].append({"context": context, "concurrency": concurrency, "reason": reason})
                continue
            rows = bench_cell(engine, prompts, specs, cell, args.max_new_tokens, args.repeats, args.warmup_tokens,
                              bandwidth)
            report["rows"] += rows
            print(f"\ncontext {context}, concurrency {concurrency}\n{format_table(rows)}\n", flush=True)
            _write(args, report)
    _write(args, report)
    bad = [f"{r['config']} (context {r['context']} x {r['concurrency']})" for r in report["rows"] if not r["lossless"]]
    if bad:
        print(f"NOT LOSSLESS against AR at T=0: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(format_markdown(report))


if __name__ == "__main__":
    raise SystemExit(main())
