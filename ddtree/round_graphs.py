"""A round as named stages, run eagerly or captured as CUDA graphs and replayed (ddtree.cuda_graphs).

A round (ddtree.decode) is a list of (stage name, function of a `RoundState`). Eagerly each function runs
in turn under the stage timer; graphed, the whole list is captured once per key (rows bucket, tree size,
sampled, ...) and replayed with one launch, rows padded up to a captured bucket (the rows past the live
ones are free slots of length 0, whatever they compute is discarded). Budget auto captures every tree size
it may choose for a row bucket and every bucket below it up front, and times their replays
(ddtree.round_costs turns those times into its cost table).

`GraphedRounds` is a part of ddtree.decode.DecodeBatch: it reads the batch's graphs, timer, slots (cache,
ctx, bonus), spec and max_batch, and its `_round_stages`.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ddtree.cuda_graphs import row_bucket, tree_sizes
from ddtree.tree import CompiledTrees, DraftTrees

log = logging.getLogger("ddtree.engine")

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
        self._device = device
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
            torch.cuda.synchronize(self._device)
        return time.perf_counter()


class RoundState:
    """The tensors one round hands from stage to stage (a graph's are the ones its capture allocated).

    What a captured round's state still holds at its end stays allocated for as long as the graph lives;
    the stages delete the large tensors they use up (draft_logits [m, L, V], taps [m, B+1, T*D]) so a
    batch that captures many rounds (budget auto: every tree size of every row bucket) keeps one copy of
    them in the shared pool, not one per graph.
    """

    committed: torch.Tensor  # [m] committed lengths at the round's start
    draft_logits: torch.Tensor  # [m, L, V]
    trees: DraftTrees  # built at the round's size (budget auto choosing: at the cap, then cut to it)
    compiled: CompiledTrees
    taps: torch.Tensor  # [m, B+1, T*D] target hidden states for the drafter
    target_tokens: torch.Tensor  # [m, B+1] the target's token at every node
    accepted: torch.Tensor  # [m, <= L+1] accepted node indices, -1 padded
    accept_lens: torch.Tensor  # [m]
    new_bonus: torch.Tensor  # [m]
    host: torch.Tensor  # [m, width + 2]: accepted tokens, bonus, accepted length (what goes to the host)
    next_budget: torch.Tensor  # 0-dim: graphed budget auto's choice for the next round
    next: torch.Tensor  # [m] AR rounds: the next token

    def copy(self) -> RoundState:
        new = RoundState()
        new.__dict__.update(self.__dict__)
        return new


Stage = Callable[[RoundState], None]


def apply_stages(prev: RoundState, stages: Sequence[Stage]) -> RoundState:
    s = prev.copy()
    for fn in stages:
        fn(s)
    return s


class GraphedRounds:
    """DecodeBatch's stage runner (`_run_stages`), row padding and budget auto's up-front captures."""

    def _run_stages(self, key: tuple, make_stages: Callable[[], Sequence[tuple[str, Stage]]],
                    prev: RoundState) -> RoundState:
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
                s = graphs.run(key + (i,), functools.partial(apply_stages, s, [fn]), self._graph_state())
            return s
        if key in graphs:
            t.start(self._graph_heads[key])  # the whole graph is timed (as enqueued) under its first stage
            return graphs.replay(key)
        stages = make_stages()
        self._graph_heads[key] = stages[0][0]
        t.start(stages[0][0])
        return graphs.run(key, functools.partial(apply_stages, prev, [fn for _, fn in stages]), self._graph_state())

    def _graph_state(self) -> list[torch.Tensor]:
        """What a round mutates in place (restored after a capture's warm-up run). The target's K/V is
        only written past each row's committed length, which a restored length makes unused again."""
        state = [self.cache.lengths, self.bonus]
        if self.ctx is not None:
            state += [self.ctx.total, self.ctx.k, self.ctx.v]
        if self._gains is not None:
            state.append(self._gains)
        return state

    def _padded_rows(self, n: int) -> int:
        """Rows a round computes: n eagerly; graphed, n padded up to a captured bucket (the rows past n
        are free slots with length 0, whatever they compute is discarded)."""
        return row_bucket(n, self.max_batch) if self.graphs is not None else n

    def _clear_padding(self, n: int, m: int) -> None:
        """Free slots that a graphed round computed on go back to empty (no sync: two fills)."""
        if m > n:
            self.cache.lengths[n:m].zero_()
            if self.ctx is not None:
                self.ctx.total[n:m].zero_()

    def _capture_tree_sizes(self, m: int, sampled: bool) -> None:
        """Capture budget auto's rounds (choosing and not) at every tree size it may choose, for m rows and
        every row bucket below (a batch shrinks as its requests finish), the first time such rounds run: a
        size or bucket met for the first time mid-run would stall that round on its capture (~15 ms on the
        H200, tens of rounds). Each runs once here, and the batch's state is put back after each; then their
        replays are timed for budget auto's cost table (ddtree.round_costs)."""
        if self.graphs is None or (m, sampled) in self._sizes_captured:  # and so every bucket below it
            return
        buckets = [b for b in sorted({row_bucket(r, self.max_batch) for r in range(1, m + 1)})
                   if (b, sampled) not in self._sizes_captured]
        state = self._graph_state()
        saved = [t.clone() for t in state]
        timer, self.timer = self.timer, StageTimer(self.device, sync=self.timer.sync)  # not the batch's time
        started, cap = time.perf_counter(), self.spec.budget_cap
        try:
            for rows in buckets:
                keys = [("round", rows, size, sampled, choosing) for size in tree_sizes(cap) for choosing in (True, False)]
                for key in keys:
                    try:
                        self._run_stages(key, functools.partial(self._round_stages, *key[1:], None), RoundState())
                    finally:  # each runs from the batch's state: no row runs past its cache
                        for t, s in zip(state, saved):
                            t.copy_(s)
                if not self.timer.sync:  # profiling graphs each stage apart: keep the model's table
                    self._set_round_table(rows, sampled, self._time_replays(keys, state, saved))
                self._sizes_captured.add((rows, sampled))
        finally:
            self.timer = timer
        log.debug("budget auto: captured %d tree sizes (choosing and not) for row buckets %s in %.2f s",
                  len(tree_sizes(self.spec.budget_cap)), buckets, time.perf_counter() - started)

    def _time_replays(self, keys: list[tuple], state: list[torch.Tensor],
                      saved: list[torch.Tensor]) -> dict[tuple, float]:
        """Median seconds of ROUND_TIMING_REPEATS replays of each captured round, each from the saved state,
        the rounds taking turns (after one untimed turn)."""
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
