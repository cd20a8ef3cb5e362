"""Tree build, compile and walk for a batch, in Triton kernels, with ddtree.tree's torch code as reference.

The torch versions in ddtree.tree loop over depth with a handful of small ops per step (~76 kernels for
the selection at L = 7, ~35 for the compile, 28 for the walk); on a GPU each is a launch of a few
microseconds, which is more than the arithmetic. Here one program per row does the whole step in
registers:

* vocabulary pass: per drafted position, the log-softmax statistics and the top K token ids in one
  pass over the vocabulary (the torch version is ~10 kernels).
* select: per depth, the best B of the B x K extensions, then the best B over all depths. Candidates
  are ranked by sorting packed int64 keys (order-preserving float32 bits of the score in the high word,
  the reversed candidate index in the low word), so a descending sort is a stable descending sort by
  score; the sorted keys go through a small scratch buffer to read the first B back.
* compile: input ids, positions, the ancestor-or-self mask and its packed words, by walking every
  node's parent chain L times.
* walk: the nodes whose every ancestor-or-self agrees with the target's token at its parent (the
  packed words against the packed agreement bits), their depths as columns, the deepest one's token.

Given the same log-probs, select, compile and walk equal the torch versions bit for bit (the same float32
additions in the same order); only exact score ties may pick or order different, equally good, nodes, as
between the heap and the torch selection. The vocabulary pass gives the same ids and log-probs equal to
float32 rounding (its log-sum-exp adds in another order). Trees of more than MAX_FUSED_NODES nodes (budget >= 128) use the torch code.
"""

from __future__ import annotations

from typing import Literal

import torch

from ddtree import tree as tree_torch
from ddtree.kernels.bitmask import num_words
from ddtree.tree import CompiledTrees, DraftTrees
from ddtree.vocab_pass import LOG_PROB_FLOOR

try:  # Triton is optional: CPU machines use the torch code (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
MAX_FUSED_NODES = 128  # root + budget; the compile holds an n x n mask tile in registers
_MAX_SORT = 4096  # keys one program sorts (B x K candidates per depth, L x B slots overall)
_MAX_TOPK = 64  # the vocabulary pass keeps its best K in registers


def _mono_key(x: float) -> int:
    """The int32 a float32 maps to in the kernels' order-preserving encoding (for the -inf padding key)."""
    bits = int(torch.tensor([x], dtype=torch.float32).view(torch.int32))
    return bits ^ 0x7FFFFFFF if bits < 0 else bits


_NEG_KEY = _mono_key(float("-inf")) << 32  # a padding slot: scores below every real path


def fused_fits(budget: int, topk: int, depth: int) -> bool:
    """Whether the fused kernels take a tree of this shape (else the torch code runs)."""
    if triton is None:
        return False
    bp, kp, lp = (triton.next_power_of_2(v) for v in (budget, topk, depth))
    return budget + 1 <= MAX_FUSED_NODES and topk <= _MAX_TOPK and bp * kp <= _MAX_SORT and lp * bp <= _MAX_SORT


