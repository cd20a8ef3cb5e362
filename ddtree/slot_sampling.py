"""A decode batch's sampling options per slot, as device tensors, and choosing the target's tokens with them.

Temperature and seed live beside the bonus token in ddtree.decode.DecodeBatch (prefill sets them); top-k,
top-p, min-p and min_new_tokens (its stop tokens banned below the minimum length, by position) live here.
Every round reads them in place, so a captured graph serves any mix of requests; the round's `Mode` (what
its rows need: greedy, sampled, filtered, banned, log-probs) is part of every graph key.

`SlotSampling` is a part of DecodeBatch: it reads the batch's engine, device, max_batch and rows, and the
temps and seeds buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ddtree.request import Request
from ddtree.sampling import Filters, Mode, ban_tokens, choose_tokens_no_sync


class SlotSampling:
    """DecodeBatch's per-slot sampling state beyond T and the seed (ddtree.sampling: Filters, ban_tokens)."""

    def _init_slot_sampling(self, max_batch: int) -> None:
        self.top_ks = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # <= 0: off
        self.top_ps = torch.ones(max_batch, dtype=torch.float32, device=self.device)
        self.min_ps = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.min_until = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # stop tokens banned below
        self.banned: torch.Tensor | None = None  # [max_batch, V] a slot's stop tokens; made when first needed

    def _sampling_buffers(self) -> Iterator[torch.Tensor]:
        """Every per-slot buffer of this part (a row moving to another slot takes its entries along)."""
        yield from (self.top_ks, self.top_ps, self.min_ps, self.min_until)
        if self.banned is not None:
            yield self.banned

    def _mode(self) -> Mode:
        return self._mode_of([r.request for r in self.rows], [len(r.output) for r in self.rows])

    @staticmethod
    def _mode_of(requests: Sequence[Request], produced: Sequence[int]) -> Mode:
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

    def _set_sampling(self, start: int, requests: Sequence[Request]) -> None:
        """Slots start.. take these requests' sampling state (next to temps and seeds, which prefill sets)."""
        stop = start + len(requests)
        dev = self.device
        self.top_ks[start:stop] = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=dev)
        self.top_ps[start:stop] = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=dev)
        self.min_ps[start:stop] = torch.tensor([r.min_p for r in requests], dtype=torch.float32, device=dev)
        self.min_until[start:stop] = torch.tensor([len(r.prompt_ids) + r.min_new_tokens for r in requests],
                                                  dtype=torch.long, device=dev)
        if self.banned is None and any(r.min_new_tokens > 0 for r in requests):
            self.banned = torch.zeros(self.max_batch, self.engine.vocab_size, dtype=torch.bool, device=dev)
        if self.banned is not None:
            self.banned[start:stop] = False
            for slot, r in enumerate(requests, start):
                stops = set(r.stop_token_ids) | ({self.engine.eos_token_id} if not r.ignore_eos and
                                                 self.engine.eos_token_id is not None else set())
                if r.min_new_tokens > 0 and stops:
                    self.banned[slot, sorted(stops)] = True

    def _choose(self, logits: torch.Tensor, rows: slice | torch.Tensor, positions: torch.Tensor, mode: Mode) -> torch.Tensor:
        """The target's token at every position of these slots' rows (a slice, or a device index), per `mode`."""

        def take(buf: torch.Tensor) -> torch.Tensor:
            return buf[rows] if isinstance(rows, slice) else buf.index_select(0, rows)

        if mode & Mode.BAN:
            assert self.banned is not None  # made by _set_sampling for the request that needs it
            logits = ban_tokens(logits, take(self.banned), take(self.min_until), positions)
        filters = Filters(take(self.top_ks), take(self.top_ps), take(self.min_ps)) if mode & Mode.FILTERED else None
        return choose_tokens_no_sync(logits, take(self.temps), take(self.seeds), positions, bool(mode & Mode.SAMPLED),
                                     filters)
