"""DDTree core: draft-tree build (reference heap and batched), compile, walk and compaction indices.

The vocabulary pass before the build (per-depth top-K log-probs) is ddtree.vocab_pass; top_log_probs and
top_log_probs_fast are re-exported here.

Pure tensor code; it knows nothing of models, caches or sampling. Shapes: `bs` batch rows, `L`
drafted positions (max depth), `V` vocabulary, `K = min(topk, V)` candidates per depth, `B` budget
(non-root nodes). Node 0 is the root (the bonus token); nodes 1..n are numbered so that a parent's
index is always smaller than its child's.

Two implementations of every step live side by side:

* `build_tree` / `compile_tree` / `follow_tree` work on one request with Python loops. They are the
  paper's reference (best-first heap, pop order) and what the batched path is tested against.
* `build_trees` / `compile_trees` / `follow_trees` / `compaction_indices` work on a batch with
  tensor ops on the logits' device, loop only over depth and never wait for the host (no `.item()`,
  `.tolist()`, `nonzero` or boolean-mask indexing), so a GPU decode loop never stalls on them.

Tie-breaking (exact equal path scores):
* the heap orders candidates like the Python tuple (-score, rank tuple): on equal scores the
  lexicographically smaller rank path wins and a prefix sorts before its extensions;
* the batched build orders by score with a stable sort over depth-major candidate slots: on equal
  scores the shallower node wins, then the better per-depth slot.
Both always yield a valid prefix-closed tree of the B best paths; when scores tie exactly at the
cut (the B-th and (B+1)-th best paths are equal) the two may pick different, equally good, nodes.
Otherwise the node sets are identical, and so is the node order when no two scores tie at all.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.errors import ConfigError
from ddtree.vocab_pass import top_log_probs, top_log_probs_fast

__all__ = [
    "CompiledTrees",
    "DraftTree",
    "DraftTrees",
    "build_tree",
    "build_trees",
    "check_budget_topk",
    "check_logits",
    "compaction_indices",
    "compile_tree",
    "compile_trees",
    "expand_bitmask",
    "follow_tree",
    "follow_trees",
    "follow_trees_by_mask",
    "is_chain",
    "select_tree",
    "select_trees",
    "top_log_probs",
    "top_log_probs_fast",
]

BITMASK_MAX_NODES = 64  # one int64 word per row


@dataclass
class DraftTree:
    """One request's draft tree; node i (1-based) is entry i-1 of every field."""

    tokens: torch.Tensor  # [n] long, token id of each node
    parents: torch.Tensor  # [n] long, parent node index (0 = root), always < own index
    depths: torch.Tensor  # [n] long, 1..L
    log_probs: torch.Tensor  # [n] float32, path score: sum of log q_i along the path

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class DraftTrees:
    """A batch of draft trees padded to the budget.

    Padded entries (index >= num_nodes[b]) hold token 0, parent 0, depth 0, log_prob -inf.
    `max_depth` is L, the depth the trees were built for (a Python int, so shape decisions
    downstream never read the device).
    """

    tokens: torch.Tensor  # [bs, B] long
    parents: torch.Tensor  # [bs, B] long
    depths: torch.Tensor  # [bs, B] long
    log_probs: torch.Tensor  # [bs, B] float32
    num_nodes: torch.Tensor  # [bs] long
    max_depth: int

    @property
    def budget(self) -> int:
        return int(self.tokens.shape[1])

    def row(self, b: int) -> DraftTree:
        """Row b as a DraftTree (reads num_nodes: a host sync; for tests and debugging)."""
        n = int(self.num_nodes[b])
        return DraftTree(self.tokens[b, :n], self.parents[b, :n], self.depths[b, :n], self.log_probs[b, :n])


@dataclass
class CompiledTrees:
    """Verify inputs for a batch of trees (root + B nodes per row)."""

    input_ids: torch.Tensor  # [bs, B+1] long: root token, then node tokens (root token on padding)
    position_ids: torch.Tensor  # [bs, B+1] long: start + depth (start on padding)
    mask: torch.Tensor  # [bs, B+1, B+1] bool: mask[b, i, j] iff j is an ancestor-or-self of i
    bitmask: torch.Tensor | None  # [bs, B+1] int64, bit j of [b, i] == mask[b, i, j]; None if B+1 > 64


