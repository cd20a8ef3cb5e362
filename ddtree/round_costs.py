"""Budget auto in a decode batch: the round costs its choice reads, where they come from, how they move.

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

`RoundCosts` is a part of ddtree.decode.DecodeBatch: it reads the batch's engine, spec, graphs, device and
max_batch.
"""

from __future__ import annotations

import torch

from ddtree.budget import RoundCostCalibration
from ddtree.cuda_graphs import tree_sizes

# Eager budget auto rewrites its round costs from measured rounds this often (graphed: never by default).
CALIBRATE_EVERY = 8
# Graphed budget auto builds the cap's tree and chooses the next round's size on one round in this many.
CHOOSE_EVERY = 4


class RoundCosts:
    """DecodeBatch's budget auto state: cost tensors, calibration, the size chosen ahead, round counts."""

    def _init_round_costs(self, max_batch: int) -> None:
        spec, device = self.spec, self.device
        self._penalty: torch.Tensor | None = None
        # graphed budget auto: the tree size the previous round chose for this one (None: decide with a sync)
        self._next_budget: int | None = None
        self._rounds_ahead = 0  # graphed auto rounds run on a size chosen ahead (every CHOOSE_EVERY-th chooses)
        self._live = torch.zeros(max_batch, dtype=torch.bool, device=device)  # rows < n (not padding)
        self._live_n = 0
        self._round_tables: dict[tuple[int, int], list[float]] = {}  # (rows, cap): seconds per tree size, timed
        self._auto_costs: dict[tuple[int, int], torch.Tensor] = {}  # static per (rows, cap): graphs read them
        self._pinned: dict[tuple[int, int], torch.Tensor] = {}  # host staging of calibrated costs (GPU)
        self._calibrated_rounds = 0
        # rounds between rewrites of auto's costs from measured rounds; 0: never (graphed, see CALIBRATE_EVERY)
        self.calibrate_every = CALIBRATE_EVERY if self.graphs is None else 0
        # the round cost model (measured once per engine, or loaded from a profile)
        self.cost_model = self.engine.budget_cost_model(spec, max_batch) if spec.auto_budget else None
        self.calibration = RoundCostCalibration() if spec.auto_budget else None  # what rounds really take
        # graphed budget auto chooses from a running mean of per-row gains (ddtree.budget.choose_budget)
        self._gains = torch.full((spec.budget_cap,), -1.0, device=device) if spec.auto_budget else None
        self.last_budget: int | None = None  # the latest round's tree size, for /server_info
        self.budget_rounds = 0
        self.budget_total = 0

    def _count_round(self, budget: int) -> None:
        self.last_budget = budget
        self.budget_rounds += 1
        self.budget_total += budget

    def _mark_live(self, n: int) -> None:
        """self._live[i] = i < n: the rows budget auto's captured choice counts (padding rows do not)."""
        if self._live_n != n:
            self._live.zero_()
            self._live[:n] = True
            self._live_n = n

    def _set_round_table(self, rows: int, sampled: bool, timed: dict[tuple, float]) -> None:
        """The timed replays of every captured tree size for `rows` become the costs auto chooses with. A
        size's cost is what its rounds take on average: one in CHOOSE_EVERY chooses."""
        cap = self.spec.budget_cap
        seconds = [float("inf")] * cap  # sizes with no graph stay out of reach
        for size in tree_sizes(cap):
            plain = timed[("round", rows, size, sampled, False)]
            choosing = timed[("round", rows, size, sampled, True)]
            seconds[size - 1] = plain + (choosing - plain) / CHOOSE_EVERY
        self._round_tables[(rows, cap)] = seconds
        if self.device.type == "cuda" and self.calibrate_every:
            self._pinned_staging(rows, cap)
        self._round_costs(rows, cap, graphed=True).copy_(torch.tensor(seconds, dtype=torch.float32))

    def _round_costs(self, m: int, cap: int, graphed: bool) -> torch.Tensor:
        """Budget auto's [cap] round costs for m computed rows; graphed, +inf on sizes with no graph (one
        static tensor per (m, cap): a captured choice reads it in place, and calibration rewrites it)."""
        assert self.cost_model is not None
        if (m, cap) not in self._auto_costs:
            costs = self.cost_model.round_costs(m, cap, self.device).clone()
            self._auto_costs[(m, cap)] = costs + self._non_bucket_penalty(cap) if graphed else costs
        return self._auto_costs[(m, cap)]

    def _calibrate(self, m: int, cap: int, budget: int, seconds: float) -> None:
        """Record a round's seconds; every `calibrate_every` rounds, rewrite the costs auto chooses with (an
        asynchronous copy from pinned memory on a GPU: no sync; the next round reads it in stream order)."""
        assert self.calibration is not None and self.cost_model is not None
        self.calibration.observe(m, budget, seconds)
        self._calibrated_rounds += 1
        if self._calibrated_rounds % self.calibrate_every:
            return
        table = self._round_tables.get((m, cap))  # the captured rounds' own times, else the model's
        if table is None:
            table = self.cost_model.round_costs(m, cap, "cpu").tolist()
            if self.graphs is not None:  # sizes with no graph stay out of reach
                on_graph = set(tree_sizes(cap))
                table = [t if b in on_graph else float("inf") for b, t in enumerate(table, start=1)]
        values = torch.tensor(self.calibration.corrected(m, table), dtype=torch.float32)
        costs = self._round_costs(m, cap, self.graphs is not None)
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
