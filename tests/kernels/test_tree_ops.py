"""The fused tree kernels (vocabulary pass, select, compile, walk) against ddtree.tree's torch code, their reference.

Without exact score ties select, compile and walk are equal bit for bit (same float32 additions, same
order) and the vocabulary pass gives the same ids with log-probs equal to float32 rounding; with
ties (quantised logits) the kernels must still give valid trees of the same best scores. On machines
without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton
is) on small shapes; the GPU cases cover batch 1..32, budgets up to 127 (two-word masks), topk up to 8
and depth up to 15.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree import tree
from ddtree.kernels import tree_ops
from ddtree.kernels.bitmask import pack_mask
from ddtree.vocab_pass import LOG_PROB_FLOOR
from tests.kernels.kernel_asserts import interpreter_off_but_installed, run_triton_cases_in_child, triton_runtime

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
gpu_only = [pytest.mark.gpu,
            pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: large sorts are minutes in the Triton interpreter")]


@dataclass(frozen=True)
class Case:
    bs: int
    depth: int  # L drafted positions
    vocab: int
    budget: int
    topk: int
    seed: int = 0

    @property
    def id(self) -> str:
        return f"b{self.bs}-L{self.depth}-V{self.vocab}-B{self.budget}-K{self.topk}"


CPU_CASES = [
    Case(1, 1, 40, 1, 1),
    Case(3, 7, 200, 8, 4, seed=1),
    Case(2, 3, 64, 5, 8, seed=2),  # topk > budget
    Case(4, 7, 100, 12, 6, seed=3),  # non-power-of-two budget and topk
    Case(2, 4, 80, 16, 2, seed=4),  # more budget than the tree can fill at depth 1..2
    Case(1, 3, 60, 70, 4, seed=5),  # 71 nodes: two mask words
]
GPU_CASES = [
    Case(32, 7, 4096, 8, 4, seed=10),
    Case(32, 7, 4096, 64, 8, seed=11),  # 65 nodes: two words
    Case(1, 15, 32000, 127, 8, seed=12),
    Case(17, 15, 1000, 32, 8, seed=13),
    Case(8, 7, 151936, 16, 4, seed=14),
    Case(5, 1, 300, 4, 4, seed=15),
    Case(32, 3, 500, 100, 3, seed=16),
]


def draft_logits(case: Case, quantised: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    logits = torch.randn(case.bs, case.depth, case.vocab, generator=gen) * 3.0
    if quantised:  # many exactly equal log-probs: ties inside and across depths
        logits = logits.round()
    return logits.to(DEVICE)


def spine_targets(logits: torch.Tensor, compiled: tree.CompiledTrees, starts: torch.Tensor,
                  seed: int) -> torch.Tensor:
    """Targets that mostly follow the drafter's top-1 token one depth deeper, so walks go deep, with some noise."""
    bs = logits.shape[0]
    gen = torch.Generator().manual_seed(seed)
    spine = torch.cat([logits.argmax(-1).cpu(), torch.zeros(bs, 1, dtype=torch.long)], dim=1)
    depth = (compiled.position_ids.cpu() - starts.cpu()[:, None]).clamp(0, spine.shape[1] - 1)
    follow = spine.gather(1, depth)
    noise = compiled.input_ids.cpu().gather(1, torch.randint(0, depth.shape[1], depth.shape, generator=gen))
    pick = torch.rand(depth.shape, generator=gen)
    return torch.where(pick < 0.8, follow, torch.where(pick < 0.9, noise, 0)).to(logits.device)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: {tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}")
    if not torch.equal(actual, expected):
        wrong = (actual != expected).nonzero()
        first = tuple(int(i) for i in wrong[0])
        raise AssertionError(f"{what}: {wrong.shape[0]}/{actual.numel()} elements differ, first at {first}: "
                             f"{actual[first].item()} != {expected[first].item()}")


def poison_allocator() -> None:
    """Fill freed CUDA cache blocks with a sentinel, so an output element the kernel never writes shows up."""
    if HAS_CUDA:
        junk = torch.full((1 << 22,), -7, dtype=torch.long, device="cuda")
        del junk


