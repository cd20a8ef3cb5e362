"""KV compaction after a tree verify: move each row's accepted nodes to the front of its tree window.

For every layer, request b and kv head, slot lengths[b] + src[b, j] moves to lengths[b] + j for
j < counts[b], in K and V alike (buffers [layers, bs, Hkv, max_len, d]). Lengths are not advanced here;
the cache owner does that. A Triton kernel (one program per (layer, request, head): all moved rows are
read into registers, a barrier, then written, so overlapping moves never alias) and a torch reference
(gather then scatter). Rows whose accepted path is already contiguous (src[b, j] == j) move nothing:
the kernel masks out every identity move, so they cost no traffic and need no host sync.
"""

from __future__ import annotations

from typing import Literal

import torch

try:  # Triton is optional: CPU machines use the reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Backend = Literal["auto", "triton", "reference"]


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
) -> tuple[int, int]:
    if k.dim() != 5 or v.shape != k.shape:
        raise ValueError(f"compact_kv: k and v must both be [layers, bs, Hkv, max_len, d], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    bs = k.shape[1]
    if src.dim() != 2 or src.shape[0] != bs or src.dtype.is_floating_point:
        raise ValueError(f"compact_kv: src must be [bs={bs}, m] integer, got {tuple(src.shape)} {src.dtype}")
    for name, t in (("lengths", lengths), ("counts", counts)):
        if t.shape != (bs,) or t.dtype.is_floating_point:
            raise ValueError(f"compact_kv: {name} must be [bs={bs}] integer, got {tuple(t.shape)} {t.dtype}")
        if t.device != k.device:
            raise ValueError(f"compact_kv: {name} is on {t.device}, the KV buffers on {k.device}")
    if src.device != k.device or v.device != k.device:
        raise ValueError(f"compact_kv: src ({src.device}) and v ({v.device}) must be on {k.device}")
    return bs, src.shape[1]


def compact_kv_reference(
    k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
) -> None:
    """In place, torch: gather every moved slot (a copy), then scatter; entries j >= counts[b] are no-ops.

    Slots outside [0, max_len) are the caller's bug and are clamped rather than checked (no host sync).
    """
    _, m = _check_inputs(k, v, lengths, src, counts)
    max_len = k.shape[3]
    j = torch.arange(m, device=k.device)[None, :]  # [1, m]
    src = torch.where(j < counts[:, None], src, j)  # [bs, m]
    from_slots = (lengths[:, None] + src).clamp(0, max_len - 1)  # [bs, m]
    to_slots = (lengths[:, None] + j).clamp(0, max_len - 1)  # [bs, m]
    rows = torch.arange(k.shape[1], device=k.device)[:, None]  # [bs, 1]
    for buf in (k, v):
        moved = buf[:, rows, :, from_slots]  # [bs, m, layers, Hkv, d] (advanced indexing copies)
        buf[:, rows, :, to_slots] = moved


if triton is not None:

    @triton.jit
    def _compact_kv_kernel(
        K, V, LENS, SRC, COUNTS, m, max_len, bs, n_heads,
        sk_l, sk_b, sk_h, sk_s, sk_d,
        sv_l, sv_b, sv_h, sv_s, sv_d,
        s_src_b, s_src_j,
        HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)  # (layer, request, head)
        h = pid % n_heads
        b = (pid // n_heads) % bs
        layer = (pid // (n_heads * bs)).to(tl.int64)  # 64-bit offsets: the whole cache can pass 2^31 elements
        length = tl.load(LENS + b)
        count = tl.load(COUNTS + b)
        j = tl.arange(0, BLOCK_J)
        src = tl.load(SRC + b * s_src_b + j * s_src_j, mask=j < m, other=0)
        from_slot = length + src
        to_slot = length + j
        # identity moves (and every move of a contiguous row) are masked out: no traffic, no branch
        move = (j < count) & (j < m) & (src != j) & (from_slot >= 0) & (from_slot < max_len) & (to_slot < max_len)
        dims = tl.arange(0, BLOCK_D)
        mask = move[:, None] & (dims < HEAD_DIM)[None, :]
        k_base = K + layer * sk_l + b * sk_b + h * sk_h
        v_base = V + layer * sv_l + b * sv_b + h * sv_h
        k_rows = tl.load(k_base + from_slot[:, None] * sk_s + dims[None, :] * sk_d, mask=mask)
        v_rows = tl.load(v_base + from_slot[:, None] * sv_s + dims[None, :] * sv_d, mask=mask)
        tl.debug_barrier()  # every thread has read its sources before any destination is written
        tl.store(k_base + to_slot[:, None] * sk_s + dims[None, :] * sk_d, k_rows, mask=mask)
        tl.store(v_base + to_slot[:, None] * sv_s + dims[None, :] * sv_d, v_rows, mask=mask)


def compact_kv_triton(
    k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
) -> None:
    """The Triton path of `compact_kv` (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("compact_kv_triton: triton is not installed (pip install 'triton>=3.0')")
    bs, m = _check_inputs(k, v, lengths, src, counts)
    layers, _, n_heads, max_len, d = k.shape
    if m == 0 or k.numel() == 0:
        return
    block_j = max(16, triton.next_power_of_2(m))
    block_d = max(16, triton.next_power_of_2(d))
    num_warps = 4 if block_j * block_d <= 64 * 128 else 8
    _compact_kv_kernel[(layers * bs * n_heads,)](
        k, v, lengths, src, counts, m, max_len, bs, n_heads,
        *k.stride(), *v.stride(), *src.stride(),
        HEAD_DIM=d, BLOCK_J=block_j, BLOCK_D=block_d, num_warps=num_warps,
    )


def compact_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    src: torch.Tensor,
    counts: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """In place: slot lengths[b] + src[b, j] -> lengths[b] + j for j < counts[b], every layer, K and V.

    k, v [layers, bs, Hkv, max_len, d]; lengths[bs], src[bs, m], counts[bs] integer, on k's device.
    Sources must lie at or after lengths[b] and all slots inside max_len (not checked: that would sync);
    out-of-range moves are dropped by the kernel and clamped by the reference. lengths are not changed.
    backend "auto" runs the Triton kernel on CUDA when Triton is installed, else the reference.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"compact_kv: backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "triton" or (backend == "auto" and k.is_cuda and triton is not None):
        compact_kv_triton(k, v, lengths, src, counts)
    else:
        compact_kv_reference(k, v, lengths, src, counts)
