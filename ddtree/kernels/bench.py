"""GPU benchmark of the verify kernels against the torch paths they replace: `python -m ddtree.kernels.bench`.

Tree attention (one layer's attention of n tree queries over a cached prefix, 0.6B-like heads: 16 q / 8 kv,
d 128, bf16) is timed three ways:
  triton        tree_attention_triton, tree K/V read from the cache after the prefix (how target.py calls it)
  triton_new    the same with the tree K/V passed as separate tensors
  sdpa_dense    torch SDPA over cache[:prefix + n] with a dense bool mask (ddtree.models.layers.attend,
                the path the target uses without the kernel)
compact_kv (28 layers, K and V) is timed as the Triton kernel vs the torch gather/scatter, for random
accepted paths and for all-contiguous paths (the kernel's no-move case). The tree steps of a round
(vocabulary pass, select, compile, walk; ddtree.kernels.tree_ops) are timed as the torch code vs the
fused kernels on drafter-shaped logits (--tree-*), with the vocabulary pass alone as a third path.
--tile-variants times extra tree-attention tilings (e.g. t16 = 16-key tree tiles, m32 = 32-row blocks,
w8 = 8 warps, combinable as t16m32w8) beside the default choice.

Each row reports the median time of eager launches (triton.testing.do_bench) and of CUDA-graph replays
(do_bench_cudagraph: what a graph-captured engine step pays), the bytes the operation must move at least,
and bytes / time as effective bandwidth (an H200 copies at about 4.3 TB/s). Every row is also checked
against the torch path first (max abs error). Results go to --out as JSON; a failing row is recorded
with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ddtree.kernels.bitmask import ancestor_mask, pack_mask, unpack_bitmask
from ddtree.kernels.kv_compact import compact_kv_reference, compact_kv_triton
from ddtree.kernels.tree_attention import (
    choose_splits,
    row_block,
    tree_attention_triton,
)

SCHEMA = "ddtree.kernels.bench/1"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddtree.kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kernel_bench.json"), help="JSON results path")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--nodes", type=int, nargs="+", default=[9, 17, 33, 65], help="tree tokens incl. root")
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28, help="layers moved by compact_kv")
    p.add_argument("--accepted", type=int, default=16, help="src columns for compact_kv (block size)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (ms)")
    p.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph timings")
    p.add_argument("--skip-compact", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-tree", action="store_true")
    p.add_argument("--tile-variants", nargs="+", default=[], metavar="VARIANT",
                   help="extra tree-attention tilings: t<16|32|64> tree keys per tile, m<rows> per block, w<warps>")
    p.add_argument("--tree-vocab", type=int, default=4096, help="drafter vocabulary for the tree steps")
    p.add_argument("--tree-depth", type=int, default=7, help="L = block_size - 1")
    p.add_argument("--tree-budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _timings(fn: Callable[[], object], rep_ms: int, graphs: bool) -> dict[str, float | str | None]:
    import triton.testing

    out: dict[str, float | str | None] = {}
    out["eager_ms"] = float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    out["graph_ms"] = None
    if graphs:
        try:
            out["graph_ms"] = float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except Exception as err:  # noqa: BLE001 - a path that cannot be captured is reported, not fatal
            out["graph_error"] = f"{type(err).__name__}: {err}"
    return out


def _gbps(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else nbytes / (ms * 1e-3) / 1e9


def _timed_row(row: dict[str, Any], fn: Callable[[], object], args: argparse.Namespace, graphs: bool) -> None:
    """Times into the row, and effective bandwidth where the row says how many bytes the op moves."""
    row.update(_timings(fn, args.rep_ms, graphs))
    if "bytes" in row:
        row["eager_GBps"] = _gbps(row["bytes"], row["eager_ms"])
        row["graph_GBps"] = _gbps(row["bytes"], row.get("graph_ms"))


def _checked_row(row: dict[str, Any], fn: Callable[[], object], check: Callable[[], object], key: str,
                 args: argparse.Namespace, graphs: bool) -> None:
    row[key] = check()
    _timed_row(row, fn, args, graphs)


def _max_abs_err(fn: Callable[[], torch.Tensor], expected: torch.Tensor) -> float:
    return float((fn().float() - expected).abs().max())


def _ran_and_equal(fn: Callable[[], object], *pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    fn()
    return all(torch.equal(a, b) for a, b in pairs)


def _record(rows: list[dict[str, Any]], row: dict[str, Any], measure: Callable[[], None]) -> None:
    """Fill one row with `measure`; a failure is recorded in the row and the run goes on."""
    try:
        measure()
    except Exception as err:  # noqa: BLE001 - one failing row is recorded, the run goes on
        row["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    rows.append(row)
    _print_row(row)


# -- tree attention -----------------------------------------------------------------------------------


def _attention_inputs(bs: int, prefix: int, n: int, args: argparse.Namespace, dtype: torch.dtype,
                      gen: torch.Generator) -> dict[str, Any]:
    dev = torch.device("cuda")
    d, hq, hkv = args.head_dim, args.q_heads, args.kv_heads
    max_len = prefix + n
    q = torch.randn(bs, hq, n, d, generator=gen, device=dev).to(dtype)
    k_cache = torch.randn(bs, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(bs, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    lens = torch.full((bs,), prefix, dtype=torch.long, device=dev)
    idx = torch.arange(n, device=dev)
    parents = (torch.rand(bs, n, generator=gen, device=dev) * idx).floor().long()  # random trees
    bitmask = pack_mask(ancestor_mask(parents))  # [bs, n] or [bs, n, 2]
    tree = unpack_bitmask(bitmask, n)  # [bs, n, n]
    prefix_vis = torch.ones(bs, n, prefix, dtype=torch.bool, device=dev)
    dense = torch.cat([prefix_vis, tree], dim=-1)[:, None]  # [bs, 1, n, prefix + n]
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "lens": lens, "bitmask": bitmask, "dense": dense,
                "k_new": k_cache[:, :, prefix:].contiguous(), "v_new": v_cache[:, :, prefix:].contiguous(),
                "scale": d ** -0.5}


def bench_attention(args: argparse.Namespace, dtype: torch.dtype, graphs: bool) -> list[dict[str, Any]]:
    from ddtree.models.layers import attend

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    elt = torch.finfo(dtype).bits // 8
    for bs in args.batches:
        for prefix in args.prefixes:
            for n in args.nodes:
                x = _attention_inputs(bs, prefix, n, args, dtype, gen)
                base = {"op": "tree_attention", "bs": bs, "prefix": prefix, "n": n, "q_heads": args.q_heads,
                            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": str(dtype)}
                # minimum traffic: K and V of prefix + tree once per kv head, q in, out out
                nbytes = elt * (2 * bs * args.kv_heads * (prefix + n) * args.head_dim
                                + 2 * bs * args.q_heads * n * args.head_dim)
                n_rows = args.q_heads // args.kv_heads * n  # query rows per kv head
                blocks = -(-n_rows // row_block(n_rows))
                base["splits"] = choose_splits(bs * args.kv_heads * blocks, prefix, x["q"].device)
                paths: dict[str, Callable[[], torch.Tensor]] = {
                    "triton": lambda x=x: tree_attention_triton(x["q"], x["k_cache"], x["v_cache"], x["lens"],
                                                                None, None, x["bitmask"], x["scale"]),
                    "triton_new": lambda x=x: tree_attention_triton(x["q"], x["k_cache"], x["v_cache"], x["lens"],
                                                                    x["k_new"], x["v_new"], x["bitmask"], x["scale"]),
                    "sdpa_dense": lambda x=x: attend(x["q"], x["k_cache"], x["v_cache"], x["dense"]),
                }
                for variant in args.tile_variants:
                    over = _tile_variant(variant)
                    paths[f"triton[{variant}]"] = partial(
                        lambda x, over: tree_attention_triton(x["q"], x["k_cache"], x["v_cache"], x["lens"], None, None,
                                                              x["bitmask"], x["scale"], **over), x, over)
                expected = paths["sdpa_dense"]().float()
                for name, fn in paths.items():
                    row = dict(base, path=name, bytes=nbytes)
                    _record(rows, row, partial(_checked_row, row, fn, partial(_max_abs_err, fn, expected),
                                               "max_abs_err_vs_sdpa", args, graphs))
                del x
    return rows


def _tile_variant(text: str) -> dict[str, int]:
    """'t16m32w8' -> {'block_t': 16, 'block_m': 32, 'num_warps': 8}."""
    keys = {"t": "block_t", "m": "block_m", "w": "num_warps"}
    parts = re.findall(r"([tmw])(\d+)", text)
    if not parts or "".join(f"{k}{v}" for k, v in parts) != text:
        raise SystemExit(f"--tile-variants: {text!r} is not like t16, m32, w8 or t16m32w8")
    return {keys[k]: int(v) for k, v in parts}


# -- tree steps ---------------------------------------------------------------------------------------


def _tree_steps(backend: str, logits: torch.Tensor, budget: int, topk: int, roots: torch.Tensor,
                starts: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """build + compile + walk, as a round runs them."""
    from ddtree.kernels import tree_ops

    trees = tree_ops.build_trees(logits, budget, topk, backend=backend)  # type: ignore[arg-type]
    compiled = tree_ops.compile_trees(trees, roots, starts, backend=backend)  # type: ignore[arg-type]
    return tree_ops.follow_trees(trees, compiled, targets, backend=backend)  # type: ignore[arg-type]


def bench_tree(args: argparse.Namespace, graphs: bool) -> list[dict[str, Any]]:
    """The round's tree steps on random drafter logits: torch code vs fused kernels, and the vocabulary pass."""
    from ddtree import tree

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 2)
    for bs in args.batches:
        logits = torch.randn(bs, args.tree_depth, args.tree_vocab, generator=gen, device="cuda") * 3.0
        roots = torch.zeros(bs, dtype=torch.long, device="cuda")
        starts = torch.full((bs,), 1024, dtype=torch.long, device="cuda")
        for budget in args.tree_budgets:
            ref = tree.build_trees(logits, budget, args.tree_topk)
            compiled = tree.compile_trees(ref, roots, starts)
            targets = compiled.input_ids.roll(-1, dims=1)  # some walks go deep, most stop early

            steps = partial(_tree_steps, logits=logits, budget=budget, topk=args.tree_topk, roots=roots,
                            starts=starts, targets=targets)
            matches = all(torch.equal(a, b) for a, b in zip(steps("torch"), steps("triton"), strict=True))
            paths = (("torch", partial(steps, "torch")), ("fused", partial(steps, "triton")),
                     ("vocab_only", partial(tree.top_log_probs_fast, logits, args.tree_topk)))
            for name, fn in paths:
                row = {"op": "tree_steps", "bs": bs, "budget": budget, "topk": args.tree_topk, "L": args.tree_depth,
                       "vocab": args.tree_vocab, "path": name, "matches_torch": matches if name == "fused" else None}
                _record(rows, row, partial(_timed_row, row, fn, args, graphs))
    return rows


