"""DecodeBatch: continuous batching over a fixed number of slots (token ids only).

The batch keeps the slots: requests join (`add`, `add_many`: the prefill, ddtree.prefill), leave (`cancel`,
`clear`, or by finishing) and hold their place in the slots' device state (ddtree.slots). It drives one
round for every running request at a time (ddtree.round: draft -> verify -> accept, or an AR step):

    launch()                 the round's device work is enqueued; nothing waits for it
    collect(run_ahead=...)   the round's tokens are read (the one host sync a round): each row's StepOutput
    step()                   launch() then collect(run_ahead=True): for callers with no host work between

A caller with host work of its own (the server's scheduler) does it between launch() and collect(), while the
device runs the round. collect(run_ahead=True) also launches the next round before reading this one's tokens,
where the batch may (`run_ahead`; never with budget auto or a profiling timer), so the device goes from one
round to the next without waiting for the host's bookkeeping between them. Every round input lives on the
device, so the round ahead is the round that would have run, and the next launch() takes it. A row that
finishes in the round being read (a stop token, or max_new_tokens) is handed out at once; it is also in the
round ahead, whose share for it is discarded (like a padding row's) when that round is collected, and it
leaves the batch then. The caches keep a block of room past max_len for that round. A round ahead must be
taken back (`settle()`) before requests join or leave.

The parts the batch composes, each owning its state: `slots` (ddtree.slots), `runner` (ddtree.round_graphs:
stages run eagerly or as CUDA graphs, and the stage timer), `budget` (ddtree.round_costs: the round's tree
size, fixed or budget auto) and `prefill` (ddtree.prefill). On CUDA (with Triton) verify attention is the
tree-attention kernel and each round runs as one CUDA graph, rows padded to a captured bucket; elsewhere the
same stages run eagerly on ddtree.tree's torch code. Either way the tokens committed are the target's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ddtree.budget import VerifyCostModel
from ddtree.config import SpecConfig
from ddtree.cuda_graphs import GraphCache
from ddtree.errors import ConfigError, RequestError
from ddtree.kernels.tree_attention import MAX_TREE_NODES
from ddtree.prefill import FORWARD_COST_TOKENS, FORWARD_COST_TOKENS_ACCELERATOR, PREFILL_TOKENS, Prefill, prefill_chunks
from ddtree.request import Request, Row, StepOutput, validate_request
from ddtree.round import Round, RoundParts, ar_round, speculative_round
from ddtree.round_costs import AutoBudget, FixedBudget
from ddtree.round_graphs import StageRunner, StageTimer
from ddtree.slots import Slots


def _no_round() -> Round:
    """An empty batch's round."""
    yield
    return []


def _finish(round_: Round) -> list[StepOutput]:
    """Run a launched round's host part (it reads the round's tokens): its outputs."""
    try:
        next(round_)
    except StopIteration as done:
        return done.value
    raise AssertionError("a round yields once")  # pragma: no cover


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


