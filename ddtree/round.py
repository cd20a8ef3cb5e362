"""The decode round: one draft -> verify -> accept pass for every running request at once (token ids only).

The round's stages, over one `RoundState` (docs/architecture.md, "The DDTree round"):

    1. draft     the DFlash drafter runs on [bonus, MASK...] and yields L = block_size - 1 marginals
    2. build     build_trees: the best `size` paths by drafter log-probability (a chain for DFLASH)
    3. compile   compile_trees: [bonus, nodes], positions start + depth, ancestor-or-self mask
    4. verify    one target forward over every tree; the target's token at every node
    5. walk      follow_trees: the nodes whose every ancestor matches the target; the deepest gives the bonus
    6. compact   move the accepted nodes' KV after the prefix; feed their hidden states to the drafter

Every stage is a function of the round's `RoundState`. An AR round is steps 4 and 5 over one token (`ar_round`).
The tree size comes from the batch's `BudgetChoice` (ddtree.round_costs: a fixed size, or budget auto): known
before the round, the round is one graph and one launch; chosen from the round's own trees, the round drafts,
reads the size back (a second host sync) and verifies that prefix. A round is a generator: it runs up to the
read of its tokens and yields (launched: its device work is enqueued), then reads them (the one host sync a
round) and returns each row's StepOutput. `RoundParts` is what a round works on; the batch (ddtree.decode) owns
the rows and drives the rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ddtree.budget import truncate_trees
from ddtree.config import Algorithm, SpecConfig
from ddtree.kernels import tree_ops
from ddtree.kernels.accepted import gather_accepted
from ddtree.request import Row, StepOutput, emit
from ddtree.round_graphs import StageRunner
from ddtree.sampling import Mode, token_logprobs
from ddtree.slot_sampling import rows_mode
from ddtree.slots import Slots
from ddtree.tree import CompiledTrees, DraftTrees

Round = Generator[None, None, list[StepOutput]]


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
    logprobs: torch.Tensor  # the target's log-prob at every node, then of the committed tokens (when asked)

    def copy(self) -> RoundState:
        new = RoundState()
        new.__dict__.update(self.__dict__)
        return new


Stage = Callable[[RoundState], None]
Stages = list[tuple[str, Stage]]


class RoundPlan(NamedTuple):
    """A speculative round's tree size, as its BudgetChoice plans it."""

    size: int | None  # nodes verified; None: chosen from this round's own trees (BudgetChoice.choose, a host sync)
    choose_next: bool  # the round also chooses the next round's size on the device (built at the cap)
    calibrates: bool  # the round's time feeds the choice's cost calibration (when it captured no graph)


class BudgetChoice(Protocol):
    """How a speculative round's tree size is chosen: ddtree.round_costs.FixedBudget or AutoBudget."""

    runs_ahead: bool  # whether a round may be launched before the one before it is read
    last_budget: int | None  # the latest round's tree size
    budget_rounds: int  # rounds counted
    budget_total: int  # their tree sizes summed

    def plan(self, parts: RoundParts, m: int, n: int, sampled: Mode) -> RoundPlan: ...
    def choose(self, trees: DraftTrees, n: int, m: int, graphed: bool) -> int: ...
    def choosing_stage(self, m: int) -> Stage: ...  # the next round's size from this round's trees
    def finished(self, plan: RoundPlan, m: int, budget: int, next_size: int | None, seconds: float,
                 captured: bool) -> None: ...
    def round_state(self) -> list[torch.Tensor]: ...  # what its stages mutate in place


@dataclass
class RoundParts:
    """What a round works on: the engine's models, the batch's spec, slots, stage runner and budget choice."""

    engine: Any  # ddtree.decode.BatchEngine
    spec: SpecConfig
    attention: str  # verify attention ("sdpa" where a tree is wider than the kernel's)
    slots: Slots
    runner: StageRunner
    budget: BudgetChoice


