"""Cost-aware tree budget (`--speculative-ddtree-budget auto`): the round cost model and the per-round choice.

CaDDTree (research notes section 5.4) picks the tree size that maximises expected tokens per second,

    theta(b) = sum_rows (1 + Phi_b) / (C_d(rows) + C_v(rows, b + 1))

where Phi_b is the sum of the first b best-first node probabilities (DDTree Prop. 1: the expected
accepted tokens of a prefix-closed tree is 1 + the sum of its nodes' path probabilities), C_d the
fixed cost of a round (drafter forward + tree build) and C_v the target's verify forward over b + 1
tree nodes for every row. Verify width is shared by the batch, so one b* is chosen per round from the
batch's summed gains. Because build_trees orders nodes by score with parents first, every prefix of
the node list is a valid tree, so truncating to b* nodes keeps the round lossless.

This module knows no engine: `measure_verify_cost` times the forwards of the models it is handed (a
`CostSubject`, which ddtree.engine.Engine is); the choice and the truncation are pure tensor code.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ddtree.cuda_graphs import GraphCache
from ddtree.errors import ConfigError
from ddtree.kernels import budget_choice, tree_ops
from ddtree.tree import DraftTrees

__all__ = [
    "CostSubject",
    "RoundCostCalibration",
    "VerifyCostModel",
    "choose_budget",
    "choose_budget_reference",
    "default_node_counts",
    "default_row_counts",
    "measure_verify_cost",
    "truncate_trees",
]

PROFILE_VERSION = 1
MEASURE_REPEATS = 3  # the median of this many timed runs per cell (after one warm-up run)
# Weight of the latest round in the running mean of per-row gains a graphed auto round chooses from (about
# the last ten rounds count): long enough to average one tree's noise away, short enough to follow a batch
# whose requests change.
GAIN_SMOOTHING = 0.1


class CostSubject(Protocol):
    """What `measure_verify_cost` times: a target (and drafter) run the way a decode batch runs them."""

    device: torch.device
    target: Any  # ddtree.models.target.Target
    drafter: Any  # ddtree.models.dflash.DFlashDrafter, or None (no draft cost)
    attention: str  # verify attention backend, as the engine resolved it
    cuda_graphs: bool  # time replays of captured forwards, as graphed rounds run them
    tap_layers: list[int] | None
    vocab_size: int
    mask_token_id: int | None
    max_context: int


def _monotone(values: np.ndarray, axis: int) -> np.ndarray:
    """Running max along `axis`: a larger batch or tree never costs less (timing noise aside)."""
    return np.maximum.accumulate(values, axis=axis)


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear ys(x) over sorted xs (ys[..., len(xs)]), extrapolated linearly past the last point.

    Below the first point the first value holds (no measurement is cheaper than the smallest one).
    """
    if x <= xs[0]:
        return ys[..., 0]
    if len(xs) == 1:  # one point: cost proportional to the size past it
        return ys[..., 0] * (x / xs[0])
    i = int(np.searchsorted(xs, x, side="right")) - 1
    i = min(i, len(xs) - 2)  # past the end: extend the last segment
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return ys[..., i] + w * (ys[..., i + 1] - ys[..., i])


