"""CUDA graphs for the decode loop: capture a round's device work once per shape bucket, then replay it.

A round of the fixture pair is a few hundred small kernels; launched one by one from Python they cost
more than they compute. A captured graph replays them with one launch. What a graph needs from its
callers (and what DecodeBatch provides):

- static shapes: rows are padded up to a bucket (ROW_BUCKETS) and tree sizes come from TREE_BUCKETS;
  attention reads each row's prefix length from the device (ddtree.kernels.tree_attention), never a
  host-known bound;
- static addresses: every input is a slice of a preallocated buffer (KV cache, drafter context,
  bonus tokens, temperatures, seeds), and the outputs are the tensors the capture allocated, kept
  alive with the graph;
- no host work inside: no `.item()`, `.tolist()` or host-to-device copy (tree.py and sampling.py are
  written that way).

Capturing first runs the work once eagerly (Triton compiles, cuBLAS picks kernels), which advances the
caches; `capture` restores the state the caller names so that run leaves no trace.
torch.cuda.graphs' make_graphed_callables targets autograd modules; this is the plain capture/replay.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

# Batch rows are padded up to one of these (then max_batch); a handful of graphs covers every batch size.
ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Tree sizes (non-root nodes) a graphed round verifies; budget auto chooses among these (and the cap).
TREE_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 255)


def row_bucket(rows: int, max_batch: int) -> int:
    """The smallest bucket >= rows (max_batch when rows exceed the last bucket below it)."""
    if not 1 <= rows <= max_batch:
        raise ValueError(f"rows: {rows} is out of range (allowed 1..{max_batch})")
    i = bisect.bisect_left(ROW_BUCKETS, rows)
    return min(ROW_BUCKETS[i], max_batch) if i < len(ROW_BUCKETS) else max_batch


def tree_sizes(cap: int) -> list[int]:
    """Tree sizes a graphed round may verify for a budget cap: the buckets below it, and the cap."""
    return [b for b in TREE_BUCKETS if b < cap] + [cap]


class GraphCache:
    """Captured graphs by key. `run(key, fn, state)` captures fn on the first call, then replays.

    fn must do device work only and return the tensors the caller reads; `state` lists tensors that fn
    mutates in place (lengths, context, bonus tokens): they are saved before the eager warm-up run and
    restored after it, so capturing leaves the batch exactly as it was. All graphs share one memory pool
    (the replays never overlap, and every graph's outputs stay referenced, so no graph's live tensors
    are handed to another).
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"GraphCache: CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.captures = 0
        self.replays = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], Any], state: Sequence[torch.Tensor] = ()) -> Any:
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn, state)
        return self.replay(key)

    def replay(self, key: Hashable) -> Any:
        """Replay the graph captured under `key` (KeyError if there is none); its outputs."""
        graph, outputs = self._graphs[key]
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, fn: Callable[[], Any], state: Sequence[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, Any]:
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()  # warm-up: compiles and autotunes outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph collects garbage before the capture; a collection during it could free an unreachable
        # batch's graph, and destroying a graph is a call a capture forbids (the capture fails): hold it off
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn()
        finally:
            if collecting:
                gc.enable()
        self.captures += 1
        return graph, outputs