def speculative_round(parts: RoundParts, rows: list[Row], in_flight: int) -> Round:
    """Steps 1-6 for `rows` (in_flight: tokens a row may commit in rounds launched before this one)."""
    slots, runner, budget = parts.slots, parts.runner, parts.budget
    n, cap = len(rows), parts.spec.budget_cap
    m = runner.padded_rows(n)
    graphed = runner.graphs is not None
    sampled = rows_mode(rows)
    started, captures = time.perf_counter(), runner.captures
    # host bound for the eager "sdpa" attention only (graphed rounds read every length on the device)
    longest = None if graphed else max(r.committed for r in rows) + in_flight
    plan = budget.plan(parts, m, n, sampled)
    if plan.size is None:  # draft, read the size back (the prefix of b* nodes is a valid tree), verify it
        drafted = runner.run(("draft", m), lambda: draft_stages(parts, m, longest, cap, False), RoundState())
        size = budget.choose(drafted.trees, n, m, graphed)
        s = runner.run(("verify", m, size, sampled),
                       lambda: verify_stages(parts, m, size, sampled, longest, False), drafted)
    else:  # one graph, one launch
        size = plan.size
        s = runner.run(("round", m, size, sampled, plan.choose_next),
                       lambda: round_stages(parts, m, size, sampled, plan.choose_next, longest), RoundState())
    width = s.accepted.shape[1]
    read = read_back(s.host[:n], s.logprobs[:n] if sampled & Mode.LOGPROBS else None)
    paused = time.perf_counter()
    yield  # launched: the batch's collect goes on from here
    if slots.device.type == "cpu":  # the round ran before the pause; the caller's host work is not its time
        started += time.perf_counter() - paused
    host, logprobs = read()  # the one sync per round: the committed tokens go back to the caller
    tail = 1 if plan.choose_next else 0  # columns after the accepted length: the next round's size rides along
    runner.timer.stop()  # the calibration's host time is no stage's
    seconds, captured = (time.perf_counter() - started, runner.captures != captures) if plan.calibrates else (0.0, False)
    budget.finished(plan, m, size, host[0][-1] if plan.choose_next else None, seconds, captured)
    slots.clear_padding(n, m)
    outputs = []
    for slot, row in enumerate(rows):
        k = host[slot][-1 - tail]
        new_tokens = host[slot][1:k] + [host[slot][width]]  # accepted drafts, then the bonus
        row.committed += k
        row.verify_steps += 1
        wanted = logprobs is not None and row.request.return_logprob
        outputs.append(emit(row, new_tokens, accept=k, logprobs=logprobs[slot][:k] if wanted else None,
                            budgets=[size]))
    return outputs


def ar_round(parts: RoundParts, rows: list[Row], in_flight: int) -> Round:
    """Steps 4 and 5 over one token for `rows`: the target's next token."""
    slots, runner = parts.slots, parts.runner
    n = len(rows)
    m = runner.padded_rows(n)
    sampled = rows_mode(rows)
    hint = None if runner.graphs is not None else max(r.committed for r in rows) + in_flight + 1
    cache, _ = slots.first_rows(m)

    def verify(s: RoundState) -> None:
        committed = cache.lengths.clone()  # [m] == each row's committed length, already on the device
        logits, _ = parts.engine.target.forward(slots.bonus[:m, None], committed[:, None], cache, None, None,
                                                kv_len_hint=hint, attention=parts.attention)
        s.next = slots.sampling.choose(logits, slice(0, m), committed[:, None] + 1, sampled)[:, 0]
        if sampled & Mode.LOGPROBS:
            s.logprobs = token_logprobs(logits, s.next[:, None])  # [m, 1]

    def walk(s: RoundState) -> None:
        cache.advance(torch.ones(m, dtype=torch.long, device=slots.device))
        slots.bonus[:m] = s.next

    s = runner.run(("ar", m, sampled), lambda: [("verify", verify), ("walk", walk)], RoundState())
    read = read_back(s.next[:n], s.logprobs[:n] if sampled & Mode.LOGPROBS else None)
    yield  # launched: the batch's collect goes on from here
    tokens, logprobs = read()  # the one sync: hand the tokens back
    runner.timer.stop()
    slots.clear_padding(n, m)
    outputs = []
    for slot, row in enumerate(rows):
        row.committed += 1
        wanted = logprobs is not None and row.request.return_logprob
        outputs.append(emit(row, [tokens[slot]], accept=None, logprobs=logprobs[slot] if wanted else None))
    return outputs


def round_stages(parts: RoundParts, m: int, size: int, sampled: Mode, choose_next: bool,
                 longest: int | None) -> Stages:
    """A whole round for m rows verifying `size` nodes; choose_next: built at the budget cap, and also
    choosing the next round's size, else built at `size`."""
    build = parts.spec.budget_cap if choose_next else size
    return (draft_stages(parts, m, longest, build, choose_next)
            + verify_stages(parts, m, size, sampled, longest, hand_on=choose_next))


def draft_stages(parts: RoundParts, m: int, longest: int | None, build_size: int,
                 choose_next: bool) -> list[tuple[str, Stage]]:
    """Steps 1-2 for m rows: draft, build the best `build_size` paths (and, choose_next, the next round's size
    from them: build_size is then the cap)."""
    slots, spec, drafter = parts.slots, parts.spec, parts.engine.drafter
    cache, ctx = slots.first_rows(m)
    assert ctx is not None  # check_spec: speculation has a drafter

    # 1. draft: [bonus, MASK...] at positions committed .. committed + block - 1
    def draft(s: RoundState) -> None:
        # the cache's lengths are the committed lengths, on the device: no host-to-device copy per round
        s.committed = cache.lengths.clone()  # [m]
        block_ids = torch.cat([slots.bonus[:m, None], slots.masks[:m]], dim=1)  # [m, block]
        # kernel attention: each row's stored context slots are read in place (their count on the
        # device); "sdpa": at most min(longest context, window) slots, a host bound (ctx_len_hint)
        s.draft_logits = drafter.forward(ctx, block_ids, s.committed, ctx_len_hint=longest,
                                         attention=parts.attention)  # [m, L, V]

    # 2. build: the best `build_size` paths, nodes sorted best first (parents before children)
    def build(s: RoundState) -> None:
        s.trees = tree_ops.build_trees(s.draft_logits, build_size, spec.topk)
        del s.draft_logits  # not a graph output: its memory goes back to the shared pool (see RoundState)

    stages: list[tuple[str, Stage]] = [("draft", draft), ("build", build)]
    if choose_next:  # one launch on CUDA
        stages.append(("build", parts.budget.choosing_stage(m)))
    return stages


