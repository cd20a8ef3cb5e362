r"""The engine at real model width: HBM floors, kernel profiles of an AR step and a verify step, kernel
variants side by side, engine rounds by tree size, and transformers' own Qwen3 as the peer.

    python -m ddtree.profiling.real_width --shapes 1b 8b --device cuda --out-dir /tmp/real_width

RANDOM WEIGHTS: the pairs come from ddtree.profiling.random_models, built in memory on the device (an 8b
folder would be 16 GB to write and read back); only timings mean something. Per shape:

1. The floor: the bytes a step must read (the target's weights, and the KV cache at the context) over a
   measured device-to-device copy bandwidth (bytes read + written per second, as the device's own ceiling).
2. GEMMs at the shape's projections and rows 1 / 9 / 32: cuBLAS, cuBLASLt and the fused Triton kernel at a
   few tilings (ddtree.kernels.fused_linear), each a CUDA graph over enough weight copies to miss the L2.
3. The target's forward alone, captured as a CUDA graph (q = 1: an AR step; q = 9: a b8 verify), at batch 1
   and 32 over a cached context: replay times for each kernel variant (VARIANTS), and for the default one
   the profiler's kernel times inside the replays, grouped by kind, per step and per layer.
4. Engine rounds (DecodeBatch.step, graphed, its one host sync included): AR and b8-k4 at batch 1 per
   variant, and at batch 32 the round time by tree size; round / AR step beside the floors.
5. The peer: the same shape as transformers' Qwen3ForCausalLM (sdpa, bfloat16): `generate` with a static
   cache, eager (transformers would compile that forward on CUDA by default; `--peer-compile` times that
   too, after minutes of compiling at 8b), and one decode step captured as a CUDA graph where that works.

Writes real_width.json (every number) and real_width.md (the tables) under --out-dir after each part.
On the CPU (tests) the same code runs eagerly on tiny shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddtree.config import SpecConfig
from ddtree.engine import Engine, Request
from ddtree.kernels import residual_norm
from ddtree.kernels.fused_linear import fused_linear_triton
from ddtree.kernels.skinny_gemm import Tiles, skinny_linear, skinny_linear_reference
from ddtree.models import layers
from ddtree.models import target as target_module
from ddtree.profiling.flags import add_context, add_device, resolve_device, tool_parser
from ddtree.profiling.hbm import copy_bandwidth, step_bytes
from ddtree.profiling.kernel_profile import Replay, free_memory, kernel_table, sync_device
from ddtree.profiling.peer import peer_part
from ddtree.profiling.random_models import SHAPES, random_drafter, random_models

# name -> (fused add+norm and SwiGLU kernels, rows up to which linears run the skinny Triton GEMM, its tiles,
# BLAS, norms and residual adds inside the skinny GEMMs; off, the layers keep their add + norm kernels).
# "fused, skinny gemm" is the engine's default (models.layers.GEMV_MAX_ROWS, target.NORMS_IN_SKINNY_GEMMS).
VARIANTS: dict[str, tuple[bool, int, Tiles | None, str, bool]] = {
    "torch ops": (False, 0, None, "cublas", True),
    "fused": (True, 0, None, "cublas", True),
    "fused, cublaslt": (True, 0, None, "cublaslt", True),
    "fused, skinny gemm": (True, 16, None, "cublas", False),
    "fused, skinny gemm, norms inside": (True, 16, None, "cublas", True),
    "fused, skinny gemm, norms folded": (True, 16, None, "cublas", False),
}
FOLDED_VARIANTS = {"fused, skinny gemm, norms folded"}  # the target's norms folded into its GEMMs (fold_norms)
DEFAULT_VARIANT = "fused, skinny gemm"
# (block_n, block_k, num_warps) tried for the Triton kernel at few rows; None = its own choice
TILINGS: list[tuple[int, int, int] | None] = [None, (64, 128, 4), (32, 128, 4), (16, 256, 4), (64, 256, 8)]
# the skinny kernel's tilings tried at few rows (None = choose_tiles); --skinny-sweep adds SKINNY_SWEEP
SKINNY_TILINGS: list[Tiles | None] = [None]
SKINNY_SWEEP: list[Tiles] = [Tiles(block_n=bn, block_k=bk, split=sp, stages=st, warps=4)
                             for bn in (32, 64, 128) for bk in (128, 256) for sp in (1, 2, 4, 8) for st in (4,)]
SKINNY_SWEEP += [Tiles(block_n=64, block_k=128, split=sp, stages=st, warps=4) for sp in (2, 4) for st in (3, 6)]
SKINNY_SWEEP += [Tiles(block_n=bn, block_k=bk, split=sp, stages=st, warps=w)
                 for bn, bk in ((64, 256), (128, 128)) for sp in (1, 2, 3) for st in (3, 5) for w in (4, 8)]
L2_MISS_BYTES = 256 << 20  # weight copies per GEMM timing add up to at least this (the H200's L2 is 60 MB)
TREE_CONFIGS = ["b4-k4-w2048-bs8", "b8-k4-w2048-bs8", "b16-k4-w2048-bs8", "b32-k8-w2048-bs8", "b64-k8-w2048-bs8"]


@contextlib.contextmanager
def variant(name: str, device: torch.device, target: Any = None) -> Iterator[None]:
    """The target's kernels as VARIANTS[name] says, restored afterwards (a folded variant folds `target`'s norms,
    then puts its weights back bit for bit)."""
    fused, gemv_rows, tiles, blas, into_gemms = VARIANTS[name]
    folds = name in FOLDED_VARIANTS
    if folds and target is None:
        raise ValueError(f"variant: {name!r} folds the target's norms; pass the target")
    saved = (residual_norm.ENABLED, layers.GEMV_MAX_ROWS, layers.GEMV_TILES, target_module.NORMS_IN_SKINNY_GEMMS)
    saved_blas = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    residual_norm.ENABLED, layers.GEMV_MAX_ROWS, layers.GEMV_TILES = fused, gemv_rows, tiles
    target_module.NORMS_IN_SKINNY_GEMMS = into_gemms
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(blas)
    kept = target.fold_norms(keep=True) if folds else None
    try:
        yield
    finally:
        if kept is not None:
            target.unfold_norms(kept)
        residual_norm.ENABLED, layers.GEMV_MAX_ROWS, layers.GEMV_TILES, target_module.NORMS_IN_SKINNY_GEMMS = saved
        if saved_blas is not None:
            torch.backends.cuda.preferred_blas_library(saved_blas)


# -- the parts -------------------------------------------------------------------------------------
def projections(engine: Engine) -> list[tuple[str, int, int]]:
    """(name, K, N) of the target's GEMMs: fused q/k/v, o, fused gate/up, down, the head."""
    c = engine.target.config
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return [("qkv", c.hidden_size, qkv), ("o", c.num_attention_heads * c.head_dim, c.hidden_size),
            ("gate_up", c.hidden_size, 2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size),
            ("lm_head", c.hidden_size, c.vocab_size)]


