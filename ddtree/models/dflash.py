"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` layout) and its windowed context cache.

Every drafter layer attends, from the block [bonus, MASK, ...], to keys/values built from
(a) the fused target context hidden_norm(fc(concat(taps))) and (b) the block itself; the block
is bidirectional and sees every stored context position. Embedding and output head are the
target's (shared, frozen). The context K/V (projected, k-normed, rotated at their own absolute
positions) live in a `DraftContext` ring buffer holding the last `window` positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ddtree.errors import ConfigError, ModelLoadError
from ddtree.kernels.accepted import ring_slots_reference
from ddtree.kernels.fused_linear import fused_linear
from ddtree.kernels.tree_attention import tree_attention
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.layers import GQAProjections, RMSNorm, Rotary, SwiGLU, attend
from ddtree.models.target import ATTENTION_CHOICES, AttentionPath, Target, init_weights_, rotary_positions


class DraftAttention(GQAProjections):
    """Qwen3-style attention with q/k norms always on (z-lab's drafters have them).

    `qkv` serves the block (q, k, v from the same input); `key_value` the fused target context, which
    needs no query. After `fuse_projections` both are one GEMM (key_value uses the k/v rows of it).
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.rms_norm_eps, cfg.attention_bias, qk_norm=True)
        self.q_norm: RMSNorm
        self.k_norm: RMSNorm


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused q/k/v and gate/up weights `fused_linear` runs on, or None (not fused, or a bias to add)."""
        attn, mlp = self.self_attn, self.mlp
        if attn.qkv_proj is None or not attn.qkv_proj.live or mlp.gate_up is None or not mlp.gate_up.live:
            return None
        if any(lin.bias is not None for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                 mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return None
        return attn.qkv_proj.weight, mlp.gate_up.weight

    def forward_fused(self, x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                      sin: torch.Tensor, attend_block: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      ) -> torch.Tensor:
        """The layer in four `fused_linear` launches (norm -> q/k/v, o_proj + x, norm -> SwiGLU, down + x)
        around the attention; the block's numbers differ from the module ops by summation order (and, for
        float32 on a GPU, TF32 rounding)."""
        qkv_w, gate_up_w = weights
        attn, mlp = self.self_attn, self.mlp
        q, kb, vb = attn.qkv_from(fused_linear(x, qkv_w, self.input_layernorm.weight, self.input_layernorm.eps), cos, sin)
        x = fused_linear(attn.merge_heads(attend_block(q, kb, vb)), attn.o_proj.weight, residual=x)
        h = fused_linear(x, gate_up_w, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                         swiglu=True)
        return fused_linear(h, mlp.down_proj.weight, residual=x)


class DraftContext:
    """Per-layer context K/V of the drafter: a ring buffer of the last `capacity` positions per row.

    k/v: [layers, bs, kv_heads, capacity + 1, head_dim]; the extra last slot is a write sink for
    rows that are padding or already pushed out of the window, so every write is one vectorised
    index_put with no duplicate live slots. Position p of a row (its p-th appended context row)
    lives at slot p % capacity. Order inside the ring does not matter: the block attends to all
    stored slots without a causal order.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window: int | None, capacity: int) -> None:
        self.k, self.v = k, v
        self.window = window
        self.capacity = capacity
        self.total = torch.zeros(k.shape[1], dtype=torch.long, device=k.device)  # [bs] rows appended so far

    @property
    def stored(self) -> torch.Tensor:
        """[bs] how many context positions each row holds (min(total, capacity))."""
        return self.total.clamp(max=self.capacity)

    def rows(self, start: int, stop: int) -> DraftContext:
        """A view of batch rows [start, stop): shares storage, so appends land here."""
        view = object.__new__(DraftContext)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.total = self.total[start:stop]
        view.window, view.capacity = self.window, self.capacity
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy batch row src into row dst (keeps a batch's live rows packed)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.total[dst] = self.total[src]

    def reset(self, rows: torch.Tensor) -> None:
        """Forget the context of rows[bs] bool (a batch slot handed to a new request)."""
        self.total.masked_fill_(rows.to(self.total.device), 0)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: Target) -> None:
        super().__init__()
        check_fit(config, target.config)
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the drafter runs at the target's positions
        self.rotary = Rotary(config.head_dim, config.rope_theta, rotary_positions(target.config.max_position_embeddings))
        self._block_bits: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # forward's all-ones bitmasks
        # the target is shared, not owned: keep it out of parameters(), state_dict() and .to()
        object.__setattr__(self, "target", target)

    target: Target

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def fuse_projections(self) -> None:
        """Inference: one GEMM for each layer's q/k/v and one for gate/up (see layers.FusedLinear).

        Parameters, their names and training are unchanged; call again after replacing weights.
        """
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    @property
    def tap_layers(self) -> list[int]:
        return list(self.config.target_layer_ids)

    # -- context -----------------------------------------------------------------------------
    def new_context(self, batch: int, window: int | None, max_len: int) -> DraftContext:
        """An empty context for `batch` rows keeping the last `window` positions (None: up to max_len)."""
        if window is not None and window < 1:
            raise ConfigError(f"draft_window: must be >= 1 or None, got {window}")
        if max_len < 1:
            raise ConfigError(f"max_len: must be >= 1, got {max_len}")
        cap = max_len if window is None else min(window, max_len)
        c = self.config
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, cap + 1, c.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return DraftContext(k, torch.zeros_like(k), window, cap)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps[..., T*D] -> fused context hidden_norm(fc(taps)) [..., D]."""
        return self.hidden_norm(self.fc(taps.to(self.dtype)))

    def append_context(
        self, ctx: DraftContext, taps: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Add taps[bs, m, T*D] at positions[bs, m]; only the first counts[b] rows of row b are real.

        Vectorised, no host sync. If counts[b] exceeds the capacity, only its last `capacity`
        rows are kept (the earlier ones would be overwritten anyway). slots[bs, m]: the ring slots, when the
        caller already has them (`ring_slots_reference` of these counts; gather_accepted computes them).
        """
        counts = counts.to(device=ctx.k.device, dtype=torch.long)
        if slots is None:
            slots = ring_slots_reference(counts, ctx.total, ctx.capacity, taps.shape[1])  # [bs, m]
        cos, sin = self.rotary(positions, self.dtype)
        weights = [layer.fused_weights() for layer in self.layers]
        if all(w is not None for w in weights):
            # hidden_norm folds into each layer's k/v GEMM: fc, then one fused_linear per layer (a decode round
            # appends a few rows, where launches dominate; on the CPU, and for a prefill's many rows, it is
            # exactly the ops below)
            projected = self.fc(taps.to(self.dtype))
            norm = self.hidden_norm
            for i, (layer, w) in enumerate(zip(self.layers, weights)):
                assert w is not None
                attn = layer.self_attn
                kv = fused_linear(projected, w[0][attn.n_heads * attn.head_dim:], norm.weight, norm.eps)
                attn.write_kv(*kv.chunk(2, dim=-1), cos, sin, ctx.k[i], ctx.v[i], slots)
        else:
            fused = self.fuse(taps)  # [bs, m, D]
            for i, layer in enumerate(self.layers):
                layer.self_attn.key_value_into(fused, cos, sin, ctx.k[i], ctx.v[i], slots)
        ctx.total += counts

    # -- drafting ----------------------------------------------------------------------------
    def forward(
        self, ctx: DraftContext, block_ids: torch.Tensor, start: torch.Tensor, ctx_len_hint: int | None = None,
        attention: AttentionPath = "sdpa",
    ) -> torch.Tensor:
        """block_ids[bs, block] = [bonus, MASK...] at positions start[b].. -> logits[bs, block-1, V] float32.

        ctx_len_hint: optional python int >= max stored context, to bound the "sdpa" attention
        (default: exact on the CPU, the full capacity on an accelerator). attention "triton" / "reference":
        ddtree.kernels.tree_attention reads each row's stored context slots in place (the count is read on
        the device) and the block as a fully visible tree: no mask, no copy of the window, static shapes.
        """
        bs, block = block_ids.shape
        if block < 2:
            raise ConfigError(f"block_size: must be >= 2 (bonus + at least one draft position), got {block}")
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_CHOICES}")
        device = block_ids.device
        stored = ctx.stored  # [bs]
        mask = bitmask = None
        n_ctx = 0
        if attention == "sdpa":
            if ctx_len_hint is not None:
                n_ctx = min(ctx_len_hint, ctx.capacity)
            elif stored.device.type == "cpu":
                n_ctx = int(stored.max())
            else:
                n_ctx = ctx.capacity
            ctx_ok = torch.arange(n_ctx, device=device)[None, :] < stored[:, None]  # [bs, S]
            mask = torch.cat(
                [ctx_ok[:, None, :].expand(bs, block, n_ctx),
                 torch.ones(bs, block, block, dtype=torch.bool, device=device)],
                dim=-1,
            )[:, None]  # [bs, 1, block, S + block]
        else:
            # every block token sees the whole block: all `block` bits set in each row's word (a constant)
            key = (bs, block, device)
            if key not in self._block_bits:
                self._block_bits[key] = torch.full((bs, block), (1 << block) - 1, dtype=torch.long, device=device)
            bitmask = self._block_bits[key]
        positions = start.to(device)[:, None] + torch.arange(block, device=device)[None, :]  # [bs, block]
        cos, sin = self.rotary(positions, self.dtype)
        x = self.target.embed(block_ids).to(self.dtype)  # [bs, block, D]

        def attend_block(i: int, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
            if bitmask is None:
                k = torch.cat([ctx.k[i, :, :, :n_ctx], kb], dim=2)
                v = torch.cat([ctx.v[i, :, :, :n_ctx], vb], dim=2)
                return attend(q, k, v, mask)
            # slots < stored hold context (ring order does not matter: no causal order)
            # TF32 on the kernel path: the drafter's numbers steer proposals, never acceptance
            return tree_attention(q, ctx.k[i], ctx.v[i], stored, kb, vb, bitmask, q.shape[-1] ** -0.5,
                                  backend="triton" if attention == "triton" else "reference",
                                  out=self.layers[i].self_attn.out_buffer(q), tf32=True)

        # the kernel path on a GPU: each layer in four fused_linear launches around its attention (a drafting
        # step is a few rows through small layers, so launches, not arithmetic, set its time)
        fused = [layer.fused_weights() for layer in self.layers] if attention == "triton" else []
        if fused and all(w is not None for w in fused) and self.target.dtype == self.dtype:
            for i, (layer, weights) in enumerate(zip(self.layers, fused)):
                assert weights is not None
                x = layer.forward_fused(x, weights, cos, sin, functools.partial(attend_block, i))
            return fused_linear(x[:, 1:], self.target.lm_head_weight, self.norm.weight, self.norm.eps).float()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, kb, vb = attn.qkv(layer.input_layernorm(x), cos, sin)
            x = x + attn.out(attend_block(i, q, kb, vb))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.target.lm_head(self.norm(x[:, 1:]).to(self.target.dtype))

    def forward_train(
        self,
        taps: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        block_size: int,
        window: int | None,
    ) -> torch.Tensor:
        """taps[bs, T, T*D], input_ids[bs, T], anchors[bs, A] -> logits[bs, A, block_size-1, V] float32.

        The block at anchor a is [input_ids[a], MASK...] at positions a..a+block_size-1; it sees
        context positions max(0, a - window) <= p < a and itself (bidirectionally), never another
        block. One attention over all blocks with a mask.
        """
        if block_size < 2:
            raise ConfigError(f"block_size: must be >= 2, got {block_size}")
        bs, n = input_ids.shape
        n_anchor = anchors.shape[1]
        device = input_ids.device
        fused = self.fuse(taps)  # [bs, T, D]
        ctx_pos = torch.arange(n, device=device)[None, :].expand(bs, n)
        ctx_cos, ctx_sin = self.rotary(ctx_pos, self.dtype)

        offs = torch.arange(block_size, device=device)
        ids = torch.full((bs, n_anchor, block_size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
        blk_pos = (anchors[:, :, None] + offs).reshape(bs, n_anchor * block_size)  # [bs, A*blk]
        cos, sin = self.rotary(blk_pos, self.dtype)

        p = torch.arange(n, device=device)[None, None, :]  # [1, 1, T]
        a = anchors[:, :, None]  # [bs, A, 1]
        see_ctx = p < a
        if window is not None:
            see_ctx &= p >= a - window
        see_ctx = see_ctx[:, :, None, :].expand(bs, n_anchor, block_size, n).reshape(bs, n_anchor * block_size, n)
        blk_id = torch.arange(n_anchor * block_size, device=device) // block_size
        see_blk = (blk_id[:, None] == blk_id[None, :])[None].expand(bs, -1, -1)
        mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [bs, 1, A*blk, T + A*blk]

        x = self.target.embed(ids.reshape(bs, -1)).to(self.dtype)  # [bs, A*blk, D]
        for layer in self.layers:
            attn = layer.self_attn
            kc, vc = attn.key_value(fused, ctx_cos, ctx_sin)
            q, kb, vb = attn.qkv(layer.input_layernorm(x), cos, sin)
            o = attend(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask)
            x = x + attn.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = x.view(bs, n_anchor, block_size, -1)[:, :, 1:]
        return self.target.lm_head(self.norm(x).to(self.target.dtype))


def check_fit(cfg: DrafterConfig, target: TargetConfig, where: str = "drafter") -> None:
    """Raise ModelLoadError unless the drafter can run on this target (before any tensor is read)."""
    if cfg.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"{where}: hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size} "
            "(the drafter shares the target's embedding and lm_head)"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{where}: vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    n = target.num_hidden_layers
    for t in cfg.target_layer_ids:
        if not 0 <= t < n:
            raise ModelLoadError(
                f"{where}: dflash_config.target_layer_ids contains {t}, outside the target's layers [0, {n - 1}]"
            )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ModelLoadError(
            f"{where}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the vocabulary [0, {target.vocab_size - 1}]"
        )


def init_drafter(config: DrafterConfig, target: Target, seed: int | None = None) -> DFlashDrafter:
    """A randomly initialised drafter, built on the target's device in the target's dtype."""
    gen = torch.Generator(device=target.device).manual_seed(seed) if seed is not None else None
    with torch.device(target.device):
        model = DFlashDrafter(config, target)
    init_weights_(model, gen)
    return model.to(dtype=target.dtype)