if triton is not None:

    @triton.jit
    def _to_key(x):
        # float32 -> int32 with the same order (negative floats: flip the magnitude bits)
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _from_key(k):
        bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _bit_or(a, b):
        return a | b

    @triton.jit
    def _top_kernel(X, VAL, IDS, V, s_r, floor, PM, PT, PK, chunk, K: tl.constexpr, KPAD: tl.constexpr,
                    BLOCK_V: tl.constexpr, SPLITS: tl.constexpr):
        # one program per (row, depth) x vocabulary split: log-softmax statistics and the top K in one pass
        # over its share of V; SPLITS > 1 writes the partials (max, sum, best keys) for _top_merge_kernel
        r = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, V)
        offs = tl.arange(0, BLOCK_V)
        kk = tl.arange(0, KPAD)
        none = -9223372036854775807 - 1  # int64 min: an empty slot, below every real key
        # best K as keys (score key << 32 | reversed id): empty slots lose to any token, pad slots never do
        best = tl.where(kk < K, none, 9223372036854775807).to(tl.int64)
        m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
        for start in range(lo, hi, BLOCK_V):
            cols = start + offs
            x = tl.load(X + r * s_r + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf anywhere
            total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m = m_new
            x = tl.where(x == 0.0, 0.0, x)  # -0.0 and 0.0 share a key
            keys = tl.where(cols < hi, (_to_key(x).to(tl.int64) << 32) | (2147483647 - cols), none)
            for _ in range(K):  # this chunk's best K, each replacing the current worst if better
                top = tl.max(keys, axis=0)
                keys = tl.where(keys == top, none, keys)
                worst = tl.min(best, axis=0)
                slot = tl.argmin(best, axis=0)
                best = tl.where((kk == slot) & (top > worst), top, best)
        if SPLITS == 1:
            _top_store(VAL, IDS, r, best, m, total, floor, K, KPAD)
        else:
            part = r * SPLITS + split
            tl.store(PM + part, m)
            tl.store(PT + part, total)
            tl.store(PK + part * KPAD + kk, tl.where(kk < K, best, none))

    @triton.jit
    def _top_store(VAL, IDS, r, best, m, total, floor, K: tl.constexpr, KPAD: tl.constexpr):
        kk = tl.arange(0, KPAD)
        none = -9223372036854775807 - 1
        best = tl.sort(tl.where(kk < K, best, none), descending=True)
        value = _from_key((best >> 32).to(tl.int32))
        token = 2147483647 - (best & 0xFFFFFFFF)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        finite = value > float("-inf")
        lp = tl.where(finite, value, 0.0) - m_safe - tl.log(tl.where(total > 0.0, total, 1.0))
        lp = tl.minimum(tl.where(finite, tl.maximum(lp, floor), floor), 0.0)
        tl.store(VAL + r * K + kk, lp, mask=kk < K)
        tl.store(IDS + r * K + kk, token, mask=kk < K)

    @triton.jit
    def _top_merge_kernel(VAL, IDS, PM, PT, PK, floor, K: tl.constexpr, KPAD: tl.constexpr, SPLITS: tl.constexpr):
        # one program per row: the splits' maxima and sums into one log-sum-exp, their best keys into the top K
        r = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, SPLITS)
        m_s = tl.load(PM + r * SPLITS + sp)
        t_s = tl.load(PT + r * SPLITS + sp)
        m = tl.max(m_s, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.where(m_s == float("-inf"), 0.0, t_s * tl.exp(m_s - m_safe)), axis=0)
        flat = tl.arange(0, SPLITS * KPAD)
        keys = tl.load(PK + r * SPLITS * KPAD + flat)
        kk = tl.arange(0, KPAD)
        none = -9223372036854775807 - 1
        best = tl.full([KPAD], none, tl.int64)
        for i in tl.static_range(K):  # keys are distinct (ids differ) but for empty slots
            top = tl.max(keys, axis=0)
            keys = tl.where(keys == top, none, keys)
            best = tl.where(kk == i, top, best)
        _top_store(VAL, IDS, r, best, m, total, floor, K, KPAD)

    @triton.jit
    def _select_kernel(
        LP, IDS, TOK, PAR, DEP, SCORE, NUM, SORT_BUF, SLOT_KEYS, SLOT_NODE, neg_key,
        s_lp_b, s_lp_l, s_lp_k, s_id_b, s_id_l, s_id_k,
        L: tl.constexpr, K: tl.constexpr, B: tl.constexpr,
        LPAD: tl.constexpr, KPAD: tl.constexpr, BPAD: tl.constexpr, SORT_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        C: tl.constexpr = BPAD * KPAD  # candidates per depth: slot * KPAD + rank
        S: tl.constexpr = LPAD * BPAD  # slots over all depths, depth-major
        lp = LP + row * s_lp_b
        sort_buf = SORT_BUF + row * SORT_N
        slot_keys = SLOT_KEYS + row * S
        slot_node = SLOT_NODE + row * S
        offs_b = tl.arange(0, BPAD)
        offs_k = tl.arange(0, KPAD)
        low = 0xFFFFFFFF

        # depth 1: the best min(K, B) tokens under the root (candidate index = rank)
        score = tl.load(lp + offs_b * s_lp_k, mask=(offs_b < K) & (offs_b < B), other=float("-inf"))
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 must share a key
        keys = (_to_key(score).to(tl.int64) << 32) | (C - 1 - offs_b)
        tl.store(slot_keys + offs_b, keys)
        for d in range(1, L):
            lpd = tl.load(lp + d * s_lp_l + offs_k * s_lp_k, mask=offs_k < K, other=float("-inf"))
            cand = score[:, None] + lpd[None, :]  # [BPAD, KPAD]
            cand = tl.where(cand == 0.0, 0.0, cand)
            index = offs_b[:, None] * KPAD + offs_k[None, :]
            ck = (_to_key(cand).to(tl.int64) << 32) | (C - 1 - index)
            ck = tl.sort(tl.reshape(ck, [C]), descending=True)
            tl.store(sort_buf + tl.arange(0, C), ck)
            tl.debug_barrier()
            keys = tl.load(sort_buf + offs_b)  # the best BPAD, best first
            tl.debug_barrier()  # every thread has read before the next depth overwrites the buffer
            keys = tl.where(offs_b < B, keys, neg_key)
            tl.store(slot_keys + d * BPAD + offs_b, keys)
            score = _from_key((keys >> 32).to(tl.int32))
        tl.debug_barrier()

        # the best B over all depths; on equal scores the lower (shallower, better) slot first
        offs_s = tl.arange(0, S)
        sk = tl.load(slot_keys + offs_s, mask=offs_s < L * BPAD, other=0)
        sk = tl.where(offs_s < L * BPAD, sk, neg_key)
        gk = ((sk >> 32) << 32) | (S - 1 - offs_s)
        gk = tl.sort(gk, descending=True)
        tl.store(sort_buf + offs_s, gk)
        tl.debug_barrier()
        nk = tl.load(sort_buf + offs_b)  # node i + 1 = the i-th best slot
        slot = S - 1 - (nk & low)
        node_score = _from_key((nk >> 32).to(tl.int32))
        valid = (node_score > float("-inf")) & (offs_b < B)
        depth0 = slot // BPAD
        cand_index = C - 1 - (tl.load(slot_keys + slot, mask=offs_b < B, other=0) & low)
        rank = cand_index % KPAD
        token = tl.load(IDS + row * s_id_b + depth0 * s_id_l + rank * s_id_k, mask=valid, other=0)
        # parents: the parent's slot -> its node index, through a slot -> node table (a valid node's
        # parent slot is always selected: it scores at least as much and sorts first)
        tl.store(slot_node + offs_s, tl.zeros([S], dtype=tl.int64))
        tl.debug_barrier()
        tl.store(slot_node + slot, (offs_b + 1).to(tl.int64), mask=valid)
        tl.debug_barrier()
        parent_slot = (depth0 - 1) * BPAD + cand_index // KPAD
        has_parent = valid & (depth0 > 0)
        parent = tl.load(slot_node + parent_slot, mask=has_parent, other=0)
        out = row * B + offs_b
        keep = offs_b < B
        tl.store(TOK + out, tl.where(valid, token, 0), mask=keep)
        tl.store(PAR + out, tl.where(has_parent, parent, 0), mask=keep)
        tl.store(DEP + out, tl.where(valid, depth0 + 1, 0).to(tl.int64), mask=keep)
        tl.store(SCORE + out, tl.where(valid, node_score, float("-inf")), mask=keep)
        tl.store(NUM + row, tl.sum(valid.to(tl.int64), axis=0))

    @triton.jit
    def _compile_kernel(
        TOK, PAR, DEP, ROOT, START, IDS_OUT, POS_OUT, MASK_OUT, WORDS_OUT,
        s_t_b, s_t_n, s_p_b, s_p_n, s_d_b, s_d_n, s_w_b, s_w_n, s_w_w,
        N, W,
        L: tl.constexpr, NPAD: tl.constexpr, WPAD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NPAD)  # node index; 0 is the root
        offs_w = tl.arange(0, WPAD)
        is_node = (offs >= 1) & (offs < N)
        dep = tl.load(DEP + row * s_d_b + (offs - 1) * s_d_n, mask=is_node, other=0)
        tok = tl.load(TOK + row * s_t_b + (offs - 1) * s_t_n, mask=is_node, other=0)
        root = tl.load(ROOT + row)
        start = tl.load(START + row)
        in_tree = offs < N
        tl.store(IDS_OUT + row * N + offs, tl.where(dep > 0, tok, root), mask=in_tree)
        tl.store(POS_OUT + row * N + offs, start + dep, mask=in_tree)

        one = tl.full([NPAD, WPAD], 1, tl.int64)
        cur = offs.to(tl.int64)
        mask = offs[:, None] == offs[None, :]  # [NPAD, NPAD] ancestor-or-self
        words = tl.where((cur // 64)[:, None] == offs_w[None, :], one << (cur % 64)[:, None], 0)
        for _ in range(L):  # a node has at most L ancestors besides the root, which is its own parent
            cur = tl.load(PAR + row * s_p_b + (cur - 1) * s_p_n, mask=(cur >= 1) & (cur < N), other=0)
            mask = mask | (cur[:, None] == offs[None, :])
            words = words | tl.where((cur // 64)[:, None] == offs_w[None, :], one << (cur % 64)[:, None], 0)
        tl.store(MASK_OUT + row * N * N + offs[:, None] * N + offs[None, :], mask.to(tl.int8),
                 mask=in_tree[:, None] & in_tree[None, :])
        tl.store(WORDS_OUT + row * s_w_b + offs[:, None] * s_w_n + offs_w[None, :] * s_w_w, words,
                 mask=in_tree[:, None] & (offs_w < W)[None, :])

    @triton.jit
    def _walk_kernel(
        TOK, PAR, DEP, TGT, WORDS, ACC, LENS, BONUS,
        s_t_b, s_t_n, s_p_b, s_p_n, s_d_b, s_d_n, s_g_b, s_g_n, s_w_b, s_w_n, s_w_w,
        N, W, COLS,
        NPAD: tl.constexpr, WPAD: tl.constexpr, CPAD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NPAD)
        offs_w = tl.arange(0, WPAD)
        is_node = (offs >= 1) & (offs < N)
        dep = tl.load(DEP + row * s_d_b + (offs - 1) * s_d_n, mask=is_node, other=0)
        tok = tl.load(TOK + row * s_t_b + (offs - 1) * s_t_n, mask=is_node, other=0)
        par = tl.load(PAR + row * s_p_b + (offs - 1) * s_p_n, mask=is_node, other=0)
        want = tl.load(TGT + row * s_g_b + par * s_g_n, mask=is_node, other=-1)  # the target at the parent
        agrees = (offs == 0) | (is_node & (dep > 0) & (tok == want))
        one = tl.full([NPAD, WPAD], 1, tl.int64)
        bits = tl.where(((offs // 64)[:, None] == offs_w[None, :]) & agrees[:, None],
                        one << (offs % 64).to(tl.int64)[:, None], 0)
        agree_words = tl.reduce(bits, 0, _bit_or)  # [WPAD]
        anc = tl.load(WORDS + row * s_w_b + offs[:, None] * s_w_n + offs_w[None, :] * s_w_w,
                      mask=(offs < N)[:, None] & (offs_w < W)[None, :], other=0)
        disagree = tl.sum(((anc & ~agree_words[None, :]) != 0).to(tl.int32), axis=1)
        on_path = (disagree == 0) & (offs < N)
        depth = tl.where(offs == 0, 0, dep)
        cols = tl.arange(0, CPAD)
        hit = on_path[None, :] & (depth[None, :] == cols[:, None])  # [CPAD, NPAD]: at most one per column
        node = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
        found = tl.sum(hit.to(tl.int32), axis=1) > 0
        tl.store(ACC + row * COLS + cols, tl.where(found, node, -1).to(tl.int64), mask=cols < COLS)
        tl.store(LENS + row, tl.sum(on_path.to(tl.int64), axis=0))
        deepest = tl.max(tl.where(on_path, depth * NPAD + offs, -1), axis=0) % NPAD
        tl.store(BONUS + row, tl.load(TGT + row * s_g_b + deepest * s_g_n))


def _need_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what}: triton is not installed (pip install 'triton>=3.0')")


# A few rows over a large vocabulary split it across programs (then one merge launch): the 8B-like shape's
# 7 rows x 151936 took 149 us of a 6.5 ms round in 7 programs (H200, docs/perf.md "The engine at real width")
_TOP_PROGRAMS = 1024  # ~8 a multiprocessor (132 on the H200): a program is a chain of dependent reductions
_MAX_TOP_SPLITS = 32


def top_splits(rows: int, vocab: int, block_v: int) -> int:
    """Vocabulary splits per row: about _TOP_PROGRAMS programs in all, each split at least one block."""
    want = min(-(-_TOP_PROGRAMS // max(rows, 1)), -(-vocab // block_v), _MAX_TOP_SPLITS)
    return 1 << (max(want, 1).bit_length() - 1)  # a power of two: the merge loads them as one block


def top_log_probs_triton(logits: torch.Tensor, topk: int, block_v: int | None = None,
                         splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ddtree.tree.top_log_probs in one kernel (two when the vocabulary is split): logits[..., L, V] ->
    (log_probs, ids) [..., L, K], best first.

    The ids equal the reference's (ties aside); the values agree to float32 rounding (the log-sum-exp is
    summed in another order). block_v / splits (a power of two) override the choices (tests, tuning).
    """
    _need_triton("top_log_probs_triton")
    v = logits.shape[-1]
    k = min(topk, v)
    if k > _MAX_TOPK:
        raise ValueError(f"topk: {topk} is too large for the fused kernels (allowed <= {_MAX_TOPK})")
    rows = logits.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.long, device=logits.device)
    n = rows.shape[0]
    if n:
        block_v = block_v or min(4096, triton.next_power_of_2(v))
        splits = splits or top_splits(n, v, block_v)
        if splits & (splits - 1):
            raise ValueError(f"splits: {splits} is not a power of two")
        kpad = triton.next_power_of_2(k)
        chunk = triton.cdiv(triton.cdiv(v, splits), block_v) * block_v
        floor = LOG_PROB_FLOOR
        pm = torch.empty(n * splits if splits > 1 else 1, dtype=torch.float32, device=logits.device)
        pt = torch.empty_like(pm)
        pk = torch.empty(pm.numel() * kpad, dtype=torch.long, device=logits.device)
        _top_kernel[(n, splits)](rows, values, ids, v, rows.stride(0), floor, pm, pt, pk, chunk,
                                 K=k, KPAD=kpad, BLOCK_V=block_v, SPLITS=splits, num_warps=4)
        if splits > 1:
            _top_merge_kernel[(n,)](values, ids, pm, pt, pk, floor, K=k, KPAD=kpad, SPLITS=splits, num_warps=1)
    out = (*logits.shape[:-1], k)
    return values.reshape(out), ids.reshape(out)


def select_trees_triton(log_probs: torch.Tensor, ids: torch.Tensor, budget: int) -> DraftTrees:
    """The Triton path of the selection (ddtree.tree.select_trees): log_probs/ids[bs, L, K] -> DraftTrees."""
    _need_triton("select_trees_triton")
    bs, depth, k = log_probs.shape
    if not fused_fits(budget, k, depth):
        raise ValueError(f"budget: {budget} with topk {k} and depth {depth} is too large for the fused "
                         f"kernels (allowed budget <= {MAX_FUSED_NODES - 1})")
    log_probs = log_probs.float()
    lpad, kpad, bpad = (triton.next_power_of_2(v) for v in (depth, k, budget))
    sort_n = max(bpad * kpad, lpad * bpad)
    dev = log_probs.device
    tokens = torch.empty(bs, budget, dtype=torch.long, device=dev)
    parents, depths = torch.empty_like(tokens), torch.empty_like(tokens)
    scores = torch.empty(bs, budget, dtype=torch.float32, device=dev)
    num = torch.empty(bs, dtype=torch.long, device=dev)
    sort_buf = torch.empty(bs, sort_n, dtype=torch.long, device=dev)
    slot_keys = torch.empty(bs, lpad * bpad, dtype=torch.long, device=dev)
    slot_node = torch.empty_like(slot_keys)
    if bs:
        _select_kernel[(bs,)](
            log_probs, ids, tokens, parents, depths, scores, num, sort_buf, slot_keys, slot_node, _NEG_KEY,
            *log_probs.stride(), *ids.stride(),
            L=depth, K=k, B=budget, LPAD=lpad, KPAD=kpad, BPAD=bpad, SORT_N=sort_n, num_warps=4,
        )
    return DraftTrees(tokens, parents, depths, scores, num, depth)


def _words_out(bs: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-word output in the bitmask module's layout ([bs, n] or [bs, n, W]) and its [bs, n, W] view."""
    w = num_words(n)
    words = torch.empty(bs, n, w, dtype=torch.long, device=device)
    return (words[..., 0] if w == 1 else words), words


def compile_trees_triton(trees: DraftTrees, root_tokens: torch.Tensor, starts: torch.Tensor) -> CompiledTrees:
    """The Triton path of ddtree.tree.compile_trees. The bitmask is always given (multi-word past 64 nodes)."""
    _need_triton("compile_trees_triton")
    bs, b = trees.tokens.shape
    n = b + 1
    if n > MAX_FUSED_NODES:
        raise ValueError(f"budget: {b} is too large for the fused kernels (allowed <= {MAX_FUSED_NODES - 1})")
    dev = trees.tokens.device
    root_tokens = torch.as_tensor(root_tokens, dtype=torch.long, device=dev).reshape(bs)
    starts = torch.as_tensor(starts, dtype=torch.long, device=dev).reshape(bs)
    input_ids = torch.empty(bs, n, dtype=torch.long, device=dev)
    position_ids = torch.empty_like(input_ids)
    mask = torch.empty(bs, n, n, dtype=torch.int8, device=dev)
    bitmask, words = _words_out(bs, n, dev)
    w = words.shape[-1]
    if bs:
        _compile_kernel[(bs,)](
            trees.tokens, trees.parents, trees.depths, root_tokens, starts, input_ids, position_ids, mask, words,
            *trees.tokens.stride(), *trees.parents.stride(), *trees.depths.stride(), *words.stride(), n, w,
            L=trees.max_depth, NPAD=triton.next_power_of_2(n), WPAD=triton.next_power_of_2(w), num_warps=4,
        )
    return CompiledTrees(input_ids, position_ids, mask.view(torch.bool), bitmask)


def follow_trees_triton(
    trees: DraftTrees, bitmask: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton path of ddtree.tree.follow_trees_by_mask, from the packed words instead of the bool mask."""
    _need_triton("follow_trees_triton")
    bs, b = trees.tokens.shape
    n = b + 1
    if tuple(target_tokens.shape) != (bs, n):
        raise ValueError(f"target_tokens: expected shape {(bs, n)}, got {tuple(target_tokens.shape)}")
    if n > MAX_FUSED_NODES:
        raise ValueError(f"budget: {b} is too large for the fused kernels (allowed <= {MAX_FUSED_NODES - 1})")
    w = num_words(n)
    words = bitmask[..., None] if w == 1 else bitmask
    if tuple(words.shape) != (bs, n, w):
        raise ValueError(f"bitmask: expected {(bs, n) if w == 1 else (bs, n, w)} int64 words, got "
                         f"{tuple(bitmask.shape)}")
    dev = trees.tokens.device
    target_tokens = target_tokens.to(dtype=torch.long)
    cols = trees.max_depth + 1
    accepted = torch.empty(bs, cols, dtype=torch.long, device=dev)
    lens = torch.empty(bs, dtype=torch.long, device=dev)
    bonus = torch.empty(bs, dtype=torch.long, device=dev)
    if bs:
        _walk_kernel[(bs,)](
            trees.tokens, trees.parents, trees.depths, target_tokens, words, accepted, lens, bonus,
            *trees.tokens.stride(), *trees.parents.stride(), *trees.depths.stride(), *target_tokens.stride(),
            *words.stride(), n, w, cols,
            NPAD=triton.next_power_of_2(n), WPAD=triton.next_power_of_2(w), CPAD=triton.next_power_of_2(cols),
            num_warps=4,
        )
    return accepted, lens, bonus


# -- dispatch: the fused kernels where they apply, else ddtree.tree's torch code -----------------------
def _use_triton(backend: Backend, device: torch.device, fits: bool) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"tree backend: {backend!r} is not one of {BACKENDS}")
    # a tree too large for the fused kernels takes the torch code, even when "triton" is asked for
    return backend != "torch" and fits and (backend == "triton" or device.type == "cuda")


def build_trees(logits: torch.Tensor, budget: int, topk: int, backend: Backend = "auto") -> DraftTrees:
    """ddtree.tree.build_trees with the selection in one kernel where it applies (CUDA, or forced)."""
    tree_torch.check_budget_topk(budget, topk)
    tree_torch.check_logits(logits, 3, "[bs, L, V]")
    k, depth = min(topk, logits.shape[-1]), logits.shape[1]
    if _use_triton(backend, logits.device, fused_fits(budget, k, depth)):
        return select_trees_triton(*top_log_probs_triton(logits, topk), budget)
    log_probs, ids = tree_torch.top_log_probs_fast(logits, topk)  # [bs, L, K]
    return tree_torch.select_trees(log_probs, ids, budget)


def compile_trees(trees: DraftTrees, root_tokens: torch.Tensor, starts: torch.Tensor,
                  backend: Backend = "auto") -> CompiledTrees:
    """ddtree.tree.compile_trees in one kernel where it applies."""
    if _use_triton(backend, trees.tokens.device, trees.budget + 1 <= MAX_FUSED_NODES and triton is not None):
        return compile_trees_triton(trees, root_tokens, starts)
    return tree_torch.compile_trees(trees, root_tokens, starts)


def follow_trees(trees: DraftTrees, compiled: CompiledTrees, target_tokens: torch.Tensor,
                 backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk (ddtree.tree.follow_trees_by_mask) in one kernel where it applies: needs compiled.bitmask."""
    fits = trees.budget + 1 <= MAX_FUSED_NODES and compiled.bitmask is not None and triton is not None
    if _use_triton(backend, trees.tokens.device, fits):
        assert compiled.bitmask is not None
        return follow_trees_triton(trees, compiled.bitmask, target_tokens)
    return tree_torch.follow_trees_by_mask(trees, compiled.mask, target_tokens)
