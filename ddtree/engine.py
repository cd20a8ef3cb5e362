"""The decoding loop: AR, DFlash chain and DDTree in one engine (token ids only, no text).

One round for every running request at once (DESIGN section 2):

    1. draft     the DFlash drafter runs on [bonus, MASK...] and yields L = block_size - 1 marginals
    2. build     build_trees: the best `budget` paths by drafter log-probability (a chain for DFLASH)
    3. compile   compile_trees: [bonus, nodes], positions start + depth, ancestor-or-self mask
    4. verify    one target forward over every tree; the target's token at every node
    5. walk      follow_trees: the nodes whose every ancestor matches the target; the deepest gives the bonus
    6. compact   move the accepted nodes' KV after the prefix; feed their hidden states to the drafter

Rows of a `DecodeBatch` are kept packed at the front (a finished request's slot is refilled by moving
the last row into it), so every forward runs on a contiguous view of the caches. The only host
synchronisation per round is the one that hands the new tokens back to the caller; with
`budget="auto"`, eager rounds (and a graphed batch's first) have a second one, after step 2, that reads
the chosen tree size (ddtree.budget); later graphed rounds choose the next round's size on the device and
hand it back with the tokens, one round in CHOOSE_EVERY (the rounds between build and verify that size, as
a fixed budget's round does).

On CUDA (with Triton) verify attention is the tree-attention kernel and each round runs as one CUDA graph
(ddtree.cuda_graphs), rows padded to a captured bucket, and steps 2, 3 and 5 are one Triton kernel each
(ddtree.kernels.tree_ops); elsewhere the same stage functions run eagerly on ddtree.tree's torch code.
Either way the tokens committed are the target's own.
"""

from __future__ import annotations

import functools
import logging
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from ddtree.budget import (
    RoundCostCalibration,
    VerifyCostModel,
    choose_budget,
    default_node_counts,
    default_row_counts,
    measure_verify_cost,
    truncate_trees,
)
from ddtree.config import Algorithm, SpecConfig
from ddtree.cuda_graphs import GraphCache, row_bucket, tree_sizes
from ddtree.errors import ConfigError, RequestError
from ddtree.kernels import tree_ops
from ddtree.kernels.accepted import gather_accepted
from ddtree.kernels.tree_attention import MAX_TREE_NODES, triton_available
from ddtree.models.dflash import DraftContext
from ddtree.models.kv_cache import KVCache
from ddtree.sampling import choose_tokens_no_sync
from ddtree.tree import CompiledTrees, DraftTrees

log = logging.getLogger("ddtree.engine")

STAGES = ("prefill", "draft", "build", "verify", "walk", "compact")
PREFILL_TOKENS = 8192  # default bound on padded tokens per prefill forward (activation memory)
COST_PROFILE_CONTEXT = 1024  # committed tokens the auto budget's cost model is measured on (at most)
# Replays timed per captured auto round (median): its cost table. The rounds of a row bucket are timed in
# turns (one untimed turn first), so a device that is still speeding up slows every size alike.
ROUND_TIMING_REPEATS = 5
# Eager budget auto rewrites its round costs from measured rounds this often: its cost model times a verify
# forward alone and leaves out the round's other launches. A graphed batch chooses with its captured rounds'
# own times and does not calibrate unless told (DecodeBatch.calibrate_every): on the H200, calibrated graphed
# batches ran 2-3% slower at batch 1 and chose no better at batch 32 (docs/perf.md, sixth pass).
CALIBRATE_EVERY = 8
# Graphed budget auto builds the cap's tree and chooses the next round's size on one round in this many; the
# others build and verify just the chosen size, the same graph as that fixed budget's round (a choosing
# round replayed 7 us slower than a plain one, 417 vs 410 us, on the H200 at batch 1; docs/perf.md).
CHOOSE_EVERY = 4
POOLED_BATCHES = 4  # graphed batches generate() keeps for reuse (each holds its KV cache and graphs)
COST_PROFILE_ROWS = 8  # rows measured at least, so batches up to 8 never re-measure (e.g. after a 1-row warm-up)
# A graphed batch prefills a lone request of up to this many tokens by replaying a graph (per power-of-two
# width): eager, its ~150 launches cost ~8 ms of host time on the H200's host for a 1k-token fixture prompt,
# 5x the device time. Longer prompts and multi-request chunks (whose launches are shared) run eagerly.
GRAPHED_PREFILL_TOKENS = 4096


# What one more prefill forward costs, in padded tokens (fixed work: launches, weight reads). Measured
# on the CPU fixture pair (~3 ms a forward, ~0.08 ms a token); an accelerator's fixed cost weighs more.
FORWARD_COST_TOKENS = {"cpu": 32}
FORWARD_COST_TOKENS_ACCELERATOR = 512


