"""ddtree.tree against slow, obviously-right references: brute-force path enumeration, a naive
ancestor walk and a linear-scan tree walk; plus the batched path's no-host-sync guarantee."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ddtree.errors import ConfigError
from ddtree.tree import (
    DraftTree,
    build_tree,
    build_trees,
    compaction_indices,
    compile_tree,
    compile_trees,
    expand_bitmask,
    follow_tree,
    follow_trees,
    follow_trees_by_mask,
    is_chain,
    top_log_probs,
    top_log_probs_fast,
)

pytestmark = pytest.mark.kernels

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- slow references ----------------------------------------------------------------------------
def random_logits(seed: int, shape: tuple[int, ...], kind: str = "distinct") -> torch.Tensor:
    """distinct: continuous random values (exact ties have probability ~0);
    ties: small integers (many exact ties); peaked: one token per row far above the rest, so
    its log-prob is exactly 0.0 in float32 and a child scores exactly like its parent."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        return torch.randn(shape, generator=gen) * 3.0
    if kind == "ties":
        return torch.randint(0, 3, shape, generator=gen).float()
    logits = torch.randn(shape, generator=gen)
    peak = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits.scatter(-1, peak[..., None], 200.0)


def f32(x: float) -> float:
    return float(np.float32(x))


def enumerate_paths(log_probs: list[list[float]], exact32: bool) -> list[tuple[float, tuple[int, ...]]]:
    """Every path of ranks over the top-K tokens per depth, with its score (a float32 running
    sum like the implementation when exact32, else float64)."""
    depth_limit, k = len(log_probs), len(log_probs[0])
    paths = []
    for d in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = 0.0
            for i, r in enumerate(ranks):
                score = f32(score + log_probs[i][r]) if exact32 else score + log_probs[i][r]
            paths.append((score, ranks))
    return paths


def token_paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Each node as its token path from the root, with its score."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = {}
    for i in range(1, len(tokens) + 1):
        path, node = [], i
        while node:
            path.append(tokens[node - 1])
            node = parents[node - 1]
        out[tuple(reversed(path))] = float(tree.log_probs[i - 1])
    return out


def naive_ancestors(parents: list[int], n: int) -> np.ndarray:
    """mask[i, j] iff j is i or an ancestor of i, by walking up from every node."""
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    for i in range(n + 1):
        node = i
        mask[i, node] = True
        while node:
            node = parents[node - 1]
            mask[i, node] = True
    return mask


def oracle_walk(tokens: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], int]:
    """Linear scan for a child of the current node carrying the target's token."""
    accepted, node = [0], 0
    while True:
        nxt = [i for i in range(1, len(tokens) + 1) if parents[i - 1] == node and tokens[i - 1] == targets[node]]
        assert len(nxt) <= 1, "siblings must carry distinct tokens"
        if not nxt:
            return accepted, targets[node]
        node = nxt[0]
        accepted.append(node)


def check_tree(tree: DraftTree, logits: torch.Tensor, budget: int, topk: int) -> None:
    """Structure every valid tree has: prefix closed, parent < child, bounds, top-k tokens."""
    depth_limit, vocab = logits.shape
    k = min(topk, vocab)
    n = tree.num_nodes
    total_paths = sum(k**d for d in range(1, depth_limit + 1))
    assert n == min(budget, total_paths), f"{n} nodes, expected min({budget}, {total_paths})"
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    allowed = logits.float().log_softmax(-1).topk(k, dim=-1).indices.tolist()  # distinct per row
    lp_full = logits.float().log_softmax(-1)
    children: dict[int, set[int]] = {}
    for i in range(1, n + 1):
        p, d, t = parents[i - 1], depths[i - 1], tokens[i - 1]
        assert 0 <= p < i, f"node {i} has parent {p}"
        assert 1 <= d <= depth_limit
        assert d == (1 if p == 0 else depths[p - 1] + 1), f"node {i} depth {d} vs parent {p}"
        assert t in allowed[d - 1], f"node {i} token {t} not in the top-{k} of depth {d}"
        assert t not in children.setdefault(p, set()), f"siblings under {p} repeat token {t}"
        children[p].add(t)
        parent_score = 0.0 if p == 0 else float(tree.log_probs[p - 1])
        expected = parent_score + float(lp_full[d - 1, t])
        assert float(tree.log_probs[i - 1]) == pytest.approx(expected, abs=1e-4)
        assert float(tree.log_probs[i - 1]) <= parent_score


