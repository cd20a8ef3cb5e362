"""The decoding loop: AR, DFlash chain and DDTree in one engine (token ids only, no text)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