def prefill_chunks(lengths: Sequence[int], max_tokens: int, forward_cost: int = 0) -> list[list[int]]:
    """Group prompt indices into prefill forwards of at most max_tokens padded tokens (rows x longest).

    The prompts are sorted by length and cut into runs that minimise padded tokens + forward_cost per
    forward (an exact dynamic programme over the sorted order), so padding stays small yet alike prompts
    share a forward. A prompt longer than max_tokens gets a forward of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    best = [0] + [0] * len(sizes)  # best[j]: cheapest cost of the first j sorted prompts
    cut = [0] * (len(sizes) + 1)  # cut[j]: where the last forward of that best split starts
    for j in range(1, len(sizes) + 1):
        best[j], cut[j] = best[j - 1] + sizes[j - 1] + forward_cost, j - 1
        i = j - 2
        while i >= 0 and (j - i) * sizes[j - 1] <= max_tokens:  # sizes[j - 1] is the run's longest
            cost = best[i] + (j - i) * sizes[j - 1] + forward_cost
            if cost <= best[j]:  # ties go to the longer run: fewer forwards
                best[j], cut[j] = cost, i
            i -= 1
    chunks: list[list[int]] = []
    j = len(sizes)
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


@dataclass
class Request:
    """One generation request as the batch sees it (already tokenized and validated)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class StepOutput:
    """What one round produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None while running
    verify_steps: int  # verify forwards so far for this request
    accept_lengths: list[int] = field(default_factory=list)  # this round's accepted length(s)
    budgets: list[int] = field(default_factory=list)  # this round's tree size (non-root nodes verified)


@dataclass
class GenerationResult:
    """Everything `Engine.generate` knows about one finished request."""

    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    verify_steps: int
    accept_lengths: list[int]
    timings: dict[str, float]
    budgets: list[int] = field(default_factory=list)  # tree size of every round (varies with budget auto)

    @property
    def accept_histogram(self) -> list[int]:
        """Index = accepted length of a round (bonus included), value = number of rounds."""
        counts = Counter(self.accept_lengths)
        size = max(counts, default=0) + 1
        return [counts.get(i, 0) for i in range(size)]

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


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


class _RoundState:
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

    def copy(self) -> _RoundState:
        new = _RoundState()
        new.__dict__.update(self.__dict__)
        return new


Stage = Callable[[_RoundState], None]


def _apply(prev: _RoundState, stages: Sequence[Stage]) -> _RoundState:
    s = prev.copy()
    for fn in stages:
        fn(s)
    return s


class _PrefillStage:
    """A one-row staging cache (and drafter context) that graphed prefills run on, with static inputs.

    A captured prefill forwards `ids` into the staging rows, then copies them into the slot named by the
    device index `dst`: the same graph serves every slot. Widths are padded to a power of two (right
    padding: its K/V lands past the real length and is overwritten later).
    """

    def __init__(self, batch: DecodeBatch, max_width: int) -> None:
        eng, dev = batch.engine, batch.device
        self.max_width = max_width
        self.cache = eng.target.new_cache(1, max_width)
        self.ctx = eng.drafter.new_context(1, batch.spec.draft_window, batch.max_len) if batch.ctx is not None else None
        self.ids = torch.zeros(1, max_width, dtype=torch.long, device=dev)
        self.positions = torch.arange(max_width, device=dev)[None]  # [1, max_width]
        self.real = torch.zeros(1, dtype=torch.long, device=dev)  # the prompt's length
        self.dst = torch.zeros(1, dtype=torch.long, device=dev)  # the batch slot it goes to

    def bucket(self, width: int) -> int:
        return min(self.max_width, max(64, 1 << (width - 1).bit_length()))


@dataclass
class _Row:
    """Host-side bookkeeping of one running request."""

    request: Request
    committed: int  # tokens with target KV (prompt + accepted so far, bonus excluded)
    output: list[int] = field(default_factory=list)
    verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()


class DecodeBatch:
    """Continuous batching over a fixed number of slots: add, step, cancel."""

    def __init__(self, engine: Engine, spec: SpecConfig, max_batch: int, max_len: int, profile: bool = True,
                 prefill_tokens: int = PREFILL_TOKENS):
        engine.check_spec(spec)
        if max_batch < 1:
            raise ConfigError(f"max_batch: {max_batch} is out of range (allowed >= 1)")
        if prefill_tokens < 1:
            raise ConfigError(f"prefill_tokens: {prefill_tokens} is out of range (allowed >= 1)")
        self.engine, self.spec, self.max_batch = engine, spec, max_batch
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (a longer prompt runs alone)
        self.max_len = max_len
        self.device = engine.device
        self.forward_cost = FORWARD_COST_TOKENS.get(self.device.type, FORWARD_COST_TOKENS_ACCELERATOR)
        self.timer = StageTimer(engine.device, sync=profile)
        # the tree-attention kernel verifies at most 256 tokens a row; a wider budget runs eagerly on SDPA
        wide = spec.max_nodes > MAX_TREE_NODES
        self.attention = "sdpa" if wide else engine.attention
        self.graphs = GraphCache(self.device) if engine.cuda_graphs and not wide else None
        self._penalty: torch.Tensor | None = None
        self._stage: _PrefillStage | None = None  # graphed prefills' staging rows, made on first use
        # graphed budget auto: the tree size the previous round chose for this one (None: decide with a sync)
        self._next_budget: int | None = None
        self._live = torch.zeros(max_batch, dtype=torch.bool, device=self.device)  # rows < n (not padding)
        self._live_n = 0
        self._sizes_captured: set[tuple[int, bool]] = set()  # (rows, sampled) whose every tree size is captured
        self._graph_heads: dict[tuple, str] = {}  # a captured round's first stage (the timer's name for it)
        self._round_tables: dict[tuple[int, int], list[float]] = {}  # (rows, cap): seconds per tree size, timed
        self._auto_costs: dict[tuple[int, int], torch.Tensor] = {}  # static per (rows, cap): graphs read them
        self._pinned: dict[tuple[int, int], torch.Tensor] = {}  # host staging of calibrated costs (GPU)
        self._calibrated_rounds = 0
        # rounds between rewrites of auto's costs from measured rounds; 0: never (graphed, see CALIBRATE_EVERY)
        self.calibrate_every = CALIBRATE_EVERY if self.graphs is None else 0
        self._rounds_ahead = 0  # graphed auto rounds run on a size chosen ahead (every CHOOSE_EVERY-th chooses)
        self.rows: list[_Row] = []
        # budget auto: the round cost model (measured once per engine, or loaded from a profile)
        self.cost_model = engine.budget_cost_model(spec, max_batch) if spec.auto_budget else None
        self.calibration = RoundCostCalibration() if spec.auto_budget else None  # what rounds really take
        # graphed budget auto chooses from a running mean of per-row gains (ddtree.budget.choose_budget)
        self._gains = torch.full((spec.budget_cap,), -1.0, device=self.device) if spec.auto_budget else None
        self.last_budget: int | None = None  # the latest round's tree size, for /server_info
        self.budget_rounds = 0
        self.budget_total = 0
        target = engine.target
        self.cache = target.new_cache(max_batch, max_len)
        self.ctx = None
        if spec.speculative:
            self.ctx = engine.drafter.new_context(max_batch, spec.draft_window, max_len)
            assert engine.mask_token_id is not None  # check_spec: speculation has a drafter
            # the MASK positions of every draft block (a constant: the block is the bonus, then these)
            self._masks = torch.full((max_batch, spec.block_size - 1), engine.mask_token_id, dtype=torch.long,
                                     device=self.device)
        # the first m rows of the cache and the context, by m (views: a round reuses them, not rebuilds them)
        self._views: dict[int, tuple[KVCache, DraftContext | None]] = {}
        # Per-slot device state (rows 0..n-1 are live).
        self.bonus = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.temps = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.seeds = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    # -- public API ----------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.rows)

    def add(self, request: Request) -> list[StepOutput]:
        """Prefill one request into a free slot; returns its first token as a StepOutput."""
        return self.add_many([request])

    def validate(self, request: Request) -> None:
        """Raise RequestError (naming the field) if `request` can never run in this batch; no forward."""
        self._validate(request)

    @torch.inference_mode()
    def add_many(self, requests: Sequence[Request]) -> list[StepOutput]:
        """Prefill several requests into free slots at once; returns their first tokens, in request order.

        Every request is checked before any forward, so a bad one (RequestError naming its id and
        field) leaves the batch untouched. The prefill runs in right-padded chunks of at most
        `prefill_tokens` padded tokens, the prompts sorted by length so the padding stays small.
        """
        seen = {row.request.request_id for row in self.rows}
        for request in requests:
            try:
                self._validate(request)
            except RequestError as err:
                raise RequestError(f"request {request.request_id!r}: {err}", field=err.field,
                                   status_code=err.status_code) from err
            if request.request_id in seen:
                raise RequestError(f"request_id: {request.request_id!r} is already in the batch",
                                   field="request_id")
            seen.add(request.request_id)
        if len(requests) > self.free_slots:
            raise RequestError(f"no free slot in the batch ({len(requests)} requests, {self.free_slots} free slots)",
                               field="batch", status_code=503)
        outputs: dict[str, StepOutput] = {}
        for chunk in prefill_chunks([len(r.prompt_ids) for r in requests], self.prefill_tokens,
                                    self.forward_cost):
            for out in self._prefill([requests[i] for i in chunk]):
                outputs[out.request_id] = out
        return self._retire_finished([outputs[r.request_id] for r in requests])

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round for every running request."""
        if not self.rows:
            return []
        if self.spec.speculative:
            outputs = self._speculative_round()
        else:
            outputs = self._ar_round()
        return self._retire_finished(outputs)

    @torch.inference_mode()
    def clear(self) -> None:
        """Drop every running request (the batch is empty and ready for reuse; graphs stay captured)."""
        for slot in reversed(range(len(self.rows))):
            self._remove(slot)

    @torch.inference_mode()
    def cancel(self, request_id: str) -> bool:
        for slot, row in enumerate(self.rows):
            if row.request.request_id == request_id:
                self._remove(slot)
                return True
        return False

    # -- rounds --------------------------------------------------------------------------------
    def _prefill(self, requests: list[Request]) -> list[StepOutput]:
        """One right-padded target forward for `requests` into the next free slots; their first tokens."""
        eng = self.engine
        seeds = [r.seed if r.seed is not None else random.SystemRandom().randrange(1 << 31) for r in requests]
        self.timer.start("prefill")
        if (self.graphs is not None and len(requests) == 1
                and len(requests[0].prompt_ids) <= min(GRAPHED_PREFILL_TOKENS, self.max_len)):
            tokens = self._prefill_graphed(requests[0], seeds[0])
        else:
            tokens = self._prefill_eager(requests, seeds)
        self.timer.stop()
        outputs = []
        for i, request in enumerate(requests):
            stop_ids = set(request.stop_token_ids)
            if not request.ignore_eos and eng.eos_token_id is not None:
                stop_ids.add(eng.eos_token_id)
            row = _Row(request, committed=len(request.prompt_ids), stop_ids=frozenset(stop_ids))
            self.rows.append(row)
            outputs.append(self._emit(len(self.rows) - 1, row, [tokens[i]], accept=None))
        return outputs

    def _prefill_eager(self, requests: list[Request], seeds: list[int]) -> list[int]:
        eng, k = self.engine, len(requests)
        start, stop = len(self.rows), len(self.rows) + k
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        padded = [r.prompt_ids + [0] * (width - len(r.prompt_ids)) for r in requests]
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # [k, width]
        real = torch.tensor(lengths, dtype=torch.long, device=self.device)  # [k]
        self.temps[start:stop] = torch.tensor([float(r.temperature) for r in requests], device=self.device)
        self.seeds[start:stop] = torch.tensor(seeds, dtype=torch.long, device=self.device)
        fresh = torch.ones(k, dtype=torch.bool, device=self.device)
        cache = self.cache.rows(start, stop)
        cache.reset(fresh)
        positions = torch.arange(width, device=self.device)[None].expand(k, -1)  # [k, width]
        taps_layers = eng.tap_layers if self.spec.speculative else None
        # Causal attention keeps the padding (after each row's prompt) out of the real tokens; its KV
        # lands beyond lengths[b] and is overwritten by the next forward.
        logits, taps = eng.target.forward(ids, positions, cache, None, taps_layers, kv_len_hint=width,
                                          logit_positions=(real - 1)[:, None])  # logits [k, 1, V]
        cache.advance(real)
        if self.ctx is not None:
            ctx = self.ctx.rows(start, stop)
            ctx.reset(fresh)
            eng.drafter.append_context(ctx, taps, positions, real)  # counts = real: padding is skipped
        first = choose_tokens_no_sync(logits, self.temps[start:stop], self.seeds[start:stop], real[:, None],
                                      any(r.temperature > 0 for r in requests))[:, 0]
        self.bonus[start:stop] = first
        return first.tolist()  # the one sync: hand the first tokens back

    def _prefill_graphed(self, request: Request, seed: int) -> list[int]:
        """The eager prefill's work for one request, replayed from a graph captured per width bucket."""
        eng, slot, width = self.engine, len(self.rows), len(request.prompt_ids)
        if self._stage is None:
            self._stage = _PrefillStage(self, min(GRAPHED_PREFILL_TOKENS, self.max_len))
        st = self._stage
        bucket = st.bucket(width)
        st.ids[0, :bucket].copy_(torch.tensor(request.prompt_ids + [0] * (bucket - width), dtype=torch.long))
        st.real.fill_(width)
        st.dst.fill_(slot)
        self.temps[slot] = float(request.temperature)
        self.seeds[slot] = seed
        sampled = request.temperature > 0
        taps_layers = eng.tap_layers if self.spec.speculative else None

        def prefill() -> torch.Tensor:
            cache = st.cache.window(bucket)  # the first `bucket` slots of the staging row
            cache.lengths.zero_()
            ids, positions = st.ids[:, :bucket], st.positions[:, :bucket]
            logits, taps = eng.target.forward(ids, positions, cache, None, taps_layers, kv_len_hint=bucket,
                                              logit_positions=(st.real - 1)[:, None])
            cache.advance(st.real)
            for mine, theirs in ((cache.k, self.cache.k), (cache.v, self.cache.v)):  # into the request's slot
                theirs[:, :, :, :bucket].index_copy_(1, st.dst, mine)
            self.cache.lengths.index_copy_(0, st.dst, cache.lengths)
            if st.ctx is not None and self.ctx is not None:
                st.ctx.total.zero_()
                eng.drafter.append_context(st.ctx, taps, positions, st.real)
                self.ctx.k.index_copy_(1, st.dst, st.ctx.k)
                self.ctx.v.index_copy_(1, st.dst, st.ctx.v)
                self.ctx.total.index_copy_(0, st.dst, st.ctx.total)
            first = choose_tokens_no_sync(logits, self.temps.index_select(0, st.dst), self.seeds.index_select(0, st.dst),
                                          st.real[:, None], sampled)[:, 0]
            self.bonus.index_copy_(0, st.dst, first)
            return first

        assert self.graphs is not None
        first = self.graphs.run(("prefill", bucket, sampled), prefill, self._graph_state())
        return first.tolist()  # the one sync: hand the first token back

    def _ar_round(self) -> list[StepOutput]:
        n = len(self.rows)
        m = self._padded_rows(n)
        sampled = self._any_sampled()
        hint = None if self.graphs is not None else max(r.committed for r in self.rows) + 1
        cache, _ = self._first_rows(m)

        def verify(s: _RoundState) -> None:
            committed = cache.lengths.clone()  # [m] == each row's committed length, already on the device
            logits, _ = self.engine.target.forward(self.bonus[:m, None], committed[:, None], cache, None, None,
                                                   kv_len_hint=hint, attention=self.attention)
            s.next = choose_tokens_no_sync(logits, self.temps[:m], self.seeds[:m], committed[:, None] + 1, sampled)[:, 0]

        def walk(s: _RoundState) -> None:
            cache.advance(torch.ones(m, dtype=torch.long, device=self.device))
            self.bonus[:m] = s.next

        s = self._run_stages(("ar", m, sampled), lambda: [("verify", verify), ("walk", walk)], _RoundState())
        tokens = s.next[:n].tolist()  # the one sync: hand the tokens back
        self.timer.stop()
        self._clear_padding(n, m)
        outputs = []
        for slot, row in enumerate(self.rows):
            row.committed += 1
            outputs.append(self._emit(slot, row, [tokens[slot]], accept=None))
        return outputs

    def _speculative_round(self) -> list[StepOutput]:
        n, cap = len(self.rows), self.spec.budget_cap
        m = self._padded_rows(n)
        graphed = self.graphs is not None
        sampled = self._any_sampled()
        started, captures = time.perf_counter(), (self.graphs.captures if self.graphs is not None else 0)
        # host bound for the eager "sdpa" attention only (graphed rounds read every length on the device)
        longest = None if graphed else max(r.committed for r in self.rows)
        costs = self._round_costs(m, cap, graphed) if self.cost_model is not None else None
        # budget auto, graphed: after the first round, each round also picks the next round's tree size from
        # its own tree (on the device, read back with the tokens), so a round is one graph and one sync; the
        # choice is one round stale. The first round (and every eager round) drafts, reads b* back (a second
        # sync) and verifies that prefix.
        ahead = graphed and costs is not None and self._next_budget is not None
        choosing = False  # this round also chooses the next one's size
        if ahead:
            assert self._next_budget is not None
            budget = self._next_budget
            choosing = self._rounds_ahead % CHOOSE_EVERY == 0
            self._rounds_ahead += 1
            self._mark_live(n)
            self._capture_tree_sizes(m, sampled)
            s = self._run_stages(("round", m, budget, sampled, choosing),
                                 functools.partial(self._round_stages, m, budget, sampled, choosing, longest),
                                 _RoundState())
        elif costs is not None:
            drafted = self._run_stages(("draft", m), functools.partial(self._draft_stages, m, longest, cap, False),
                                       _RoundState())
            # the prefix of b* nodes (a valid tree: parents come first) with the most expected tokens per
            # second for the live rows; graphed, b* is one of the captured tree sizes
            budget = int(choose_budget(drafted.trees.log_probs[:n], costs))
            s = self._run_stages(("verify", m, budget, sampled),
                                 functools.partial(self._verify_stages, m, budget, sampled, longest, False), drafted)
        else:  # a fixed budget: the round is one graph, one launch
            budget = cap
            s = self._run_stages(("round", m, budget, sampled, False),
                                 functools.partial(self._round_stages, m, budget, sampled, False, longest), _RoundState())
        width = s.accepted.shape[1]
        # The one sync per round: the committed tokens go back to the caller.
        host = s.host[:n].tolist()
        tail = 0  # columns after the accepted length: next round's tree size when it rides along
        if choosing:
            self._next_budget, tail = host[0][-1], 1
        elif graphed and costs is not None:  # a first auto round seeds the next with its own choice
            self._next_budget = budget
        self.timer.stop()  # the calibration's host time is no stage's
        # budget auto learns what rounds take (when calibrating): a graphed round that captured nothing, past
        # the first (which reads b* back with a second sync), or any eager round
        if self.calibration is not None and self.calibrate_every and (ahead or not graphed) and (
                self.graphs is None or self.graphs.captures == captures):
            self._calibrate(m, cap, budget, time.perf_counter() - started)
        self._clear_padding(n, m)
        self.last_budget = budget
        self.budget_rounds += 1
        self.budget_total += budget
        outputs = []
        for slot, row in enumerate(self.rows):
            k = host[slot][-1 - tail]
            new_tokens = host[slot][1:k] + [host[slot][width]]  # accepted drafts, then the bonus
            row.committed += k
            row.verify_steps += 1
            out = self._emit(slot, row, new_tokens, accept=k)
            out.budgets = [budget]
            outputs.append(out)
        return outputs

    def _round_stages(self, m: int, budget: int, sampled: bool, choose_next: bool,
                      longest: int | None) -> list[tuple[str, Stage]]:
        """A whole round for m rows verifying `budget` nodes; choose_next: built at the budget cap, and also
        choosing the next round's size (budget auto), else built at `budget`."""
        build = self.spec.budget_cap if choose_next else budget
        return (self._draft_stages(m, longest, build, choose_next)
                + self._verify_stages(m, budget, sampled, longest, hand_on=choose_next))

    def _draft_stages(self, m: int, longest: int | None, build_size: int,
                      choose_next: bool) -> list[tuple[str, Stage]]:
        """Steps 1-2 for m rows: draft, build the best `build_size` paths (and, choose_next, budget auto's
        next size from them: build_size is then the cap)."""
        eng, spec = self.engine, self.spec
        cap = spec.budget_cap
        cache, ctx = self._first_rows(m)
        assert ctx is not None  # check_spec: speculation has a drafter

        # 1. draft: [bonus, MASK...] at positions committed .. committed + block - 1
        def draft(s: _RoundState) -> None:
            # the cache's lengths are the committed lengths, on the device: no host-to-device copy per round
            s.committed = cache.lengths.clone()  # [m]
            block_ids = torch.cat([self.bonus[:m, None], self._masks[:m]], dim=1)  # [m, block]
            # kernel attention: each row's stored context slots are read in place (their count on the
            # device); "sdpa": at most min(longest context, window) slots, a host bound (ctx_len_hint)
            s.draft_logits = eng.drafter.forward(ctx, block_ids, s.committed, ctx_len_hint=longest,
                                                 attention=self.attention)  # [m, L, V]

        # 2. build: the best `build_size` paths, nodes sorted best first (parents before children)
        def build(s: _RoundState) -> None:
            s.trees = tree_ops.build_trees(s.draft_logits, build_size, spec.topk)
            del s.draft_logits  # not a graph output: its memory goes back to the shared pool (see _RoundState)

        stages: list[tuple[str, Stage]] = [("draft", draft), ("build", build)]
        if choose_next:  # one launch on CUDA; reads the static cost tensor and live mask a capture holds on to
            next_costs, live = self._round_costs(m, cap, graphed=True), self._live[:m]

            def choose_next_budget(s: _RoundState) -> None:
                s.next_budget = choose_budget(s.trees.log_probs, next_costs, live, smoothed=self._gains)

            stages.append(("build", choose_next_budget))
        return stages

    def _verify_stages(self, m: int, budget: int, sampled: bool, longest: int | None,
                       hand_on: bool) -> list[tuple[str, Stage]]:
        """Steps 3-6 for m rows on the first `budget` nodes of the built trees (hand_on: the next round's
        size, chosen in the draft stages, rides along in the rows the host reads)."""
        eng, spec = self.engine, self.spec
        cache, ctx = self._first_rows(m)
        assert ctx is not None
        # topk 1 always gives a chain (causal attention is then exact); deciding it from the trees
        # themselves would read the device every round, so only the host-known cases skip the mask
        chain = spec.algorithm is Algorithm.DFLASH or spec.topk == 1

        # 3. compile: [bonus, nodes], positions start + depth, the ancestor-or-self mask (and its bits)
        def compile_(s: _RoundState) -> None:
            s.trees = truncate_trees(s.trees, budget) if budget < s.trees.budget else s.trees
            s.compiled = tree_ops.compile_trees(s.trees, self.bonus[:m], s.committed)

        # 4. verify: one target forward over every tree; the target's token at every node
        def verify(s: _RoundState) -> None:
            c = s.compiled
            logits, s.taps = eng.target.forward(
                c.input_ids, c.position_ids, cache, None if chain else c.mask, eng.tap_layers,
                kv_len_hint=None if longest is None else longest + budget + 1, attention=self.attention,
                tree_bitmask=None if chain else c.bitmask)
            s.target_tokens = choose_tokens_no_sync(logits, self.temps[:m], self.seeds[:m], c.position_ids + 1, sampled)

        # 5. walk: the nodes whose every ancestor matches the target's token; the deepest gives the bonus
        def walk(s: _RoundState) -> None:
            # from the compiled ancestor mask: one kernel on CUDA, a fixed 28 ops on the CPU (walking depth by
            # depth is ~125 at L = 7)
            accepted, s.accept_lens, s.new_bonus = tree_ops.follow_trees(s.trees, s.compiled, s.target_tokens)
            # A path never holds more than budget + 1 nodes: keep the compaction inside the verify window.
            s.accepted = accepted[:, : min(accepted.shape[1], budget + 1)]

        # 6. compact: target KV to the accepted path; accepted hidden states into the drafter context
        def compact(s: _RoundState) -> None:
            # moves past a row's accepted length are no-ops, so the -1 padding needs no masking here
            cache.compact(s.accepted, s.accept_lens)
            # the path's tokens (column 0: the old bonus) for the host, its taps, positions and ring slots for the
            # drafter, and the new bonus into self.bonus: one kernel on CUDA
            path = gather_accepted(s.accepted, s.accept_lens, s.compiled.input_ids, s.new_bonus, s.taps,
                                   s.committed, bonus_out=self.bonus[:m], ring=(ctx.total, ctx.capacity))
            s.host = path.host
            eng.drafter.append_context(ctx, path.taps, path.positions, s.accept_lens, slots=path.slots)
            del s.taps  # as draft_logits: used up within the round

        stages: list[tuple[str, Stage]] = [("build", compile_), ("verify", verify), ("walk", walk), ("compact", compact)]
        if hand_on:
            def hand_on_budget(s: _RoundState) -> None:
                s.host = torch.cat([s.host, s.next_budget.expand(m, 1)], dim=1)

            stages.append(("compact", hand_on_budget))
        return stages

    def _mark_live(self, n: int) -> None:
        """self._live[i] = i < n: the rows budget auto's captured choice counts (padding rows do not)."""
        if self._live_n != n:
            self._live.zero_()
            self._live[:n] = True
            self._live_n = n

    def _capture_tree_sizes(self, m: int, sampled: bool) -> None:
        """Capture budget auto's rounds (choosing and not) at every tree size it may choose, for m rows and
        every row bucket below (a batch shrinks as its requests finish), the first time such rounds run: a
        size or bucket met for the first time mid-run would stall that round on its capture (~15 ms on the
        H200, tens of rounds). Each runs once here, and the batch's state is put back after each. A size's
        cost is what its rounds take on average: one in CHOOSE_EVERY chooses."""
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
                        self._run_stages(key, functools.partial(self._round_stages, *key[1:], None), _RoundState())
                    finally:  # each runs from the batch's state: no row runs past its cache
                        for t, s in zip(state, saved):
                            t.copy_(s)
                if not self.timer.sync:  # profiling graphs each stage apart: keep the model's table
                    timed = self._time_replays(keys, state, saved)
                    seconds = [float("inf")] * cap  # sizes with no graph stay out of reach
                    for size in tree_sizes(cap):
                        plain = timed[("round", rows, size, sampled, False)]
                        choosing = timed[("round", rows, size, sampled, True)]
                        seconds[size - 1] = plain + (choosing - plain) / CHOOSE_EVERY
                    self._round_tables[(rows, cap)] = seconds
                    if self.device.type == "cuda" and self.calibrate_every:
                        self._pinned_staging(rows, cap)
                    self._round_costs(rows, cap, graphed=True).copy_(torch.tensor(seconds, dtype=torch.float32))
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

    # -- eager or graphed stages ---------------------------------------------------------------
    def _first_rows(self, m: int) -> tuple[KVCache, DraftContext | None]:
        """Views of the cache's and the context's first m rows (made once per m: each is a few slicing ops)."""
        if m not in self._views:
            self._views[m] = (self.cache.rows(0, m), None if self.ctx is None else self.ctx.rows(0, m))
        return self._views[m]

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

    def _graph_state(self) -> list[torch.Tensor]:
        """What a round mutates in place (restored after a capture's warm-up run). The target's K/V is
        only written past each row's committed length, which a restored length makes unused again."""
        state = [self.cache.lengths, self.bonus]
        if self.ctx is not None:
            state += [self.ctx.total, self.ctx.k, self.ctx.v]
        if self._gains is not None:
            state.append(self._gains)
        return state

    def _run_stages(self, key: tuple, make_stages: Callable[[], Sequence[tuple[str, Stage]]],
                    prev: _RoundState) -> _RoundState:
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
                s = graphs.run(key + (i,), functools.partial(_apply, s, [fn]), self._graph_state())
            return s
        if key in graphs:
            t.start(self._graph_heads[key])  # the whole graph is timed (as enqueued) under its first stage
            return graphs.replay(key)
        stages = make_stages()
        self._graph_heads[key] = stages[0][0]
        t.start(stages[0][0])
        return graphs.run(key, functools.partial(_apply, prev, [fn for _, fn in stages]), self._graph_state())

    # -- bookkeeping ---------------------------------------------------------------------------
    def _any_sampled(self) -> bool:
        return any(r.request.temperature > 0 for r in self.rows)

    def _emit(self, slot: int, row: _Row, tokens: list[int], accept: int | None) -> StepOutput:
        req = row.request
        room = req.max_new_tokens - len(row.output)
        kept, reason = [], None
        for tok in tokens[:room]:
            kept.append(tok)
            if tok in row.stop_ids:
                reason = "stop"
                break
        if reason is None and len(row.output) + len(kept) >= req.max_new_tokens:
            reason = "length"
        row.output.extend(kept)
        if accept is not None:
            row.accept_lengths.append(accept)
        return StepOutput(req.request_id, kept, reason is not None, reason, row.verify_steps,
                          [accept] if accept is not None else [])

    def _retire_finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        done = {o.request_id for o in outputs if o.finished}
        for slot in reversed(range(len(self.rows))):
            if self.rows[slot].request.request_id in done:
                self._remove(slot)
        return outputs

    def _remove(self, slot: int) -> None:
        last = len(self.rows) - 1
        if slot != last:  # keep rows packed: move the last row into the freed slot
            self.cache.move_row(last, slot)
            if self.ctx is not None:
                self.ctx.move_row(last, slot)
            for buf in (self.bonus, self.temps, self.seeds):
                buf[slot] = buf[last]
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        # a free slot is empty (a graphed round may compute on it as padding)
        self.cache.lengths[last] = 0
        if self.ctx is not None:
            self.ctx.total[last] = 0

    def _validate(self, request: Request) -> None:
        eng = self.engine
        if not request.prompt_ids:
            raise RequestError("prompt is empty", field="input_ids")
        if request.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: {request.max_new_tokens} is out of range (allowed >= 1)",
                               field="max_new_tokens")
        if request.temperature < 0:
            raise RequestError(f"temperature: {request.temperature} is out of range (allowed >= 0)",
                               field="temperature")
        bad = [t for t in request.prompt_ids if not 0 <= t < eng.vocab_size]
        if bad:
            raise RequestError(f"input_ids: token {bad[0]} is outside the vocabulary 0..{eng.vocab_size - 1}",
                               field="input_ids")
        context = min(eng.max_context, self.max_len - self.spec.max_nodes)
        need = len(request.prompt_ids) + request.max_new_tokens
        if need > context:
            raise RequestError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"= {need} exceeds the context length ({context})",
                field="max_new_tokens",
            )