# -- validation (shared with ddtree.kernels.tree_ops' fused path) ---------------------------------
def check_budget_topk(budget: int, topk: int) -> None:
    for name, value in (("budget", budget), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: {value!r} is not an integer (allowed range >= 1)")
        if value < 1:
            raise ConfigError(f"{name}: {value} is out of range (allowed >= 1)")


def check_logits(logits: torch.Tensor, dims: int, shape: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != dims:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected a tensor of shape {shape}, got {got}")
    if logits.shape[-2] < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: L and V must be >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating dtype, got {logits.dtype}")


def _f32(x: float) -> float:
    """Round a Python float to float32, so the heap adds scores exactly like the tensor path."""
    return float(np.float32(x))


# -- reference heap -------------------------------------------------------------------------------
def build_tree(logits: torch.Tensor, budget: int, topk: int) -> DraftTree:
    """The paper's best-first heap over one request's drafter logits[L, V].

    Pops the best candidate path, adds it as the next node, then pushes its next sibling (same
    parent, next rank at that depth) and its first child (rank 0 one depth deeper). The result is
    the first `budget` paths in the order (-score, rank tuple), in that order.
    """
    check_budget_topk(budget, topk)
    check_logits(logits, 2, "[L, V]")
    log_probs, ids = top_log_probs(logits, topk)  # [L, K]
    return select_tree(log_probs, ids, budget)


def select_tree(log_probs: torch.Tensor, ids: torch.Tensor, budget: int) -> DraftTree:
    """The heap itself, from top_log_probs' output (log_probs[L, K], ids[L, K]): build_tree after the
    vocabulary pass (ddtree.profiling.tree_cpu times it alone)."""
    depth_limit, k = int(log_probs.shape[0]), int(log_probs.shape[1])
    lp = log_probs.tolist()
    tok = ids.tolist()

    # entry: (-score, rank tuple, parent node, depth, rank, parent score, score); the rank tuple
    # is unique per path, so comparisons never reach the fields after it.
    first = lp[0][0]
    heap: list[tuple[float, tuple[int, ...], int, int, int, float, float]] = [
        (-first, (0,), 0, 1, 0, 0.0, first)
    ]
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, parent_score, score = heapq.heappop(heap)
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        node = len(tokens)
        if rank + 1 < k:  # next sibling
            s = _f32(parent_score + lp[depth - 1][rank + 1])
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, parent_score, s))
        if depth < depth_limit:  # first child
            s = _f32(score + lp[depth][0])
            heapq.heappush(heap, (-s, ranks + (0,), node, depth + 1, 0, score, s))

    device = log_probs.device
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        log_probs=torch.tensor(scores, dtype=torch.float32, device=device),
    )


