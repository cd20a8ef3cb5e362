"""How a decode batch chooses each round's tree size: a fixed budget, or budget auto (ddtree.round.BudgetChoice).

Budget auto (`AutoBudget`): the round costs its choice reads, where they come from, how they move.

The choice itself is ddtree.budget.choose_budget (expected tokens per second of every tree size). What it
reads is one static [cap] tensor of seconds per tree size for each (rows, cap), so a captured choice
reads it in place:

- eager: the engine's verify cost model (ddtree.budget.VerifyCostModel, measured once per engine), and
  every CALIBRATE_EVERY measured rounds that table shifted by what rounds really took (the model times a
  verify forward alone and leaves out the round's other launches);
- graphed: the captured rounds' own replay times (ddtree.round_graphs times them when it captures every
  tree size), +inf on sizes with no graph; no calibration unless asked (calibrate_every): on the H200,
  calibrated graphed batches ran 2-3% slower at batch 1 and chose no better at batch 32.

Graphed, one round in CHOOSE_EVERY builds the cap's tree and chooses the next round's size on the device
(handed back with the tokens); the rounds between build and verify that size, the same graph as that fixed
budget's round: a choosing round replayed 7 us slower than a plain one (417 vs 410 us, H200, batch 1).

Eagerly, and in a graphed batch's first round, the size is chosen from the round's own trees, read back with a
second host sync (ddtree.round.speculative_round drafts, reads it, then verifies that prefix). The first graphed
round that runs on a size chosen ahead captures every tree size auto may choose, for its row bucket and every
bucket below, and times their replays (`capture_tree_sizes`).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ddtree.budget import RoundCostCalibration, VerifyCostModel, choose_budget
from ddtree.config import SpecConfig
from ddtree.cuda_graphs import row_bucket, tree_sizes
from ddtree.round import RoundParts, RoundPlan, RoundState, Stage, round_stages
from ddtree.sampling import Mode
from ddtree.tree import DraftTrees

log = logging.getLogger("ddtree.engine")

# Eager budget auto rewrites its round costs from measured rounds this often (graphed: never by default).
CALIBRATE_EVERY = 8
# Graphed budget auto builds the cap's tree and chooses the next round's size on one round in this many.
CHOOSE_EVERY = 4


class FixedBudget:
    """Every round verifies the budget cap: the round is one graph and one launch, and may run ahead."""

    runs_ahead = True
    cost_model: VerifyCostModel | None = None  # budget auto's; a fixed budget needs none

    def __init__(self, spec: SpecConfig) -> None:
        self.cap = spec.budget_cap
        self._plan = RoundPlan(self.cap, choose_next=False, calibrates=False)  # every round's (made once)
        self.last_budget: int | None = None  # the latest round's tree size
        self.budget_rounds = 0
        self.budget_total = 0

    def plan(self, parts: RoundParts, m: int, n: int, sampled: Mode) -> RoundPlan:
        return self._plan

    def choose(self, trees: DraftTrees, n: int, m: int, graphed: bool) -> int:
        raise AssertionError("a fixed budget's size is planned, never chosen")  # pragma: no cover

    def choosing_stage(self, m: int) -> Stage:
        raise AssertionError("a fixed budget chooses no next size")  # pragma: no cover

    def finished(self, plan: RoundPlan, m: int, budget: int, next_size: int | None, seconds: float,
                 captured: bool) -> None:
        self.count(budget)

    def count(self, budget: int) -> None:
        self.last_budget = budget
        self.budget_rounds += 1
        self.budget_total += budget

    def round_state(self) -> list[torch.Tensor]:
        return []

    def snapshot(self) -> tuple | None:
        """What carries from one generation to the next (budget auto's; a fixed budget has none)."""
        return None

    def restore(self, state: tuple | None) -> None:
        pass


class AutoBudget(FixedBudget):
    """Budget auto: cost tensors, calibration, the size chosen ahead (graphed), the running mean of gains."""

    runs_ahead = False  # a graphed round reads its next size back with the tokens; eagerly it reads b* mid-round

    cost_model: VerifyCostModel

    def __init__(self, spec: SpecConfig, cost_model: VerifyCostModel, max_batch: int, device: torch.device,
                 graphed: bool) -> None:
        """cost_model: the engine's (measured once per engine, or loaded from a profile); graphed: the batch's
        rounds are CUDA graphs (no calibration by default then: CALIBRATE_EVERY)."""
        super().__init__(spec)
        self.cost_model, self.max_batch, self.device = cost_model, max_batch, device
        self._penalty: torch.Tensor | None = None
        # graphed: the tree size the previous round chose for this one (None: decide with a sync)
        self.next_budget: int | None = None
        self.rounds_ahead = 0  # graphed rounds run on a size chosen ahead (every CHOOSE_EVERY-th chooses)
        self.live = torch.zeros(max_batch, dtype=torch.bool, device=device)  # rows < n (not padding)
        self._live_n = 0
        self.round_tables: dict[tuple[int, int], list[float]] = {}  # (rows, cap): seconds per tree size, timed
        self.auto_costs: dict[tuple[int, int], torch.Tensor] = {}  # static per (rows, cap): graphs read them
        self._pinned: dict[tuple[int, int], torch.Tensor] = {}  # host staging of calibrated costs (GPU)
        self.sizes_captured: set[tuple[int, Mode]] = set()  # (rows, sampled) whose every tree size is captured
        self.calibrated_rounds = 0
        # rounds between rewrites of auto's costs from measured rounds; 0: never (graphed, see CALIBRATE_EVERY)
        self.calibrate_every = 0 if graphed else CALIBRATE_EVERY
        self.graphed = graphed  # as the latest round ran (plan() looks again each round)
        self.calibration = RoundCostCalibration()  # what rounds really take
        # graphed rounds choose from a running mean of per-row gains (ddtree.budget.choose_budget)
        self.gains = torch.full((spec.budget_cap,), -1.0, device=device)

    def plan(self, parts: RoundParts, m: int, n: int, sampled: Mode) -> RoundPlan:
        """Graphed, after the first round: the size the round before chose, and one round in CHOOSE_EVERY
        chooses the next (on the device, read back with the tokens), so a round is one graph and one sync;
        the choice is one round stale. Otherwise (the first graphed round, every eager round): chosen from
        this round's trees."""
        graphed = self.graphed = parts.runner.graphs is not None
        self.round_costs(m, self.cap, graphed)
        if not graphed or self.next_budget is None:
            return RoundPlan(None, choose_next=False, calibrates=not graphed)
        choosing = self.rounds_ahead % CHOOSE_EVERY == 0
        self.rounds_ahead += 1
        self._mark_live(n)
        self.capture_tree_sizes(parts, m, sampled)
        return RoundPlan(self.next_budget, choose_next=choosing, calibrates=True)

    def choose(self, trees: DraftTrees, n: int, m: int, graphed: bool) -> int:
        """The prefix of b* nodes (a valid tree: parents come first) with the most expected tokens per second
        for the live rows; graphed, b* is one of the captured tree sizes (and seeds the next round's)."""
        size = int(choose_budget(trees.log_probs[:n], self.round_costs(m, self.cap, graphed)))
        if graphed:
            self.next_budget = size
        return size

    def choosing_stage(self, m: int) -> Stage:
        """The next round's size from this round's trees: one launch on CUDA; reads the static cost tensor and
        live mask a capture holds on to, and updates the running mean of gains in place."""
        next_costs, live = self.round_costs(m, self.cap, graphed=True), self.live[:m]

        def choose_next_budget(s: RoundState) -> None:
            s.next_budget = choose_budget(s.trees.log_probs, next_costs, live, smoothed=self.gains)

        return choose_next_budget

    def finished(self, plan: RoundPlan, m: int, budget: int, next_size: int | None, seconds: float,
                 captured: bool) -> None:
        """After the round's read: the size it chose ahead, and (calibrating) what it took: a graphed round that
        captured nothing, past the first (which reads b* back with a second sync), or any eager round."""
        if next_size is not None:
            self.next_budget = next_size
        if self.calibrate_every and plan.calibrates and not captured:
            self.calibrate(m, self.cap, budget, seconds)
        self.count(budget)

    def round_state(self) -> list[torch.Tensor]:
        return [self.gains]

    def snapshot(self) -> tuple:
        """The state that carries from one generation to the next on a batch (the size chosen ahead, the
        choosing rounds' phase, the running mean of gains): restore() it to start each from the same one."""
        return self.next_budget, self.rounds_ahead, self.gains.clone()

    def restore(self, state: tuple | None) -> None:
        if state is not None:
            self.next_budget, self.rounds_ahead = state[0], state[1]
            self.gains.copy_(state[2])

    def _mark_live(self, n: int) -> None:
        """self.live[i] = i < n: the rows the captured choice counts (padding rows do not)."""
        if self._live_n != n:
            self.live.zero_()
            self.live[:n] = True
            self._live_n = n

    def capture_tree_sizes(self, parts: RoundParts, m: int, sampled: Mode) -> None:
        """Capture the rounds (choosing and not) at every tree size auto may choose, for m rows and every row
        bucket below (a batch shrinks as its requests finish), the first time such rounds run: a size or bucket
        met for the first time mid-run would stall that round on its capture (~15 ms on the H200, tens of
        rounds). Each runs once from the batch's state, put back after it; their replays' times become the
        cost table (unless profiling, which graphs each stage apart: the model's table stays)."""
        runner = parts.runner
        if runner.graphs is None or (m, sampled) in self.sizes_captured:  # and so every bucket below it
            return
        buckets = [b for b in sorted({row_bucket(r, self.max_batch) for r in range(1, m + 1)})
                   if (b, sampled) not in self.sizes_captured]
        started = time.perf_counter()
        for rows in buckets:
            rounds = {key: functools.partial(round_stages, parts, *key[1:], None)
                      for key in [("round", rows, size, sampled, choosing)
                                  for size in tree_sizes(self.cap) for choosing in (True, False)]}
            timed = runner.capture_all(rounds, RoundState, timed=not runner.timer.sync)
            if timed:
                self.set_round_table(rows, sampled, timed)
            self.sizes_captured.add((rows, sampled))
        log.debug("budget auto: captured %d tree sizes (choosing and not) for row buckets %s in %.2f s",
                  len(tree_sizes(self.cap)), buckets, time.perf_counter() - started)
    def set_round_table(self, rows: int, sampled: bool, timed: dict[tuple, float]) -> None:
        """The timed replays of every captured tree size for `rows` become the costs auto chooses with. A
        size's cost is what its rounds take on average: one in CHOOSE_EVERY chooses."""
        cap = self.cap
        seconds = [float("inf")] * cap  # sizes with no graph stay out of reach
        for size in tree_sizes(cap):
            plain = timed[("round", rows, size, sampled, False)]
            choosing = timed[("round", rows, size, sampled, True)]
            seconds[size - 1] = plain + (choosing - plain) / CHOOSE_EVERY
        self.round_tables[(rows, cap)] = seconds
        if self.device.type == "cuda" and self.calibrate_every:
            self._pinned_staging(rows, cap)
        self.round_costs(rows, cap, graphed=True).copy_(torch.tensor(seconds, dtype=torch.float32))

    def round_costs(self, m: int, cap: int, graphed: bool) -> torch.Tensor:
        """Budget auto's [cap] round costs for m computed rows; graphed, +inf on sizes with no graph (one
        static tensor per (m, cap): a captured choice reads it in place, and calibration rewrites it)."""
        if (m, cap) not in self.auto_costs:
            costs = self.cost_model.round_costs(m, cap, self.device).clone()
            self.auto_costs[(m, cap)] = costs + self._non_bucket_penalty(cap) if graphed else costs
        return self.auto_costs[(m, cap)]

    def calibrate(self, m: int, cap: int, budget: int, seconds: float) -> None:
        """Record a round's seconds; every `calibrate_every` rounds, rewrite the costs auto chooses with (an
        asynchronous copy from pinned memory on a GPU: no sync; the next round reads it in stream order)."""
        self.calibration.observe(m, budget, seconds)
        self.calibrated_rounds += 1
        if self.calibrated_rounds % self.calibrate_every:
            return
        table = self.round_tables.get((m, cap))  # the captured rounds' own times, else the model's
        if table is None:
            table = self.cost_model.round_costs(m, cap, "cpu").tolist()
            if self.graphed:  # sizes with no graph stay out of reach
                on_graph = set(tree_sizes(cap))
                table = [t if b in on_graph else float("inf") for b, t in enumerate(table, start=1)]
        values = torch.tensor(self.calibration.corrected(m, table), dtype=torch.float32)
        costs = self.round_costs(m, cap, self.graphed)
        if costs.device.type == "cpu":
            costs.copy_(values)
            return
        staging = self._pinned_staging(m, cap)
        staging.copy_(values)  # the last copy from it finished: every round since ended in a sync
        costs.copy_(staging, non_blocking=True)

    def _pinned_staging(self, m: int, cap: int) -> torch.Tensor:
        """Host memory the calibration copies (m, cap)'s costs from (pinning takes ~1 ms on the H200's host:
        the first round ahead makes it, with its captures, not a timed round)."""
        staging = self._pinned.get((m, cap))
        if staging is None:
            staging = self._pinned[(m, cap)] = torch.empty(cap, dtype=torch.float32, pin_memory=True)
        return staging

    def _non_bucket_penalty(self, cap: int) -> torch.Tensor:
        """+inf on the tree sizes that have no captured verify (budget auto picks among tree_sizes(cap))."""
        if self._penalty is None or self._penalty.shape[0] != cap:
            penalty = torch.full((cap,), float("inf"), device=self.device)
            penalty[[b - 1 for b in tree_sizes(cap)]] = 0.0
            self._penalty = penalty
        return self._penalty
