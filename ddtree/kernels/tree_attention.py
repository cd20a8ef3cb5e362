"""Tree attention for a verify forward: a cached prefix plus an ancestor-masked tree, as a Triton kernel and a torch reference.

Each request b has a prefix of cache_lens[b] keys in the KV cache (every tree node sees all of it) and n
tree nodes (root first) whose keys are visible by the packed ancestor bitmask (see bitmask.py). The tree's
own K/V either come as separate tensors (k_new/v_new) or already sit in the cache right after the prefix,
at slots cache_lens[b] .. cache_lens[b] + n - 1 (k_new=None: how the target's forward calls it, since it
writes the new rows first). A chain is the causal bitmask, so the same code serves DFlash and AR.

The kernel is flash-style: one program per (request, kv head, block of query rows), the group's query heads
stacked as rows so each K/V tile is read once per group; online softmax over prefix tiles, then the tree
tiles. For small batches the prefix is split across programs and the partial results merged (split-KV),
so short grids still fill the GPU. Nothing here syncs with the host; shapes are checked on the host.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from ddtree.kernels.bitmask import as_words, unpack_bitmask

try:  # Triton is optional: CPU machines use the reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Backend = Literal["auto", "triton", "reference"]

MAX_TREE_NODES = 256  # 4 bitmask words per row; larger trees would need more registers than they save
_BLOCK_N = 64  # prefix keys per tile
# A split may be as short as one tile: a decode step's few query rows make each tile a chain of dependent
# loads, so latency falls with every tile moved to another program (H200, fixture pair, context 1024,
# batch 1: 21-22 us a layer with 256-key splits; AR 2192 -> 2466 tok/s in two runs minutes apart, see
# the third H200 pass in `git log -p docs/perf.md`). The merge of more partials is cheap.
MIN_SPLIT_KEYS = _BLOCK_N
_TREE_TILE = 64  # tree keys per tile: one bitmask word


def triton_available() -> bool:
    """Whether the Triton kernel can be imported at all (running it also needs CUDA or TRITON_INTERPRET=1)."""
    return triton is not None


# -- torch reference ---------------------------------------------------------------------------------


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tree_bitmask: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense masked softmax in `compute_dtype` (float32 or float64); same contract as `tree_attention`.

    Keys are the whole cache (masked to c < cache_lens[b]) followed by the n tree keys (masked by the
    bitmask), so every shape is static and nothing syncs with the host.
    """
    bs, hq, n, _ = _check_inputs(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_bitmask)
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    if k_new is None or v_new is None:
        k_new, v_new = _tree_rows_from_cache(k_cache, v_cache, cache_lens, n)
    cols = torch.arange(max_len, device=q.device)
    prefix_vis = cols[None, :] < cache_lens.to(q.device)[:, None]  # [bs, max_len]
    # unused cache slots may hold garbage (even NaN): zero them so masked-out columns add exactly 0
    unused = ~prefix_vis[:, None, :, None]  # [bs, 1, max_len, 1]
    keys = torch.cat([k_cache.masked_fill(unused, 0), k_new], dim=2).to(compute_dtype)  # [bs, hkv, L+n, d]
    vals = torch.cat([v_cache.masked_fill(unused, 0), v_new], dim=2).to(compute_dtype)
    group = hq // hkv
    keys = keys.repeat_interleave(group, dim=1)  # [bs, hq, max_len + n, d]
    vals = vals.repeat_interleave(group, dim=1)
    tree_vis = unpack_bitmask(tree_bitmask.to(q.device), n)  # [bs, n, n]
    visible = torch.cat([prefix_vis[:, None, :].expand(bs, n, max_len), tree_vis], dim=-1)  # [bs, n, L+n]
    scores = torch.matmul(q.to(compute_dtype), keys.transpose(-1, -2)) * scale  # [bs, hq, n, L+n]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vals).to(q.dtype)  # [bs, hq, n, d]


def _tree_rows_from_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree's K/V stored at slots cache_lens[b] + j: [bs, hkv, n, d] each (a gather; slots past max_len clamp)."""
    bs, hkv, max_len, d = k_cache.shape
    slots = cache_lens.to(k_cache.device)[:, None] + torch.arange(n, device=k_cache.device)  # [bs, n]
    idx = slots.clamp(max=max_len - 1)[:, None, :, None].expand(bs, hkv, n, d)
    return torch.gather(k_cache, 2, idx), torch.gather(v_cache, 2, idx)


