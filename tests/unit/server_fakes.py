"""A fake engine for server tests: the DecodeBatch protocol with deterministic tokens and no model.

Tokens are a pure function of (prompt, absolute position, seed when sampling), and the accepted
length of a round a pure function of (prompt, round), so a request's output never depends on
what else is in the batch -- the property the real engine guarantees and the server must keep.
Like the real batch, `add` is the prefill and yields the first token; each `step` commits
1..block_size tokens per request and counts one verify step.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddtree.config import SpecConfig
from ddtree.engine import Request, StepOutput
from ddtree.errors import RequestError


def _mix(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def fake_token(prompt: Sequence[int], position: int, vocab: int, temperature: float, seed: int | None) -> int:
    """The token the fake chooses at absolute `position` (prompt tokens are positions 0..n-1)."""
    salt = seed if temperature > 0 else None
    return _mix(tuple(prompt), position, salt) % vocab


def fake_logprob(token: int) -> float:
    """The fake's log-prob of a committed token (a pure function of it, so tests can predict it)."""
    return -0.5 - (token % 7) / 4


def fake_accept(prompt: Sequence[int], round_index: int, block: int) -> int:
    return 1 + _mix(tuple(prompt), "round", round_index) % block


def expected_output(req: Request, vocab: int, eos: int | None) -> tuple[list[int], str]:
    """What the fake generates for `req` alone: (tokens, finish_reason)."""
    stops = set(req.stop_token_ids) | ({eos} if eos is not None and not req.ignore_eos else set())
    out: list[int] = []
    n = len(req.prompt_ids)
    while len(out) < req.max_new_tokens:
        tok = fake_token(req.prompt_ids, n + len(out), vocab, req.temperature, req.seed)
        out.append(tok)
        if tok in stops:
            return out, "stop"
    return out, "length"


@dataclass
class _Row:
    request: Request
    output: list[int] = field(default_factory=list)
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)


class FakeBatch:
    """The scheduler's batch protocol (ddtree.serving.admission.DecodeBatchLike): add (prefill, first token),
    launch and collect (the round: step), cancel, free_slots, active; its rounds never run ahead."""

    prefill_tokens: int | None = None  # no bound on a prefill forward: a burst is admitted whole
    forward_cost = 0
    graphs = None
    last_budget: int | None = None
    budget_rounds = budget_total = 0
    round_ahead = False

    def __init__(self, engine: FakeEngine, spec: SpecConfig, max_batch: int, max_len: int) -> None:
        self.engine, self.spec, self.max_batch, self.max_len = engine, spec, max_batch, max_len
        self.block = spec.block_size if spec.speculative else 1
        self.rows: dict[str, _Row] = {}
        self.added: list[str] = []
        self.cancelled: list[str] = []
        self.step_sizes: list[int] = []  # rows per step(), to see continuous batching happen

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.rows)

    def validate(self, request: Request) -> None:
        if self.engine.fail_add:
            raise RequestError("fake prefill refused", field="input_ids", status_code=422)
        if len(request.prompt_ids) + request.max_new_tokens + self.spec.max_nodes > self.max_len:
            raise RequestError("prompt + max_new_tokens exceeds the batch length", field="max_new_tokens")

    def add(self, request: Request) -> list[StepOutput]:
        self.validate(request)
        if self.free_slots <= 0:
            raise RequestError("no free slot in the batch", field="batch", status_code=503)
        row = _Row(request)
        self.rows[request.request_id] = row
        self.added.append(request.request_id)
        out = self._emit(row, 1, accept=None)
        return [out]

    def step(self) -> list[StepOutput]:
        eng = self.engine
        eng.gate.wait()
        if eng.fail_step:
            raise RuntimeError("fake round failure")
        if eng.step_delay:
            time.sleep(eng.step_delay)
        self.step_sizes.append(len(self.rows))
        outputs = []
        for row in list(self.rows.values()):
            row.rounds += 1
            a = fake_accept(row.request.prompt_ids, row.rounds, self.block)
            outputs.append(self._emit(row, a, accept=a))
        return outputs

    def add_many(self, requests: Sequence[Request]) -> list[StepOutput]:
        return [out for request in requests for out in self.add(request)]

    def launch(self) -> None:
        pass  # the round runs in collect()

    def collect(self, run_ahead: bool = False) -> list[StepOutput]:
        return self.step()

    def settle(self) -> list[StepOutput]:
        return []

    def clear(self) -> None:
        self.rows.clear()

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return self.rows.pop(request_id, None) is not None

    def _emit(self, row: _Row, count: int, accept: int | None) -> StepOutput:
        req, eng = row.request, self.engine
        stops = set(req.stop_token_ids)
        if eng.eos_token_id is not None and not req.ignore_eos:
            stops.add(eng.eos_token_id)
        new: list[int] = []
        reason = None
        n = len(req.prompt_ids)
        for _ in range(count):
            if len(row.output) + len(new) >= req.max_new_tokens:
                break
            tok = fake_token(req.prompt_ids, n + len(row.output) + len(new), eng.vocab_size, req.temperature, req.seed)
            new.append(tok)
            if tok in stops:
                reason = "stop"
                break
        row.output.extend(new)
        if reason is None and len(row.output) >= req.max_new_tokens:
            reason = "length"
        if accept is not None:
            row.accept_lengths.append(accept)
        if reason is not None:
            self.rows.pop(req.request_id, None)
        logprobs = [fake_logprob(t) for t in new] if req.return_logprob else []
        return StepOutput(req.request_id, new, reason is not None, reason, row.rounds, [accept] if accept else [],
                          logprobs=logprobs)


class FakeEngine:
    """Engine protocol: open_batch, eos_token_id, max_context, vocab_size; knobs for failure tests."""

    def __init__(self, vocab_size: int = 97, eos_token_id: int | None = 5, max_context: int = 512) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_context = max_context
        self.step_delay = 0.0
        self.fail_add = False
        self.fail_step = False
        self.gate = threading.Event()  # clear it to hold every round (e.g. the warm-up)
        self.gate.set()
        self.batches: list[FakeBatch] = []
        self.run_ahead: bool | None = None  # the last open_batch's run_ahead

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int, run_ahead: bool = True) -> FakeBatch:
        batch = FakeBatch(self, spec, max_batch, max_len)
        self.run_ahead = run_ahead  # what the server asked for (its rounds never run ahead)
        self.batches.append(batch)
        return batch
