"""DecodeBatch: continuous batching over a fixed number of slots, and the decode round (token ids only).

One round for every running request at once (docs/architecture.md, "The DDTree round"):

    1. draft     the DFlash drafter runs on [bonus, MASK...] and yields L = block_size - 1 marginals
    2. build     build_trees: the best `budget` paths by drafter log-probability (a chain for DFLASH)
    3. compile   compile_trees: [bonus, nodes], positions start + depth, ancestor-or-self mask
    4. verify    one target forward over every tree; the target's token at every node
    5. walk      follow_trees: the nodes whose every ancestor matches the target; the deepest gives the bonus
    6. compact   move the accepted nodes' KV after the prefix; feed their hidden states to the drafter

An AR round is steps 4 and 5 over one token. Rows are kept packed at the front (a finished request's slot
is refilled by moving the last row into it), so every forward runs on a contiguous view of the caches. The
only host synchronisation per round is the one that hands the new tokens back to the caller; with
`budget="auto"`, eager rounds (and a graphed batch's first) have a second one, after step 2, that reads
the chosen tree size; later graphed rounds choose the next round's size on the device and hand it back
with the tokens, one round in CHOOSE_EVERY (the rounds between build and verify that size, as a fixed
budget's round does). `step()` is `launch()` then `collect()`: a caller with host work of its own (the
server's scheduler) does it between the two, while the device runs the round.

`step()` also runs ahead (`run_ahead`): it launches the next round before reading this one's tokens, so the
device goes from one round to the next without waiting for the host's bookkeeping between them. Every round
input lives on the device, so the round ahead is the round that would have run, and it becomes the next
step()'s round. A row that finishes in the round being read (a stop token, or max_new_tokens) is handed out
at once; it is also in the round ahead, whose share for it is discarded (like a padding row's) when that round
is collected, and it leaves the batch then. The caches keep a block of room past max_len for that round.
A round ahead must be taken back (`settle()`) before requests join or leave. The server's scheduler, which
launches and collects itself, asks for the same with `collect(run_ahead=True)`: its next `launch()` then
takes the round already in flight.

On CUDA (with Triton) verify attention is the tree-attention kernel and each round runs as one CUDA graph,
rows padded to a captured bucket, and steps 2, 3 and 5 are one Triton kernel each (ddtree.kernels.tree_ops);
elsewhere the same stage functions run eagerly on ddtree.tree's torch code. Either way the tokens committed
are the target's own.

The heavy parts sit beside this file, each a part of DecodeBatch: ddtree.prefill (requests joining),
ddtree.round_graphs (running the stages eagerly or as captured graphs, row padding, capturing every tree
size), ddtree.round_costs (budget auto's cost tables and calibration) and ddtree.slot_sampling (each slot's
sampling options as device tensors, and choosing the target's tokens with them).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import torch

from ddtree.budget import VerifyCostModel, choose_budget, truncate_trees
from ddtree.config import Algorithm, SpecConfig
from ddtree.cuda_graphs import GraphCache
from ddtree.errors import ConfigError, RequestError
from ddtree.kernels import tree_ops
from ddtree.kernels.accepted import gather_accepted
from ddtree.kernels.tree_attention import MAX_TREE_NODES
from ddtree.models.dflash import DraftContext
from ddtree.models.kv_cache import KVCache
from ddtree.prefill import FORWARD_COST_TOKENS, FORWARD_COST_TOKENS_ACCELERATOR, PREFILL_TOKENS, Prefill, PrefillStaging, prefill_chunks
from ddtree.request import Request, Row, StepOutput, emit, validate_request
from ddtree.round_costs import CHOOSE_EVERY, RoundCosts
from ddtree.round_graphs import GraphedRounds, RoundState, Stage, StageTimer
from ddtree.sampling import Mode, token_logprobs
from ddtree.slot_sampling import SlotSampling


def _no_round() -> Generator[None, None, list[StepOutput]]:
    """An empty batch's round."""
    yield
    return []