# -- KV compaction ------------------------------------------------------------------------------------


def bench_compact(args: argparse.Namespace, dtype: torch.dtype, graphs: bool) -> list[dict[str, Any]]:
    rows = []
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    elt = torch.finfo(dtype).bits // 8
    n = max(args.nodes)
    m = args.accepted
    for bs in args.batches:
        for prefix in args.prefixes:
            shape = (args.layers, bs, args.kv_heads, prefix + n, args.head_dim)
            k = torch.randn(*shape, generator=gen, device=dev).to(dtype)
            v = torch.randn(*shape, generator=gen, device=dev).to(dtype)
            lengths = torch.full((bs,), prefix, dtype=torch.long, device=dev)
            counts = torch.full((bs,), m, dtype=torch.long, device=dev)
            scattered = torch.sort(torch.randperm(n - 1, device=dev, generator=gen)[:m] + 1).values
            scattered[0] = 0  # a path of m nodes spread over the tree window, root first
            for kind, src_row in (("scattered", scattered), ("contiguous", torch.arange(m, device=dev))):
                src = src_row[None].expand(bs, m).contiguous()
                moved_rows = int((src_row != torch.arange(m, device=dev)).sum())
                nbytes = 2 * 2 * args.layers * bs * args.kv_heads * moved_rows * args.head_dim * elt  # K,V read+write
                base = {"op": "compact_kv", "kind": kind, "bs": bs, "prefix": prefix, "layers": args.layers,
                            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "accepted": m, "dtype": str(dtype)}
                k_ref, v_ref = k.clone(), v.clone()
                compact_kv_reference(k_ref, v_ref, lengths, src, counts)
                k_tri, v_tri = k.clone(), v.clone()
                paths = (("triton", partial(compact_kv_triton, k_tri, v_tri, lengths, src, counts)),
                         ("torch", partial(compact_kv_reference, k_ref, v_ref, lengths, src, counts)))
                for name, fn in paths:
                    row = dict(base, path=name, bytes=nbytes)
                    if name == "triton":  # run once, then compare with the torch result
                        check = partial(_ran_and_equal, fn, (k_tri, k_ref), (v_tri, v_ref))
                        _record(rows, row, partial(_checked_row, row, fn, check, "matches_torch", args, graphs))
                    else:
                        _record(rows, row, partial(_timed_row, row, fn, args, graphs))
                del k_ref, v_ref, k_tri, v_tri
            del k, v
    return rows


