"""A round as named stages, run eagerly or captured as CUDA graphs and replayed (ddtree.cuda_graphs).

A round (ddtree.round) is a list of (stage name, function of its `RoundState`). Eagerly each function
runs in turn under the stage timer; graphed, the whole list is captured once per key (rows bucket, tree size,
sampled, ...) and replayed with one launch, rows padded up to a captured bucket (the rows past the live
ones are free slots of length 0, whatever they compute is discarded). `StageRunner` does either, and also
captures a list of rounds up front and times their replays (budget auto's cost table, ddtree.round_costs).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from ddtree.cuda_graphs import GraphCache, row_bucket

STAGES = ("prefill", "draft", "build", "verify", "walk", "compact")
# Replays timed per captured auto round (median): its cost table. The rounds of a row bucket are timed in
# turns (one untimed turn first), so a device that is still speeding up slows every size alike.
ROUND_TIMING_REPEATS = 5


class StageTimer:
    """Wall time per stage; syncs the device before each clock read only when asked to."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.sync = sync  # exact per-stage times wanted (a graphed round then runs one graph per stage)
        self._sync = sync and device.type == "cuda"
        self.device = device
        self._stage: str | None = None
        self._t0 = 0.0

    def start(self, stage: str) -> None:
        now = self._now()
        if self._stage is not None:
            self.totals[self._stage] += now - self._t0
        self._stage, self._t0 = stage, now

    def stop(self) -> None:
        if self._stage is not None:
            self.totals[self._stage] += self._now() - self._t0
            self._stage = None

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class StageState(Protocol):
    """What stages hand on (ddtree.round.RoundState): a run starts from a shallow copy of the state before."""

    def copy(self: S) -> S: ...


S = TypeVar("S", bound=StageState)
Stages = Sequence[tuple[str, Callable[[S], None]]]  # a round: (stage name, function of its state), in order


def apply_stages(prev: S, stages: Sequence[Callable[[S], None]]) -> S:
    s = prev.copy()
    for fn in stages:
        fn(s)
    return s


class StageRunner:
    """Runs a round's stages: eagerly, or as CUDA graphs (`graphs`, None: eagerly) captured once per key and
    replayed; times them (`timer`). `state()` lists what a round mutates in place, restored after a capture's
    warm-up run."""

    def __init__(self, graphs: GraphCache | None, timer: StageTimer, max_batch: int,
                 state: Callable[[], list[torch.Tensor]]) -> None:
        self.graphs, self.timer, self.max_batch, self.state = graphs, timer, max_batch, state
        self._heads: dict[tuple, str] = {}  # a captured round's first stage (the timer's name for it)

    @property
    def captures(self) -> int:
        """Graphs captured so far (0 when eager)."""
        return self.graphs.captures if self.graphs is not None else 0

    def padded_rows(self, n: int) -> int:
        """Rows a round computes: n eagerly; graphed, n padded up to a captured bucket (the rows past n
        are free slots with length 0, whatever they compute is discarded)."""
        return row_bucket(n, self.max_batch) if self.graphs is not None else n

    def run(self, key: tuple, make_stages: Callable[[], Stages[S]], prev: S) -> S:
        """Run the stages `make_stages()` returns on a copy of `prev`: eagerly, or as one captured graph per key
        (one per stage when profiling, so each stage's device time can be read between them). A graph that is
        captured already replays without the stages being built (their closures are host time every round)."""
        t, graphs = self.timer, self.graphs
        if graphs is None:
            s = prev.copy()
            for name, fn in make_stages():
                t.start(name)
                fn(s)
            return s
        if t.sync:
            s = prev
            for i, (name, fn) in enumerate(make_stages()):
                t.start(name)
                s = graphs.run(key + (i,), functools.partial(apply_stages, s, [fn]), self.state())
            return s
        if key in graphs:
            t.start(self._heads[key])  # the whole graph is timed (as enqueued) under its first stage
            return graphs.replay(key)
        stages = make_stages()
        self._heads[key] = stages[0][0]
        t.start(stages[0][0])
        return graphs.run(key, functools.partial(apply_stages, prev, [fn for _, fn in stages]), self.state())

    def capture_all(self, rounds: dict[tuple, Callable[[], Stages[S]]], fresh: Callable[[], S],
                    timed: bool) -> dict[tuple, float]:
        """Capture each of `rounds` (key: its stages) that is not yet captured, each run on a `fresh()` state
        from the batch's state and the batch's state put back after it (no row runs past its cache); with `timed`, the median seconds of
        ROUND_TIMING_REPEATS replays of each, the rounds taking turns (after one untimed turn). The stage clock
        stays the batch's: these runs are no round of it."""
        state = self.state()
        saved = [t.clone() for t in state]
        timer = self.timer
        self.timer = StageTimer(timer.device, sync=timer.sync)
        try:
            for key, make_stages in rounds.items():
                try:
                    self.run(key, make_stages, fresh())
                finally:
                    for t, s in zip(state, saved):
                        t.copy_(s)
        finally:
            self.timer = timer
        return self._time_replays(list(rounds), state, saved) if timed else {}

    def _time_replays(self, keys: list[tuple], state: list[torch.Tensor],
                      saved: list[torch.Tensor]) -> dict[tuple, float]:
        assert self.graphs is not None
        times: dict[tuple, list[float]] = {key: [] for key in keys}
        for turn in range(ROUND_TIMING_REPEATS + 1):
            for key in keys:
                for t, s in zip(state, saved):
                    t.copy_(s)
                self._sync_device()
                t0 = time.perf_counter()
                self.graphs.replay(key)
                self._sync_device()
                if turn:
                    times[key].append(time.perf_counter() - t0)
        for t, s in zip(state, saved):
            t.copy_(s)
        return {key: statistics.median(seconds) for key, seconds in times.items()}

    def _sync_device(self) -> None:
        if self.timer.device.type == "cuda":
            torch.cuda.synchronize(self.timer.device)