class DecodeBatch:
    """Continuous batching over a fixed number of slots: add, launch/collect (or step), cancel, settle."""

    def __init__(self, engine: BatchEngine, spec: SpecConfig, max_batch: int, max_len: int, profile: bool = True,
                 prefill_tokens: int = PREFILL_TOKENS,
                 graph_cache: Callable[[torch.device], GraphCache] | None = None, run_ahead: bool = True):
        """graph_cache: makes the batch's graph cache (None: the rounds run eagerly). run_ahead: collect() may
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
        # the tree-attention kernel verifies at most 256 tokens a row; a wider budget runs eagerly on SDPA
        wide = spec.max_nodes > MAX_TREE_NODES
        graphs = graph_cache(self.device) if graph_cache is not None and not wide else None
        self.budget: FixedBudget = (
            AutoBudget(spec, engine.budget_cost_model(spec, max_batch), max_batch, self.device, graphed=graphs is not None)
            if spec.auto_budget else FixedBudget(spec))
        # room for a round launched ahead of one in which a row may reach max_len: its tokens are discarded,
        # but its tree is written past what validate() allows, by at most what one round commits
        self.cache_len = max_len + (spec.block_size if spec.speculative else 1)  # slots a cache row holds
        self.slots = Slots(engine, spec, max_batch, self.cache_len)
        self.runner = StageRunner(graphs, StageTimer(self.device, sync=profile), max_batch,
                                  lambda: self.slots.round_state() + self.budget.round_state())
        self.parts = RoundParts(engine, spec, "sdpa" if wide else engine.attention, self.slots, self.runner,
                                self.budget)
        self.prefill = Prefill(engine, spec, self.slots, self.runner, max_len, self.cache_len)
        self.rows: list[Row] = []
        self._launched: Round | None = None  # launch() to collect()
        self.run_ahead = run_ahead
        self._ahead: Round | None = None  # the round collect() launched ahead
        self._leaving: set[str] = set()  # finished rows still in the round ahead: they leave when it is read
        self.rounds_run_ahead = 0  # rounds collect() launched before reading the previous round's tokens

    # -- the parts' state, as the batch's callers read it ----------------------------------------
    @property
    def attention(self) -> str:
        """Verify attention: the engine's, or "sdpa" where a tree is wider than the kernel verifies."""
        return self.parts.attention

    @property
    def graphs(self) -> GraphCache | None:
        """The rounds' CUDA graphs (None: the rounds run eagerly)."""
        return self.runner.graphs

    @property
    def timer(self) -> StageTimer:
        """Wall time per stage (ddtree.round_graphs.STAGES)."""
        return self.runner.timer

    @property
    def last_budget(self) -> int | None:
        """The latest round's tree size (None before any speculative round)."""
        return self.budget.last_budget

    @property
    def budget_rounds(self) -> int:
        return self.budget.budget_rounds

    @property
    def budget_total(self) -> int:
        """Tree sizes summed over budget_rounds rounds."""
        return self.budget.budget_total

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
            for out in self.prefill.run([requests[i] for i in chunk], self.rows):
                outputs[out.request_id] = out
        return self._retire_finished([outputs[r.request_id] for r in requests])

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """launch() then collect(run_ahead=True), entering inference mode once: one round for every running
        request; finished requests leave the batch (with a round launched ahead, when that round is read)."""
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
        """Whether a round launched ahead (by collect(run_ahead=True), or step()) is in flight."""
        return self._ahead is not None

    @torch.inference_mode()
    def launch(self) -> None:
        """Start one round for every running request; `collect` finishes it and returns its outputs.

        The round's device work is enqueued and nothing waits for it (except the rounds of budget auto that
        read b* before verifying), so between the two the caller may do host work of its own while the
        device runs: the server hands out the previous round's tokens there. A round launched ahead is
        taken as this round: it runs already."""
        self._take_or_launch()

    @torch.inference_mode()
    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        """Wait for the launched round; its outputs (finished requests leave the batch).

        run_ahead: where the batch's `run_ahead` allows it, the next round is launched before this one's tokens
        are read, and stays in flight for the next launch() (or settle())."""
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
        launched = self._round(in_flight=0) if self.rows else _no_round()
        next(launched)  # runs up to the round's host read of its tokens (a round that raises is not launched)
        self._launched = launched

    def _round(self, in_flight: int) -> Round:
        """This batch's round for its rows (in_flight: tokens a row may commit in rounds launched before it)."""
        run = speculative_round if self.spec.speculative else ar_round
        return run(self.parts, self.rows, in_flight)

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
        if self.runner.timer.sync or not self.budget.runs_ahead:
            return False
        most = self.spec.block_size if self.spec.speculative else 1  # tokens a round commits for a row, at most
        return any(row.request.max_new_tokens - len(row.output) > most for row in self.rows)

    def _launch_ahead(self) -> Round:
        """Launch the round after the launched one (its inputs are on the device already; host bounds of the
        eager path allow for the tokens the launched round may commit)."""
        ahead = self._round(in_flight=self.spec.block_size if self.spec.speculative else 1)
        next(ahead)
        self.rounds_run_ahead += 1
        return ahead

    def _idle(self, action: str) -> None:
        if self._launched is not None:
            raise RuntimeError(f"{action} while a round is launched: collect it first")
        if self._ahead is not None:
            raise RuntimeError(f"{action} while a round launched ahead is in flight: settle() first")

    @torch.inference_mode()
    def clear(self) -> None:
        """Drop every running request (the batch is empty and ready for reuse; graphs stay captured), a round
        launched ahead with them."""
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

    # -- bookkeeping ---------------------------------------------------------------------------
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
            self.slots.move_row(last, slot)
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        self.slots.empty(last)