@dataclass
class VerifyCostModel:
    """Seconds per round as a function of (batch rows, tree nodes n + 1), from a measured table.

    rows        sorted batch sizes measured, e.g. (1, 2, 4, 8)
    nodes       sorted verify widths measured (root included), e.g. (2, 3, 5, 9, 17, 33)
    verify_s    verify_s[i][j]: target forward over nodes[j] tokens for rows[i] rows
    draft_s     draft_s[i]: drafter forward + tree build for rows[i] rows (C_d: independent of b)

    Between measured points the cost is interpolated linearly in both axes; the table is made
    monotone (non-decreasing) in both before use, so the model never says a bigger tree is cheaper.
    """

    rows: tuple[int, ...]
    nodes: tuple[int, ...]
    verify_s: tuple[tuple[float, ...], ...]
    draft_s: tuple[float, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    _cache: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows, nodes = np.asarray(self.rows, dtype=float), np.asarray(self.nodes, dtype=float)
        verify = np.asarray(self.verify_s, dtype=float)
        draft = np.asarray(self.draft_s, dtype=float)
        if len(rows) < 1 or len(nodes) < 1:
            raise ConfigError("cost model: rows and nodes need at least one measured point each")
        if np.any(np.diff(rows) <= 0) or np.any(np.diff(nodes) <= 0) or rows[0] < 1 or nodes[0] < 1:
            raise ConfigError(f"cost model: rows {self.rows} and nodes {self.nodes} must be increasing and >= 1")
        if verify.shape != (len(rows), len(nodes)) or draft.shape != (len(rows),):
            raise ConfigError(
                f"cost model: verify_s must be [{len(rows)}][{len(nodes)}] and draft_s [{len(rows)}], "
                f"got {list(verify.shape)} and {list(draft.shape)}"
            )
        if not (np.all(np.isfinite(verify)) and np.all(verify >= 0) and np.all(np.isfinite(draft)) and np.all(draft >= 0)):
            raise ConfigError("cost model: every time must be finite and >= 0 seconds")
        self._rows, self._nodes = rows, nodes
        self._verify = _monotone(_monotone(verify, 0), 1)  # [R, N]
        self._draft = _monotone(draft, 0)  # [R]

    # -- queries -------------------------------------------------------------------------------
    def verify_cost(self, rows: int, nodes: int) -> float:
        """C_v: seconds of one verify forward over `nodes` tree tokens (root included) for `rows` rows."""
        per_width = _interp(float(rows), self._rows, self._verify.T)  # [N]
        return float(max(_interp(float(nodes), self._nodes, per_width), 0.0))

    def draft_cost(self, rows: int) -> float:
        """C_d: seconds of the round's fixed part (drafter forward + tree build) for `rows` rows."""
        return float(max(_interp(float(rows), self._rows, self._draft), 0.0))

    def round_costs(self, rows: int, max_budget: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[max_budget] float32 on `device`: C_d + C_v(rows, b + 1) for b = 1..max_budget (cached)."""
        key = (rows, max_budget, str(device))
        if key not in self._cache:
            values = [self.draft_cost(rows) + self.verify_cost(rows, b + 1) for b in range(1, max_budget + 1)]
            self._cache[key] = torch.tensor(values, dtype=torch.float32, device=device)
        return self._cache[key]

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "rows": list(self.rows), "nodes": list(self.nodes),
                "verify_s": [list(r) for r in self.verify_s], "draft_s": list(self.draft_s), "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cost profile") -> VerifyCostModel:
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ConfigError(f"{where}: not a version {PROFILE_VERSION} cost profile")
        try:
            return cls(tuple(int(r) for r in data["rows"]), tuple(int(n) for n in data["nodes"]),
                       tuple(tuple(float(t) for t in row) for row in data["verify_s"]),
                       tuple(float(t) for t in data["draft_s"]), dict(data.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{where}: {type(err).__name__}: {err}") from err

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> VerifyCostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"--speculative-ddtree-cost-profile: cannot read {str(path)!r}: {err}") from err
        return cls.from_dict(data, where=f"cost profile {str(path)!r}")


# -- what rounds really take ---------------------------------------------------------------------
class RoundCostCalibration:
    """Budget auto's round costs moved by what finished rounds took on the host's clock.

    Each finished round reports its seconds for (rows, tree size): a running mean (EMA, weight `alpha`) per
    pair. The costs to choose with are the table's, every size shifted by the same amount: the median
    (mean - table) gap of the sizes with at least `min_samples` rounds at that row count. The shift is what
    the table leaves out for every size alike (the host's part of a round, a longer context than it was
    timed at); the differences between sizes stay the table's, so the table must carry them (a graphed
    batch times every captured round in place: ddtree.round_costs.AutoBudget.capture_tree_sizes). Taking the
    measured mean for the sizes that ran and the table for the rest instead held auto on its first choice
    whenever the table's slope was too flat: the rounds never ran the size that would have measured better.
    """

    def __init__(self, alpha: float = 0.2, min_samples: int = 2) -> None:
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha: {alpha} is out of range (allowed (0, 1])")
        if min_samples < 1:
            raise ConfigError(f"min_samples: {min_samples} is out of range (allowed >= 1)")
        self.alpha, self.min_samples = alpha, min_samples
        self._mean: dict[tuple[int, int], float] = {}
        self._count: dict[tuple[int, int], int] = {}

    def observe(self, rows: int, budget: int, seconds: float) -> None:
        """A finished round of `rows` computed rows that verified `budget` nodes took `seconds`."""
        key = (rows, budget)
        n = self._count.get(key, 0)
        old = self._mean.get(key, seconds)
        self._mean[key] = seconds if n == 0 else old + self.alpha * (seconds - old)
        self._count[key] = n + 1

    def measured(self, rows: int) -> dict[int, float]:
        """{tree size: mean seconds} of the sizes with at least min_samples rounds at this row count."""
        return {b: t for (r, b), t in self._mean.items() if r == rows and self._count[(r, b)] >= self.min_samples}

    def corrected(self, rows: int, table: Sequence[float]) -> list[float]:
        """table[b - 1] = the table's seconds for tree size b -> the costs to choose with (same layout)."""
        known = {b: t for b, t in self.measured(rows).items() if b <= len(table) and math.isfinite(table[b - 1])}
        if not known:
            return list(table)
        gap = statistics.median(t - table[b - 1] for b, t in known.items())
        return [t + gap for t in table]


# -- the per-round choice ------------------------------------------------------------------------
def choose_budget(log_probs: torch.Tensor, costs: torch.Tensor, live: torch.Tensor | None = None,
                  smoothed: torch.Tensor | None = None, alpha: float = GAIN_SMOOTHING,
                  backend: str = "auto") -> torch.Tensor:
    """b* in 1..B maximising the batch's expected tokens per second; a 0-dim long tensor, no host sync.

    log_probs[bs, B]: the nodes' path log-probabilities in build order (best first, padding -inf,
    so its probability is 0). costs[B]: seconds of a round verifying b = 1..B nodes. live[bs] bool:
    the rows that count (a graphed round's padding rows do not); None: all. Expected tokens of the batch
    with prefix b is sum_rows (1 + cumsum_b p); ties go to the smaller b (argmax picks the first maximum).

    smoothed[B] float32 (in/out): choose from a running mean of the per-row gains instead, updated in place
    with weight `alpha` (a negative first entry: empty, the first round's gains are taken as they are):
    b* = argmax (1 + smoothed) / costs. A graphed round chooses the next round's size from its own tree
    (ddtree.engine), and one tree is a noisy guess at the next one's: at batch 1 the stale per-round
    choice put 12 nodes on a sixth of the rounds where 4 did better on average.

    backend "auto": one Triton launch on CUDA (ddtree.kernels.budget_choice), else the torch reference;
    "triton" or "reference" to force one.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ConfigError(f"backend: {backend!r} is not one of 'auto', 'triton', 'reference'")
    if backend == "triton" or (backend == "auto" and log_probs.is_cuda and budget_choice.triton is not None
                               and log_probs.shape[-1] <= budget_choice.MAX_BUDGET):
        return budget_choice.choose_budget_triton(log_probs, costs, live, smoothed, alpha)
    return choose_budget_reference(log_probs, costs, live, smoothed, alpha)


def choose_budget_reference(log_probs: torch.Tensor, costs: torch.Tensor, live: torch.Tensor | None = None,
                            smoothed: torch.Tensor | None = None, alpha: float = GAIN_SMOOTHING) -> torch.Tensor:
    """The torch ops of `choose_budget` (the CPU path, and the kernel's reference)."""
    budget_choice.check_choice_inputs(log_probs, costs, live, smoothed, alpha)
    log_probs = log_probs.float()
    # a fill, not torch.tensor: no host-to-device copy (the reference may run on a device, even captured)
    rows = torch.full((), float(log_probs.shape[0]), device=log_probs.device)
    if live is not None:
        log_probs = log_probs.masked_fill(~live[:, None], float("-inf"))
        rows = live.sum().float()
    gains = log_probs.exp().cumsum(dim=-1).sum(dim=0)  # [B]: the batch's expected accepted drafts per prefix
    costs = costs.to(gains.device)
    if smoothed is None:
        return ((gains + rows) / costs).argmax() + 1  # rows * 1 (the bonus) + summed path probs
    mean = gains / rows.clamp_min(1.0)
    new = torch.where(smoothed[0] < 0, mean, smoothed + alpha * (mean - smoothed))
    smoothed.copy_(torch.where(rows > 0, new, smoothed))
    return ((1.0 + smoothed) / costs).argmax() + 1


def truncate_trees(trees: DraftTrees, budget: int) -> DraftTrees:
    """The first `budget` nodes of every tree (a prefix-closed tree: parents come before children).

    Verify width becomes budget + 1; rows with fewer nodes keep their padding.
    """
    if not 1 <= budget <= trees.budget:
        raise ConfigError(f"budget: {budget} is out of range (allowed 1..{trees.budget})")
    if budget == trees.budget:
        return trees
    return DraftTrees(
        tokens=trees.tokens[:, :budget],
        parents=trees.parents[:, :budget],
        depths=trees.depths[:, :budget],
        log_probs=trees.log_probs[:, :budget],
        num_nodes=trees.num_nodes.clamp(max=budget),
        max_depth=trees.max_depth,
    )


# -- measuring -----------------------------------------------------------------------------------
def default_row_counts(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, max_batch included; at most 4 sizes (measuring stays quick)."""
    sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
    if len(sizes) > 4:
        sizes = sorted({sizes[0], sizes[len(sizes) // 3], sizes[2 * len(sizes) // 3], sizes[-1]})
    return sizes


def default_node_counts(max_budget: int) -> list[int]:
    """Verify widths 2, 3, 5, 9, 17, ... up to max_budget + 1, max_budget + 1 included."""
    top = max_budget + 1
    return sorted({min(2, top), *[(1 << i) + 1 for i in range(1, 7) if (1 << i) + 1 < top], top})


def _timed(fn: Callable[[], object], device: torch.device, repeats: int, graphed: bool = False) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up; the device syncs around each clock read.

    graphed: time replays of fn captured as a CUDA graph, as a graphed engine round runs it.
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if graphed:
        graphs, eager = GraphCache(device), fn
        fn = functools.partial(graphs.run, "timed", eager)
    fn()  # warm-up (allocator, kernels; the capture when graphed), left out
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_verify_cost(engine: CostSubject, batch_sizes: Sequence[int], node_counts: Sequence[int], context: int,
                        *, block_size: int = 8, draft_window: int | None = None, topk: int = 4,
                        repeats: int = MEASURE_REPEATS) -> VerifyCostModel:
    """Time `engine`'s target verify (and drafter + build) forwards on a `context`-token prefix.

    The caches are not filled by a prefill: their lengths are set to `context` and the stored K/V
    stays zero, since the time of a forward does not depend on the values it attends to. Forwards run
    the way the engine's rounds do: its attention path, and captured as CUDA graphs when it uses them.
    """
    if context < 1:
        raise ConfigError(f"context: {context} is out of range (allowed >= 1)")
    rows = sorted(set(int(b) for b in batch_sizes))
    nodes = sorted(set(int(n) for n in node_counts))
    device, target, drafter = engine.device, engine.target, engine.drafter
    graphed, attention = engine.cuda_graphs, engine.attention
    gen = torch.Generator().manual_seed(0)
    verify: list[tuple[float, ...]] = []
    draft: list[float] = []
    for bs in rows:
        cache = target.new_cache(bs, context + nodes[-1])
        cache.advance(torch.full((bs,), context, dtype=torch.long, device=device))
        starts = torch.full((bs,), context, dtype=torch.long, device=device)
        row_times = []
        for n in nodes:
            ids = torch.randint(engine.vocab_size, (bs, n), generator=gen).to(device)  # [bs, n]
            positions = starts[:, None] + torch.arange(n, device=device)  # [bs, n]
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(bs, n, n)  # [bs, n, n]

            def verify_once(ids=ids, positions=positions, mask=mask, cache=cache, n=n) -> object:
                return target.forward(ids, positions, cache, mask, engine.tap_layers,
                                      kv_len_hint=None if graphed else context + n, attention=attention)

            row_times.append(_timed(verify_once, device, repeats, graphed))
        verify.append(tuple(row_times))
        draft.append(_time_draft(engine, bs, context, block_size, draft_window, topk, nodes[-1] - 1, repeats, gen)
                     if drafter is not None else 0.0)
    meta = {"device": str(device), "context": context, "block_size": block_size, "topk": topk,
            "draft_window": draft_window, "repeats": repeats, "attention": attention, "cuda_graphs": graphed}
    return VerifyCostModel(tuple(rows), tuple(nodes), tuple(verify), tuple(draft), meta)


def _time_draft(engine: CostSubject, bs: int, context: int, block_size: int, draft_window: int | None, topk: int,
                max_budget: int, repeats: int, gen: torch.Generator) -> float:
    """C_d for `bs` rows: one drafter forward on [bonus, MASK...] plus build_trees at max_budget."""
    device, drafter, graphed = engine.device, engine.drafter, engine.cuda_graphs
    # graphed rounds attend to the drafter's whole window (a static shape): size it as a batch would
    ctx = drafter.new_context(bs, draft_window, engine.max_context + block_size if graphed else context + block_size)
    ctx.total.fill_(context)  # a full context of zero K/V: same attention work as a real one
    block_ids = torch.full((bs, block_size), engine.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = torch.randint(engine.vocab_size, (bs,), generator=gen).to(device)
    starts = torch.full((bs,), context, dtype=torch.long, device=device)

    def draft_once() -> object:
        logits = drafter.forward(ctx, block_ids, starts, ctx_len_hint=None if graphed else context,
                                 attention=engine.attention)  # [bs, L, V]
        return tree_ops.build_trees(logits, max_budget, topk)  # the engine's build: fused on CUDA

    return _timed(draft_once, device, repeats, graphed)
