"""A drafter's starting weights: the target's last layers, or an earlier drafter's grown to a larger shape.

Used by ddtree.train.drafter before the first step (`--init target` and `--init-from DIR`). Both
only copy tensors between models already built; neither trains nor reads files.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree.errors import ConfigError


def init_from_target(drafter: Any, target: Any) -> list[int]:
    """Copy the target's last num_hidden_layers layers into the drafter's layers (same names)."""
    n_t, n_d = target.config.num_hidden_layers, len(drafter.layers)
    if n_d > n_t:
        raise ConfigError(f"init: the drafter has {n_d} layers but the target only {n_t}")
    src = list(range(n_t - n_d, n_t))
    for dst, s in zip(drafter.layers, src):
        try:
            dst.load_state_dict(target.model.layers[s].state_dict())
        except RuntimeError as err:
            raise ConfigError(f"init: target layer {s} does not fit a drafter layer ({err})") from err
    return src


# what a fine-tune may change against the drafter it starts from: the weights carry over unchanged
GROWABLE_FIELDS = ("num_hidden_layers", "layer_types", "block_size", "sliding_window", "target_layer_ids",
                    "intermediate_size")
MLP_IN, MLP_OUT = ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.down_proj.weight"  # [I, D] x 2, [D, I]


def init_from_drafter(drafter: Any, start: Any, where: str) -> list[int]:
    """Load `start`'s weights into `drafter`; return the indices of the layers it adds (grown).

    The two may differ in block size, window, depth (the new drafter at least as deep), MLP width (at least as
    wide) and taps (the new target_layer_ids holding every one of start's). Layers past start's begin random
    with their attention output and MLP down projections zeroed, so their residual branches add nothing; an
    MLP's units past start's begin random with their down projection's columns zeroed, so they add nothing;
    and the fusion's columns of a tap start has not are zeroed, so the tap adds nothing: the grown drafter
    starts out computing what `start` does.
    """
    a, b = start.config, drafter.config
    other = [f for f in type(a).__dataclass_fields__ if f not in GROWABLE_FIELDS and getattr(a, f) != getattr(b, f)]
    old_taps, new_taps = list(a.target_layer_ids), list(b.target_layer_ids)
    if (other or b.num_hidden_layers < a.num_hidden_layers or b.intermediate_size < a.intermediate_size
            or not set(old_taps) <= set(new_taps)):
        what = ", ".join(f"{f} {getattr(a, f)} -> {getattr(b, f)}" for f in other) or (
            f"num_hidden_layers {a.num_hidden_layers} -> {b.num_hidden_layers} (fewer)"
            if b.num_hidden_layers < a.num_hidden_layers else
            f"intermediate_size {a.intermediate_size} -> {b.intermediate_size} (narrower)"
            if b.intermediate_size < a.intermediate_size else
            f"target_layer_ids {old_taps} -> {new_taps} (drops {sorted(set(old_taps) - set(new_taps))})")
        raise ConfigError(f"init_from: {where} does not fit the drafter being trained ({what}); only more layers, "
                          "wider MLPs, more taps, another block size or window may differ")
    state = start.state_dict()
    fc = state.pop("fc.weight")  # [D, T_old * D]: one block of columns per tap, in target_layer_ids' order
    mlp = {k: state.pop(k) for k in list(state) if k.endswith((*MLP_IN, MLP_OUT))}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    own = drafter.state_dict()
    unexpected += [k for k in mlp if k not in own]
    missing = [k for k in missing if k not in mlp]
    width_in = a.intermediate_size
    with torch.no_grad():
        for k, w in mlp.items():
            if k not in own:
                continue
            if k.endswith(MLP_OUT):
                own[k].zero_()
                own[k][:, :width_in].copy_(w)
            else:
                own[k][:width_in].copy_(w)
    if unexpected:
        raise ConfigError(f"init_from: {where} has weights the drafter lacks: {unexpected[:4]}")
    grown = list(range(a.num_hidden_layers, b.num_hidden_layers))
    width = a.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        for i, tap in enumerate(old_taps):
            j = new_taps.index(tap)
            drafter.fc.weight[:, j * width:(j + 1) * width].copy_(fc[:, i * width:(i + 1) * width])
        for i in grown:
            drafter.layers[i].self_attn.o_proj.weight.zero_()
            drafter.layers[i].mlp.down_proj.weight.zero_()
    left = [k for k in missing if k != "fc.weight" and not any(k.startswith(f"layers.{i}.") for i in grown)]
    if left:
        raise ConfigError(f"init_from: {where} lacks weights the drafter needs: {left[:4]}")
    return grown
