"""CPU timing of one DDTree round's tree work (build + compile + walk), heap vs batched.

The heap path is the per-request reference in a Python loop over rows (build_tree, compile_tree,
follow_tree); the batched path is build_trees, compile_trees, follow_trees on the whole batch.
Compare within a group (same bs, budget, topk, L):

    python -m pytest tests/kernels/test_tree_bench.py --benchmark-group-by=group

`python -m ddtree.profiling.tree_cpu` prints the same comparison as a per-request table (docs/perf.md).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.tree import (
    build_tree,
    build_trees,
    compile_tree,
    compile_trees,
    follow_tree,
    follow_trees,
)

pytestmark = [pytest.mark.bench, pytest.mark.kernels]

VOCAB = 32000
ROUNDS = 5


@pytest.fixture(scope="module")
def logits_cache() -> dict[tuple[int, int], torch.Tensor]:
    return {}


def _logits(cache: dict[tuple[int, int], torch.Tensor], bs: int, depth: int) -> torch.Tensor:
    if (bs, depth) not in cache:
        gen = torch.Generator().manual_seed(bs * 100 + depth)
        cache[(bs, depth)] = torch.randn(bs, depth, VOCAB, generator=gen) * 3.0  # [bs, L, V]
    return cache[(bs, depth)]


def _spine_targets(logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The target picks the drafter's top-1 token of the next depth at every node, so walks go deep."""
    bs = logits.shape[0]
    spine = torch.cat([logits.argmax(-1), torch.zeros(bs, 1, dtype=torch.long)], dim=1)  # [bs, L+1]
    return spine.gather(1, torch.cat([torch.zeros(bs, 1, dtype=torch.long), depths], dim=1))  # [bs, B+1]


@pytest.mark.parametrize("depth", [7, 15], ids=lambda d: f"L{d}")
@pytest.mark.parametrize("topk", [4, 8], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("budget", [8, 16, 64], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("bs", [1, 32], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("path", ["heap", "batched"])
def test_round_cpu(benchmark, logits_cache, path: str, bs: int, budget: int, topk: int, depth: int) -> None:
    logits = _logits(logits_cache, bs, depth)
    trees = build_trees(logits, budget, topk)
    targets = _spine_targets(logits, trees.depths)
    roots = torch.zeros(bs, dtype=torch.long)
    starts = torch.full((bs,), 100, dtype=torch.long)

    def heap_round() -> list[int]:
        lens = []
        for r in range(bs):
            tree = build_tree(logits[r], budget, topk)
            compile_tree(tree, 0, 100)
            accepted, _ = follow_tree(tree, targets[r, : tree.num_nodes + 1])
            lens.append(len(accepted))
        return lens

    def batched_round() -> list[int]:
        t = build_trees(logits, budget, topk)
        compile_trees(t, roots, starts)
        _, lens, _ = follow_trees(t, targets)
        return lens.tolist()  # the one sync, outside what a GPU loop would do, to check the result

    benchmark.group = f"bs{bs}-b{budget}-k{topk}-L{depth}"
    benchmark.extra_info.update(bs=bs, budget=budget, topk=topk, depth=depth, vocab=VOCAB)
    lens = benchmark.pedantic(heap_round if path == "heap" else batched_round, rounds=ROUNDS, warmup_rounds=1)
    # both paths walk the same trees with the same targets (random logits: no exact ties)
    assert heap_round() == batched_round() == lens
    assert min(lens) >= 2, f"spine targets should accept at least one node, got {lens}"
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["per_request_us"] = benchmark.stats.stats.min / bs * 1e6
