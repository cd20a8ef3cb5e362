"""What a decode batch takes in and hands back: Request, StepOutput, GenerationResult.

Also a running request's host-side row and the two checks made on the host: `validate_request` (before
any forward) and `emit` (stop tokens and max_new_tokens cut what a round commits). Token ids only.
"""

from __future__ import annotations

import array
import struct
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from ddtree.errors import RequestError


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
    # at T > 0 the draw is from softmax(logits / T) truncated to the top_k tokens, the top_p mass and the tokens
    # with p >= min_p * p_max (SGLang's order); -1 / 1.0 / 0.0 are off
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0  # stop tokens (EOS included) cannot be chosen before this many new tokens
    return_logprob: bool = False  # StepOutput.logprobs: the target's log-prob of each committed token

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (the server's submit to the engine process) as its fields, the prompt as packed C ints where
        every id fits one: a bytes object instead of an int a token. 1024 ids at concurrency 1 on 2 cores:
        submit to admitted ~0.30 -> ~0.27 ms (the unpickling's share ~105 -> ~80 us)."""
        ids = self.prompt_ids
        try:
            packed: bytes | list[int] = struct.pack(f"{len(ids)}i", *ids)
        except struct.error:  # an id past a C int (or not an int): the list as it is
            packed = ids
        return _unpickle_request, (self.request_id, packed, *[getattr(self, name) for name in _REQUEST_FIELDS[2:]])

    @property
    def filtered(self) -> bool:
        """Whether sampling truncates the distribution (greedy never does: truncation keeps the argmax)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


_REQUEST_FIELDS = tuple(f.name for f in fields(Request))


def _unpickle_request(request_id: str, prompt: bytes | list[int], *rest: Any) -> Request:
    if isinstance(prompt, bytes):
        ids = array.array("i")
        ids.frombytes(prompt)
        prompt = ids.tolist()
    return Request(request_id, prompt, *rest)


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
    logprobs: list[float] = field(default_factory=list)  # per new token, when the request asked (return_logprob)


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
    logprobs: list[float] = field(default_factory=list)  # the target's log-prob of each token (return_logprob)

    @property
    def accept_histogram(self) -> list[int]:
        """Index = accepted length of a round (bonus included), value = number of rounds."""
        counts = Counter(self.accept_lengths)
        size = max(counts, default=0) + 1
        return [counts.get(i, 0) for i in range(size)]

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@dataclass
class Row:
    """Host-side bookkeeping of one running request."""

    request: Request
    committed: int  # tokens with target KV (prompt + accepted so far, bonus excluded)
    output: list[int] = field(default_factory=list)
    verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()


def validate_request(request: Request, vocab_size: int, context: int) -> None:
    """Raise RequestError (naming the field) if `request` can never run in `context` tokens."""
    if not request.prompt_ids:
        raise RequestError("prompt is empty", field="input_ids")
    if request.max_new_tokens < 1:
        raise RequestError(f"max_new_tokens: {request.max_new_tokens} is out of range (allowed >= 1)",
                           field="max_new_tokens")
    if request.temperature < 0:
        raise RequestError(f"temperature: {request.temperature} is out of range (allowed >= 0)",
                           field="temperature")
    if not 0.0 < request.top_p <= 1.0:
        raise RequestError(f"top_p: {request.top_p} is out of range (allowed (0, 1])", field="top_p")
    if not (request.top_k == -1 or request.top_k >= 1):
        raise RequestError(f"top_k: {request.top_k} is out of range (allowed -1 or >= 1)", field="top_k")
    if not 0.0 <= request.min_p <= 1.0:
        raise RequestError(f"min_p: {request.min_p} is out of range (allowed [0, 1])", field="min_p")
    if not 0 <= request.min_new_tokens <= request.max_new_tokens:
        raise RequestError(f"min_new_tokens: {request.min_new_tokens} is out of range (allowed 0..max_new_tokens)",
                           field="min_new_tokens")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids: token {bad[0]} is outside the vocabulary 0..{vocab_size - 1}",
                           field="input_ids")
    need = len(request.prompt_ids) + request.max_new_tokens
    if need > context:
        raise RequestError(
            f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"= {need} exceeds the context length ({context})",
            field="max_new_tokens",
        )


def emit(row: Row, tokens: list[int], accept: int | None, logprobs: list[float] | None = None,
         budgets: list[int] | None = None) -> StepOutput:
    """Append a round's committed `tokens` to `row` up to a stop token or max_new_tokens; what the caller gets
    (`logprobs`, one per token, are cut with them; `budgets`: the round's tree size). Once per row per round,
    on the host between two rounds: `tokens` is handed on uncopied when nothing cuts it."""
    req = row.request
    output = row.output
    room = req.max_new_tokens - len(output)
    kept = tokens if len(tokens) <= room else tokens[:room]
    reason = None
    stop_ids = row.stop_ids
    if stop_ids and not stop_ids.isdisjoint(kept):
        for i, tok in enumerate(kept):
            if tok in stop_ids:
                kept, reason = kept[: i + 1], "stop"
                break
    if reason is None and len(kept) >= room:
        reason = "length"
    output.extend(kept)
    if accept is not None:
        row.accept_lengths.append(accept)
    return StepOutput(req.request_id, kept, reason is not None, reason, row.verify_steps,
                      [accept] if accept is not None else [], budgets if budgets is not None else [],
                      logprobs[: len(kept)] if logprobs else [])