def gemm_bench(engine: Engine, bw: float, rows: tuple[int, ...] = (1, 9, 32)) -> list[dict[str, Any]]:
    """Each projection at each row count: cuBLAS, cuBLASLt and the Triton kernel's tilings (ms, GB/s read)."""
    device, dtype = engine.device, engine.target.dtype
    out = []
    for name, k, n in projections(engine):
        nbytes = k * n * dtype.itemsize
        copies = max(2, -(-L2_MISS_BYTES // nbytes)) if device.type == "cuda" else 1
        weights = [torch.empty(n, k, dtype=dtype, device=device).normal_(0, 0.02) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, dtype=dtype, device=device)
            row: dict[str, Any] = {"gemm": name, "k": k, "n": n, "rows": m, "floor_ms": 1000 * nbytes / bw, "ms": {}}
            cands = _gemm_candidates(x, weights, triton_tiles=m <= 16 and dtype != torch.float32
                                     and device.type == "cuda", swiglu=name == "gate_up")
            expected = skinny_linear_reference(x, weights[0], swiglu=True) if name == "gate_up" else None
            for label, fn in cands.items():
                try:
                    replay = _blas_replay(fn, label, device)
                    row["ms"][label] = replay.time(10) / copies
                    if label.startswith("skinny"):  # a tiling that computes the wrong product is no candidate
                        want = expected if expected is not None else F.linear(x, weights[0])
                        err = (replay.out[0].float() - want.float()).abs().max().item()
                        row.setdefault("max_abs_err", {})[label] = err
                        if not err <= 0.05 * max(want.float().abs().max().item(), 1e-3):
                            raise AssertionError(f"max |error| {err:.3g}")
                except Exception as err:  # a tiling the compiler refuses is a row entry, not a stop
                    row["ms"][label] = None
                    row.setdefault("errors", {})[label] = repr(err)[:200]
            best = min((v, k_) for k_, v in row["ms"].items() if v is not None)
            row["best"] = best[1]
            out.append(row)
            shown = sorted(((v, lab) for lab, v in row["ms"].items() if v is not None and lab.startswith("skinny")))[:3]
            shown += [(row["ms"][lab], lab) for lab in ("cublas", "cublaslt") if row["ms"].get(lab) is not None]
            failed = f", {len(row.get('errors', {}))} failed" if row.get("errors") else ""
            print(f"  gemm {name:8} K {k:6} N {n:6} rows {m:3}: " + "  ".join(
                f"{lab} {v * 1000:.1f}us" for v, lab in shown) + f"  (floor {row['floor_ms'] * 1000:.1f}us{failed})",
                  flush=True)
        del weights
    return out


def _gemm_candidates(x: torch.Tensor, weights: list[torch.Tensor], triton_tiles: bool,
                     swiglu: bool = False) -> dict[str, Callable[[], Any]]:
    """label -> x @ w.T over every weight copy: cuBLAS, cuBLASLt (chosen at capture), the fused_linear
    tilings and the skinny kernel's (which, for gate/up, includes SwiGLU's product, as the target runs it)."""
    def blas() -> list[torch.Tensor]:
        return [F.linear(x, w) for w in weights]

    def tiled(tiles: tuple[int, int, int] | None) -> Callable[[], Any]:
        bn, bk, nw = tiles or (None, None, 4)
        return lambda: [fused_linear_triton(x, w, block_n=bn, block_k=bk, num_warps=nw) for w in weights]

    def skinny(tiles: Tiles | None) -> Callable[[], Any]:
        return lambda: [skinny_linear(x, w, swiglu=swiglu, tiles=tiles) for w in weights]

    cands: dict[str, Callable[[], Any]] = {"cublas": blas, "cublaslt": blas}
    if triton_tiles:
        for tiles in TILINGS:
            cands["triton " + ("default" if tiles is None else "{}x{}/{}w".format(*tiles))] = tiled(tiles)
        for sk in SKINNY_TILINGS:
            cands["skinny " + ("auto" if sk is None else sk.label)] = skinny(sk)
    return cands


def _blas_replay(fn: Callable[[], Any], label: str, device: torch.device) -> Replay:
    """Capture fn with cuBLAS or cuBLASLt preferred when the label names one (the choice is read at call time)."""
    if device.type != "cuda" or label not in ("cublas", "cublaslt"):
        return Replay(fn, device)
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(label)
    try:
        return Replay(fn, device)
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


def forward_step(engine: Engine, bs: int, q: int, context: int) -> Callable[[], Any]:
    """One target forward of q tokens per row over a cached random context (q = 1: an AR step; q > 1: a
    verify of a q-token chain, with the drafter's taps), writing K/V past the context and never advancing."""
    target = engine.target
    cache = target.new_cache(bs, context + q)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.fill_(context)
    gen = torch.Generator(device=engine.device).manual_seed(bs * 1000 + q)
    ids = torch.randint(0, engine.vocab_size, (bs, q), device=engine.device, generator=gen)
    pos = (context + torch.arange(q, device=engine.device))[None].expand(bs, q).contiguous()
    taps = engine.tap_layers if q > 1 else None

    def run() -> Any:
        return target.forward(ids, pos, cache, tap_layers=taps, attention=engine.attention)

    run.cache = cache  # type: ignore[attr-defined]  # kept alive with the closure
    return run


def forward_part(engine: Engine, context: int, batches: list[int], variants: list[str],
                 profile_variants: list[str]) -> list[dict[str, Any]]:
    """The target's forward (AR step, b8 verify) per batch and variant: replay ms; kernel tables where asked."""
    rows = []
    for bs in batches:
        for q in (1, 9):
            for name in variants:
                with variant(name, engine.device, engine.target), torch.inference_mode():
                    replay = Replay(forward_step(engine, bs, q, context), engine.device)
                    row: dict[str, Any] = {"bs": bs, "q": q, "variant": name, "ms": replay.time()}
                    if name in profile_variants:
                        row["profile"] = kernel_table(replay, engine.device)
                        if not row["profile"]["kernels"]:  # no kernels seen inside the replay: profile it eagerly
                            row["profile"] = kernel_table(replay.fn, engine.device)
                            row["profile"]["eager"] = True
                del replay
                free_memory(engine.device)
                rows.append(row)
                print(f"  forward bs {bs:2} q {q}: {name:20} {row['ms']:.3f} ms", flush=True)
    return rows


def engine_rounds(engine: Engine, config: str, bs: int, context: int, steps: int = 12, warmup: int = 4,
                  profile: bool = False) -> dict[str, Any]:
    """Median ms of a graphed engine round (DecodeBatch.step: the round's graph and its one host sync)."""
    spec = SpecConfig.from_id(config)
    new = (warmup + steps + 8) * max(spec.block_size, 1)
    # one round per step(), each read back before the next starts (run ahead, step() would time its host part)
    batch = engine.open_batch(spec, bs, max_len=context + new + spec.max_nodes + 8, run_ahead=False)
    gen = torch.Generator().manual_seed(bs)
    prompts = torch.randint(0, engine.vocab_size, (bs, context), generator=gen).tolist()
    with torch.inference_mode():
        batch.add_many([Request(str(i), p, new, ignore_eos=True) for i, p in enumerate(prompts)])
        for _ in range(warmup):
            batch.step()
        times = []
        for _ in range(steps):
            sync_device(engine.device)
            t0 = time.perf_counter()
            batch.step()
            times.append(1000 * (time.perf_counter() - t0))
        out: dict[str, Any] = {"config": spec.id, "bs": bs, "ms": statistics.median(times), "ms_runs": times}
        if profile:
            out["profile"] = kernel_table(batch.step, engine.device, steps=3)
    batch.clear()
    del batch
    free_memory(engine.device)
    return out


def rounds_part(engine: Engine, context: int, batches: list[int], variants: list[str],
                tree_configs: list[str], profile_variant: str) -> list[dict[str, Any]]:
    rows = []
    for name in variants:
        with variant(name, engine.device, engine.target):
            for bs in batches:
                configs = ["ar", "b8-k4-w2048-bs8"] if (name != profile_variant or bs == 1) else ["ar", *tree_configs]
                for config in configs:
                    r = engine_rounds(engine, config, bs, context, profile=name == profile_variant and bs == 1)
                    r["variant"] = name
                    rows.append(r)
                    print(f"  round {name:20} bs {bs:2} {config:18} {r['ms']:.3f} ms", flush=True)
    return rows


# -- report ----------------------------------------------------------------------------------------
def format_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"{meta['device_name']}, torch {meta['torch']}, {meta['date']}, context {meta['context']}; copy "
             f"bandwidth {meta['copy_gbps']:.0f} GB/s (read + write). RANDOM WEIGHTS.", "", f"`{meta['command']}`", ""]
    for shape, part in report["shapes"].items():
        lines += [f"### {shape}: {part['label']}", ""]
        if "bytes" not in part:  # the peer only
            lines += [f"Peer: {json.dumps(part.get('peer', part.get('errors')))}", ""]
            continue
        b = part["bytes"]["1"]
        lines += [f"Target weights {b['target_weights'] / 1e9:.2f} GB (floor {part['floor_ms']['target_1']:.3f} ms); "
                  f"drafter + shared head {b.get('drafter_weights', 0) / 1e9:.2f} GB; KV at batch 1 "
                  f"{b['target_kv'] / 1e6:.0f} MB, at 32 {part['bytes']['32']['target_kv'] / 1e9:.2f} GB.", ""]
        if part.get("forward"):
            lines += ["| batch | q | variant | forward ms | floor ms (weights + KV) | x floor |", "|---:|---:|---|---:|---:|---:|"]
            for r in part["forward"]:
                fl = part["floor_ms"][f"target_kv_{r['bs']}"]
                lines.append(f"| {r['bs']} | {r['q']} | {r['variant']} | {r['ms']:.3f} | {fl:.3f} | {r['ms'] / fl:.2f} |")
            lines.append("")
            for r in part["forward"]:
                if "profile" in r:
                    lines += _profile_md(r, part["layers"])
        if part.get("rounds"):
            lines += ["| variant | batch | config | round ms | / AR step | floor ms |", "|---|---:|---|---:|---:|---:|"]
            ar = {(r["variant"], r["bs"]): r["ms"] for r in part["rounds"] if r["config"] == "ar"}
            for r in part["rounds"]:
                key = "target_kv_" if r["config"] == "ar" else "round_kv_"
                fl = part["floor_ms"].get(f"{key}{r['bs']}", float("nan"))
                lines.append(f"| {r['variant']} | {r['bs']} | {r['config']} | {r['ms']:.3f} | "
                             f"{r['ms'] / ar[(r['variant'], r['bs'])]:.3f} | {fl:.3f} |")
            lines.append("")
        if part.get("gemm"):
            labels = sorted({k for r in part["gemm"] for k in r["ms"]})
            lines += ["| gemm | K | N | rows | floor us | " + " | ".join(labels) + " |",
                      "|---|---:|---:|---:|---:|" + "---:|" * len(labels)]
            for r in part["gemm"]:
                cells = [("-" if r["ms"].get(k) is None else f"{1000 * r['ms'][k]:.1f}") for k in labels]
                lines.append(f"| {r['gemm']} | {r['k']} | {r['n']} | {r['rows']} | {1000 * r['floor_ms']:.1f} | "
                             + " | ".join(cells) + " |")
            lines.append("")
        if part.get("peer"):
            lines += [f"Peer (transformers {part['peer'].get('transformers', '?')}, Qwen3ForCausalLM, sdpa): "
                      + json.dumps({k: v for k, v in part["peer"].items() if k != "transformers"}), ""]
    return "\n".join(lines) + "\n"


def _profile_md(row: dict[str, Any], n_layers: int) -> list[str]:
    prof = row["profile"]
    lines = [f"Kernels of the batch-{row['bs']} q={row['q']} forward ({row['variant']}): {prof['launches']:.0f} launches, "
             f"{prof['total_us']:.0f} us of kernels in a {1000 * row['ms']:.0f} us replay.", "",
             "| kind | launches | us / step | us / layer | share |", "|---|---:|---:|---:|---:|"]
    for kind, k in sorted(prof["kinds"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"| {kind} | {k['launches']:.0f} | {k['us']:.1f} | {k['us'] / n_layers:.2f} | "
                     f"{100 * k['us'] / max(prof['total_us'], 1e-9):.0f}% |")
    return lines + [""]


def _guarded(part: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one part; a failure is recorded in the report (and printed) and the next part still runs."""
    try:
        fn()
    except Exception as err:  # one call on a lent device: keep what the other parts measure
        import traceback

        part.setdefault("errors", {})[name] = traceback.format_exc()[-1500:]
        print(f"  {name} FAILED: {err!r}", flush=True)


def _peer_into(part: dict[str, Any], shape: str, device: torch.device, dtype: torch.dtype, context: int,
               compiled: bool) -> None:
    part["peer"] = peer_part(shape, device, dtype, context, compiled=compiled)


def _run_part(name: str, part: dict[str, Any], engine: Engine, args: argparse.Namespace, shape: str) -> None:
    if name == "gemm":
        part["gemm"] = gemm_bench(engine, part["bandwidth"], rows=tuple(args.gemm_rows))
    elif name == "forward":
        profiled = [args.default_variant, "torch ops"] if "torch ops" in args.variants else [args.default_variant]
        part["forward"] = forward_part(engine, args.context, args.batches, args.variants, profiled)
    else:
        part["rounds"] = rounds_part(engine, args.context, args.batches, args.variants, TREE_CONFIGS,
                                     args.default_variant)
        target = engine.target
        for layers_ in args.draft_layers[1:]:  # extra drafter depths: AR and b8-k4 at batch 1
            engine.drafter = None
            free_memory(engine.device)
            other = Engine(target, random_drafter(target, shape, draft_layers=layers_), fold_norms=False)
            with variant(args.default_variant, engine.device):
                for config in ("ar", "b8-k4-w2048-bs8"):
                    r = engine_rounds(other, config, 1, args.context)
                    r["variant"] = f"{args.default_variant}, {layers_}-layer drafter"
                    part["rounds"].append(r)
                    print(f"  round {r['variant']} bs 1 {config} {r['ms']:.3f} ms", flush=True)
            del other


# -- entry -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    add_device(p)
    add_context(p)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--default-variant", choices=list(VARIANTS),
                   help="the variant profiled and run over every tree size (one of --variants; default: "
                        f"{DEFAULT_VARIANT!r} when listed, else the first)")
    p.add_argument("--parts", nargs="+", default=["gemm", "forward", "rounds", "peer"],
                   choices=["gemm", "forward", "rounds", "peer"])
    p.add_argument("--draft-layers", nargs="+", type=int, default=[2],
                   help="drafter depths; the first is the main one, others add AR / b8-k4 rows at batch 1")
    p.add_argument("--peer-compile", action="store_true",
                   help="also time the peer's generate with its forward torch.compiled (transformers' default "
                        "for a static cache on CUDA; minutes of compiling at 8b)")
    p.add_argument("--skinny-sweep", action="store_true",
                   help="time the skinny kernel at every SKINNY_SWEEP tiling in the gemm part (a tuning run)")
    p.add_argument("--gemm-rows", nargs="+", type=int, default=[1, 9, 32],
                   help="the row counts the gemm part times each projection at")
    p.add_argument("--out-dir", type=Path, default=Path("real_width"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.default_variant is None:
        args.default_variant = DEFAULT_VARIANT if DEFAULT_VARIANT in args.variants else args.variants[0]
    elif args.default_variant not in args.variants:
        parser.error(f"--default-variant {args.default_variant!r} is not among --variants {args.variants}; add it there")
    if args.skinny_sweep:
        SKINNY_TILINGS[:] = [None, *SKINNY_SWEEP]
    device = torch.device(resolve_device(args.device))
    dtype = torch.bfloat16
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(device)
    report: dict[str, Any] = {"meta": {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m ddtree.profiling.real_width", *argv]), "context": args.context,
        "copy_gbps": bw / 1e9}, "shapes": {}}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    def write() -> None:
        (args.out_dir / "real_width.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out_dir / "real_width.md").write_text(format_markdown(report))

    for shape in args.shapes:
        if not set(args.parts) - {"peer"}:  # the peer alone: no pair of ours to build
            report["shapes"][shape] = part = {"label": "the peer only", "layers": SHAPES[shape].layers}
            _guarded(part, "peer", functools.partial(_peer_into, part, shape, device, dtype, args.context,
                                                         args.peer_compile))
            write()
            continue
        target, drafter = random_models(shape, device=device, dtype=dtype, draft_layers=args.draft_layers[0])
        engine = Engine(target, drafter, fold_norms=False)  # the variants fold it where they say so
        n = sum(p.numel() for p in target.parameters())
        part: dict[str, Any] = {"label": f"RANDOM WEIGHTS, {n / 1e9:.2f}B-parameter target, {args.draft_layers[0]}-layer "
                                f"drafter", "layers": target.config.num_hidden_layers, "bytes": {}, "floor_ms": {}}
        part["bandwidth"] = bw
        report["shapes"][shape] = part
        for bs in sorted({1, 32, *args.batches}):
            b = step_bytes(engine, bs, args.context)
            part["bytes"][str(bs)] = b
            part["floor_ms"][f"target_{bs}"] = 1000 * b["target_weights"] / bw
            part["floor_ms"][f"target_kv_{bs}"] = 1000 * (b["target_weights"] + b["target_kv"]) / bw
            part["floor_ms"][f"round_kv_{bs}"] = 1000 * sum(b.values()) / bw
        print(f"{shape}: {part['label']}; floors {json.dumps({k: round(v, 3) for k, v in part['floor_ms'].items()})}",
              flush=True)
        for name in ("gemm", "forward", "rounds"):
            if name in args.parts:
                _guarded(part, name, functools.partial(_run_part, name, part, engine, args, shape))
                write()
        engine.drafter = drafter = None
        del engine, target
        free_memory(device)
        if "peer" in args.parts:
            _guarded(part, "peer", functools.partial(_peer_into, part, shape, device, dtype, args.context,
                                                         args.peer_compile))
            free_memory(device)
            write()
    write()
    print(format_markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
