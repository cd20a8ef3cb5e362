"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream still runs.

At batch 1 a real-width decoder step is ~140 short kernels in a CUDA graph, and each one's start costs time
the HBM sits idle: the launch, its programs' scheduling, the latency before its first weight tiles land
(docs/perf.md, "The engine at real width": 1b's kernels took 1144 us of a 1452 us replay). On Hopper and
later (compute capability 9.0+), a kernel launched with the programmatic-serialization attribute may begin
once every program of the kernel ahead of it has signalled (griddepcontrol.launch_dependents). Its programs
do what does not depend on that kernel (the skinny GEMM puts its first weight tiles in flight towards the
L2), then wait (griddepcontrol.wait) until it has finished and its writes are visible.

Every kernel launched this way keeps two rules, or a graph of them races:

- every program calls `wait` (this module's `wait_then_release`) before it reads anything an earlier kernel
  wrote, writes anything an earlier kernel reads, and before any early return. The kernel ahead finishes only
  after its own wait, so one wait orders a program after every kernel before it too;
- before the wait it touches nothing but constants (weights).

Kernels launched without the attribute (torch's) wait for everything before them as usual, so the two mix.
`DDTREE_PDL=0` turns it off (launches then are what they were without it).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:  # Triton is optional: CPU machines use the references (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

ENV = "DDTREE_PDL"


def _gdc_in_triton() -> bool:
    if triton is None:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch dependent: a CUDA device of compute capability 9.0 or later, a Triton
    with griddepcontrol, and DDTREE_PDL not "0". Never under TRITON_INTERPRET (no device to overlap on)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _gdc_in_triton() and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict[str, Any]:
    """The kernel arguments that go together: the kernel's PDL constexpr (its wait) and Triton's launch_pdl
    option (the attribute). A kernel launched with the attribute but without the wait would race."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """Wait for the kernel ahead (and so every kernel before it) to finish and flush, then let the next
        kernel launch: its programs can be scheduled, and start on their weights, while this one works."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs):
        """Ask for the cache lines at ptrs to be brought into the L2 (no registers, no wait: the loads that
        follow the wait find them there). Only for memory no kernel writes: the weights."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