# -- output -------------------------------------------------------------------------------------------


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_header() -> None:
    print(f"{'op':<15}{'case':<34}{'path':<12}{'eager ms':>10}{'graph ms':>10}{'GB/s(graph)':>12}"
          f"{'check':>12}", flush=True)


def _print_row(row: dict[str, Any]) -> None:
    if row["op"] == "tree_attention":
        case = f"bs{row['bs']} prefix{row['prefix']} n{row['n']} s{row['splits']}"
        check = _fmt(row.get("max_abs_err_vs_sdpa"), ".1e")
    elif row["op"] == "tree_steps":
        case = f"bs{row['bs']} B{row['budget']} K{row['topk']} L{row['L']} V{row['vocab']}"
        check = {True: "exact", False: "MISMATCH", None: ""}[row.get("matches_torch")]
    else:
        case = f"bs{row['bs']} prefix{row['prefix']} {row['kind']} m{row['accepted']}"
        check = {True: "exact", False: "MISMATCH", None: ""}[row.get("matches_torch")]
    if "error" in row:
        print(f"{row['op']:<15}{case:<34}{row['path']:<12} ERROR {row['error']}", flush=True)
        return
    print(f"{row['op']:<15}{case:<34}{row['path']:<12}{_fmt(row.get('eager_ms'), '.4f'):>10}"
          f"{_fmt(row.get('graph_ms'), '.4f'):>10}{_fmt(row.get('graph_GBps'), '.0f'):>12}{check:>12}", flush=True)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)  # atomic: a crash never leaves half a file


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("ddtree.kernels.bench needs a CUDA GPU (and triton); nothing to do on this machine", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("ddtree.kernels.bench needs triton: pip install 'triton>=3.0'", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    graphs = not args.no_graphs
    props = torch.cuda.get_device_properties(0)
    env = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    _print_header()
    results: dict[str, Any] = {"schema": SCHEMA, "env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                 for k, v in vars(args).items()}}
    for variant in args.tile_variants:
        _tile_variant(variant)  # bad input fails before anything runs
    sections = (("attention", not args.skip_attention, lambda: bench_attention(args, dtype, graphs)),
                ("tree", not args.skip_tree, lambda: bench_tree(args, graphs)),
                ("compact", not args.skip_compact, lambda: bench_compact(args, dtype, graphs)))
    for name, wanted, run in sections:
        if wanted:
            results[name] = run()
            _write_json(args.out, results)  # each section lands on disk as soon as it is done
    print(f"wrote {args.out}", flush=True)
    failed = [r for name, _, _ in sections for r in results.get(name, []) if "error" in r
              or r.get("matches_torch") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
