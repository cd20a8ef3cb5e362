"""`ddtree train ...`: build the corpus, the tokenizer, the target and the drafter from local files.

    ddtree train corpus    --out DATA [--vocab-size 4096]     documents, tokenizer.json, token arrays
    ddtree train tokenizer --corpus DATA --out FILE           only the tokenizer
    ddtree train encode    --corpus DATA [--tokenizer FILE]   only the token arrays
    ddtree train target    --data DATA --out DIR [...]
    ddtree train drafter   --data DATA --target DIR --out DIR [...]
    ddtree train all       --data DATA --out DIR --device cuda --time-budget-s N   target, then drafter
    ddtree train rollouts  --data DATA --target DIR --out DIR [--num N --gen-len G ...]   the target's greedy rollouts
    ddtree train distill   --data DATA --target DIR --out DIR --device cuda --time-budget-s N
                           rollouts (a share of the budget), then a drafter trained on them

The GPU host runs another Python whose stdlib differs, so `corpus` runs here and only DATA's
token arrays, tokenizer.json and manifest.json travel; `target`, `drafter` and `all` read only those.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ddtree.errors import ConfigError, DDTreeError

TARGET_DEFAULTS = {"batch_size": 16, "seq_len": 4096, "lr": 3e-3}
DRAFTER_DEFAULTS = {"batch_size": 16, "seq_len": 4096, "lr": 2e-3}


def _add_train_options(p: argparse.ArgumentParser, defaults: dict[str, float]) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=100_000, help="optimiser steps (an upper bound when --time-budget-s is set)")
    g.add_argument("--batch-size", type=int, default=int(defaults["batch_size"]))
    g.add_argument("--seq-len", type=int, default=int(defaults["seq_len"]))
    g.add_argument("--lr", type=float, default=defaults["lr"])
    g.add_argument("--warmup-steps", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--time-budget-s", type=float, default=None, help="stop cleanly and save when this much wall time is used")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--eval-batches", type=int, default=4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true", help="torch.compile the model being trained")


def _add_target_shape(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target shape")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g.add_argument("--max-position-embeddings", type=int, default=8192)


def _add_drafter_shape(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafter shape")
    g.add_argument("--draft-layers", type=int, default=2)
    g.add_argument("--draft-intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--window", type=int, default=2048)
    g.add_argument("--num-anchors", type=int, default=64)
    g.add_argument("--gamma", type=float, default=4.0)
    g.add_argument("--soft-weight", type=float, default=0.0,
                   help="share of the loss that is KL to the target's distribution (0: hard labels only)")
    g.add_argument("--target-layer-ids", default=None, help="comma-separated tap layers (default: z-lab's spread)")
    g.add_argument("--init", choices=("random", "target"), default="random")
    g.add_argument("--init-from", default=None, help="start from this drafter folder (fine-tuning)")
    g.add_argument("--label", choices=("target", "data"), default="target",
                   help="block labels: the target's argmax (self-distillation) or the data's next tokens")


def _add_rollout_spec(p: argparse.ArgumentParser, num_default: int, batch_flag: str) -> None:
    g = p.add_argument_group("rollouts")
    g.add_argument("--num", "--rollouts-num", dest="num", type=int, default=num_default,
                   help="sequences to generate (an upper bound when a time budget applies)")
    g.add_argument("--prompt-len-min", type=int, default=32)
    g.add_argument("--prompt-len-max", type=int, default=1024)
    g.add_argument("--gen-len", type=int, default=128, help="greedy tokens generated per prompt")
    g.add_argument(batch_flag, dest="rollout_batch_size", type=int, default=256, help="prompts per engine batch")
    g.add_argument("--prompt-lengths", choices=("per-batch", "per-sequence"), default="per-batch",
                   help="draw a prompt length per engine batch (no padding), or per sequence (batches of "
                        "neighbouring lengths, right-padded, run in random order)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("corpus", help="build documents, tokenizer and token arrays from local files")
    c.add_argument("--out", required=True)
    c.add_argument("--vocab-size", type=int, default=4096)
    c.add_argument("--heldout-percent", type=float, default=3.0)
    c.add_argument("--gate-repeat", type=int, default=64)
    c.add_argument("--gate-file", default=None)
    c.add_argument("--max-stdlib-files", type=int, default=None)
    c.add_argument("--max-file-bytes", type=int, default=200_000)
    c.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    c.add_argument("--no-tokenize", action="store_true", help="stop after writing the documents")

    t = sub.add_parser("tokenizer", help="train the byte-level BPE on a corpus folder")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=4096)

    e = sub.add_parser("encode", help="tokenize a corpus folder into train/held-out token arrays")
    e.add_argument("--corpus", required=True)
    e.add_argument("--tokenizer", default=None)

    tg = sub.add_parser("target", help="train the target")
    tg.add_argument("--data", required=True)
    tg.add_argument("--out", required=True)
    _add_train_options(tg, TARGET_DEFAULTS)
    _add_target_shape(tg)

    d = sub.add_parser("drafter", help="train a DFlash drafter for a trained target")
    d.add_argument("--data", required=True)
    d.add_argument("--target", required=True)
    d.add_argument("--out", required=True)
    _add_train_options(d, DRAFTER_DEFAULTS)
    _add_drafter_shape(d)

    d.add_argument("--rollouts", default=None, help="a folder written by `ddtree train rollouts`")
    d.add_argument("--rollout-share", type=float, default=0.8, help="share of each batch's rows taken from the rollouts")

    r = sub.add_parser("rollouts", help="the target's greedy continuations of random training windows")
    r.add_argument("--data", required=True)
    r.add_argument("--target", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--time-budget-s", type=float, default=None, help="stop between batches and save what exists")
    _add_rollout_spec(r, 4096, "--batch-size")

    ds = sub.add_parser("distill", help="rollouts of the target, then a drafter trained on them, in one budget")
    ds.add_argument("--data", required=True)
    ds.add_argument("--target", required=True)
    ds.add_argument("--out", required=True, help="writes OUT/drafter (and OUT/rollouts unless --rollouts-dir)")
    ds.add_argument("--rollouts-dir", default=None, help="where the rollouts go (default OUT/rollouts)")
    ds.add_argument("--rollouts-budget-share", type=float, default=0.25,
                    help="share of --time-budget-s spent generating rollouts")
    ds.add_argument("--rollout-share", type=float, default=0.8, help="share of each batch's rows taken from the rollouts")
    _add_rollout_spec(ds, 1_000_000, "--rollout-batch-size")
    _add_train_options(ds, DRAFTER_DEFAULTS)
    _add_drafter_shape(ds)
    ds.set_defaults(seq_len=None)  # None: prompt_len_max + gen_len, so one rollout fills a row

    a = sub.add_parser("all", help="train the target, then the drafter, splitting one time budget")
    a.add_argument("--data", default=None, help="corpus folder (default OUT/data; built here if it has no token arrays)")
    a.add_argument("--out", required=True, help="writes OUT/target and OUT/drafter")
    a.add_argument("--target-share", type=float, default=0.6, help="share of the time budget for the target")
    a.add_argument("--drafter-lr", type=float, default=DRAFTER_DEFAULTS["lr"])
    _add_train_options(a, TARGET_DEFAULTS)
    _add_target_shape(a)
    _add_drafter_shape(a)
    return parser


def _train_options(args: argparse.Namespace, **override: object) -> object:
    from ddtree.train.loop import TrainOptions

    fields: dict[str, object] = {
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
        "device": args.device, "time_budget_s": args.time_budget_s, "log_every": args.log_every,
        "eval_batches": args.eval_batches, "seed": args.seed, "compile": args.compile,
    }
    fields.update(override)
    return TrainOptions(**fields)  # type: ignore[arg-type]


def _target_shape(args: argparse.Namespace) -> object:
    from ddtree.train.target import TargetShape

    return TargetShape(
        hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate_size,
        rope_theta=args.rope_theta, max_position_embeddings=args.max_position_embeddings,
    )


def _drafter_shape(args: argparse.Namespace) -> object:
    from ddtree.train.drafter import DrafterShape

    ids = None
    if args.target_layer_ids:
        try:
            ids = tuple(int(x) for x in args.target_layer_ids.split(","))
        except ValueError as err:
            raise ConfigError(f"--target-layer-ids: {args.target_layer_ids!r} is not a comma-separated list of ints") from err
    return DrafterShape(
        num_hidden_layers=args.draft_layers, block_size=args.block_size, window=args.window,
        num_anchors=args.num_anchors, gamma=args.gamma, soft_weight=args.soft_weight, target_layer_ids=ids, init=args.init,
        init_from=args.init_from, intermediate_size=args.draft_intermediate_size,
    )


def _has_arrays(data: Path) -> bool:
    return all((data / n).exists() for n in ("manifest.json", "tokenizer.json", "train_tokens.npy", "heldout_tokens.npy"))


def cmd_corpus(args: argparse.Namespace) -> None:
    from ddtree.train.corpus import TOKENIZER, CorpusSpec, build_corpus, encode_corpus
    from ddtree.train.tokenizer import train_corpus_tokenizer

    out = Path(args.out)
    spec = CorpusSpec(
        heldout_percent=args.heldout_percent, gate_repeat=args.gate_repeat, gate_file=args.gate_file,
        max_stdlib_files=args.max_stdlib_files, max_file_bytes=args.max_file_bytes,
    )
    t0 = time.perf_counter()
    m = build_corpus(out, spec)
    print(f"[corpus] {len(m['stdlib_files'])} stdlib files ({m['stdlib_bytes']:,} bytes), "
          f"{len(m['heldout_files'])} held out, {m['humaneval_problems']} HumanEval problems, "
          f"gate {len(m['gate_ids'])} x {m['gate_repeat']} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if args.no_tokenize:
        return
    tok_path = Path(args.tokenizer) if args.tokenizer else out / TOKENIZER
    if not args.tokenizer:
        train_corpus_tokenizer(out, tok_path, vocab_size=args.vocab_size)
        print(f"[corpus] tokenizer trained: vocabulary {args.vocab_size} -> {tok_path} ({time.perf_counter() - t0:.0f}s)", flush=True)
    elif tok_path.resolve() != (out / TOKENIZER).resolve():
        (out / TOKENIZER).write_bytes(tok_path.read_bytes())
    m = encode_corpus(out, out / TOKENIZER)
    sizes = {n: (out / n).stat().st_size for n in ("train_tokens.npy", "heldout_tokens.npy")}
    print(f"[corpus] {m['train_tokens']:,} train tokens ({sizes['train_tokens.npy'] / 2**20:.1f} MiB), "
          f"{m['heldout_tokens']:,} held-out tokens ({sizes['heldout_tokens.npy'] / 2**20:.1f} MiB) "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)


def _rollout_spec(args: argparse.Namespace, time_budget_s: float | None) -> object:
    from ddtree.train.rollouts import RolloutSpec

    return RolloutSpec(
        num=args.num, prompt_len_min=args.prompt_len_min, prompt_len_max=args.prompt_len_max, gen_len=args.gen_len,
        batch_size=args.rollout_batch_size, seed=args.seed, time_budget_s=time_budget_s,
        prompt_lengths=args.prompt_lengths,
    )


def cmd_distill(args: argparse.Namespace, command: str) -> None:
    from ddtree.train.drafter import train_drafter
    from ddtree.train.rollouts import make_rollouts

    if not 0.0 < args.rollouts_budget_share < 1.0:
        raise ConfigError(f"--rollouts-budget-share: {args.rollouts_budget_share} is outside (0, 1)")
    out = Path(args.out)
    roll_dir = Path(args.rollouts_dir) if args.rollouts_dir else out / "rollouts"
    budget = args.time_budget_s
    spec = _rollout_spec(args, None if budget is None else budget * args.rollouts_budget_share)
    start = time.perf_counter()
    make_rollouts(args.data, args.target, roll_dir, spec, device=args.device, command=command)  # type: ignore[arg-type]
    left = None if budget is None else budget - (time.perf_counter() - start)
    if left is not None and left < 10:
        raise ConfigError(f"--time-budget-s: {budget} left {left:.0f}s for the drafter; raise it or lower "
                          "--rollouts-budget-share")
    seq_len = args.seq_len or args.prompt_len_max + args.gen_len
    d_opts = _train_options(args, time_budget_s=left, seq_len=seq_len)
    train_drafter(args.data, args.target, out / "drafter", d_opts, _drafter_shape(args), command=command,  # type: ignore[arg-type]
                  rollouts_dir=roll_dir, rollout_share=args.rollout_share, label=args.label)
    print(f"[distill] done in {time.perf_counter() - start:.0f}s: {out / 'drafter'}", flush=True)


def cmd_all(args: argparse.Namespace, command: str) -> None:
    from ddtree.train.drafter import train_drafter
    from ddtree.train.target import train_target

    if not 0.0 < args.target_share < 1.0:
        raise ConfigError(f"--target-share: {args.target_share} is outside (0, 1)")
    out = Path(args.out)
    data = Path(args.data) if args.data else out / "data"
    if not _has_arrays(data):
        print(f"[all] {data} has no token arrays; building the corpus from this interpreter's stdlib", flush=True)
        cmd_corpus(build_parser().parse_args(["corpus", "--out", str(data)]))
    start = time.perf_counter()
    budget = args.time_budget_s
    t_opts = _train_options(args, time_budget_s=None if budget is None else budget * args.target_share)
    train_target(data, out / "target", t_opts, _target_shape(args), command=command)  # type: ignore[arg-type]
    left = None if budget is None else budget - (time.perf_counter() - start)
    if left is not None and left < 10:
        raise ConfigError(f"--time-budget-s: {budget} left {left:.0f}s for the drafter; raise it or lower --target-share")
    d_opts = _train_options(args, time_budget_s=left, lr=args.drafter_lr)
    train_drafter(data, out / "target", out / "drafter", d_opts, _drafter_shape(args), command=command,  # type: ignore[arg-type]
                  label=args.label)
    print(f"[all] done in {time.perf_counter() - start:.0f}s: {out / 'target'}, {out / 'drafter'}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = "ddtree train " + shlex.join(argv)
    try:
        if args.command == "corpus":
            cmd_corpus(args)
        elif args.command == "tokenizer":
            from ddtree.train.tokenizer import train_corpus_tokenizer

            tok = train_corpus_tokenizer(args.corpus, args.out, vocab_size=args.vocab_size)
            print(f"[tokenizer] vocabulary {tok.get_vocab_size()} -> {args.out}", flush=True)
        elif args.command == "encode":
            from ddtree.train.corpus import encode_corpus

            m = encode_corpus(args.corpus, args.tokenizer)
            print(f"[encode] {m['train_tokens']:,} train tokens, {m['heldout_tokens']:,} held-out tokens", flush=True)
        elif args.command == "target":
            from ddtree.train.target import train_target

            train_target(args.data, args.out, _train_options(args), _target_shape(args), command=command)  # type: ignore[arg-type]
        elif args.command == "drafter":
            from ddtree.train.drafter import train_drafter

            train_drafter(args.data, args.target, args.out, _train_options(args), _drafter_shape(args), command=command,  # type: ignore[arg-type]
                          rollouts_dir=args.rollouts, rollout_share=args.rollout_share, label=args.label)
        elif args.command == "rollouts":
            from ddtree.train.rollouts import make_rollouts

            make_rollouts(args.data, args.target, args.out, _rollout_spec(args, args.time_budget_s),  # type: ignore[arg-type]
                          device=args.device, command=command)
        elif args.command == "distill":
            cmd_distill(args, command)
        elif args.command == "all":
            cmd_all(args, command)
    except DDTreeError as err:
        print(f"ddtree train {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0