def verify_stages(parts: RoundParts, m: int, size: int, sampled: Mode, longest: int | None,
                  hand_on: bool) -> list[tuple[str, Stage]]:
    """Steps 3-6 for m rows on the first `size` nodes of the built trees (hand_on: the next round's size,
    chosen in the draft stages, rides along in the rows the host reads)."""
    eng, spec, slots = parts.engine, parts.spec, parts.slots
    cache, ctx = slots.first_rows(m)
    assert ctx is not None
    # topk 1 always gives a chain (causal attention is then exact); deciding it from the trees
    # themselves would read the device every round, so only the host-known cases skip the mask
    chain = spec.algorithm is Algorithm.DFLASH or spec.topk == 1

    # 3. compile: [bonus, nodes], positions start + depth, the ancestor-or-self mask (and its bits)
    def compile_(s: RoundState) -> None:
        s.trees = truncate_trees(s.trees, size) if size < s.trees.budget else s.trees
        s.compiled = tree_ops.compile_trees(s.trees, slots.bonus[:m], s.committed)

    # 4. verify: one target forward over every tree; the target's token at every node
    def verify(s: RoundState) -> None:
        c = s.compiled
        logits, s.taps = eng.target.forward(
            c.input_ids, c.position_ids, cache, None if chain else c.mask, eng.tap_layers,
            kv_len_hint=None if longest is None else longest + size + 1, attention=parts.attention,
            tree_bitmask=None if chain else c.bitmask)
        s.target_tokens = slots.sampling.choose(logits, slice(0, m), c.position_ids + 1, sampled)
        if sampled & Mode.LOGPROBS:
            s.logprobs = token_logprobs(logits, s.target_tokens)  # [m, B+1]: at every node, for now

    # 5. walk: the nodes whose every ancestor matches the target's token; the deepest gives the bonus
    def walk(s: RoundState) -> None:
        # from the compiled ancestor mask: one kernel on CUDA, a fixed 28 ops on the CPU (walking depth by
        # depth is ~125 at L = 7)
        accepted, s.accept_lens, s.new_bonus = tree_ops.follow_trees(s.trees, s.compiled, s.target_tokens)
        # A path never holds more than size + 1 nodes: keep the compaction inside the verify window.
        s.accepted = accepted[:, : min(accepted.shape[1], size + 1)]
        if sampled & Mode.LOGPROBS:  # the committed tokens' log-probs: the target's at each accepted node
            s.logprobs = s.logprobs.gather(1, s.accepted.clamp_min(0))  # [m, width]

    # 6. compact: target KV to the accepted path; accepted hidden states into the drafter context
    def compact(s: RoundState) -> None:
        # moves past a row's accepted length are no-ops, so the -1 padding needs no masking here
        cache.compact(s.accepted, s.accept_lens)
        # the path's tokens (column 0: the old bonus) for the host, its taps, positions and ring slots for the
        # drafter, and the new bonus into the slots' bonus: one kernel on CUDA
        path = gather_accepted(s.accepted, s.accept_lens, s.compiled.input_ids, s.new_bonus, s.taps,
                               s.committed, bonus_out=slots.bonus[:m], ring=(ctx.total, ctx.capacity))
        s.host = path.host
        eng.drafter.append_context(ctx, path.taps, path.positions, s.accept_lens, slots=path.slots)
        del s.taps  # as draft_logits: used up within the round

    stages: list[tuple[str, Stage]] = [("build", compile_), ("verify", verify), ("walk", walk), ("compact", compact)]
    if hand_on:
        def hand_on_size(s: RoundState) -> None:
            s.host = torch.cat([s.host, s.next_budget.expand(m, 1)], dim=1)

        stages.append(("compact", hand_on_size))
    return stages


def read_back(tokens: torch.Tensor, logprobs: torch.Tensor | None) -> Callable[[], tuple[list[Any], list[Any] | None]]:
    """Start copying a round's outputs to the host, in stream order (a round launched ahead may overwrite
    the graph's output tensors before they are read); the function returned waits for the copy only."""
    wanted = [tokens] if logprobs is None else [tokens, logprobs]
    if tokens.device.type != "cuda":  # the round has run already (no graph: its tensors are its own)
        return lambda: _as_lists(wanted)
    copies = [t.to("cpu", non_blocking=True) for t in wanted]  # pinned host memory
    done = torch.cuda.Event()
    done.record()

    def read() -> tuple[list[Any], list[Any] | None]:
        done.synchronize()
        return _as_lists(copies)
    return read


def _as_lists(host: list[torch.Tensor]) -> tuple[list[Any], list[Any] | None]:
    return host[0].tolist(), (host[1].tolist() if len(host) > 1 else None)
