"""Models: the target decoder (Qwen3/Llama) with a compactable KV cache, and the DFlash drafter.

No decoding policy lives here; see docs/architecture.md ("ddtree/models/") for the contracts.
"""

from ddtree.models.configs import DrafterConfig, TargetConfig, build_target_layer_ids
from ddtree.models.dflash import DFlashDrafter, DraftContext, check_fit, init_drafter
from ddtree.models.kv_cache import KVCache
from ddtree.models.loading import load_drafter, load_target, save_drafter, save_target
from ddtree.models.target import Target, init_target

__all__ = [
    "DFlashDrafter",
    "DraftContext",
    "DrafterConfig",
    "KVCache",
    "Target",
    "TargetConfig",
    "build_target_layer_ids",
    "check_fit",
    "init_drafter",
    "init_target",
    "load_drafter",
    "load_target",
    "save_drafter",
    "save_target",
]
