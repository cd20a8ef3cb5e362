"""Prefill: requests join a decode batch (their prompts' KV and drafter context, and their first tokens).

Eager, several prompts share a right-padded target forward: `prefill_chunks` groups them so padding stays
small. A graphed batch prefills a lone short request by replaying a graph captured per power-of-two width
(`PrefillStaging`): eager, a prefill's ~150 launches are mostly host time. Either way the first token is
the target's own and the one sync hands it back.

`Prefill` works on the batch's slots (ddtree.slots: caches, bonus tokens, sampling state) and runs through
its stage runner (graphs and stage timer); the batch hands it the rows the new requests join.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from ddtree.config import SpecConfig
from ddtree.request import Request, Row, StepOutput, emit
from ddtree.round_graphs import StageRunner
from ddtree.sampling import Mode, token_logprobs
from ddtree.slot_sampling import mode_of
from ddtree.slots import Slots

PREFILL_TOKENS = 8192  # default bound on padded tokens per prefill forward (activation memory)
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


class PrefillStaging:
    """A one-row staging cache (and drafter context) that graphed prefills run on, with static inputs.

    A captured prefill forwards `ids` into the staging rows, then copies them into the slot named by the
    device index `dst`: the same graph serves every slot. Widths are padded to a power of two (right
    padding: its K/V lands past the real length and is overwritten later).
    """

    def __init__(self, target, drafter, max_width: int, draft_window: int | None, max_len: int,
                 device: torch.device) -> None:
        """drafter: None when the batch has no drafter context (AR)."""
        self.max_width = max_width
        self.cache = target.new_cache(1, max_width)
        self.ctx = drafter.new_context(1, draft_window, max_len) if drafter is not None else None
        self.ids = torch.zeros(1, max_width, dtype=torch.long, device=device)
        self.positions = torch.arange(max_width, device=device)[None]  # [1, max_width]
        self.real = torch.zeros(1, dtype=torch.long, device=device)  # the prompt's length
        self.dst = torch.zeros(1, dtype=torch.long, device=device)  # the batch slot it goes to

    def bucket(self, width: int) -> int:
        return min(self.max_width, max(64, 1 << (width - 1).bit_length()))


class Prefill:
    """Requests join a batch: `run` puts them into the next free slots and returns their first tokens."""

    def __init__(self, engine: Any, spec: SpecConfig, slots: Slots, runner: StageRunner, max_len: int,
                 cache_len: int) -> None:
        """engine: ddtree.decode.BatchEngine; max_len: a prompt longer than this never prefills graphed;
        cache_len: positions a slot holds (the graphed staging context's length)."""
        self.engine, self.spec, self.slots, self.runner = engine, spec, slots, runner
        self.max_len, self.cache_len, self.device = max_len, cache_len, slots.device
        self.staging: PrefillStaging | None = None  # graphed prefills' staging rows, made on first use

    def run(self, requests: list[Request], rows: list[Row]) -> list[StepOutput]:
        """One right-padded target forward for `requests` into the slots after `rows`, which they join; their
        first tokens."""
        eng, timer = self.engine, self.runner.timer
        seeds = [r.seed if r.seed is not None else random.SystemRandom().randrange(1 << 31) for r in requests]
        timer.start("prefill")
        if (self.runner.graphs is not None and len(requests) == 1
                and len(requests[0].prompt_ids) <= min(GRAPHED_PREFILL_TOKENS, self.max_len)):
            tokens, logprobs = self._graphed(requests[0], seeds[0], len(rows))
        else:
            tokens, logprobs = self._eager(requests, seeds, len(rows))
        timer.stop()
        outputs = []
        for i, request in enumerate(requests):
            stop_ids = set(request.stop_token_ids)
            if not request.ignore_eos and eng.eos_token_id is not None:
                stop_ids.add(eng.eos_token_id)
            row = Row(request, committed=len(request.prompt_ids), stop_ids=frozenset(stop_ids))
            rows.append(row)
            outputs.append(emit(row, [tokens[i]], accept=None,
                                logprobs=[logprobs[i]] if logprobs is not None and request.return_logprob else None))
        return outputs

    def _eager(self, requests: list[Request], seeds: list[int], start: int) -> tuple[list[int], list[float] | None]:
        eng, slots, k = self.engine, self.slots, len(requests)
        stop = start + k
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        padded = [r.prompt_ids + [0] * (width - len(r.prompt_ids)) for r in requests]
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # [k, width]
        real = torch.tensor(lengths, dtype=torch.long, device=self.device)  # [k]
        slots.sampling.set_rows(start, requests, seeds)
        fresh = torch.ones(k, dtype=torch.bool, device=self.device)
        cache = slots.cache.rows(start, stop)
        cache.reset(fresh)
        positions = torch.arange(width, device=self.device)[None].expand(k, -1)  # [k, width]
        taps_layers = eng.tap_layers if self.spec.speculative else None
        # Causal attention keeps the padding (after each row's prompt) out of the real tokens; its KV
        # lands beyond lengths[b] and is overwritten by the next forward.
        logits, taps = eng.target.forward(ids, positions, cache, None, taps_layers, kv_len_hint=width,
                                          logit_positions=(real - 1)[:, None])  # logits [k, 1, V]
        cache.advance(real)
        if slots.ctx is not None:
            ctx = slots.ctx.rows(start, stop)
            ctx.reset(fresh)
            eng.drafter.append_context(ctx, taps, positions, real)  # counts = real: padding is skipped
        mode = mode_of(requests, [0] * k)
        first = slots.sampling.choose(logits, slice(start, stop), real[:, None], mode)[:, 0]
        slots.bonus[start:stop] = first
        logprobs = token_logprobs(logits, first[:, None])[:, 0].tolist() if mode & Mode.LOGPROBS else None
        return first.tolist(), logprobs  # the one sync: hand the first tokens back

    def _graphed(self, request: Request, seed: int, slot: int) -> tuple[list[int], list[float] | None]:
        """The eager prefill's work for one request, replayed from a graph captured per width bucket."""
        eng, slots, width = self.engine, self.slots, len(request.prompt_ids)
        if self.staging is None:
            self.staging = PrefillStaging(eng.target, eng.drafter if slots.ctx is not None else None,
                                          min(GRAPHED_PREFILL_TOKENS, self.max_len), self.spec.draft_window,
                                          self.cache_len, self.device)  # the batch context's rows
        st = self.staging
        bucket = st.bucket(width)
        st.ids[0, :bucket].copy_(torch.tensor(request.prompt_ids + [0] * (bucket - width), dtype=torch.long))
        st.real.fill_(width)
        st.dst.fill_(slot)
        slots.sampling.set_row(slot, request, seed)
        mode = mode_of([request], [0])
        taps_layers = eng.tap_layers if self.spec.speculative else None

        def prefill() -> torch.Tensor:
            cache = st.cache.window(bucket)  # the first `bucket` slots of the staging row
            cache.lengths.zero_()
            ids, positions = st.ids[:, :bucket], st.positions[:, :bucket]
            logits, taps = eng.target.forward(ids, positions, cache, None, taps_layers, kv_len_hint=bucket,
                                              logit_positions=(st.real - 1)[:, None])
            cache.advance(st.real)
            for mine, theirs in ((cache.k, slots.cache.k), (cache.v, slots.cache.v)):  # into the request's slot
                theirs[:, :, :, :bucket].index_copy_(1, st.dst, mine)
            slots.cache.lengths.index_copy_(0, st.dst, cache.lengths)
            if st.ctx is not None and slots.ctx is not None:
                st.ctx.total.zero_()
                eng.drafter.append_context(st.ctx, taps, positions, st.real)
                slots.ctx.k.index_copy_(1, st.dst, st.ctx.k)
                slots.ctx.v.index_copy_(1, st.dst, st.ctx.v)
                slots.ctx.total.index_copy_(0, st.dst, st.ctx.total)
            first = slots.sampling.choose(logits, st.dst, st.real[:, None], mode)[:, 0]
            slots.bonus.index_copy_(0, st.dst, first)
            return torch.cat([first.double(), token_logprobs(logits, first[:, None])[:, 0].double()])

        graphs = self.runner.graphs
        assert graphs is not None
        # the token and its log-prob in one tensor: one read (float64 holds every token id exactly)
        first, logprob = graphs.run(("prefill", bucket, mode), prefill, self.runner.state()).tolist()
        return [int(first)], [logprob] if mode & Mode.LOGPROBS else None  # the one sync: hand the first token back