def compile_tree(
    tree: DraftTree, root_token: int | torch.Tensor, start: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify inputs for one tree: (input_ids[n+1], position_ids[n+1], mask[n+1, n+1] bool).

    Row i of the mask marks node i's ancestors and itself (row 0: the root only).
    """
    n = tree.num_nodes
    device = tree.tokens.device
    root = torch.tensor([int(root_token)], dtype=torch.long, device=device)
    input_ids = torch.cat([root, tree.tokens.long()])  # [n+1]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    position_ids = int(start) + torch.cat([zero, tree.depths.long()])  # [n+1]
    parents = tree.parents.tolist()
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[0, 0] = True
    for i, parent in enumerate(parents, start=1):  # parents come first, so their rows are done
        mask[i] = mask[parent]
        mask[i, i] = True
    return input_ids, position_ids, torch.from_numpy(mask).to(device)


def follow_tree(tree: DraftTree, target_tokens: torch.Tensor | list[int]) -> tuple[list[int], int]:
    """Walk a verified tree: (accepted node indices starting with 0, bonus token).

    target_tokens[n+1] is the target's choice at every node. From the root, while the target's
    token at the current node is the token of one of its children, move to that child.
    """
    targets = target_tokens.tolist() if isinstance(target_tokens, torch.Tensor) else list(target_tokens)
    n = tree.num_nodes
    if len(targets) < n + 1:
        raise ValueError(f"target_tokens: need n+1 = {n + 1} entries, got {len(targets)}")
    children: list[dict[int, int]] = [{} for _ in range(n + 1)]
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()), start=1):
        children[parent][token] = i
    accepted = [0]
    node = 0
    while (child := children[node].get(targets[node])) is not None:
        accepted.append(child)
        node = child
    return accepted, int(targets[node])


# -- batched, on device, no host sync -------------------------------------------------------------
def build_trees(logits: torch.Tensor, budget: int, topk: int) -> DraftTrees:
    """The top-`budget` paths of every row of logits[bs, L, V], on the logits' device.

    Per depth d keep the best B paths of the (B x K) extensions of depth d-1's best B (a path in
    the global top-B at depth d always extends one in the top-B at depth d-1), then take the
    global top B over all depths. Nodes are ordered by score, best first, with a stable sort over
    depth-major slots, so a parent precedes its child even when a log-prob is exactly 0.
    """
    check_budget_topk(budget, topk)
    check_logits(logits, 3, "[bs, L, V]")
    log_probs, ids = top_log_probs_fast(logits, topk)  # [bs, L, K]
    return select_trees(log_probs, ids, budget)


def _order_key(scores: torch.Tensor) -> torch.Tensor:
    """scores[bs, N] float32 -> int64 keys, larger = better: by score, then by lower index.

    The float bits are mapped to an int32 with the same order, shifted up, and the reversed
    index fills the low word, so a plain (fast) top-k gives exactly a stable descending sort.
    """
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    n = scores.shape[-1]
    return (monotone << 32) | (n - 1 - torch.arange(n, device=scores.device))


def select_trees(log_probs: torch.Tensor, ids: torch.Tensor, budget: int) -> DraftTrees:
    """The batched selection itself, from top_log_probs' output (log_probs[bs, L, K], ids[bs, L, K]): build_trees
    after the vocabulary pass (the reference of ddtree.kernels.tree_ops.select_trees_triton)."""
    bs, depth_limit, k = log_probs.shape
    b = budget
    device = log_probs.device

    # Per depth, B slots: score and flat = parent slot * K + rank into that depth's (B x K)
    # candidates. Depth 1 has one virtual parent (slot 0); slots beyond K are -inf padding.
    width = min(k, b)
    score = log_probs.new_full((bs, b), float("-inf"))
    score[:, :width] = log_probs[:, 0, :width]  # topk order: the best `width` tokens
    flat = torch.arange(b, device=device).clamp_(max=k - 1).expand(bs, b)
    scores = [score]
    flats = [flat]
    for d in range(1, depth_limit):
        cand = score[:, :, None] + log_probs[:, d, None, :]  # [bs, B, K]
        score, flat = cand.reshape(bs, b * k).topk(b, dim=-1, sorted=False)  # [bs, B]
        scores.append(score)
        flats.append(flat)

    all_scores = torch.stack(scores, dim=1).reshape(bs, depth_limit * b)  # [bs, L*B], depth-major
    _, sel = _order_key(all_scores).topk(b, dim=-1)  # [bs, B] slot of node i+1, best first
    sel_scores = all_scores.gather(1, sel)  # [bs, B]
    valid = sel_scores > float("-inf")  # padding slots are the only -inf scores (see ddtree.vocab_pass.LOG_PROB_FLOOR)
    num_nodes = valid.sum(dim=-1)  # [bs]

    depth0 = sel // b  # [bs, B] 0-based depth
    sel_flat = torch.stack(flats, dim=1).reshape(bs, depth_limit * b).gather(1, sel)  # [bs, B]
    rank = sel_flat % k
    node_tokens = ids.reshape(bs, depth_limit * k).gather(1, depth0 * k + rank)
    # parents: slot (depth0-1, sel_flat // K) -> node index through a slot -> node table; a
    # valid node's parent slot is always selected too (it scores >= the child and sorts first)
    node_ids = torch.arange(1, b + 1, device=device).expand(bs, b)
    slot_to_node = torch.zeros(bs, depth_limit * b, dtype=torch.long, device=device)
    slot_to_node.scatter_(1, sel, node_ids)
    parent_flat = ((depth0 - 1) * b + sel_flat // k).clamp_(min=0)
    parents = torch.where(depth0 > 0, slot_to_node.gather(1, parent_flat), 0)

    return DraftTrees(
        tokens=torch.where(valid, node_tokens, 0),
        parents=torch.where(valid, parents, 0),
        depths=torch.where(valid, depth0 + 1, 0),
        log_probs=sel_scores,  # padding is already -inf
        num_nodes=num_nodes,
        max_depth=depth_limit,
    )


def _full_parents(trees: DraftTrees) -> torch.Tensor:
    """parents over nodes 0..B: [bs, B+1] long; the root and padding nodes point at the root."""
    root = torch.zeros_like(trees.parents[:, :1])
    return torch.cat([root, trees.parents], dim=1)


def compile_trees(trees: DraftTrees, root_tokens: torch.Tensor, starts: torch.Tensor) -> CompiledTrees:
    """Verify inputs for a batch (see CompiledTrees); ancestors found with a loop over depth only.

    root_tokens[bs] long, starts[bs] long (the committed length: the root's position).
    """
    bs, b = trees.tokens.shape
    device = trees.tokens.device
    n = b + 1
    root_tokens = torch.as_tensor(root_tokens, dtype=torch.long, device=device).reshape(bs)
    starts = torch.as_tensor(starts, dtype=torch.long, device=device).reshape(bs)
    valid = trees.depths > 0  # [bs, B]
    node_tokens = torch.where(valid, trees.tokens, root_tokens[:, None])
    input_ids = torch.cat([root_tokens[:, None], node_tokens], dim=1)  # [bs, B+1]
    depths = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)
    position_ids = starts[:, None] + depths  # [bs, B+1]; padding has depth 0

    parents = _full_parents(trees)  # [bs, B+1]
    mask = torch.eye(n, dtype=torch.bool, device=device).repeat(bs, 1, 1)  # [bs, B+1, B+1]
    cur = torch.arange(n, device=device).expand(bs, n)  # [bs, B+1]: walking ancestor of each node
    for _ in range(trees.max_depth):  # a node has at most L ancestors besides the root
        cur = parents.gather(1, cur)
        mask.scatter_(2, cur[:, :, None], True)  # the root is its own parent: a fixed point

    bitmask = None
    if n <= BITMASK_MAX_NODES:
        # distinct bits, so the sum is the OR; bit 63 wraps to the sign bit, as intended
        weights = torch.ones(n, dtype=torch.long, device=device) << torch.arange(n, device=device)
        bitmask = (mask.long() * weights).sum(dim=-1)  # [bs, B+1]
    return CompiledTrees(input_ids, position_ids, mask, bitmask)


def expand_bitmask(bitmask: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """bitmask[..., N] int64 -> mask[..., N, num_nodes] bool (bit j of word i is mask[i, j])."""
    if not 1 <= num_nodes <= BITMASK_MAX_NODES:
        raise ValueError(f"num_nodes: {num_nodes} is out of range (allowed 1..{BITMASK_MAX_NODES})")
    shifts = torch.arange(num_nodes, device=bitmask.device)
    return ((bitmask[..., None] >> shifts) & 1).bool()


def is_chain(trees: DraftTrees) -> torch.Tensor:
    """[bs] bool: row b's tree is the single chain 1 -> 2 -> ... -> n (causal attention suffices)."""
    expected = torch.arange(trees.budget, device=trees.parents.device)  # node i+1's parent is i
    valid = trees.depths > 0
    return ((trees.parents == expected) | ~valid).all(dim=-1)


def follow_trees(
    trees: DraftTrees, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every row's verified tree on device, one depth per step.

    target_tokens[bs, B+1] -> (accepted[bs, L+1] long padded with -1 (root 0 first),
    accept_lens[bs] long >= 1, bonus[bs] long: the target's token at the last accepted node).
    """
    bs, b = trees.tokens.shape
    if tuple(target_tokens.shape) != (bs, b + 1):
        raise ValueError(f"target_tokens: expected shape {(bs, b + 1)}, got {tuple(target_tokens.shape)}")
    device = trees.tokens.device
    target_tokens = target_tokens.to(device=device, dtype=torch.long)
    depth_limit = trees.max_depth
    valid = trees.depths > 0  # [bs, B]
    node_ids = torch.arange(1, b + 1, device=device)  # [B]
    cur = torch.zeros(bs, dtype=torch.long, device=device)  # current node per row
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    accepted = torch.full((bs, depth_limit + 1), -1, dtype=torch.long, device=device)
    accepted[:, 0] = 0
    for d in range(1, depth_limit + 1):
        want = target_tokens.gather(1, cur[:, None])  # [bs, 1]
        match = valid & (trees.parents == cur[:, None]) & (trees.tokens == want)  # [bs, B], <= 1 true
        child = (match * node_ids).amax(dim=-1)  # [bs], 0 when no child matches
        alive = alive & (child > 0)
        cur = torch.where(alive, child, cur)
        accepted[:, d] = torch.where(alive, cur, -1)
    accept_lens = (accepted >= 0).sum(dim=-1)  # [bs], a walk never resumes once it stops
    bonus = target_tokens.gather(1, cur[:, None]).squeeze(1)
    return accepted, accept_lens, bonus


def follow_trees_by_mask(
    trees: DraftTrees, mask: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """follow_trees' result from the compiled ancestor-or-self mask, with no loop over depth.

    mask[bs, B+1, B+1] bool (CompiledTrees.mask). A node is on the accepted path iff it and every
    ancestor agree with the target's token at their parent; siblings carry distinct tokens (the
    top-k of one position), so those nodes form a single path, one per depth. 28 tensor ops whatever
    the depth, against 61 + 16 per depth beyond 3 for the walk (125 at depth 7): on a GPU, where a
    round is made of small kernels, the kernel count is the cost.
    """
    bs, b = trees.tokens.shape
    if tuple(target_tokens.shape) != (bs, b + 1):
        raise ValueError(f"target_tokens: expected shape {(bs, b + 1)}, got {tuple(target_tokens.shape)}")
    if tuple(mask.shape) != (bs, b + 1, b + 1):
        raise ValueError(f"mask: expected shape {(bs, b + 1, b + 1)}, got {tuple(mask.shape)}")
    device = trees.tokens.device
    target_tokens = target_tokens.to(device=device, dtype=torch.long)
    depth_limit = trees.max_depth
    agrees = (trees.depths > 0) & (trees.tokens == target_tokens.gather(1, trees.parents))  # [bs, B]
    agrees = torch.cat([torch.ones_like(agrees[:, :1]), agrees], dim=1)  # the root always stands
    on_path = ~(mask & ~agrees[:, None, :]).any(dim=-1)  # [bs, B+1]: every ancestor-or-self agrees
    depths = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)  # [bs, B+1]
    # node i of the path goes to column depth[i]; everything else to a spare column, dropped after
    column = torch.where(on_path, depths, depth_limit + 1)
    nodes = torch.arange(b + 1, device=device).expand(bs, -1)
    accepted = torch.full((bs, depth_limit + 2), -1, dtype=torch.long, device=device)
    accepted = accepted.scatter(1, column, nodes)[:, : depth_limit + 1]
    accept_lens = on_path.sum(dim=-1)
    deepest = (on_path * (depths + 1)).argmax(dim=-1, keepdim=True)  # [bs, 1]
    bonus = target_tokens.gather(1, deepest).squeeze(1)
    return accepted, accept_lens, bonus


def compaction_indices(accepted: torch.Tensor, accept_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV moves after a walk: (src[bs, L+1] long, contiguous[bs] bool).

    src[b, j] = accepted[b, j] for j < accept_lens[b], else j (a no-op move), so tree slot
    src[b, j] moves to slot j. contiguous[b] says the accepted path is already 0, 1, 2, ...
    and the copy can be skipped.
    """
    width = accepted.shape[-1]
    j = torch.arange(width, device=accepted.device)  # [L+1]
    src = torch.where(j < accept_lens[:, None], accepted, j)  # [bs, L+1]
    contiguous = (src == j).all(dim=-1)
    return src, contiguous