class Engine:
    """A target (and optionally a DFlash drafter) ready to decode with AR, DFLASH or DDTREE."""

    def __init__(self, target, drafter=None, attention: str = "auto", cuda_graphs: bool | None = None) -> None:
        """attention: "auto" (the Triton tree-attention kernel on CUDA when Triton is installed, else
        "sdpa"), "sdpa", "triton" or "reference" (the kernel's torch reference; tests). cuda_graphs: None
        = on wherever possible (CUDA with a kernel attention); graphs need static shapes, which only the
        kernel attention gives (it reads each row's prefix length on the device)."""
        self.target, self.drafter = target, drafter
        # one GEMM for q/k/v and one for gate/up per layer: small forwards are launch-bound on a GPU. On
        # the CPU the fused GEMM gave the same bits as the separate ones (fixture models, f32 and bf16;
        # tests/unit/test_layers.py checks it), so the CPU runs the same code path as the GPU
        target.fuse_projections()
        if drafter is not None:
            drafter.fuse_projections()
        self.device = next(target.parameters()).device
        self.attention = resolve_attention(attention, self.device)
        can_graph = self.device.type == "cuda" and self.attention != "sdpa"
        if cuda_graphs and not can_graph:
            raise ConfigError(f"cuda_graphs: need a CUDA device and a kernel attention (device {self.device}, "
                              f"attention {self.attention!r})")
        self.cuda_graphs: bool = can_graph if cuda_graphs is None else bool(cuda_graphs)
        if self.device.type == "cuda" and target.dtype == torch.float32:
            # Process-wide. cuBLAS's default heuristics run float32 GEMMs of 8-13 rows 2-3x slower than
            # cuBLASLt on the H200 (35-62 vs 19 us; a whole fixture verify 1.96 vs 0.59 ms, docs/perf.md),
            # and verify widths x rows land right there
            torch.backends.cuda.preferred_blas_library("cublaslt")
        cfg = target.config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_id: int | None = _first_id(getattr(cfg, "eos_token_id", None))
        self.max_context: int = cfg.max_position_embeddings
        self.tap_layers: list[int] | None = None
        self.mask_token_id: int | None = None
        self.trained_block_size: int | None = None
        if drafter is not None:
            self.tap_layers = list(drafter.config.target_layer_ids)
            self.mask_token_id = drafter.config.mask_token_id
            self.trained_block_size = drafter.config.block_size
        # budget auto: a profile set here (e.g. from --speculative-ddtree-cost-profile) is used as is;
        # otherwise the first auto batch measures one and later batches reuse it
        self.cost_model: VerifyCostModel | None = None
        self._measured: dict[tuple, VerifyCostModel] = {}
        # generate() reuses its batches when graphed, so a repeated call replays instead of recapturing
        self._pooled: dict[tuple, DecodeBatch] = {}

    @classmethod
    def from_pretrained(cls, target_path, draft_path=None, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, attention: str = "auto",
                        cuda_graphs: bool | None = None) -> Engine:
        from ddtree.models import load_drafter, load_target

        target = load_target(target_path, device=device, dtype=dtype)
        drafter = load_drafter(draft_path, target, device=device, dtype=dtype) if draft_path else None
        return cls(target, drafter, attention=attention, cuda_graphs=cuda_graphs)

    def check_spec(self, spec: SpecConfig) -> None:
        """Reject a config this engine cannot run, before any forward pass."""
        if spec.speculative and self.drafter is None:
            raise ConfigError(f"algorithm: {spec.algorithm.value} needs a draft model "
                              "(--speculative-draft-model-path); this engine has none")

    def budget_cost_model(self, spec: SpecConfig, max_batch: int) -> VerifyCostModel:
        """The round cost model for an auto budget: the loaded profile, else measured (once per setting).

        Measured on min(1024, context) committed tokens for 1..max(max_batch, 8) rows (at most 4 sizes) and
        verify widths up to max_budget + 1 (_cost_widths); larger batches extrapolate. A handful of
        forwards: ~1 s on CPU.
        """
        if self.cost_model is not None:
            return self.cost_model
        key = (spec.budget_cap, spec.topk, spec.block_size, spec.draft_window)
        cached = self._measured.get(key)
        if cached is None or max(cached.rows) < max_batch:
            context = max(1, min(COST_PROFILE_CONTEXT, self.max_context - spec.max_nodes - spec.block_size))
            cached = measure_verify_cost(
                self, default_row_counts(max(max_batch, COST_PROFILE_ROWS)), self._cost_widths(spec.budget_cap), context,
                block_size=spec.block_size, draft_window=spec.draft_window, topk=spec.topk)
            self._measured[key] = cached
        return cached

    def _cost_widths(self, cap: int) -> list[int]:
        """Verify widths the auto budget's cost model measures: graphed, exactly the captured tree sizes
        (+ the root) it chooses among, since graphed verify time need not be smooth in width; eagerly,
        a few powers of two that it interpolates between."""
        if self.cuda_graphs:
            return [b + 1 for b in tree_sizes(cap)]
        return default_node_counts(cap)

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int | None = None,
                   profile: bool | None = None, prefill_tokens: int = PREFILL_TOKENS) -> DecodeBatch:
        """profile: synchronise the device around each stage so the per-stage timings are exact.
        None (the default) = only where that is free (the CPU); on CUDA the stage clocks then time
        the host's enqueueing, and the round runs without waiting on the device."""
        max_len = max_len if max_len is not None else self.max_context + spec.max_nodes
        if profile is None:
            profile = self.device.type != "cuda"
        return DecodeBatch(self, spec, max_batch, max_len, profile=profile, prefill_tokens=prefill_tokens)

    def _generate_batch(self, spec: SpecConfig, max_batch: int, max_len: int, profile: bool | None) -> DecodeBatch:
        """A fresh batch, or (graphed engines) a pooled empty one of the same spec and rows whose cache is
        long enough: its graphs replay instead of being captured again."""
        if not self.cuda_graphs:
            return self.open_batch(spec, max_batch, max_len, profile=profile)
        key = (spec, max_batch, profile)
        batch = self._pooled.pop(key, None)
        if batch is None or batch.max_len < max_len:
            batch = self.open_batch(spec, max_batch, max_len, profile=profile)
        batch.clear()  # a generate that raised may have left rows behind
        batch.timer = StageTimer(self.device, sync=batch.timer.sync)
        self._pooled[key] = batch  # most recent last
        while len(self._pooled) > POOLED_BATCHES:
            self._pooled.pop(next(iter(self._pooled)))
        return batch

    def release_pooled(self) -> None:
        """Drop the batches generate() keeps for graph reuse (their KV caches and graphs free up)."""
        self._pooled.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        spec: SpecConfig | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        max_batch: int | None = None,
        profile: bool | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (a list of ids) or several (a list of lists) in one batch."""
        spec = spec if spec is not None else SpecConfig()
        single = len(prompt_ids) == 0 or isinstance(prompt_ids[0], int)
        if single:
            prompts = [list(cast(Sequence[int], prompt_ids))]
        else:
            prompts = [list(p) for p in cast(Sequence[Sequence[int]], prompt_ids)]
        longest = max(len(p) for p in prompts)
        batch = self._generate_batch(spec, max_batch or len(prompts), longest + max_new_tokens + spec.max_nodes,
                                     profile)
        reqs = [Request(str(i), p, max_new_tokens, temperature, seed, tuple(stop_token_ids or ()), ignore_eos)
                for i, p in enumerate(prompts)]
        for r in reqs:  # validate every request before any forward pass
            batch._validate(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        accepts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        budgets: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        final: dict[str, StepOutput] = {}
        pending = list(reqs)

        def absorb(outs: list[StepOutput]) -> None:
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
                accepts[o.request_id].extend(o.accept_lengths)
                budgets[o.request_id].extend(o.budgets)
                if o.finished:
                    final[o.request_id] = o

        while pending or batch.active:
            while pending and batch.free_slots:  # a request finished at its first token frees its slot again
                joining, pending = pending[: batch.free_slots], pending[batch.free_slots :]
                absorb(batch.add_many(joining))
            absorb(batch.step())
        out = [
            GenerationResult(
                token_ids=tokens[r.request_id], prompt_tokens=len(r.prompt_ids),
                finish_reason=final[r.request_id].finish_reason or "length",
                verify_steps=final[r.request_id].verify_steps,
                accept_lengths=accepts[r.request_id], timings=dict(batch.timer.totals),
                budgets=budgets[r.request_id],
            )
            for r in reqs
        ]
        return out[0] if single else out


ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "reference")


def resolve_attention(attention: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "sdpa"; anything else is checked."""
    if attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if attention == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if attention == "triton" and not triton_available():
        raise ConfigError("attention: 'triton' needs the triton package (pip install triton)")
    return attention


def _first_id(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value) if value is not None else None