shape_args = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 4),  # L
    st.integers(1, 12),  # V
    st.integers(1, 24),  # budget
    st.integers(1, 4),  # topk
)


# -- build ----------------------------------------------------------------------------------------
@SETTINGS
@given(shape_args)
def test_heap_selects_top_budget_paths(args: tuple[int, int, int, int, int]) -> None:
    seed, depth_limit, vocab, budget, topk = args
    logits = random_logits(seed, (depth_limit, vocab))
    lp64 = logits.double().log_softmax(-1)  # an independent float64 reference
    k = min(topk, vocab)
    order = lp64.argsort(-1, descending=True)[:, :k].tolist()
    paths = enumerate_paths(lp64.gather(1, torch.tensor(order)).tolist(), exact32=False)
    paths.sort(key=lambda p: -p[0])
    if len(paths) > budget:
        assume(paths[budget - 1][0] - paths[budget][0] > 1e-5)  # no near-tie at the cut
    expected = {tuple(order[i][r] for i, r in enumerate(ranks)) for _, ranks in paths[:budget]}

    tree = build_tree(logits, budget, topk)
    check_tree(tree, logits, budget, topk)
    assert set(token_paths(tree)) == expected


@SETTINGS
@given(shape_args, st.sampled_from(["distinct", "ties", "peaked"]))
def test_heap_pops_in_score_then_rank_tuple_order(args: tuple[int, int, int, int, int], kind: str) -> None:
    """Even with exact ties the heap is the first B paths in (-score, rank tuple) order."""
    seed, depth_limit, vocab, budget, topk = args
    logits = random_logits(seed, (depth_limit, vocab), kind)
    lp, ids = top_log_probs(logits, topk)
    paths = sorted(enumerate_paths(lp.tolist(), exact32=True), key=lambda p: (-p[0], p[1]))[:budget]
    tree = build_tree(logits, budget, topk)
    check_tree(tree, logits, budget, topk)
    ids_l = ids.tolist()
    expected_tokens = [ids_l[len(ranks) - 1][ranks[-1]] for _, ranks in paths]
    assert tree.tokens.tolist() == expected_tokens
    assert tree.log_probs.tolist() == [score for score, _ in paths]


@SETTINGS
@given(shape_args, st.integers(1, 5), st.sampled_from(["distinct", "ties", "peaked"]))
def test_batched_matches_heap_per_row(args: tuple[int, int, int, int, int], bs: int, kind: str) -> None:
    seed, depth_limit, vocab, budget, topk = args
    logits = random_logits(seed, (bs, depth_limit, vocab), kind)
    trees = build_trees(logits, budget, topk)
    assert trees.tokens.shape == (bs, budget) and trees.max_depth == depth_limit
    for b in range(bs):
        heap = build_tree(logits[b], budget, topk)
        row = trees.row(b)
        check_tree(row, logits[b], budget, topk)
        n = row.num_nodes
        # padding
        assert trees.tokens[b, n:].eq(0).all() and trees.parents[b, n:].eq(0).all()
        assert trees.depths[b, n:].eq(0).all() and trees.log_probs[b, n:].eq(float("-inf")).all()
        # both are the top-B by score: the sorted scores agree exactly, ties or not
        assert sorted(row.log_probs.tolist()) == sorted(heap.log_probs.tolist())
        assert row.log_probs.tolist() == sorted(row.log_probs.tolist(), reverse=True)
        lp, _ = top_log_probs(logits[b], topk)
        scores = sorted((s for s, _ in enumerate_paths(lp.tolist(), exact32=True)), reverse=True)
        if kind == "distinct" and len(set(scores)) == len(scores):
            # no ties anywhere: the same nodes in the same order
            for field in ("tokens", "parents", "depths", "log_probs"):
                assert torch.equal(getattr(row, field), getattr(heap, field)), field
            assert token_paths(row) == token_paths(heap)