# -- input checks (host side, shapes only) -------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tree_bitmask: torch.Tensor,
) -> tuple[int, int, int, int]:
    if q.dim() != 4:
        raise ValueError(f"tree_attention: q must be [bs, Hq, n, d], got shape {tuple(q.shape)}")
    bs, hq, n, d = q.shape
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"tree_attention: n (tree nodes incl. root) must be in [1, {MAX_TREE_NODES}], got {n}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != bs or t.shape[3] != d:
            raise ValueError(f"tree_attention: {name} must be [bs={bs}, Hkv, max_len, d={d}], got {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"tree_attention: v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    hkv = k_cache.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"tree_attention: Hq ({hq}) must be a positive multiple of Hkv ({hkv})")
    if cache_lens.shape != (bs,) or cache_lens.dtype.is_floating_point:
        raise ValueError(f"tree_attention: cache_lens must be [bs={bs}] integer, got {tuple(cache_lens.shape)} "
                         f"{cache_lens.dtype}")
    if (k_new is None) != (v_new is None):
        raise ValueError("tree_attention: pass both k_new and v_new, or neither (tree K/V read from the cache)")
    if k_new is not None and v_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if tuple(t.shape) != (bs, hkv, n, d):
                raise ValueError(f"tree_attention: {name} must be [bs, Hkv, n, d] = {(bs, hkv, n, d)}, "
                                 f"got {tuple(t.shape)}")
    elif k_cache.shape[2] < n:
        raise ValueError(f"tree_attention: the cache (max_len {k_cache.shape[2]}) cannot hold n={n} tree rows")
    if tree_bitmask.dtype != torch.int64:
        raise ValueError(f"tree_attention: tree_bitmask must be int64, got {tree_bitmask.dtype}")
    words = as_words(tree_bitmask, n)
    if words.shape[0] != bs or words.dim() != 3:
        raise ValueError(f"tree_attention: tree_bitmask must have batch {bs}, got shape {tuple(tree_bitmask.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_lens", cache_lens), ("tree_bitmask",
                                                                                             tree_bitmask)):
        if t.device != q.device:
            raise ValueError(f"tree_attention: {name} is on {t.device}, q on {q.device}")
    return bs, hq, n, d