def _finish(round_: Generator[None, None, list[StepOutput]]) -> list[StepOutput]:
    """Run a launched round's host part (it reads the round's tokens): its outputs."""
    try:
        next(round_)
    except StopIteration as done:
        return done.value
    raise AssertionError("a round yields once")  # pragma: no cover


def _as_lists(host: list[torch.Tensor]) -> tuple[list[Any], list[Any] | None]:
    return host[0].tolist(), (host[1].tolist() if len(host) > 1 else None)


class BatchEngine(Protocol):
    """What a batch needs of its engine (ddtree.engine.Engine)."""

    target: Any
    drafter: Any
    device: torch.device
    attention: str
    vocab_size: int
    max_context: int
    eos_token_id: int | None
    tap_layers: list[int] | None
    mask_token_id: int | None

    def check_spec(self, spec: SpecConfig) -> None: ...
    def budget_cost_model(self, spec: SpecConfig, max_batch: int) -> VerifyCostModel: ...


class DecodeBatch(Prefill, GraphedRounds, RoundCosts, SlotSampling):
    """Continuous batching over a fixed number of slots: add, step, cancel."""

    def __init__(self, engine: BatchEngine, spec: SpecConfig, max_batch: int, max_len: int, profile: bool = True,
                 prefill_tokens: int = PREFILL_TOKENS,
                 graph_cache: Callable[[torch.device], GraphCache] | None = None, run_ahead: bool = True):
        """graph_cache: makes the batch's graph cache (None: the rounds run eagerly). run_ahead: step() may
        launch the next round before reading this one's tokens (never with budget auto or a profiling timer)."""
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
        self.graphs = graph_cache(self.device) if graph_cache is not None and not wide else None
        self._staging: PrefillStaging | None = None  # graphed prefills' staging rows, made on first use
        self._sizes_captured: set[tuple[int, bool]] = set()  # (rows, sampled) whose every tree size is captured
        self._graph_heads: dict[tuple, str] = {}  # a captured round's first stage (the timer's name for it)
        self.rows: list[Row] = []
        self._init_round_costs(max_batch)  # budget auto (ddtree.round_costs)
        # room for a round launched ahead of one in which a row may reach max_len: its tokens are discarded,
        # but its tree is written past what validate() allows, by at most what one round commits
        self.cache_len = max_len + (spec.block_size if spec.speculative else 1)  # slots a cache row holds
        self.cache = engine.target.new_cache(max_batch, self.cache_len)
        self.ctx = None
        if spec.speculative:
            self.ctx = engine.drafter.new_context(max_batch, spec.draft_window, self.cache_len)
            assert engine.mask_token_id is not None  # check_spec: speculation has a drafter
            # the MASK positions of every draft block (a constant: the block is the bonus, then these)
            self._masks = torch.full((max_batch, spec.block_size - 1), engine.mask_token_id, dtype=torch.long,
                                     device=self.device)
        # the first m rows of the cache and the context, by m (views: a round reuses them, not rebuilds them)
        self._views: dict[int, tuple[KVCache, DraftContext | None]] = {}
        self._launched: Generator[None, None, list[StepOutput]] | None = None  # launch() to collect()
        self.run_ahead = run_ahead
        self._ahead: Generator[None, None, list[StepOutput]] | None = None  # step()'s round launched ahead
        self._leaving: set[str] = set()  # finished rows still in the round ahead: they leave when it is read
        self._in_flight = 0  # tokens a row may commit in rounds launched but not collected (host bounds)
        self.rounds_run_ahead = 0  # rounds step() launched before reading the previous round's tokens
        # Per-slot device state (rows 0..n-1 are live).
        self.bonus = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.temps = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.seeds = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._init_slot_sampling(max_batch)  # top-k/p, min-p, min_new_tokens (ddtree.slot_sampling)

    # -- public API ----------------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Rows still running (a finished row waiting for the round ahead to be collected is not)."""
        return len(self.rows) - len(self._leaving)

    @property
    def free_slots(self) -> int:
        """Slots free for requests to join (after settle(), where a round ahead is in flight)."""
        return self.max_batch - self.active

    def add(self, request: Request) -> list[StepOutput]:
        """Prefill one request into a free slot; returns its first token as a StepOutput."""
        return self.add_many([request])

    def validate(self, request: Request) -> None:
        """Raise RequestError (naming the field) if `request` can never run in this batch; no forward."""
        context = min(self.engine.max_context, self.max_len - self.spec.max_nodes)
        validate_request(request, self.engine.vocab_size, context)

    @torch.inference_mode()
    def add_many(self, requests: Sequence[Request]) -> list[StepOutput]:
        """Prefill several requests into free slots at once; returns their first tokens, in request order.

        Every request is checked before any forward, so a bad one (RequestError naming its id and
        field) leaves the batch untouched. The prefill runs in right-padded chunks of at most
        `prefill_tokens` padded tokens, the prompts sorted by length so the padding stays small.
        """
        self._idle("add")
        seen = {row.request.request_id for row in self.rows}
        for request in requests:
            try:
                self.validate(request)
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
            for out in self._prefill([requests[i] for i in chunk]):  # ddtree.prefill
                outputs[out.request_id] = out
        return self._retire_finished([outputs[r.request_id] for r in requests])

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round for every running request; finished requests leave the batch (with a round launched
        ahead, when that round is read: see the module's doc)."""
        self._take_or_launch()
        return self._collect(run_ahead=self.run_ahead)

    @torch.inference_mode()
    def settle(self) -> list[StepOutput]:
        """Collect the round launched ahead, if any (its outputs; finished requests, and those that finished in
        the round before it, leave the batch): afterwards requests may join or leave."""
        if self._ahead is None:
            return []
        self._launched, self._ahead = self._ahead, None
        return self._collect()

    @property
    def round_ahead(self) -> bool:
        """Whether a round launched ahead (by step() or collect(run_ahead=True)) is in flight."""
        return self._ahead is not None

    @torch.inference_mode()
    def launch(self) -> None:
        """Start one round for every running request; `collect` finishes it and returns its outputs.

        The round's device work is enqueued and nothing waits for it (except the rounds of budget auto that
        read b* before verifying), so between the two the caller may do host work of its own while the
        device runs: the server hands out the previous round's tokens there. Outputs are step()'s. A round
        launched ahead is taken as this round: it runs already."""
        self._take_or_launch()

    @torch.inference_mode()
    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        """Wait for the launched round; its outputs (finished requests leave the batch).

        run_ahead: as step() does, where the batch's `run_ahead` allows it: the next round is launched
        before this one's tokens are read, and stays in flight for the next launch() (or settle())."""
        return self._collect(run_ahead=run_ahead and self.run_ahead)

    # step() enters inference mode once (~1-3 us a call), launch() and collect() once each
    def _take_or_launch(self) -> None:
        if self._launched is not None:
            raise RuntimeError("a round is already launched: collect it first")
        if self._ahead is not None:
            self._launched, self._ahead = self._ahead, None
        else:
            self._launch()

    def _launch(self) -> None:
        if not self.rows:
            launched = _no_round()
        else:
            launched = self._speculative_round() if self.spec.speculative else self._ar_round()
        next(launched)  # runs up to the round's host read of its tokens (a round that raises is not launched)
        self._launched = launched

    def _collect(self, run_ahead: bool = False) -> list[StepOutput]:
        launched, self._launched = self._launched, None
        if launched is None:
            raise RuntimeError("no round launched")
        # rows that finished in the round before are in this one: it is read before anything more runs
        leaving, self._leaving = self._leaving, set()
        ahead = self._launch_ahead() if run_ahead and not leaving and self._may_run_ahead() else None
        outputs = _finish(launched)
        if leaving:
            outputs = [o for o in outputs if o.request_id not in leaving]  # their discarded extra round
        finished = {o.request_id for o in outputs if o.finished}
        if ahead is not None:
            self._ahead = ahead
            self._leaving = finished  # handed out now; they leave when the round ahead is read
            return outputs
        self._retire(leaving | finished)
        return outputs

    def _may_run_ahead(self) -> bool:
        """Whether the next round may be launched before the launched one is read: a fixed tree size (budget
        auto reads its next size back with the tokens), no per-stage profiling, and a row that the launched
        round cannot finish by length (its max_new_tokens): a round ahead for rows that all end in the round
        before it would be all waste, and at batch 1 the next request's prefill would wait for it. A row that
        reaches its max_new_tokens in the launched round is in the round ahead too: the caches' room past
        max_len holds that round's tree."""
        if self.timer.sync or self.cost_model is not None:
            return False
        most = self.spec.block_size if self.spec.speculative else 1  # tokens a round commits for a row, at most
        return any(row.request.max_new_tokens - len(row.output) > most for row in self.rows)

    def _launch_ahead(self) -> Generator[None, None, list[StepOutput]]:
        """Launch the round after the launched one (its inputs are on the device already; host bounds of the
        eager path allow for the tokens the launched round may commit)."""
        self._in_flight = self.spec.block_size if self.spec.speculative else 1
        try:
            ahead = self._speculative_round() if self.spec.speculative else self._ar_round()
            next(ahead)
        finally:
            self._in_flight = 0
        self.rounds_run_ahead += 1
        return ahead

    def _idle(self, action: str) -> None:
        if self._launched is not None:
            raise RuntimeError(f"{action} while a round is launched: collect it first")
        if self._ahead is not None:
            raise RuntimeError(f"{action} while step() has a round launched ahead: settle() first")

    @torch.inference_mode()
    def clear(self) -> None:
        """Drop every running request (the batch is empty and ready for reuse; graphs stay captured), a round
        step() launched ahead with them."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            _finish(ahead)
        self._idle("clear")
        self._leaving = set()
        for slot in reversed(range(len(self.rows))):
            self._remove(slot)

    @torch.inference_mode()
    def cancel(self, request_id: str) -> bool:
        self._idle("cancel")
        for slot, row in enumerate(self.rows):
            if row.request.request_id == request_id:
                self._remove(slot)
                return True
        return False

    # -- rounds --------------------------------------------------------------------------------
    def _ar_round(self) -> Generator[None, None, list[StepOutput]]:
        n = len(self.rows)
        m = self._padded_rows(n)
        sampled = self._mode()
        hint = None if self.graphs is not None else max(r.committed for r in self.rows) + self._in_flight + 1
        cache, _ = self._first_rows(m)

        def verify(s: RoundState) -> None:
            committed = cache.lengths.clone()  # [m] == each row's committed length, already on the device
            logits, _ = self.engine.target.forward(self.bonus[:m, None], committed[:, None], cache, None, None,
                                                   kv_len_hint=hint, attention=self.attention)
            s.next = self._choose(logits, slice(0, m), committed[:, None] + 1, sampled)[:, 0]
            if sampled & Mode.LOGPROBS:
                s.logprobs = token_logprobs(logits, s.next[:, None])  # [m, 1]

        def walk(s: RoundState) -> None:
            cache.advance(torch.ones(m, dtype=torch.long, device=self.device))
            self.bonus[:m] = s.next

        s = self._run_stages(("ar", m, sampled), lambda: [("verify", verify), ("walk", walk)], RoundState())
        read = self._read_back(s.next[:n], s.logprobs[:n] if sampled & Mode.LOGPROBS else None)
        yield  # launched: collect() goes on from here
        tokens, logprobs = read()  # the one sync: hand the tokens back
        self.timer.stop()
        self._clear_padding(n, m)
        outputs = []
        for slot, row in enumerate(self.rows):
            row.committed += 1
            wanted = logprobs is not None and row.request.return_logprob
            outputs.append(emit(row, [tokens[slot]], accept=None, logprobs=logprobs[slot] if wanted else None))
        return outputs

    def _speculative_round(self) -> Generator[None, None, list[StepOutput]]:
        n, cap = len(self.rows), self.spec.budget_cap
        m = self._padded_rows(n)
        graphed = self.graphs is not None
        sampled = self._mode()
        started, captures = time.perf_counter(), (self.graphs.captures if self.graphs is not None else 0)
        # host bound for the eager "sdpa" attention only (graphed rounds read every length on the device)
        longest = None if graphed else max(r.committed for r in self.rows) + self._in_flight
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
                                 RoundState())
        elif costs is not None:
            drafted = self._run_stages(("draft", m), functools.partial(self._draft_stages, m, longest, cap, False),
                                       RoundState())
            # the prefix of b* nodes (a valid tree: parents come first) with the most expected tokens per
            # second for the live rows; graphed, b* is one of the captured tree sizes
            budget = int(choose_budget(drafted.trees.log_probs[:n], costs))
            s = self._run_stages(("verify", m, budget, sampled),
                                 functools.partial(self._verify_stages, m, budget, sampled, longest, False), drafted)
        else:  # a fixed budget: the round is one graph, one launch
            budget = cap
            s = self._run_stages(("round", m, budget, sampled, False),
                                 functools.partial(self._round_stages, m, budget, sampled, False, longest), RoundState())
        width = s.accepted.shape[1]
        read = self._read_back(s.host[:n], s.logprobs[:n] if sampled & Mode.LOGPROBS else None)
        paused = time.perf_counter()
        yield  # launched: collect() goes on from here
        if self.device.type == "cpu":  # the round ran before the pause; the caller's host work is not its time
            started += time.perf_counter() - paused
        # The one sync per round: the committed tokens go back to the caller.
        host, logprobs = read()
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
        self._count_round(budget)
        outputs = []
        for slot, row in enumerate(self.rows):
            k = host[slot][-1 - tail]
            new_tokens = host[slot][1:k] + [host[slot][width]]  # accepted drafts, then the bonus
            row.committed += k
            row.verify_steps += 1
            wanted = logprobs is not None and row.request.return_logprob
            outputs.append(emit(row, new_tokens, accept=k, logprobs=logprobs[slot][:k] if wanted else None,
                                budgets=[budget]))
        return outputs

    def _round_stages(self, m: int, budget: int, sampled: Mode, choose_next: bool,
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
        def draft(s: RoundState) -> None:
            # the cache's lengths are the committed lengths, on the device: no host-to-device copy per round
            s.committed = cache.lengths.clone()  # [m]
            block_ids = torch.cat([self.bonus[:m, None], self._masks[:m]], dim=1)  # [m, block]
            # kernel attention: each row's stored context slots are read in place (their count on the
            # device); "sdpa": at most min(longest context, window) slots, a host bound (ctx_len_hint)
            s.draft_logits = eng.drafter.forward(ctx, block_ids, s.committed, ctx_len_hint=longest,
                                                 attention=self.attention)  # [m, L, V]

        # 2. build: the best `build_size` paths, nodes sorted best first (parents before children)
        def build(s: RoundState) -> None:
            s.trees = tree_ops.build_trees(s.draft_logits, build_size, spec.topk)
            del s.draft_logits  # not a graph output: its memory goes back to the shared pool (see RoundState)

        stages: list[tuple[str, Stage]] = [("draft", draft), ("build", build)]
        if choose_next:  # one launch on CUDA; reads the static cost tensor and live mask a capture holds on to
            next_costs, live = self._round_costs(m, cap, graphed=True), self._live[:m]

            def choose_next_budget(s: RoundState) -> None:
                s.next_budget = choose_budget(s.trees.log_probs, next_costs, live, smoothed=self._gains)

            stages.append(("build", choose_next_budget))
        return stages

    def _verify_stages(self, m: int, budget: int, sampled: Mode, longest: int | None,
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
        def compile_(s: RoundState) -> None:
            s.trees = truncate_trees(s.trees, budget) if budget < s.trees.budget else s.trees
            s.compiled = tree_ops.compile_trees(s.trees, self.bonus[:m], s.committed)

        # 4. verify: one target forward over every tree; the target's token at every node
        def verify(s: RoundState) -> None:
            c = s.compiled
            logits, s.taps = eng.target.forward(
                c.input_ids, c.position_ids, cache, None if chain else c.mask, eng.tap_layers,
                kv_len_hint=None if longest is None else longest + budget + 1, attention=self.attention,
                tree_bitmask=None if chain else c.bitmask)
            s.target_tokens = self._choose(logits, slice(0, m), c.position_ids + 1, sampled)
            if sampled & Mode.LOGPROBS:
                s.logprobs = token_logprobs(logits, s.target_tokens)  # [m, B+1]: at every node, for now

        # 5. walk: the nodes whose every ancestor matches the target's token; the deepest gives the bonus
        def walk(s: RoundState) -> None:
            # from the compiled ancestor mask: one kernel on CUDA, a fixed 28 ops on the CPU (walking depth by
            # depth is ~125 at L = 7)
            accepted, s.accept_lens, s.new_bonus = tree_ops.follow_trees(s.trees, s.compiled, s.target_tokens)
            # A path never holds more than budget + 1 nodes: keep the compaction inside the verify window.
            s.accepted = accepted[:, : min(accepted.shape[1], budget + 1)]
            if sampled & Mode.LOGPROBS:  # the committed tokens' log-probs: the target's at each accepted node
                s.logprobs = s.logprobs.gather(1, s.accepted.clamp_min(0))  # [m, width]

        # 6. compact: target KV to the accepted path; accepted hidden states into the drafter context
        def compact(s: RoundState) -> None:
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
            def hand_on_budget(s: RoundState) -> None:
                s.host = torch.cat([s.host, s.next_budget.expand(m, 1)], dim=1)

            stages.append(("compact", hand_on_budget))
        return stages

    # -- bookkeeping ---------------------------------------------------------------------------
    def _read_back(self, tokens: torch.Tensor, logprobs: torch.Tensor | None
                   ) -> Callable[[], tuple[list[Any], list[Any] | None]]:
        """Start copying a round's outputs to the host, in stream order (a round launched ahead may overwrite
        the graph's output tensors before they are read); the function returned waits for the copy only."""
        wanted = [tokens] if logprobs is None else [tokens, logprobs]
        if self.device.type != "cuda":  # the round has run already (no graph: its tensors are its own)
            return lambda: _as_lists(wanted)
        copies = [t.to("cpu", non_blocking=True) for t in wanted]  # pinned host memory
        done = torch.cuda.Event()
        done.record()

        def read() -> tuple[list[Any], list[Any] | None]:
            done.synchronize()
            return _as_lists(copies)
        return read

    def _first_rows(self, m: int) -> tuple[KVCache, DraftContext | None]:
        """Views of the cache's and the context's first m rows (made once per m: each is a few slicing ops)."""
        if m not in self._views:
            self._views[m] = (self.cache.rows(0, m), None if self.ctx is None else self.ctx.rows(0, m))
        return self._views[m]

    def _retire_finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        self._retire({o.request_id for o in outputs if o.finished})
        return outputs

    def _retire(self, done: set[str]) -> None:
        if not done:
            return
        for slot in reversed(range(len(self.rows))):
            if self.rows[slot].request.request_id in done:
                self._remove(slot)

    def _remove(self, slot: int) -> None:
        last = len(self.rows) - 1
        if slot != last:  # keep rows packed: move the last row into the freed slot
            self.cache.move_row(last, slot)
            if self.ctx is not None:
                self.ctx.move_row(last, slot)
            for buf in (self.bonus, self.temps, self.seeds, *self._sampling_buffers()):
                buf[slot] = buf[last]
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        # a free slot is empty (a graphed round may compute on it as padding)
        self.cache.lengths[last] = 0
        if self.ctx is not None:
            self.ctx.total[last] = 0