@SETTINGS
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.integers(1, 3000),
    st.integers(1, 16),
    st.sampled_from(["distinct", "ties", "peaked"]),
)
def test_fast_vocab_pass_equals_reference(seed: int, rows: int, vocab: int, topk: int, kind: str) -> None:
    """The two-stage (block max) top-k gives the reference's values exactly, and its ids when
    there are no exact ties; large V so the block path runs, odd V so the tail is covered."""
    logits = random_logits(seed, (rows, 2, vocab), kind)
    ref_values, ref_ids = top_log_probs(logits, topk)
    values, ids = top_log_probs_fast(logits, topk)
    assert torch.equal(values, ref_values)
    assert torch.equal(logits.log_softmax(-1).gather(-1, ids).clamp(min=-1e30), values)  # ids carry those values
    assert (ids.sort(dim=-1).values.diff(dim=-1) != 0).all(), "ids repeat within a row"
    if kind == "distinct":
        assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("vocab", [2000, 32000, 32001])
def test_batched_equals_heap_at_large_vocab(vocab: int) -> None:
    logits = random_logits(vocab, (4, 7, vocab))
    trees = build_trees(logits, 16, 4)
    for b in range(4):
        heap, row = build_tree(logits[b], 16, 4), trees.row(b)
        for field in ("tokens", "parents", "depths", "log_probs"):
            assert torch.equal(getattr(row, field), getattr(heap, field)), field


@pytest.mark.parametrize("budget, depth_limit", [(3, 7), (7, 7), (16, 7), (1, 1), (20, 15)])
def test_topk_one_is_a_chain(budget: int, depth_limit: int) -> None:
    logits = random_logits(1, (3, depth_limit, 50))
    n = min(budget, depth_limit)
    trees = build_trees(logits, budget, 1)
    assert trees.num_nodes.tolist() == [n] * 3
    assert is_chain(trees).all()
    assert trees.parents[:, :n].tolist() == [list(range(n))] * 3
    assert trees.depths[:, :n].tolist() == [list(range(1, n + 1))] * 3
    assert torch.equal(trees.tokens[:, :n], logits.argmax(-1)[:, :n])
    heap = build_tree(logits[0], budget, 1)
    assert heap.parents.tolist() == list(range(n))
    assert not is_chain(build_trees(logits, max(budget, 2), 2)).any()


def test_zero_log_prob_keeps_parent_before_child() -> None:
    """Log-prob exactly 0 at every depth: a node and its first child tie; order must still hold."""
    logits = torch.full((2, 6, 10), -200.0)
    logits[:, :, 3] = 200.0
    trees = build_trees(logits, 8, 3)
    assert float(trees.log_probs[0, 0]) == 0.0
    for b in range(2):
        check_tree(trees.row(b), logits[b], 8, 3)


def test_zero_probability_tokens_are_not_padding() -> None:
    logits = torch.tensor([[0.0, float("-inf"), float("-inf")]] * 2)  # L=2, V=3
    tree = build_tree(logits, 12, 3)
    trees = build_trees(logits[None], 12, 3)
    assert tree.num_nodes == 12 and int(trees.num_nodes[0]) == 12
    assert sorted(tree.log_probs.tolist()) == sorted(trees.log_probs[0].tolist())


