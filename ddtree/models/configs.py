"""Model configs read from a Hugging Face `config.json`: the target decoder and the DFlash drafter.

Only the fields the models need are kept; everything is validated here so that a bad folder
fails with a `ModelLoadError` naming the field before any tensor is read. `to_dict()` writes a
config.json that transformers and z-lab's loaders read back (target: Qwen3/Llama; drafter:
`DFlashDraftModel` with `dflash_config {target_layer_ids, mask_token_id}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.errors import ModelLoadError

SUPPORTED_TARGET_TYPES = ("qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default",)


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """The parsed config.json of a model folder (ModelLoadError if absent or not JSON)."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ModelLoadError(f"model folder {str(folder)!r} does not exist or is not a directory")
    if not path.is_file():
        raise ModelLoadError(f"{path}: config.json is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: config.json is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: config.json must hold a JSON object")
    return data


def _req(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ModelLoadError(f"{where}: required field {key!r} is missing")
    return d[key]


def _pos_int(d: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ModelLoadError(f"{where}: required field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def parse_rope_theta(d: dict[str, Any], where: str) -> float:
    """rope_theta from the top level or from a rope_parameters / rope_scaling dict of type 'default'.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta}`; older files write a top-level
    `rope_theta` and `rope_scaling: null`. Any scaling type other than 'default' changes the
    frequencies, so it is refused rather than silently ignored.
    """
    theta = d.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ModelLoadError(f"{where}: {key} must be an object or null, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{where}: {key}.rope_type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    if theta is None:
        theta = 10000.0  # the transformers default for Llama/Qwen3 when nothing is given
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"{where}: rope_theta must be a number > 0, got {theta!r}")
    return float(theta)


def _eps(d: dict[str, Any], where: str) -> float:
    eps = d.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ModelLoadError(f"{where}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    return float(eps)


def _heads(d: dict[str, Any], hidden: int, where: str) -> tuple[int, int, int]:
    heads = _pos_int(d, "num_attention_heads", where)
    kv_heads = _pos_int(d, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    default_head_dim = hidden // heads if hidden % heads == 0 else None
    head_dim = _pos_int(d, "head_dim", where, default=default_head_dim)
    if head_dim % 2:
        raise ModelLoadError(f"{where}: head_dim must be even for RoPE, got {head_dim}")
    return heads, kv_heads, head_dim


def _dtype_name(d: dict[str, Any]) -> str | None:
    value = d.get("torch_dtype", d.get("dtype"))
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TargetConfig:
    """A Qwen3 (per-head q/k RMSNorm) or Llama (no q/k norm) decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> TargetConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ModelLoadError(
                f"{where}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_TARGET_TYPES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported; supported: silu")
        if d.get("use_sliding_window"):
            raise ModelLoadError(f"{where}: use_sliding_window=true is not supported for the target")
        hidden = _pos_int(d, "hidden_size", where)
        heads, kv_heads, head_dim = _heads(d, hidden, where)
        eos = d.get("eos_token_id")
        if eos is not None and not (isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(e, int) for e in eos))):
            raise ModelLoadError(f"{where}: eos_token_id must be an int, a list of ints or null, got {eos!r}")
        bos = d.get("bos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=_pos_int(d, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_pos_int(d, "intermediate_size", where),
            num_hidden_layers=_pos_int(d, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_eps(d, where),
            rope_theta=parse_rope_theta(d, where),
            max_position_embeddings=_pos_int(d, "max_position_embeddings", where, default=4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            eos_token_id=eos,
            bos_token_id=bos if isinstance(bos, int) else None,
            torch_dtype=_dtype_name(d),
        )

    def to_dict(self) -> dict[str, Any]:
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
        }
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.torch_dtype:
            out["torch_dtype"] = self.torch_dtype
        return out


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: num_draft_layers ids spread evenly over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    """A z-lab DFlash drafter (`DFlashDraftModel`): Qwen3-style layers with KV injection."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    layer_types: tuple[str, ...] = field(default=())
    sliding_window: int | None = None
    torch_dtype: str | None = None

    @property
    def window(self) -> int | None:
        """The trained draft window: sliding_window when any layer is a sliding one, else None."""
        if self.sliding_window and any(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> DrafterConfig:
        archs = d.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ModelLoadError(f"{where}: architectures must contain 'DFlashDraftModel', got {archs!r}")
        dflash = d.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ModelLoadError(f"{where}: dflash_config must be an object, got {dflash!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported; supported: silu")
        hidden = _pos_int(d, "hidden_size", where)
        heads, kv_heads, head_dim = _heads(d, hidden, where)
        n_layers = _pos_int(d, "num_hidden_layers", where)
        # newer z-lab files move block_size into dflash_config
        block_src = d if d.get("block_size") is not None else dflash
        block = _pos_int(block_src, "block_size", where)
        if block < 2:
            raise ModelLoadError(f"{where}: block_size must be >= 2, got {block}")
        n_target = d.get("num_target_layers", dflash.get("num_target_layers"))
        ids = dflash.get("target_layer_ids")
        if ids is None:
            if not isinstance(n_target, int) or n_target < 4:
                raise ModelLoadError(
                    f"{where}: dflash_config.target_layer_ids is missing and num_target_layers "
                    f"({n_target!r}) cannot derive them (need an integer >= 4)"
                )
            ids = build_target_layer_ids(n_target, n_layers)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ModelLoadError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
            raise ModelLoadError(f"{where}: dflash_config.mask_token_id must be an integer >= 0, got {mask!r}")
        layer_types = d.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
            raise ModelLoadError(
                f"{where}: layer_types must list {n_layers} entries of 'full_attention'/'sliding_attention', "
                f"got {layer_types!r}"
            )
        sliding = d.get("sliding_window")
        if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1):
            raise ModelLoadError(f"{where}: sliding_window must be an integer >= 1 or null, got {sliding!r}")
        return cls(
            hidden_size=hidden,
            intermediate_size=_pos_int(d, "intermediate_size", where),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_pos_int(d, "vocab_size", where),
            block_size=block,
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=n_target if isinstance(n_target, int) else max(ids) + 1,
            rms_norm_eps=_eps(d, where),
            rope_theta=parse_rope_theta(d, where),
            max_position_embeddings=_pos_int(d, "max_position_embeddings", where, default=4096),
            attention_bias=bool(d.get("attention_bias", False)),
            layer_types=tuple(layer_types),
            sliding_window=sliding,
            torch_dtype=_dtype_name(d),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
        }
        if self.torch_dtype:
            out["torch_dtype"] = self.torch_dtype
        return out
