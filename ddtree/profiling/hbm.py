"""The memory floor of a decode step: the bytes it must read over a measured copy bandwidth.

At batch 1 a step of a real-width model is memory-bound: it cannot run faster than its weights (and the KV
cache it attends over) take to stream through HBM once. `copy_bandwidth` measures the device's ceiling as a
device-to-device copy (bytes read + written per second, random data); `step_bytes` counts what an AR step
and a speculative round read; their quotient is the floor printed beside measured step times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (random data)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a tied weight counts once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def step_bytes(engine, bs: int, context: int) -> dict[str, int]:
    """What one step must read from memory: target weights, the target's KV at `context`, the drafter's
    own weights plus the shared head it reads again, and its context window's KV."""
    target, drafter = engine.target, engine.drafter
    c = target.config
    elem = target.lm_head_weight.element_size()
    out = {"target_weights": tensor_bytes(target.parameters()),
           "target_kv": c.num_hidden_layers * bs * c.num_key_value_heads * context * c.head_dim * 2 * elem}
    if drafter is not None:
        d = drafter.config
        window = min(context, d.sliding_window or context)
        out["drafter_weights"] = tensor_bytes(drafter.parameters()) + tensor_bytes([target.lm_head_weight])
        out["drafter_kv"] = d.num_hidden_layers * bs * d.num_key_value_heads * window * d.head_dim * 2 * elem
    return out




def floors_ms(nbytes: dict[str, int], bandwidth: float) -> dict[str, float]:
    """AR step (target weights + KV) and speculative round (everything in nbytes) floors in ms."""
    ar = nbytes["target_weights"] + nbytes["target_kv"]
    return {"weights": 1000 * nbytes["target_weights"] / bandwidth, "ar": 1000 * ar / bandwidth,
            "round": 1000 * sum(nbytes.values()) / bandwidth}