@pytest.mark.parametrize(
    "call, match",
    [
        pytest.param(lambda: build_tree(torch.zeros(3, 5), 0, 2), "budget", id="budget-zero"),
        pytest.param(lambda: build_trees(torch.zeros(1, 3, 5), 4, 0), "topk", id="topk-zero"),
        pytest.param(lambda: build_tree(torch.zeros(3, 5), True, 2), "budget", id="budget-bool"),
        pytest.param(lambda: build_tree(torch.zeros(1, 3, 5), 4, 2), r"logits.*\[L, V\]", id="tree-3d"),
        pytest.param(lambda: build_trees(torch.zeros(3, 5), 4, 2), r"logits.*\[bs, L, V\]", id="trees-2d"),
        pytest.param(lambda: build_trees(torch.zeros(1, 0, 5), 4, 2), "logits", id="empty-depth"),
        pytest.param(lambda: build_tree(torch.zeros(3, 5, dtype=torch.long), 4, 2), "dtype", id="int-logits"),
    ],
)
def test_bad_input_names_the_field(call, match: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=match):
        call()


# -- compile --------------------------------------------------------------------------------------
@SETTINGS
@given(shape_args, st.integers(1, 4))
def test_compiled_mask_is_the_ancestor_relation(args: tuple[int, int, int, int, int], bs: int) -> None:
    seed, depth_limit, vocab, budget, topk = args
    logits = random_logits(seed, (bs, depth_limit, vocab))
    trees = build_trees(logits, budget, topk)
    roots = torch.arange(bs) + 1000
    starts = torch.arange(bs) * 7 + 3
    c = compile_trees(trees, roots, starts)
    assert c.mask.shape == (bs, budget + 1, budget + 1) and c.mask.dtype == torch.bool
    for b in range(bs):
        row = trees.row(b)
        n = row.num_nodes
        expected = np.zeros((budget + 1, budget + 1), dtype=bool)
        expected[: n + 1, : n + 1] = naive_ancestors(row.parents.tolist(), n)
        for j in range(n + 1, budget + 1):  # padding sees the root and itself
            expected[j, 0] = expected[j, j] = True
        assert np.array_equal(c.mask[b].numpy(), expected)
        assert c.input_ids[b].tolist() == [1000 + b] + row.tokens.tolist() + [1000 + b] * (budget - n)
        assert c.position_ids[b].tolist() == [int(starts[b]) + d for d in [0] + row.depths.tolist()] + [
            int(starts[b])
        ] * (budget - n)
        ids, pos, mask = compile_tree(row, 1000 + b, int(starts[b]))
        assert torch.equal(ids, c.input_ids[b, : n + 1]) and torch.equal(pos, c.position_ids[b, : n + 1])
        assert torch.equal(mask, c.mask[b, : n + 1, : n + 1])
        parents = row.parents.tolist()
        assert bool(is_chain(trees)[b]) == (parents == list(range(n)))
    if budget + 1 <= 64:
        assert c.bitmask is not None and c.bitmask.dtype == torch.int64
        assert torch.equal(expand_bitmask(c.bitmask, budget + 1), c.mask)
        for b, i in itertools.product(range(bs), range(budget + 1)):
            word = int(c.bitmask[b, i]) & ((1 << 64) - 1)
            assert [(word >> j) & 1 == 1 for j in range(budget + 1)] == c.mask[b, i].tolist()


