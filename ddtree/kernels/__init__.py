"""Triton kernels for the verify step (tree attention, KV compaction) and the forwards' q/k norm + RoPE,
each with a torch reference beside it."""

from ddtree.kernels.bitmask import (
    ancestor_mask,
    causal_bitmask,
    pack_mask,
    unpack_bitmask,
)
from ddtree.kernels.kv_compact import (
    compact_kv,
    compact_kv_reference,
    compact_kv_triton,
)
from ddtree.kernels.norm_rope import (
    norm_rope,
    norm_rope_reference,
    norm_rope_triton,
)
from ddtree.kernels.tree_attention import (
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
    triton_available,
)

__all__ = [
    "ancestor_mask",
    "causal_bitmask",
    "compact_kv",
    "compact_kv_reference",
    "compact_kv_triton",
    "norm_rope",
    "norm_rope_reference",
    "norm_rope_triton",
    "pack_mask",
    "tree_attention",
    "tree_attention_reference",
    "tree_attention_triton",
    "triton_available",
    "unpack_bitmask",
]
