"""Acceptance and speed of AR, DFLASH and DDTREE side by side on held-out code, in one process.

    python -m ddtree.profiling.acceptance --target fixtures/models/target --drafter fixtures/models/drafter \
        --configs dflash-w2048-bs8 b8-k4-w2048-bs8 --prompts 8 --context 256 --max-new-tokens 96

Prompts are cut from the held-out code files (the target's training manifest names them) to an
exact token length; every config runs on the same prompts with the same engine, and each output is
checked against AR's (lossless at T = 0). Prints how certain the target is of its own greedy tokens along
AR's path (their probabilities, from the engine's log-probs), then one line per config, and can write JSON.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import Engine
from ddtree.profiling.flags import (
    add_configs,
    add_context,
    add_device,
    add_max_new_tokens,
    add_models,
    add_out,
    resolve_device,
    tool_parser,
)
from ddtree.text import load_tokenizer

# The fixture model card's table: the DFlash chain, and DDTREE at (budget, topk) = (4,4), (8,4), (12,6),
# (16,4), each with window 2048 and none, at the trained block 8 and with the drafter run at block 16.
DEFAULT_CONFIGS = [f"dflash-w{w}-bs{bs}" for bs in (8, 16) for w in (2048, "none")] + [
    f"b{b}-k{k}-w{w}-bs{bs}" for bs in (8, 16) for w in (2048, "none") for b, k in ((4, 4), (8, 4), (12, 6), (16, 4))
]


def heldout_files(target_dir: Path, stdlib_root: Path | None = None) -> list[Path]:
    """The held-out stdlib files named in the target's model card, resolved against stdlib_root (None:
    this Python's stdlib; another Python's lacks some of them, so a copy of the card's can be named)."""
    card = (target_dir / "README.md").read_text()
    line = next((ln for ln in card.splitlines() if ln.startswith("- Held out")), "")
    names = [n.strip() for n in line.split(":", 1)[-1].split(",") if n.strip().endswith(".py")]
    root = Path(stdlib_root) if stdlib_root is not None else Path(sysconfig.get_paths()["stdlib"])
    return [root / n for n in names if (root / n).is_file()]


def heldout_prompts(target_dir: Path, count: int, context: int, stdlib_root: Path | None = None,
                    per_file: int = 1) -> list[list[int]]:
    """`count` prompts of exactly `context` tokens: each file's first window, then (per_file > 1) the
    next non-overlapping windows of the files long enough, one round over the files at a time."""
    codec = load_tokenizer(target_dir)
    if codec is None:
        raise SystemExit(f"{target_dir}: no tokenizer.json")
    if per_file < 1:
        raise SystemExit(f"--per-file: {per_file} is out of range (allowed >= 1)")
    files = [codec.encode(path.read_text(encoding="utf-8", errors="replace"))
             for path in heldout_files(target_dir, stdlib_root)]
    prompts: list[list[int]] = []
    for r in range(per_file):
        for ids in files:
            start = r * context
            if start + context < len(ids) and len(prompts) < count:  # one token left over: AR has a next token
                prompts.append(ids[start : start + context])
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} held-out prompts of {context} tokens (wanted {count})")
    return prompts


def source_prompts(args: argparse.Namespace) -> list[list[int]]:
    """--source-dir's prompts, checked before a model loads."""
    from ddtree.bench.prompts import code_prompts
    from ddtree.errors import ConfigError

    codec = load_tokenizer(args.target)
    if codec is None:
        raise SystemExit(f"{args.target}: no tokenizer.json")
    try:
        return code_prompts(codec, args.context, args.prompts, args.source_dir)
    except ConfigError as err:
        raise SystemExit(f"--source-dir: {err}") from err


def greedy_confidence(logprobs: list[float]) -> dict[str, float]:
    """The target's probability of its own greedy choice along its path: how predictable what a drafter has to
    guess is (a flat target caps any drafter's acceptance; a confident one leaves the gap to the drafter)."""
    p = torch.tensor(logprobs, dtype=torch.float64).exp()
    return {"median": p.median().item(), "mean": p.mean().item(), "share_over_0.9": (p > 0.9).double().mean().item()}


def measure(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new_tokens: int,
            batch: int, logprobs: bool = False) -> dict:
    engine.generate(prompts[0], 4, spec=spec, ignore_eos=True)  # warm-up, left out of the timing
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(prompts), batch):
        out = engine.generate(prompts[i : i + batch], max_new_tokens, spec=spec, ignore_eos=True,
                              return_logprob=logprobs)
        results.extend(out)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(len(r.accept_lengths) for r in results)
    row = {
        "config_id": spec.id,
        "tau": sum(sum(r.accept_lengths) for r in results) / rounds if rounds else 1.0,
        "tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "outputs": [r.token_ids for r in results],
    }
    if logprobs:
        row["greedy_p"] = greedy_confidence([lp for r in results for lp in r.logprobs])
    return row


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    add_models(p)
    add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--prompts", type=int, default=8)
    add_context(p)
    add_max_new_tokens(p)
    # the fixture model card's acceptance table was measured at 256 prompt tokens and 96 new ones
    p.set_defaults(context=256, max_new_tokens=96)
    p.add_argument("--batch", type=int, default=8, help="prompts per engine.generate call")
    add_device(p)
    add_out(p, "write the results as JSON here")
    p.add_argument("--stdlib-root", type=Path, default=None,
                   help="where the card's held-out files are (default: this Python's stdlib)")
    p.add_argument("--per-file", type=int, default=1, help="at most this many non-overlapping prompts per file")
    p.add_argument("--source-dir", type=Path, default=None,
                   help="cut the prompts from this folder's .py files instead (ddtree.bench.prompts.code_prompts: "
                        "consecutive windows of the sorted files): other code than the held-out files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.device = resolve_device(args.device)

    prompts = source_prompts(args) if args.source_dir is not None else heldout_prompts(
        args.target, args.prompts, args.context, args.stdlib_root, args.per_file)
    engine = Engine.from_pretrained(args.target, args.drafter, device=args.device)
    ar = measure(engine, prompts, SpecConfig(algorithm=Algorithm.NONE), args.max_new_tokens, args.batch, logprobs=True)
    rows = [ar]
    conf = ar["greedy_p"]
    print(f"the target's probability of its greedy token: median {conf['median']:.3f}, mean {conf['mean']:.3f}, "
          f"> 0.9 at {conf['share_over_0.9']:.0%} of {ar['tokens']} tokens")
    print(f"{'config':22} {'tau':>6} {'tok/s':>8} {'vs AR':>6}  lossless")
    print(f"{'ar':22} {1.0:6.2f} {ar['tok_per_s']:8.1f} {1.0:6.2f}  -")
    for config_id in args.configs:
        spec = SpecConfig.from_id(config_id)
        row = measure(engine, prompts, spec, args.max_new_tokens, args.batch)
        row["lossless"] = row["outputs"] == ar["outputs"]
        rows.append(row)
        print(f"{spec.id:22} {row['tau']:6.2f} {row['tok_per_s']:8.1f} "
              f"{row['tok_per_s'] / ar['tok_per_s']:6.2f}  {row['lossless']}", flush=True)
    if args.out:
        summary = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
        meta = {"prompts": args.prompts, "context": args.context, "max_new_tokens": args.max_new_tokens,
                "source": str(args.source_dir) if args.source_dir is not None else "held-out files",
                "device": args.device, "batch": args.batch, "per_file": args.per_file, "drafter": str(args.drafter)}
        args.out.write_text(json.dumps({"meta": meta, "results": summary}, indent=2))
    return 0 if all(r.get("lossless", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
