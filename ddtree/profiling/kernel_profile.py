"""Timing and profiling device work for the profiling tools: a callable captured as a CUDA graph and timed
(Replay), and the profiler's kernel times grouped by kind (kernel_table).

On the CPU the same code runs eagerly (tests), and the aten ops' own CPU time stands in for kernels.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync_device(device: Any) -> None:
    """Wait for the device's queued work (a no-op off CUDA, or for no device), before a clock read."""
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop what the last measurement left on the device before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Replay:
    """fn captured as a CUDA graph (eager on the CPU); `time()` is the median of `repeats` replays in ms."""

    def __init__(self, fn: Callable[[], Any], device: torch.device) -> None:
        self.fn, self.device, self.graph = fn, device, None
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()
        else:
            self.out = fn()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()

    def time(self, repeats: int = 20) -> float:
        for _ in range(3):
            self()
        times = []
        for _ in range(repeats):
            sync_device(self.device)
            t0 = time.perf_counter()
            self()
            sync_device(self.device)
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)


KINDS = [  # (kind, name fragments), first match wins
    ("triton gemv", ("_fused_linear_kernel",)),
    ("skinny gemm (triton)", ("_skinny_kernel",)),
    ("gemm (cuBLAS)", ("gemm", "gemv", "cutlass", "nvjet", "splitk", "xmma", "cublas")),
    ("attention", ("tree_attention", "_attn", "flash", "fmha", "sdpa")),
    ("q/k norm + rope", ("norm_rope",)),
    ("add + rmsnorm (triton)", ("_add_rms_norm",)),
    ("silu * up (triton)", ("_silu_mul",)),
    ("norm (torch)", ("norm",)),
    ("tree ops, walk, compaction", ("tree", "_top", "compact", "accepted", "follow", "budget")),
    ("reduce / argmax", ("reduce", "argmax", "max")),
    ("copy / cat / index", ("copy", "cat", "index", "gather", "scatter", "fill")),
    ("elementwise (torch)", ("elementwise",)),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, parts in KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def kernel_table(run: Callable[[], None], device: torch.device, steps: int = 5) -> dict[str, Any]:
    """The profiler's device kernels over `steps` calls of run: per kernel name, launches and us per step.

    On the CPU (no kernels) the aten ops' self CPU time stands in. CUPTI reports the kernels inside a graph
    replay one by one, so a replayed step lists what it launched."""
    from torch.profiler import ProfilerActivity, profile

    run()
    sync_device(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        sync_device(device)
    rows: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if cuda:
            if not str(getattr(e, "device_type", "")).endswith("CUDA"):
                continue
            us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "device_time_total", 0.0))
        else:
            if not e.key.startswith("aten::"):
                continue
            us = float(e.self_cpu_time_total)
        if us <= 0:
            continue
        count, total = rows.get(e.key, [0.0, 0.0])
        rows[e.key] = [count + e.count / steps, total + us / steps]
    kernels = sorted(({"name": k, "launches": c, "us": t, "kind": kind_of(k)} for k, (c, t) in rows.items()),
                     key=lambda r: -r["us"])
    kinds: dict[str, dict[str, float]] = {}
    for r in kernels:
        k = kinds.setdefault(r["kind"], {"launches": 0.0, "us": 0.0})
        k["launches"] += r["launches"]
        k["us"] += r["us"]
    return {"kernels": kernels, "kinds": kinds, "total_us": sum(r["us"] for r in kernels),
            "launches": sum(r["launches"] for r in kernels)}
