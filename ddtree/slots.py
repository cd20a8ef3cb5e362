"""A decode batch's slots on the device: the target's KV cache, the drafter's context, each slot's bonus token and
sampling state, one row a slot.

Rows are kept packed at the front (a finished request's slot is refilled by moving the last row into it), so
every forward runs on a contiguous view of the caches; a free slot is empty (length 0), so a graphed round may
compute on it as padding.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree.config import SpecConfig
from ddtree.models.dflash import DraftContext
from ddtree.models.kv_cache import KVCache
from ddtree.slot_sampling import SlotSampling


class Slots:
    """The per-slot device state of a batch of `max_batch` slots, `cache_len` positions each."""

    def __init__(self, engine: Any, spec: SpecConfig, max_batch: int, cache_len: int) -> None:
        """engine: ddtree.decode.BatchEngine (its target, drafter, mask token, vocabulary, EOS, device)."""
        self.device: torch.device = engine.device
        self.cache: KVCache = engine.target.new_cache(max_batch, cache_len)
        self.ctx: DraftContext | None = None
        if spec.speculative:
            self.ctx = engine.drafter.new_context(max_batch, spec.draft_window, cache_len)
            assert engine.mask_token_id is not None  # check_spec: speculation has a drafter
            # the MASK positions of every draft block (a constant: the block is the bonus, then these)
            self.masks = torch.full((max_batch, spec.block_size - 1), engine.mask_token_id, dtype=torch.long,
                                    device=self.device)
        # the first m rows of the cache and the context, by m (views: a round reuses them, not rebuilds them)
        self._views: dict[int, tuple[KVCache, DraftContext | None]] = {}
        self.bonus = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # the next round's first token
        self.sampling = SlotSampling(max_batch, engine.vocab_size, engine.eos_token_id, self.device)

    def first_rows(self, m: int) -> tuple[KVCache, DraftContext | None]:
        """Views of the cache's and the context's first m rows (made once per m: each is a few slicing ops)."""
        if m not in self._views:
            self._views[m] = (self.cache.rows(0, m), None if self.ctx is None else self.ctx.rows(0, m))
        return self._views[m]

    def move_row(self, src: int, dst: int) -> None:
        """Slot `src`'s row into slot `dst` (its KV, context, bonus and sampling state)."""
        self.cache.move_row(src, dst)
        if self.ctx is not None:
            self.ctx.move_row(src, dst)
        for buf in (self.bonus, *self.sampling.buffers()):
            buf[dst] = buf[src]

    def empty(self, slot: int) -> None:
        """A free slot is empty (a graphed round may compute on it as padding)."""
        self.cache.lengths[slot] = 0
        if self.ctx is not None:
            self.ctx.total[slot] = 0

    def clear_padding(self, n: int, m: int) -> None:
        """Free slots n..m that a graphed round computed on go back to empty (no sync: two fills)."""
        if m > n:
            self.cache.lengths[n:m].zero_()
            if self.ctx is not None:
                self.ctx.total[n:m].zero_()

    def round_state(self) -> list[torch.Tensor]:
        """What a round mutates in place (restored after a capture's warm-up run). The target's K/V is only
        written past each row's committed length, which a restored length makes unused again."""
        state = [self.cache.lengths, self.bonus]
        if self.ctx is not None:
            state += [self.ctx.total, self.ctx.k, self.ctx.v]
        return state