def check_case(case: Case) -> None:
    logits = draft_logits(case)
    bs = case.bs
    gen = torch.Generator().manual_seed(case.seed + 100)
    roots = torch.randint(0, case.vocab, (bs,), generator=gen).to(DEVICE)
    starts = torch.randint(0, 4000, (bs,), generator=gen).to(DEVICE)

    # the vocabulary pass: same ids, log-probs to float32 rounding
    ref_lp, ref_ids = tree.top_log_probs_fast(logits, case.topk)
    poison_allocator()
    lp, ids = tree_ops.top_log_probs_triton(logits, case.topk)
    assert_same(ids, ref_ids, f"vocabulary pass ids, {case.id}")
    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=1e-6, msg=lambda m: f"vocabulary pass values, {case.id}: {m}")
    # the selection from the same log-probs: bit for bit
    selected = tree_ops.select_trees_triton(ref_lp, ref_ids, case.budget)
    expected = tree.select_trees(ref_lp, ref_ids, case.budget)
    for field in ("tokens", "parents", "depths", "log_probs", "num_nodes"):
        assert_same(getattr(selected, field), getattr(expected, field), f"select {field}, {case.id}")
    # end to end: the same trees, scores to rounding
    poison_allocator()
    trees = tree_ops.build_trees(logits, case.budget, case.topk, backend="triton")
    for field in ("tokens", "parents", "depths", "num_nodes"):
        assert_same(getattr(trees, field), getattr(expected, field), f"build {field}, {case.id}")
    torch.testing.assert_close(trees.log_probs, expected.log_probs, atol=2e-5, rtol=1e-6)
    assert trees.max_depth == expected.max_depth

    want = tree.compile_trees(expected, roots, starts)
    poison_allocator()
    got = tree_ops.compile_trees(trees, roots, starts, backend="triton")
    for field in ("input_ids", "position_ids", "mask"):
        assert_same(getattr(got, field), getattr(want, field), f"compile {field}, {case.id}")
    assert got.bitmask is not None
    assert_same(got.bitmask, want.bitmask if want.bitmask is not None else pack_mask(want.mask),
                f"compile bitmask, {case.id}")

    for seed in range(3):
        targets = spine_targets(logits, want, starts, seed)
        poison_allocator()
        walked = tree_ops.follow_trees(trees, got, targets, backend="triton")
        reference = tree.follow_trees_by_mask(expected, want.mask, targets)
        for name, a, e in zip(("accepted", "accept_lens", "bonus"), walked, reference, strict=True):
            assert_same(a, e, f"walk {name}, {case.id}, targets {seed}")


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_torch(case: Case) -> None:
    check_case(case)


@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=gpu_only) for c in GPU_CASES])
def test_triton_matches_torch_gpu(case: Case) -> None:
    check_case(case)


@needs_triton
@pytest.mark.parametrize("splits", [2, 4, 32])
def test_triton_vocabulary_pass_split_across_programs_matches(splits: int) -> None:
    """A few rows over a wide vocabulary split into slices (32: some slices empty) then merged: the same ids
    and values as the reference, -inf rows and ties included."""
    logits = torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[0, 0] = float("-inf")
    logits[0, 0, 999] = 2.0  # one finite token, in the last slice
    logits[1, 2, 500:530] = 9.0  # tied top across a slice boundary (block 64: 512)
    lp, ids = tree_ops.top_log_probs_triton(logits, 4, block_v=64, splits=splits)
    ref_lp, ref_ids = tree.top_log_probs_fast(logits, 4)
    assert ids[0, 0, 0] == 999 and lp[0, 0, 0] == 0.0
    assert bool((ids[1, 2] >= 500).all() and (ids[1, 2] < 530).all())
    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=1e-6)
    for b, d in ((0, 1), (0, 2), (1, 0), (1, 1)):  # the rows without ties
        assert_same(ids[b, d], ref_ids[b, d], f"ids of row ({b}, {d})")
    with pytest.raises(ValueError, match="power of two"):
        tree_ops.top_log_probs_triton(logits, 4, block_v=64, splits=3)


def test_vocabulary_splits_fill_the_device() -> None:
    assert tree_ops.top_splits(7, 151936, 4096) == 32  # the 8B-like drafter at batch 1
    assert tree_ops.top_splits(224, 151936, 4096) == 4  # batch 32
    assert tree_ops.top_splits(2048, 151936, 4096) == 1  # enough rows already
    assert tree_ops.top_splits(7, 4096, 4096) == 1  # one block of vocabulary