# -- Triton kernel -------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _f32_dot(a, b, TF32: tl.constexpr):
        if TF32:
            return tl.dot(a, b, input_precision="tf32")
        else:
            return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _tree_attn_fwd(
        Q, K, V, KT, VT, LENS, BITS, OUT, PM, PL, PACC,
        qk_scale, n_tree, n_rows, n_kv_heads,
        sq_b, sq_h, sq_n, sq_d,
        sk_b, sk_h, sk_s, sk_d,
        sv_b, sv_h, sv_s, sv_d,
        skt_b, skt_h, skt_s, skt_d,
        svt_b, svt_h, svt_s, svt_d,
        sbit_b, sbit_n, sbit_w,
        so_b, so_h, so_n, so_d,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        N_TREE_TILES: tl.constexpr, SPLITS: tl.constexpr, TREE_IN_CACHE: tl.constexpr,
        FP32_DOT: tl.constexpr, TF32: tl.constexpr,
    ):
        # program = (request b, kv head hk) x block of query rows x prefix split
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        b = (pid_bh // n_kv_heads).to(tl.int64)  # 64-bit offsets: a big cache overflows int32
        hk = pid_bh % n_kv_heads

        # query rows: row r is (group head g, tree node i); q head = hk * GROUP + g
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        g = rows // n_tree
        node = rows % n_tree
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_ptrs = Q + b * sq_b + (hk * GROUP + g)[:, None] * sq_h + node[:, None] * sq_n + dims[None, :] * sq_d
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if FP32_DOT:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # 1. this split's share of the prefix, in BLOCK_N-aligned chunks of the real length
        cache_len = tl.load(LENS + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(cache_len, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, cache_len)
        k_base = K + b * sk_b + hk * sk_h
        v_base = V + b * sv_b + hk * sv_h
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            kv_mask = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + cols[:, None] * sk_s + dims[None, :] * sk_d, mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_s + dims[None, :] * sv_d, mask=kv_mask, other=0.0)
            if FP32_DOT:
                s = _f32_dot(q, tl.trans(k.to(tl.float32)), TF32)
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(col_ok[None, :], s * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + _f32_dot(p, v.to(tl.float32), TF32)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # 2. the tree block (split 0 only): keys visible by the ancestor bitmask, tiles of one word or less
        if split == 0:
            if TREE_IN_CACHE:
                kt_base = KT + b * skt_b + hk * skt_h + cache_len * skt_s
                vt_base = VT + b * svt_b + hk * svt_h + cache_len * svt_s
            else:
                kt_base = KT + b * skt_b + hk * skt_h
                vt_base = VT + b * svt_b + hk * svt_h
            for w in range(N_TREE_TILES):
                cols = w * BLOCK_T + tl.arange(0, BLOCK_T)
                col_ok = cols < n_tree
                kv_mask = col_ok[:, None] & dim_ok[None, :]
                k = tl.load(kt_base + cols[:, None] * skt_s + dims[None, :] * skt_d, mask=kv_mask, other=0.0)
                v = tl.load(vt_base + cols[:, None] * svt_s + dims[None, :] * svt_d, mask=kv_mask, other=0.0)
                # a tile never straddles a word: BLOCK_T divides 64
                word_at = (w * BLOCK_T) // 64
                word = tl.load(BITS + b * sbit_b + node * sbit_n + word_at * sbit_w, mask=row_ok, other=0)  # [BLOCK_M]
                bit = (word[:, None] >> (cols - word_at * 64)[None, :].to(tl.int64)) & 1
                vis = (bit != 0) & col_ok[None, :]
                if FP32_DOT:
                    s = _f32_dot(q, tl.trans(k.to(tl.float32)), TF32)
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(vis, s * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_T]
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if FP32_DOT:
                    acc = acc * alpha[:, None] + _f32_dot(p, v.to(tl.float32), TF32)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new

        # 3. write: straight to the output, or this split's partial (max, denominator, numerator)
        if SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_ptrs = OUT + b * so_b + (hk * GROUP + g)[:, None] * so_h + node[:, None] * so_n + dims[None, :] * so_d
            tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            part = (pid_bh * SPLITS + split) * n_rows + rows  # partials: [bs*hkv, SPLITS, n_rows(, d)]
            tl.store(PM + part, m_i, mask=row_ok)
            tl.store(PL + part, l_i, mask=row_ok)
            tl.store(PACC + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _tree_attn_merge(
        PM, PL, PACC, OUT, n_tree, n_rows, n_kv_heads, splits,
        so_b, so_h, so_n, so_d,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # program = (request b, kv head hk) x one query row: every split's partial is loaded at once and
        # reduced in registers (a loop over splits would chain SPLITS dependent loads: 5-8 us at 32 splits)
        pid_bh = tl.program_id(0)
        row = tl.program_id(1)
        b = (pid_bh // n_kv_heads).to(tl.int64)
        hk = pid_bh % n_kv_heads
        s = tl.arange(0, BLOCK_S)
        s_ok = s < splits
        dims = tl.arange(0, BLOCK_D)
        part = (pid_bh * splits + s) * n_rows + row  # [BLOCK_S]
        m_s = tl.load(PM + part, mask=s_ok, other=float("-inf"))
        l_s = tl.load(PL + part, mask=s_ok, other=0.0)
        a_s = tl.load(PACC + part[:, None] * BLOCK_D + dims[None, :], mask=s_ok[:, None], other=0.0)
        m = tl.max(m_s, 0)
        w = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))  # empty splits (m_s = -inf) weigh 0
        l_i = tl.sum(l_s * w, 0)
        acc = tl.sum(a_s * w[:, None], 0)  # [BLOCK_D]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)
        g = row // n_tree
        node = row % n_tree
        o_ptrs = OUT + b * so_b + (hk * GROUP + g) * so_h + node * so_n + dims * so_d
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number exercises the split path


def row_block(n_rows: int, fp32: bool = False) -> int:
    """Query rows per program: all of a kv head's rows in one block where possible (each extra row block
    re-reads the prefix), capped at 128 so the fp32 accumulator fits in registers; at 32 when the inputs
    are float32 too (q and the tiles then take twice the registers and the dots run as IEEE float32: on
    the H200, fixture heads, 33 tree tokens took 0.82 ms with 64-row blocks and 64-key tree tiles against
    0.11 ms with 32-row blocks and 16-key tiles)."""
    return max(16, min(32 if fp32 else 128, 1 << max(n_rows - 1, 0).bit_length()))


def tree_tile(n: int, fp32: bool = False) -> int:
    """Tree keys per tile: the tree in one tile up to a word (64 keys); 16 for float32 (see row_block)."""
    if fp32:
        return 16
    return max(16, min(_TREE_TILE, triton.next_power_of_2(n) if triton else 64))


def choose_splits(programs: int, max_prefix: int, device: torch.device) -> int:
    """Prefix splits per program so the grid fills about two waves; a split keeps >= MIN_SPLIT_KEYS keys.

    Decided from shapes only (max_len, not the per-request lengths), so it is stable under CUDA graphs.
    """
    if max_prefix <= 0:
        return 1
    want = math.ceil(2 * _num_sms(device) / max(programs, 1))
    cap = max(1, max_prefix // MIN_SPLIT_KEYS)
    splits = max(1, min(want, cap, 32))
    return 1 << (splits.bit_length() - 1)  # a power of two: fewer distinct compiled variants


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tree_bitmask: torch.Tensor,
    scale: float,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """The Triton path of `tree_attention` (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    splits: prefix splits per (request, kv head, row block); None picks from the shapes. out: an optional
    preallocated [bs, Hq, n, d] output (any strides), e.g. for CUDA graphs. block_m (query rows per
    program), block_t (tree keys per tile, a power of two 16..64) and num_warps override the choices made
    from the shapes (for tuning runs). tf32: float32 inputs multiply in TF32 instead of IEEE float32 (about
    1.7x faster at decode shapes on the H200, ~3e-4 off; for callers whose numbers only steer, the drafter).
    """
    if triton is None:
        raise RuntimeError("tree_attention_triton: triton is not installed (pip install 'triton>=3.0')")
    bs, hq, n, d = _check_inputs(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_bitmask)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"tree_attention: q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    words = as_words(tree_bitmask, n)  # [bs, n, W] (a view)
    tree_in_cache = k_new is None
    kt, vt = (k_cache, v_cache) if k_new is None or v_new is None else (k_new, v_new)
    if out is None:
        out = torch.empty_like(q)
    elif tuple(out.shape) != (bs, hq, n, d) or out.dtype != q.dtype:
        raise ValueError(f"tree_attention: out must be {(bs, hq, n, d)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")

    n_rows = group * n
    # float32 inputs need IEEE dots (TF32 would cost ~1e-3); the interpreter's bf16/fp16 dot is broken in
    # Triton 3.9, so on CPU the operands are upcast too (same indexing and masking, fp32 products)
    fp32_dot = q.dtype == torch.float32 or not q.is_cuda
    block_m = block_m or row_block(n_rows, fp32=q.dtype == torch.float32)
    block_t = block_t or tree_tile(n, fp32=q.dtype == torch.float32)
    if block_t not in (16, 32, 64):
        raise ValueError(f"tree_attention: block_t must be 16, 32 or 64 (a tile within one bitmask word), got {block_t}")
    block_d = max(16, triton.next_power_of_2(d))
    row_blocks = triton.cdiv(n_rows, block_m)
    prefix_max = max_len - n if tree_in_cache else max_len
    if splits is None:
        splits = choose_splits(bs * hkv * row_blocks, prefix_max, q.device)
    if splits < 1:
        raise ValueError(f"tree_attention: splits must be >= 1, got {splits}")
    grid = (bs * hkv, row_blocks, splits)
    if splits > 1:
        pm = torch.empty(bs * hkv * splits * n_rows, device=q.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty(bs * hkv * splits * n_rows, block_d, device=q.device, dtype=torch.float32)
    else:
        pm = pl = pacc = out  # unused
    num_warps = num_warps or (4 if block_m * block_d <= 64 * 64 else 8)
    _tree_attn_fwd[grid](
        q, k_cache, v_cache, kt, vt, cache_lens, words, out, pm, pl, pacc,
        scale * 1.4426950408889634, n, n_rows, hkv,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *kt.stride(), *vt.stride(),
        *words.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_T=block_t, BLOCK_D=block_d,
        N_TREE_TILES=triton.cdiv(n, block_t), SPLITS=splits, TREE_IN_CACHE=tree_in_cache, FP32_DOT=fp32_dot,
        TF32=tf32, num_warps=num_warps, num_stages=2,
    )
    if splits > 1:
        _tree_attn_merge[(bs * hkv, n_rows)](
            pm, pl, pacc, out, n, n_rows, hkv, splits, *out.stride(),
            GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), num_warps=2,
        )
    return out


# -- dispatcher ---------------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tree_bitmask: torch.Tensor,
    scale: float,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Attention of n tree queries over a cached prefix and the tree itself.

    q[bs, Hq, n, d]; k_cache/v_cache[bs, Hkv, max_len, d] (prefix = slots < cache_lens[b]);
    cache_lens[bs] integer; k_new/v_new[bs, Hkv, n, d], or both None when the tree rows already sit in
    the cache at slots cache_lens[b] + j (then cache_lens[b] + n <= max_len is the caller's promise:
    it cannot be checked without a host sync); tree_bitmask[bs, n] int64 (n <= 64) or [bs, n, ceil(n/64)]
    with bit j of row i set iff node j is an ancestor-or-self of node i (every row must see itself);
    scale multiplies q.k. Returns [bs, Hq, n, d] in q's dtype: `out` when given (any strides, e.g. a
    transposed [bs, n, Hq, d] buffer, so the output projection reads it without a copy).

    backend "auto" runs the Triton kernel on CUDA tensors when Triton is installed, else the reference;
    "triton" / "reference" force one (forcing Triton on CPU needs TRITON_INTERPRET=1 set before import).
    tf32: the kernel may multiply float32 inputs in TF32 (see tree_attention_triton; the reference ignores it).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"tree_attention: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda and triton is not None)
    if use_triton:
        return tree_attention_triton(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_bitmask, scale, out=out,
                                     tf32=tf32)
    result = tree_attention_reference(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_bitmask, scale)
    return result if out is None else out.copy_(result)
