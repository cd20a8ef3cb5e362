"""CPU timing of one DDTree round's tree work, per request: the heap reference vs the batched code.

`python -m ddtree.profiling.tree_cpu` prints a markdown table (docs/perf.md, tree ops): for each (batch rows,
budget, topk, depth) the heap path (ddtree.tree's per-request reference, a Python loop over rows) against
the batched path, for the vocabulary pass, the build, the selection alone, the tree work after the
vocabulary pass and a whole round (build + compile + walk).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ddtree.profiling.flags import add_repeats, tool_parser
from ddtree.tree import (
    DraftTree,
    DraftTrees,
    build_tree,
    build_trees,
    compile_tree,
    compile_trees,
    follow_tree,
    follow_trees,
    select_tree,
    select_trees,
    top_log_probs,
    top_log_probs_fast,
)


def _spine_targets(logits: torch.Tensor, trees: DraftTrees) -> torch.Tensor:
    """Target tokens that follow the drafter's top-1 token at the next depth, so walks go deep."""
    bs = logits.shape[0]
    spine = torch.cat([logits.argmax(-1), torch.zeros(bs, 1, dtype=torch.long)], dim=1)  # [bs, L+1]
    depths = torch.cat([torch.zeros(bs, 1, dtype=torch.long), trees.depths], dim=1)  # [bs, B+1]
    return spine.gather(1, depths)  # node at depth d gets the top-1 token of depth d+1


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _round_cases(logits: torch.Tensor, budget: int, topk: int) -> dict[str, Callable[[], object]]:
    """The timed callables for one cell, heap_* (a loop over rows) and batched_*."""
    bs = logits.shape[0]
    lp, ids = top_log_probs(logits, topk)  # [bs, L, K]
    targets = _spine_targets(logits, build_trees(logits, budget, topk))  # [bs, B+1]
    roots = torch.zeros(bs, dtype=torch.long)
    starts = torch.full((bs,), 100, dtype=torch.long)

    def heap(select: Callable[[int], DraftTree], compile_walk: bool) -> Callable[[], object]:
        def run() -> None:
            for r in range(bs):
                tree = select(r)
                if compile_walk:
                    compile_tree(tree, 0, 100)
                    follow_tree(tree, targets[r, : tree.num_nodes + 1])

        return run

    def batched(select: Callable[[], DraftTrees], compile_walk: bool) -> Callable[[], object]:
        def run() -> None:
            trees = select()
            if compile_walk:
                compile_trees(trees, roots, starts)
                follow_trees(trees, targets)

        return run

    def heap_select(r: int) -> DraftTree:
        return select_tree(lp[r], ids[r], budget)

    def heap_build(r: int) -> DraftTree:
        return build_tree(logits[r], budget, topk)

    def batched_select() -> DraftTrees:
        return select_trees(lp, ids, budget)

    def batched_build() -> DraftTrees:
        return build_trees(logits, budget, topk)

    return {
        "heap_vocab": lambda: [top_log_probs(logits[r], topk) for r in range(bs)],
        "batched_vocab": lambda: top_log_probs_fast(logits, topk),
        "heap_build": heap(heap_build, False),
        "batched_build": batched(batched_build, False),
        "heap_select": heap(heap_select, False),
        "batched_select": batched(batched_select, False),
        "heap_tree": heap(heap_select, True),
        "batched_tree": batched(batched_select, True),
        "heap_round": heap(heap_build, True),
        "batched_round": batched(batched_build, True),
    }


def benchmark_cpu(
    batch_sizes: tuple[int, ...] = (1, 32),
    budgets: tuple[int, ...] = (8, 16, 64),
    topks: tuple[int, ...] = (4, 8),
    depths: tuple[int, ...] = (7, 15),
    vocab: int = 32000,
    repeats: int = 5,
) -> list[dict[str, float]]:
    """Per-request microseconds (best of `repeats`) of the heap path (a Python loop over rows)
    and the batched path, for: the vocabulary pass (top_log_probs per row vs top_log_probs_fast
    on the batch), the build (vocabulary pass + selection), the selection alone, the tree work
    after the vocabulary pass (selection + compile + walk) and a whole round (build + compile + walk).
    """
    rows: list[dict[str, float]] = []
    gen = torch.Generator().manual_seed(0)
    for depth in depths:
        for bs in batch_sizes:
            logits = torch.randn(bs, depth, vocab, generator=gen) * 3.0  # [bs, L, V]
            for topk in topks:
                for budget in budgets:
                    row: dict[str, float] = {"bs": bs, "budget": budget, "topk": topk, "L": depth}
                    for name, fn in _round_cases(logits, budget, topk).items():
                        row[name] = _time(fn, repeats) / bs * 1e6
                    rows.append(row)
    return rows


STEPS = ("vocab", "build", "select", "tree", "round")


def _print_table(rows: list[dict[str, float]]) -> None:
    """A markdown table of benchmark_cpu's rows: heap / batched us per request, and the speed-up."""
    print("| bs | B | K | L | " + " | ".join(STEPS) + " |")
    print("|" + "---|" * (4 + len(STEPS)))
    for r in rows:
        cells = [f"{r['bs']}", f"{r['budget']}", f"{r['topk']}", f"{r['L']}"]
        for step in STEPS:
            heap, batched = r[f"heap_{step}"], r[f"batched_{step}"]
            cells.append(f"{heap:.0f} / {batched:.0f} = {heap / batched:.1f}x")
        print("| " + " | ".join(cells) + " |")


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser(__name__, __doc__)
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--budget", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--topk", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--depth", type=int, nargs="+", default=[7, 15], help="L = block_size - 1")
    parser.add_argument("--vocab", type=int, default=32000)
    add_repeats(parser, help="the best of this many runs is reported")
    parser.set_defaults(repeats=9)  # steps of tens of microseconds: the best of more runs, for a steady minimum
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, V={args.vocab}, best of "
        f"{args.repeats}; each cell: heap us/request / batched us/request = speed-up"
    )
    rows = benchmark_cpu(
        tuple(args.bs), tuple(args.budget), tuple(args.topk), tuple(args.depth), args.vocab, args.repeats
    )
    _print_table(rows)


if __name__ == "__main__":
    main()
