"""Reading and writing model folders (config.json + *.safetensors) for the target and the drafter.

Every tensor is checked by name and shape against the model built from config.json before any
weight is copied: a missing, extra or mis-shaped tensor is a `ModelLoadError` naming it. Names
are Hugging Face's for the target (`model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`
absent when tied) and z-lab's for the drafter (`layers.{i}...`, `fc.weight`, `hidden_norm.weight`,
`norm.weight`; a `model.` prefix is accepted on load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ddtree.errors import ModelLoadError
from ddtree.models.configs import DrafterConfig, TargetConfig, read_config_json
from ddtree.models.dflash import DFlashDrafter, check_fit
from ddtree.models.target import Target

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16}
# buffers some exporters write that carry no weights
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """dtype None: the config's torch_dtype on an accelerator, float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if device.type == "cpu" or config_dtype is None:
            return torch.float32
        dtype = config_dtype
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; supported: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the folder (CPU), by name."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({err})") from err
        for name, t in part.items():
            if name in tensors:
                raise ModelLoadError(f"{folder}: tensor {name!r} appears in more than one safetensors file")
            tensors[name] = t
    return tensors


def _fill(model: torch.nn.Module, tensors: dict[str, torch.Tensor], rename: dict[str, str], where: str,
          device: torch.device, dtype: torch.dtype, ignore: frozenset[str] = frozenset()) -> None:
    """Check names/shapes against a meta-device model, then assign the converted tensors."""
    expected = {rename.get(k, k): (k, p.shape) for k, p in model.state_dict().items()}
    found = {k: t for k, t in tensors.items() if not k.endswith(_IGNORED_SUFFIXES) and k not in ignore}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"{where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ModelLoadError(f"{where}: unexpected tensor {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    state: dict[str, torch.Tensor] = {}
    for file_name, (own_name, shape) in expected.items():
        t = found[file_name]
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{where}: tensor {file_name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        state[own_name] = t.to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True)


def load_target(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None) -> Target:
    """A Target from a Hugging Face Qwen3/Llama folder (config.json + *.safetensors)."""
    device = torch.device(device)
    config = TargetConfig.from_dict(read_config_json(path), where=f"{path}/config.json")
    dtype = resolve_dtype(dtype, device, config.torch_dtype)
    with torch.device("meta"):
        model = Target(config)
    tensors = read_safetensors(path)
    # tied checkpoints sometimes still carry a copy of the head; the embedding is what is used
    ignore = frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset()
    _fill(model, tensors, {"head.weight": "lm_head.weight"}, str(path), device, dtype, ignore)
    return model.eval()


def load_drafter(path: str | Path, target: Target, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None) -> DFlashDrafter:
    """A DFlash drafter from a z-lab-format folder, checked against its target before any tensor is read."""
    device = torch.device(device)
    where = f"{path}/config.json"
    config = DrafterConfig.from_dict(read_config_json(path), where=where)
    check_fit(config, target.config, where=where)
    dtype = resolve_dtype(dtype, device, config.torch_dtype)
    tensors = read_safetensors(path)
    if tensors and all(k.startswith("model.") for k in tensors):
        tensors = {k[len("model."):]: t for k, t in tensors.items()}
    fc = tensors.get("fc.weight")
    want = len(config.target_layer_ids) * config.hidden_size
    if fc is not None and fc.dim() == 2 and fc.shape[1] != want:
        raise ModelLoadError(
            f"{path}: tensor 'fc.weight' has input width {fc.shape[1]}, expected len(target_layer_ids) "
            f"({len(config.target_layer_ids)}) x hidden_size ({config.hidden_size}) = {want}"
        )
    with torch.device("meta"):
        model = DFlashDrafter(config, target)
    _fill(model, tensors, {}, str(path), device, dtype)
    return model.eval()


def _write(path: str | Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # clone: safetensors refuses tensors that share storage (views, tied weights)
    tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _dtype_str(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def save_target(model: Target, path: str | Path, compute_dtype: str | None = None) -> None:
    """Write a Hugging Face-format folder that `load_target` (and transformers) read back.

    compute_dtype: the config's torch_dtype (what loaders run in) when it differs from the stored weights'.
    """
    state = {("lm_head.weight" if k == "head.weight" else k): t for k, t in model.state_dict().items()}
    config = model.config.to_dict() | {"torch_dtype": compute_dtype or _dtype_str(model.dtype)}
    _write(path, config, state)


def save_drafter(model: DFlashDrafter, path: str | Path, compute_dtype: str | None = None) -> None:
    """Write a z-lab-format drafter folder (config.json with dflash_config + model.safetensors)."""
    config = model.config.to_dict() | {"torch_dtype": compute_dtype or _dtype_str(model.dtype)}
    _write(path, config, model.state_dict())
