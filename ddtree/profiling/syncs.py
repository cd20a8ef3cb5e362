"""Count the host-device synchronisations a piece of CUDA work makes (torch's sync debug mode).

torch.cuda.set_sync_debug_mode("warn") makes every synchronising call (`.item()`, `.tolist()`, a
device-to-host copy, `nonzero`, a stream sync) emit a UserWarning; counting those warnings counts
the syncs, with no profiler and no change to the work itself. Waiting on an event (how a decode round
reads its tokens back) is a sync the debug mode does not see, so those waits are counted beside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def count_host_syncs(fn: Callable[[], T]) -> tuple[T, int]:
    """fn()'s result and how many synchronising CUDA calls it made (0 on a machine without CUDA)."""
    if not torch.cuda.is_available():
        return fn(), 0
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    event_waits = 0
    event_sync = torch.cuda.Event.synchronize

    def counted_event_sync(event: torch.cuda.Event) -> None:
        nonlocal event_waits
        event_waits += 1
        event_sync(event)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted_event_sync  # type: ignore[method-assign]
        try:
            result = fn()
        finally:
            torch.cuda.Event.synchronize = event_sync  # type: ignore[method-assign]
            torch.cuda.set_sync_debug_mode(previous)
    # only the per-call warnings count (torch also warns once that the debug mode is a prototype)
    return result, event_waits + sum("called a synchronizing CUDA operation" in str(w.message) for w in seen)


def round_syncs(batch, rounds: int = 4, warmup_rounds: int = 2) -> list[int]:
    """Host syncs of each of `rounds` DecodeBatch.step() calls after `warmup_rounds` (which capture graphs).

    The batch must have running requests that outlast warmup_rounds + rounds rounds.
    """
    for _ in range(warmup_rounds):
        batch.step()
    return [count_host_syncs(batch.step)[1] for _ in range(rounds)]