@pytest.mark.parametrize("budget, has_bitmask", [(62, True), (63, True), (64, False)])
def test_bitmask_word_limit(budget: int, has_bitmask: bool) -> None:
    """B+1 <= 64 nodes fit one int64 (bit 63 is the sign bit); one more does not."""
    logits = random_logits(3, (2, 15, 40))
    trees = build_trees(logits, budget, 8)
    c = compile_trees(trees, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert (c.bitmask is not None) == has_bitmask
    if has_bitmask:
        assert torch.equal(expand_bitmask(c.bitmask, budget + 1), c.mask)


def test_expand_bitmask_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        expand_bitmask(torch.zeros(1, 65, dtype=torch.long), 65)


# -- walk -----------------------------------------------------------------------------------------
@SETTINGS
@given(shape_args, st.integers(1, 4), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_walk_matches_oracle(args: tuple[int, int, int, int, int], bs: int, p_follow: float, tseed: int) -> None:
    seed, depth_limit, vocab, budget, topk = args
    logits = random_logits(seed, (bs, depth_limit, vocab))
    trees = build_trees(logits, budget, topk)
    rng = np.random.default_rng(tseed)
    targets = rng.integers(0, vocab + 2, size=(bs, budget + 1))  # may name no child at all
    for b in range(bs):  # with probability p_follow the target picks one of the node's children
        row = trees.row(b)
        for node in range(budget + 1):
            kids = [i for i in range(1, row.num_nodes + 1) if int(row.parents[i - 1]) == node]
            if kids and rng.random() < p_follow:
                targets[b, node] = int(row.tokens[rng.choice(kids) - 1])
    target_t = torch.from_numpy(targets).long()
    accepted, lens, bonus = follow_trees(trees, target_t)
    assert accepted.shape == (bs, depth_limit + 1)
    compiled = compile_trees(trees, target_t[:, 0], torch.zeros(bs, dtype=torch.long))
    by_mask = follow_trees_by_mask(trees, compiled.mask, target_t)
    for got, want in zip(by_mask, (accepted, lens, bonus), strict=True):
        assert torch.equal(got, want), "the mask walk differs from the depth walk"
    for b in range(bs):
        row = trees.row(b)
        want, want_bonus = oracle_walk(row.tokens.tolist(), row.parents.tolist(), targets[b].tolist())
        assert follow_tree(row, target_t[b, : row.num_nodes + 1]) == (want, want_bonus)
        assert accepted[b].tolist() == want + [-1] * (depth_limit + 1 - len(want))
        assert int(lens[b]) == len(want) >= 1
        assert int(bonus[b]) == want_bonus


def test_walk_full_depth_and_immediate_rejection() -> None:
    depth_limit, vocab = 7, 30
    logits = random_logits(5, (2, depth_limit, vocab))
    trees = build_trees(logits, 10, 1)  # a chain of 7
    spine = logits.argmax(-1)  # [2, L]
    targets = torch.full((2, 11), vocab + 5)  # never a child's token
    targets[0, :depth_limit] = spine[0]  # row 0: the target agrees everywhere
    targets[0, depth_limit] = 17  # the bonus after the last node
    accepted, lens, bonus = follow_trees(trees, targets)
    assert accepted[0].tolist() == list(range(depth_limit + 1)) and int(lens[0]) == depth_limit + 1
    assert int(bonus[0]) == 17
    assert accepted[1].tolist() == [0] + [-1] * depth_limit and int(lens[1]) == 1
    assert int(bonus[1]) == vocab + 5
    assert follow_tree(trees.row(0), targets[0, :8]) == (list(range(8)), 17)
    assert follow_tree(trees.row(1), targets[1, :8]) == ([0], vocab + 5)


def test_follow_trees_rejects_wrong_shape() -> None:
    trees = build_trees(random_logits(0, (2, 3, 9)), 4, 2)
    with pytest.raises(ValueError, match="target_tokens"):
        follow_trees(trees, torch.zeros(2, 4, dtype=torch.long))
    mask = torch.ones(2, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="target_tokens"):
        follow_trees_by_mask(trees, mask, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 5, 5\)"):
        follow_trees_by_mask(trees, mask[:, :4, :4], torch.zeros(2, 5, dtype=torch.long))


def _ops(fn) -> int:
    """How many tensor ops fn dispatches (each one a kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("budget", [8, 32])
def test_mask_walk_op_count_does_not_grow_with_depth(budget: int) -> None:
    """The mask walk is a fixed number of ops; the depth walk pays a few per depth (kernel launches)."""
    counts = {}
    for depth in (3, 15):
        trees = build_trees(random_logits(depth, (4, depth, 50)), budget, 4)
        targets = torch.randint(0, 50, (4, budget + 1), generator=torch.Generator().manual_seed(depth))
        mask = compile_trees(trees, targets[:, 0], torch.zeros(4, dtype=torch.long)).mask
        counts[depth] = (_ops(functools.partial(follow_trees_by_mask, trees, mask, targets)),
                         _ops(functools.partial(follow_trees, trees, targets)))
    assert counts[3][0] == counts[15][0] <= 30, counts
    assert counts[15][1] > counts[3][1] + 40, counts  # the depth walk: the baseline it replaces


# -- compaction -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "accepted, length, src, contiguous",
    [
        pytest.param([0, 1, 2, -1], 3, [0, 1, 2, 3], True, id="already-contiguous"),
        pytest.param([0, -1, -1, -1], 1, [0, 1, 2, 3], True, id="root-only"),
        pytest.param([0, 2, 5, -1], 3, [0, 2, 5, 3], False, id="branch"),
        pytest.param([0, 1, 4, 6], 4, [0, 1, 4, 6], False, id="full-depth-branch"),
    ],
)
def test_compaction_indices_examples(accepted: list[int], length: int, src: list[int], contiguous: bool) -> None:
    got_src, got_contiguous = compaction_indices(torch.tensor([accepted]), torch.tensor([length]))
    assert got_src.tolist() == [src] and got_contiguous.tolist() == [contiguous]


@SETTINGS
@given(shape_args, st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_compaction_indices_after_walk(args: tuple[int, int, int, int, int], bs: int, tseed: int) -> None:
    seed, depth_limit, vocab, budget, topk = args
    trees = build_trees(random_logits(seed, (bs, depth_limit, vocab)), budget, topk)
    gen = torch.Generator().manual_seed(tseed)
    targets = torch.randint(0, vocab, (bs, budget + 1), generator=gen)
    accepted, lens, _ = follow_trees(trees, targets)
    src, contiguous = compaction_indices(accepted, lens)
    for b in range(bs):
        n = int(lens[b])
        want = accepted[b, :n].tolist() + list(range(n, depth_limit + 1))
        assert src[b].tolist() == want
        assert bool(contiguous[b]) == (want == list(range(depth_limit + 1)))


# -- no host sync ---------------------------------------------------------------------------------
def _batched_round(device: str | torch.device, logits: torch.Tensor) -> None:
    trees = build_trees(logits, 12, 3)
    bs = logits.shape[0]
    roots = torch.zeros(bs, dtype=torch.long, device=device)
    c = compile_trees(trees, roots, roots + 5)
    accepted, lens, _ = follow_trees(trees, c.input_ids)
    follow_trees_by_mask(trees, c.mask, c.input_ids)
    compaction_indices(accepted, lens)
    is_chain(trees)
    if c.bitmask is not None:
        expand_bitmask(c.bitmask, 13)


def test_batched_path_runs_on_meta_tensors() -> None:
    """Meta tensors have shapes but no data: anything that reads a value on the host (.item(),
    .tolist(), bool(), nonzero, boolean-mask indexing) raises, so a clean run means no sync."""
    logits = torch.empty(4, 5, 1000, device="meta")  # V large enough for the block top-k
    _batched_round("meta", logits)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check can fail
        build_trees(logits, 12, 3).num_nodes.tolist()


def test_batched_path_never_reads_values_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, forbid every Tensor method that hands a value to Python. Torch's own C++ never
    goes through these Python methods, so only our code can trip them."""

    def forbidden(name: str):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called")

        return raise_

    logits = random_logits(0, (4, 5, 32000))  # large enough for the chunked vocabulary pass
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setattr(torch, "nonzero", forbidden("nonzero"))
    monkeypatch.setattr(torch, "masked_select", forbidden("masked_select"))
    _batched_round("cpu", logits)
    with pytest.raises(AssertionError, match="host sync"):  # the check can fail
        build_tree(logits[0], 12, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; run on a GPU host with -m gpu")
def test_batched_path_has_no_cuda_sync() -> None:
    logits = random_logits(0, (8, 7, 1000)).cuda()
    _batched_round("cuda", logits)  # warm up (first calls may allocate/sync in the allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _batched_round("cuda", logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = build_trees(logits.cpu(), 12, 3)
    gpu = build_trees(logits, 12, 3)
    for b in range(8):
        assert sorted(cpu.row(b).log_probs.tolist()) == pytest.approx(sorted(gpu.row(b).log_probs.tolist()))