@needs_triton
def test_vocabulary_pass_handles_minus_inf_and_ties() -> None:
    """-inf logits get the floor log-prob (never NaN), ids stay distinct; a wide vocabulary spans chunks."""
    logits = torch.randn(2, 3, 9000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits[0, 0] = float("-inf")
    logits[0, 0, 8999] = 2.0  # one finite token, in the last chunk
    logits[1, 1, :40] = 10.0  # exact ties at the top
    lp, ids = tree_ops.top_log_probs_triton(logits, 6)
    ref_lp, ref_ids = tree.top_log_probs_fast(logits, 6)
    assert not lp.isnan().any()
    assert ids[0, 0, 0] == 8999 and lp[0, 0, 0] == 0.0 and bool((lp[0, 0, 1:] == LOG_PROB_FLOOR).all())
    for row in ids.reshape(-1, 6).tolist():
        assert len(set(row)) == 6, f"duplicate ids {row}"
    assert bool((ids[1, 1] < 40).all()), "a tied top must come from the tied tokens"
    torch.testing.assert_close(lp[1, 1], ref_lp[1, 1])
    assert_same(ids[1:, 2:], ref_ids[1:, 2:], "ids without ties")


def assert_valid_tree(trees: tree.DraftTrees, log_probs: torch.Tensor, ids: torch.Tensor, row: int) -> None:
    """Prefix-closed, parents first, depth = parent's + 1, each score = parent's + its rank's log-prob."""
    n = int(trees.num_nodes[row])
    tok, par, dep, score = (t[row].cpu() for t in (trees.tokens, trees.parents, trees.depths, trees.log_probs))
    lp, ids = log_probs[row].cpu(), ids[row].cpu()
    for i in range(n):
        p = int(par[i])
        assert p <= i, f"node {i + 1}'s parent {p} comes after it"
        parent_depth = 0 if p == 0 else int(dep[p - 1])
        parent_score = torch.tensor(0.0) if p == 0 else score[p - 1]
        assert int(dep[i]) == parent_depth + 1
        rank = int((ids[int(dep[i]) - 1] == tok[i]).nonzero()[0])
        assert score[i] == parent_score + lp[int(dep[i]) - 1, rank], f"node {i + 1}'s score"
    siblings = {(int(par[i]), int(tok[i])) for i in range(n)}
    assert len(siblings) == n, "two children of one node carry the same token"
    assert bool((dep[n:] == 0).all()) and bool((score[n:] == float("-inf")).all()), "padding"


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[1:5]])
def test_ties_give_valid_trees_of_the_same_scores(case: Case) -> None:
    logits = draft_logits(case, quantised=True)
    log_probs, ids = tree.top_log_probs_fast(logits, case.topk)
    trees = tree_ops.select_trees_triton(log_probs, ids, case.budget)
    expected = tree.select_trees(log_probs, ids, case.budget)
    assert_same(trees.num_nodes, expected.num_nodes, "num_nodes")
    # the best `budget` path scores are one multiset, whichever equal nodes were picked
    assert_same(trees.log_probs.sort(dim=-1).values, expected.log_probs.sort(dim=-1).values, "scores")
    for row in range(case.bs):
        assert_valid_tree(trees, log_probs, ids, row)


def test_auto_runs_torch_on_cpu_and_large_trees_fall_back() -> None:
    case = Case(2, 7, 90, 8, 4, seed=7)
    logits = draft_logits(case).cpu()
    expected = tree.build_trees(logits, case.budget, case.topk)
    trees = tree_ops.build_trees(logits, case.budget, case.topk)  # auto on the CPU: the torch code
    assert_same(trees.tokens, expected.tokens, "auto tokens")
    assert not tree_ops._use_triton("auto", torch.device("cpu"), fits=True)
    assert not tree_ops._use_triton("triton", torch.device("cuda"), fits=False), "too large must fall back"
    assert tree_ops._use_triton("triton", torch.device("cpu"), fits=True)
    assert not tree_ops.fused_fits(tree_ops.MAX_FUSED_NODES, 4, 7)
    big = tree_ops.build_trees(logits, tree_ops.MAX_FUSED_NODES, 4, backend="triton")  # torch code, no error
    assert big.budget == tree_ops.MAX_FUSED_NODES


def test_bad_backend_names_the_choices() -> None:
    logits = draft_logits(Case(1, 2, 20, 2, 2)).cpu()
    with pytest.raises(ValueError, match=r"tree backend: 'cuda' is not one of \('auto', 'triton', 'torch'\)"):
        tree_ops.build_trees(logits, 2, 2, backend="cuda")  # type: ignore[arg-type]


@needs_triton
def test_select_rejects_trees_too_large_for_the_kernel() -> None:
    log_probs, ids = tree.top_log_probs_fast(draft_logits(Case(1, 2, 300, 2, 2)), 2)
    with pytest.raises(ValueError, match=r"budget: 200 with topk 2 and depth 2 is too large .*\(allowed budget <= 127\)"):
        tree_ops.select_trees_triton(log_probs, ids, 200)


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton_matches_torch or ties or rejects or vocabulary")
