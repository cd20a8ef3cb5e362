"""A decode batch's sampling options per slot, as device tensors, and choosing the target's tokens with them.

Temperature, seed, top-k, top-p, min-p and min_new_tokens (its stop tokens banned below the minimum length, by
position) live here, one entry a slot. Every round reads them in place, so a captured graph serves any mix of
requests; the round's `Mode` (what its rows need: greedy, sampled, filtered, banned, log-probs) is part of
every graph key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ddtree.request import Request, Row
from ddtree.sampling import Filters, Mode, ban_tokens, choose_tokens_no_sync


def mode_of(requests: Sequence[Request], produced: Sequence[int]) -> Mode:
    """What choosing tokens for these requests needs (`produced`: new tokens each has so far)."""
    mode = Mode.GREEDY
    for request, done in zip(requests, produced):
        if request.temperature > 0:
            mode |= Mode.SAMPLED
        if request.filtered:
            mode |= Mode.FILTERED
        if request.min_new_tokens > done:
            mode |= Mode.BAN
        if request.return_logprob:
            mode |= Mode.LOGPROBS
    return mode


def rows_mode(rows: Sequence[Row]) -> Mode:
    """mode_of the running rows."""
    return mode_of([r.request for r in rows], [len(r.output) for r in rows])


class SlotSampling:
    """Each slot's sampling state (ddtree.sampling: Filters, ban_tokens) and the choice of tokens with it."""

    def __init__(self, max_batch: int, vocab_size: int, eos_token_id: int | None, device: torch.device) -> None:
        self.max_batch, self.vocab_size, self.eos_token_id, self.device = max_batch, vocab_size, eos_token_id, device
        self.temps = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.top_ks = torch.zeros(max_batch, dtype=torch.long, device=device)  # <= 0: off
        self.top_ps = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.min_ps = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.min_until = torch.zeros(max_batch, dtype=torch.long, device=device)  # stop tokens banned below
        self.banned: torch.Tensor | None = None  # [max_batch, V] a slot's stop tokens; made when first needed

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every per-slot buffer (a row moving to another slot takes its entries along)."""
        yield from (self.temps, self.seeds, self.top_ks, self.top_ps, self.min_ps, self.min_until)
        if self.banned is not None:
            yield self.banned

    def set_rows(self, start: int, requests: Sequence[Request], seeds: Sequence[int]) -> None:
        """Slots start.. take these requests' sampling state (one copy a buffer)."""
        stop = start + len(requests)
        self.temps[start:stop] = torch.tensor([float(r.temperature) for r in requests], device=self.device)
        self.seeds[start:stop] = torch.tensor(list(seeds), dtype=torch.long, device=self.device)
        self._set_filters(start, requests)

    def set_row(self, slot: int, request: Request, seed: int) -> None:
        """One slot takes one request's sampling state (temperature and seed as fills: no host-to-device copy)."""
        self.temps[slot] = float(request.temperature)
        self.seeds[slot] = seed
        self._set_filters(slot, [request])

    def _set_filters(self, start: int, requests: Sequence[Request]) -> None:
        stop = start + len(requests)
        dev = self.device
        self.top_ks[start:stop] = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=dev)
        self.top_ps[start:stop] = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=dev)
        self.min_ps[start:stop] = torch.tensor([r.min_p for r in requests], dtype=torch.float32, device=dev)
        self.min_until[start:stop] = torch.tensor([len(r.prompt_ids) + r.min_new_tokens for r in requests],
                                                  dtype=torch.long, device=dev)
        if self.banned is None and any(r.min_new_tokens > 0 for r in requests):
            self.banned = torch.zeros(self.max_batch, self.vocab_size, dtype=torch.bool, device=dev)
        if self.banned is not None:
            self.banned[start:stop] = False
            for slot, r in enumerate(requests, start):
                stops = set(r.stop_token_ids) | ({self.eos_token_id} if not r.ignore_eos and
                                                 self.eos_token_id is not None else set())
                if r.min_new_tokens > 0 and stops:
                    self.banned[slot, sorted(stops)] = True

    def choose(self, logits: torch.Tensor, rows: slice | torch.Tensor, positions: torch.Tensor, mode: Mode) -> torch.Tensor:
        """The target's token at every position of these slots' rows (a slice, or a device index), per `mode`."""

        def take(buf: torch.Tensor) -> torch.Tensor:
            return buf[rows] if isinstance(rows, slice) else buf.index_select(0, rows)

        if mode & Mode.BAN:
            assert self.banned is not None  # made by _set_filters for the request that needs it
            logits = ban_tokens(logits, take(self.banned), take(self.min_until), positions)
        filters = Filters(take(self.top_ks), take(self.top_ps), take(self.min_ps)) if mode & Mode.FILTERED else None
        return choose_tokens_no_sync(logits, take(self.temps), take(self.seeds), positions, bool(mode & Mode.SAMPLED),
                                     filters)
