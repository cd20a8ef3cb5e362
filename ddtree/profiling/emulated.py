"""An engine with no model, for a machine without a GPU: a batch of fixed round time and prefill cost.

    EmulatedBatch(spec, max_batch, max_len, round_s, prefill_s, tokens_per_round, prefill_token_s=0.0)
    EmulatedEngine(vocab_size, max_context, round_s, prefill_s, tokens_per_round)   # opens EmulatedBatches

What ddtree.profiling.http_vs_engine (`--engine emulated`, and its serve-emulated server) and
ddtree.profiling.round_overhead and ddtree.profiling.burst (`--engine emulated`) put in front of the server when there
is no model to run; the scheduler's and the engine process's unit tests drive it too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddtree.config import SpecConfig
from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError
from ddtree.prefill import PREFILL_TOKENS, prefill_chunks


class EmulatedBatch:
    """The DecodeBatch protocol with a fixed round time: `round_s` from launch() waiting with the GIL released
    (what a graphed round's one host sync does; host work between launch and collect overlaps it, as it does
    the device's), then each row's Python bookkeeping. Tokens are a pure function of (prompt, position): row
    i's output is its prompt read on from position len(prompt).

    A prefill (add_many) waits `prefill_s`; with `prefill_token_s`, it is cut into forwards as DecodeBatch
    cuts it (ddtree.prefill.prefill_chunks, at most `prefill_tokens` padded tokens each) and each forward
    waits `prefill_s` + its padded tokens x `prefill_token_s`: a burst prefilled in several groups then
    costs what it does on a device, a fixed cost per forward more."""

    forward_cost = 0  # the prefill's chunks weigh prefill_s instead (prefill_seconds)
    graphs: object | None = None  # its rounds are no graphs: nothing to warm up
    last_budget: int | None = None  # a fixed budget: no tree sizes to report
    budget_rounds = budget_total = 0

    def __init__(self, spec: SpecConfig, max_batch: int, max_len: int, round_s: float, prefill_s: float,
                 tokens_per_round: int, prefill_token_s: float = 0.0, prefill_tokens: int = PREFILL_TOKENS) -> None:
        self.spec, self.max_batch, self.max_len = spec, max_batch, max_len
        self.round_s, self.prefill_s, self.tokens_per_round = round_s, prefill_s, tokens_per_round
        self.prefill_token_s, self.prefill_tokens = prefill_token_s, prefill_tokens
        self.rows: dict[str, list[Any]] = {}  # id -> [request, output, verify steps]
        self._launched_at: float | None = None  # when the round in flight was launched

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.rows)

    @property
    def round_ahead(self) -> bool:
        return False  # its rounds never run ahead

    def validate(self, request: Request) -> None:
        if not request.prompt_ids:
            raise RequestError("prompt is empty", field="input_ids")
        if len(request.prompt_ids) + request.max_new_tokens > self.max_len:
            raise RequestError("prompt + max_new_tokens exceeds the batch length", field="max_new_tokens")

    def add(self, request: Request) -> list[StepOutput]:
        return self.add_many([request])

    def add_many(self, requests: Sequence[Request]) -> list[StepOutput]:
        for request in requests:
            self.validate(request)
        if len(requests) > self.free_slots:
            raise RequestError("no free slot in the batch", field="batch", status_code=503)
        time.sleep(self.prefill_seconds([len(r.prompt_ids) for r in requests]))
        outputs = []
        for request in requests:
            row = [request, [], 0]
            self.rows[request.request_id] = row
            outputs.append(self._emit(row, 1, None))
        return self._retire(outputs)

    def prefill_seconds(self, lengths: list[int]) -> float:
        """What a prefill of prompts of these lengths waits."""
        if not self.prefill_token_s:
            return self.prefill_s
        chunks = prefill_chunks(lengths, self.prefill_tokens, round(self.prefill_s / self.prefill_token_s))
        return sum(self.prefill_s + len(c) * max(lengths[i] for i in c) * self.prefill_token_s for c in chunks)

    def step(self) -> list[StepOutput]:
        self.launch()
        return self.collect()

    def settle(self) -> list[StepOutput]:
        """DecodeBatch.settle: nothing, as step() never runs a round ahead here."""
        return []

    def launch(self) -> None:
        """DecodeBatch.launch: the round starts "on the device" now; collect() waits for what is left of it."""
        if self._launched_at is not None:
            raise RuntimeError("a round is already launched: collect it first")
        self._launched_at = time.perf_counter()

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        """DecodeBatch.collect (run_ahead: ignored, its rounds never run ahead)."""
        launched, self._launched_at = self._launched_at, None
        if launched is None:
            raise RuntimeError("no round launched")
        if not self.rows:
            return []
        time.sleep(max(launched + self.round_s - time.perf_counter(), 0.0))
        outputs = []
        for row in self.rows.values():
            row[2] += 1
            outputs.append(self._emit(row, self.tokens_per_round, self.tokens_per_round))
        return self._retire(outputs)

    def cancel(self, request_id: str) -> bool:
        return self.rows.pop(request_id, None) is not None

    def clear(self) -> None:
        self.rows.clear()
        self._launched_at = None

    def _emit(self, row: list[Any], count: int, accept: int | None) -> StepOutput:
        request, output = row[0], row[1]
        prompt = request.prompt_ids
        take = min(count, request.max_new_tokens - len(output))
        start = len(prompt) + len(output)
        new = [prompt[(start + i) % len(prompt)] for i in range(take)]
        output.extend(new)
        done = len(output) >= request.max_new_tokens
        return StepOutput(request.request_id, new, done, "length" if done else None, row[2],
                          [accept] if accept is not None else [])

    def _retire(self, outputs: list[StepOutput]) -> list[StepOutput]:
        for out in outputs:
            if out.finished:
                self.rows.pop(out.request_id, None)
        return outputs


@dataclass
class EmulatedEngine:
    """What the server needs of an Engine (EngineLike), opening EmulatedBatches."""

    vocab_size: int
    max_context: int
    round_s: float
    prefill_s: float
    tokens_per_round: int
    eos_token_id: int | None = None
    cuda_graphs: bool = False
    attention: str = "emulated"
    prefill_token_s: float = 0.0

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int | None = None,
                   run_ahead: bool = True) -> EmulatedBatch:  # run_ahead: its rounds never run ahead
        return EmulatedBatch(spec, max_batch, max_len or self.max_context, self.round_s, self.prefill_s,
                             self.tokens_per_round, self.prefill_token_s)
