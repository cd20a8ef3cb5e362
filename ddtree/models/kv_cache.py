"""The target's preallocated, compactable KV cache (per-row lengths, no decoding policy).

Buffers are [layers, bs, kv_heads, max_len, head_dim] so shapes stay static. A forward writes its
q new rows at slots lengths[b] + j (`write_slots`) without advancing; the caller then either `advance`s (plain
decode/prefill: the real count per row) or `compact`s (tree verify: move the accepted nodes to
the front of the written window). Nothing here syncs with the host.

Bounds: writing past max_len cannot be checked on an accelerator without a sync, so the engine
keeps the row lengths on the host and must not forward more than `max_len - lengths[b]` tokens.
When `lengths` lives on the CPU, `check_room` checks it for real (cheap, no device sync).
"""

from __future__ import annotations

import torch

from ddtree.errors import RequestError
from ddtree.kernels.kv_compact import compact_kv


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache: batch ({batch}) and max_len ({max_len}) must be >= 1")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [bs]
        self.max_len = max_len
        self.batch = batch

    @property
    def device(self) -> torch.device:
        return self.k.device

    def check_room(self, n_new: int, kv_len_hint: int | None = None) -> None:
        """Raise before a forward that would write beyond max_len, where that is checkable without a sync."""
        if kv_len_hint is not None and kv_len_hint > self.max_len:
            raise RequestError(
                f"kv_len_hint {kv_len_hint} exceeds the KV cache's max_len {self.max_len}", field="max_len"
            )
        if self.lengths.device.type == "cpu":
            need = int(self.lengths.max()) + n_new
            if kv_len_hint is not None and kv_len_hint < need:
                raise RequestError(
                    f"kv_len_hint {kv_len_hint} is below the longest row + new tokens ({need})", field="kv_len_hint"
                )
            if need > self.max_len:
                raise RequestError(
                    f"KV cache overflow: writing {n_new} tokens after a row of length "
                    f"{need - n_new} needs {need} slots; max_len is {self.max_len}",
                    field="max_len",
                )

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of batch rows [start, stop): shares storage, so writes and length updates land here."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop]
        view.max_len, view.batch = self.max_len, stop - start
        return view

    def window(self, max_len: int) -> KVCache:
        """A view of the first max_len slots of every row (shares storage and lengths)."""
        if not 1 <= max_len <= self.max_len:
            raise ValueError(f"KVCache.window: max_len must be in [1, {self.max_len}], got {max_len}")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, :, :, :max_len], self.v[:, :, :, :max_len]
        view.lengths = self.lengths
        view.max_len, view.batch = max_len, self.batch
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy batch row src into row dst, K/V and length (keeps a batch's live rows packed)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.lengths[dst] = self.lengths[src]

    def write_slots(self, n_q: int) -> torch.Tensor:
        """slots[bs, q] where a forward's q new tokens go: lengths[b] + j (computed once per forward and
        shared by its layers, which write their K/V there: see GQAProjections.qkv_into)."""
        return self.lengths[:, None] + torch.arange(n_q, device=self.device)

    def view(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first kv_len slots of one layer: k, v [bs, kv, kv_len, d] (views, no copy)."""
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def advance(self, n: torch.Tensor) -> None:
        """lengths += n[bs] (the real number of tokens each row committed)."""
        self.lengths += n.to(self.lengths)

    def compact(self, src: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep accepted tree nodes: slot lengths[b]+src[b,j] -> lengths[b]+j for j < counts[b]; lengths += counts.

        src[bs, m] long, counts[bs] long. All layers, K and V at once (ddtree.kernels.compact_kv: the
        Triton kernel on CUDA, which skips identity moves, else a torch gather then scatter); overlapping
        source and destination slots never alias. Entries with j >= counts[b] are no-op moves.
        """
        compact_kv(self.k, self.v, self.lengths, src, counts.to(self.lengths))  # Triton on CUDA, else torch
        self.lengths += counts.to(self.lengths)

    def reset(self, rows: torch.Tensor) -> None:
        """Set lengths to 0 for rows[bs] bool (a batch slot handed to a new request)."""
        self.lengths.masked_fill_(rows.to(self.device), 0)
