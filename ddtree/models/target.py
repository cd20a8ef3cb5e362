"""The target decoder (Qwen3 / Llama family) over a compactable KV cache; no decoding policy.

One `forward` serves prefill (q = prompt length, rows right-padded), one-token decode (q = 1)
and tree verify (q = n + 1 with an ancestor-or-self `tree_mask`). Attention runs one of two ways:
"sdpa" builds a dense mask over the first kv_len slots on the device (any q; kv_len is a host
bound), while "triton" / "reference" call ddtree.kernels.tree_attention, which reads each row's
prefix up to cache.lengths on the device with the tree's packed ancestor bitmask (q <= 256): no
host-known bound at all, so the forward has static shapes and can be captured in a CUDA graph.
Taps follow the z-lab convention (tap k = output of decoder layer k = HF hidden_states[k + 1]).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.bitmask import causal_bitmask, pack_mask
from ddtree.kernels.residual_norm import add_rms_norm
from ddtree.kernels.tree_attention import MAX_TREE_NODES, tree_attention
from ddtree.models.configs import TargetConfig
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import FoldedNorm, GQAProjections, RMSNorm, Rotary, SwiGLU, attend, linear, skinny_route

# On the skinny route, whether each layer's norms and residual adds run inside its GEMMs (four launches a
# layer). Off by default: on the H200 the in-GEMM norm cost more than the two add + norm launches it saves
# (docs/perf.md, "Findings that explain the code").
NORMS_IN_SKINNY_GEMMS = False


def rotary_positions(max_position_embeddings: int) -> int:
    """Positions a model's RoPE table covers: the longest context, then a verify window and a draft block
    (tree nodes sit past the committed tokens)."""
    return max_position_embeddings + 2 * MAX_TREE_NODES


class Attention(GQAProjections):
    """`qkv` (inherited) projects, q/k-norms (Qwen3) and rotates through ddtree.kernels.norm_rope."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.rms_norm_eps, cfg.attention_bias, qk_norm=cfg.qk_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """Holds the HF `model.*` weights under their HF names."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def build_kv_mask(
    lengths: torch.Tensor, n_q: int, kv_len: int, tree_mask: torch.Tensor | None
) -> torch.Tensor:
    """Who sees what in a cached forward: mask[bs, 1, q, kv_len] bool, built on the device.

    Query j of row b sees cache slots < lengths[b] and new slot lengths[b] + k when
    tree_mask[b, j, k] (causal k <= j when tree_mask is None).
    """
    device = lengths.device
    slots = torch.arange(kv_len, device=device)[None, :]  # [1, S]
    rel = slots - lengths[:, None]  # [bs, S]: index among the new tokens (negative = past)
    past = rel < 0  # [bs, S]
    is_new = (rel >= 0) & (rel < n_q)  # [bs, S]
    if tree_mask is None:
        j = torch.arange(n_q, device=device)[None, :, None]  # [1, q, 1]
        allowed = rel[:, None, :] <= j  # [bs, q, S]
    else:
        idx = rel.clamp(0, n_q - 1)[:, None, :].expand(-1, n_q, -1)  # [bs, q, S]
        allowed = torch.gather(tree_mask.to(torch.bool), 2, idx)
    mask = past[:, None, :] | (is_new[:, None, :] & allowed)  # [bs, q, S]
    return mask[:, None]


AttentionPath = Literal["sdpa", "triton", "reference"]
ATTENTION_CHOICES: tuple[str, ...] = ("sdpa", "triton", "reference")


def verify_bitmask(bs: int, n_q: int, tree_mask: torch.Tensor | None, tree_bitmask: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor:
    """The packed ancestor-or-self words for a kernel forward: given, packed from tree_mask, or causal."""
    if tree_bitmask is not None:
        return tree_bitmask
    if tree_mask is not None:
        return pack_mask(tree_mask.to(torch.bool))
    causal = causal_bitmask(n_q, device)
    return causal.expand(bs, *causal.shape)


class Target(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta, rotary_positions(config.max_position_embeddings))
        self.norms_folded = False  # see fold_norms
        # folded: the layers' norm weight off the skinny route (ones); a buffer, so .to() moves it; not saved
        self.register_buffer("_unit_norm", None, persistent=False)

    # -- shared with the drafter -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def fuse_projections(self) -> None:
        """Inference: one GEMM for each layer's q/k/v and one for gate/up (see layers.FusedLinear).

        Parameters, their HF names and training are unchanged; call again after replacing weights.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def fold_norms(self, keep: bool = False) -> list[torch.Tensor]:
        """Inference: multiply each layer's input and post-attention norm weights into the columns of the fused
        q/k/v and gate/up weights they feed. For rows on the skinny kernel's route (layers.skinny_route) a layer
        is then four GEMMs with no norm or add kernel between them: o_proj and down add the residual and return
        the new rows' sums of squares (their column blocks' parts), and q/k/v and gate/up scale their sums by
        each row's 1 / rms (layers.FoldedNorm). More rows run the unfolded model's add + norm kernels with a
        weight of ones (the weight is in the GEMM after them): the same launches as unfolded. In 16 bits W * g
        is rounded once, so outputs can differ from the unfolded model's by that rounding.

        keep: return copies of the weights as they were, for unfold_norms (a bench switching variants).
        """
        if self.norms_folded:
            raise RuntimeError("fold_norms: the norms are folded already")
        self.fuse_projections()
        pairs = self._folded_pairs()
        kept = [w.detach().clone() for w, _ in pairs] if keep else []
        with torch.no_grad():
            for weight, norm in pairs:
                weight.mul_(norm.to(weight.dtype))  # [N, K] * [K]: column k scaled by the norm's weight k
        self._unit_norm = torch.ones_like(self.model.norm.weight)
        self.norms_folded = True
        return kept

    def unfold_norms(self, kept: list[torch.Tensor]) -> None:
        """The weights fold_norms(keep=True) returned, put back bit for bit."""
        if not self.norms_folded:
            raise RuntimeError("unfold_norms: the norms are not folded")
        weights = [w for w, _ in self._folded_pairs()]
        if len(kept) != len(weights):
            raise ValueError(f"unfold_norms: {len(kept)} weights for {len(weights)} (pass what fold_norms(keep=True) returned)")
        with torch.no_grad():
            for weight, original in zip(weights, kept, strict=True):
                weight.copy_(original)
        self.norms_folded = False
        self._unit_norm = None

    def fold_refusal(self) -> str | None:
        """Why fold_norms would refuse this target (None: it would not)."""
        try:
            self._folded_pairs()
        except ValueError as err:
            return str(err)
        return None

    def _folded_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fused weight, the norm weight folded into its columns) for each layer's q/k/v and gate/up."""
        pairs = []
        for i, layer in enumerate(self.model.layers):
            qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up
            if qkv is None or gate_up is None or qkv.bias is not None or gate_up.bias is not None:
                raise ValueError(f"fold_norms: layer {i} needs fused, bias-free q/k/v and gate/up projections")
            pairs += [(qkv.weight, layer.input_layernorm.weight), (gate_up.weight, layer.post_attention_layernorm.weight)]
        return pairs

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: the output head's weight (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.head is None else self.head.weight

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden[..., D] (already normed) -> logits[..., V] float32."""
        return linear(hidden, self.lm_head_weight).float()

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device)

    def _check_taps(self, tap_layers: list[int] | None) -> None:
        n = self.config.num_hidden_layers
        for t in tap_layers or []:
            if not 0 <= t < n:
                raise ValueError(f"tap_layers: layer {t} is out of range [0, {n - 1}]")

    def _collect(self, taps: dict[int, torch.Tensor], tap_layers: list[int] | None) -> torch.Tensor | None:
        return torch.cat([taps[t] for t in tap_layers], dim=-1) if tap_layers else None

    # -- inference ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,
        tap_layers: list[int] | None = None,
        kv_len_hint: int | None = None,
        logit_positions: torch.Tensor | None = None,
        attention: AttentionPath = "sdpa",
        tree_bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids/position_ids[bs, q], tree_mask[bs, q, q] bool -> (logits[bs, q, V] f32, taps[bs, q, T*D]).

        Writes K/V at slots lengths[b] + j, never advances lengths. kv_len_hint: a python int
        >= max(lengths) + q that bounds the "sdpa" attention to the slots in use (default: the exact
        bound when lengths is on the CPU, else max_len); the kernel paths ignore it. logit_positions[bs, k]
        long: only return logits at those query indices ([bs, k, V]), e.g. the last real token of a prefill.
        attention: "sdpa", or a tree_attention backend ("triton" / "reference", q <= 256 tokens), which
        takes tree_bitmask (packed words, see ddtree.kernels.bitmask) or packs tree_mask (None: causal).
        """
        bs, n_q = input_ids.shape
        self._check_taps(tap_layers)
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_CHOICES}")
        if attention != "sdpa" and n_q > MAX_TREE_NODES:
            raise ValueError(f"attention: {attention!r} verifies at most {MAX_TREE_NODES} tokens per row, got {n_q}")
        cache.check_room(n_q, kv_len_hint)
        mask = bitmask = None
        kv_len = cache.max_len
        if attention == "sdpa":
            if kv_len_hint is not None:
                kv_len = kv_len_hint
            elif cache.lengths.device.type == "cpu":
                kv_len = int(cache.lengths.max()) + n_q  # free on the CPU: no device to sync with
            mask = build_kv_mask(cache.lengths, n_q, kv_len, tree_mask)  # [bs, 1, q, S]
        else:
            bitmask = verify_bitmask(bs, n_q, tree_mask, tree_bitmask, input_ids.device)
        backend: Literal["triton", "reference"] = "triton" if attention == "triton" else "reference"
        cos, sin = self.rotary(position_ids, self.dtype)
        x = self.embed(input_ids)  # [bs, q, D]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(tap_layers or [])
        slots = cache.write_slots(n_q)
        layers = self.model.layers
        if self.norms_folded and skinny_route(x, layers[0].self_attn.qkv_proj.weight):
            # each norm's weight is in the GEMM after it (fold_norms): each residual add returns the new rows' sums
            # of squares, and the next GEMM scales by their 1 / rms
            sums = x.float().square().sum(-1).reshape(1, -1)
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                folded = FoldedNorm(sums, layer.input_layernorm.eps)
                q = attn.qkv_into(x, cos, sin, cache.k[i], cache.v[i], slots, norm=folded)
                o = self._attend(i, attn, q, cache, kv_len, mask, bitmask, backend)
                x, sums = attn.out(o, residual=x, return_sums=True)
                folded = FoldedNorm(sums, layer.post_attention_layernorm.eps)
                x, sums = layer.mlp(x, norm=folded, residual=x, return_sums=True)
                if i in wanted:
                    taps[i] = x
            x, h = add_rms_norm(x, None, self.model.norm.weight, self.model.norm.eps)
            return self._finish(x, taps, tap_layers, logit_positions, normed=h)
        if self._skinny_layers(x):
            # few rows at real width: each norm is its GEMM's prologue and each residual add its GEMM's
            # epilogue (ddtree.kernels.skinny_gemm), four GEMM launches a layer and no separate add + norm
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                q = attn.qkv_into(x, cos, sin, cache.k[i], cache.v[i], slots, norm=layer.input_layernorm)
                o = self._attend(i, attn, q, cache, kv_len, mask, bitmask, backend)
                x = attn.out(o, residual=x)
                x = layer.mlp(x, norm=layer.post_attention_layernorm, residual=x)
                if i in wanted:
                    taps[i] = x
            if self.config.num_hidden_layers - 1 not in wanted:  # the final norm rides in the head's GEMM too
                if logit_positions is not None:
                    x = torch.gather(x, 1, logit_positions[:, :, None].expand(-1, -1, x.shape[-1]))
                logits = linear(x, self.lm_head_weight, norm=self.model.norm).float()
                return logits, self._collect(taps, tap_layers)
            x, h = add_rms_norm(x, None, self.model.norm.weight, self.model.norm.eps)
            return self._finish(x, taps, tap_layers, logit_positions, normed=h)
        # each residual add runs with the norm after it (one launch on CUDA: ddtree.kernels.residual_norm);
        # h is the normed input of what comes next, ending with the final norm. Folded, the layers' norms
        # scale by ones: their weights are in the q/k/v and gate/up GEMMs after them
        norms = [layer.input_layernorm for layer in layers] + [self.model.norm]
        unit = self._unit_norm

        def weight(norm: RMSNorm) -> torch.Tensor:  # the final norm is not folded
            return norm.weight if unit is None or norm is self.model.norm else unit

        x, h = add_rms_norm(x, None, weight(norms[0]), norms[0].eps)
        for i, layer in enumerate(layers):
            q = layer.self_attn.qkv_into(h, cos, sin, cache.k[i], cache.v[i], slots)  # K/V land in the cache
            o = self._attend(i, layer.self_attn, q, cache, kv_len, mask, bitmask, backend)
            post = layer.post_attention_layernorm
            x, h = add_rms_norm(x, layer.self_attn.out(o), weight(post), post.eps)
            x, h = add_rms_norm(x, layer.mlp(h), weight(norms[i + 1]), norms[i + 1].eps)
            if i in wanted:
                taps[i] = x
        return self._finish(x, taps, tap_layers, logit_positions, normed=h)

    def _skinny_layers(self, x: torch.Tensor) -> bool:
        """Whether the layers' projections take the skinny kernel for x's rows (then norms and residual adds ride
        in its GEMMs): fused, bias-free projections on the few-row route (layers.skinny_route), as the first
        layer's are. A layer whose weights were replaced since runs the same norm and add as torch ops."""
        if not NORMS_IN_SKINNY_GEMMS:
            return False
        first = self.model.layers[0]
        qkv, gate_up = first.self_attn.qkv_proj, first.mlp.gate_up
        if qkv is None or gate_up is None or not skinny_route(x, qkv.weight):  # off (the default): one look
            return False
        return qkv.bias is None and gate_up.bias is None and qkv.live and gate_up.live

    @staticmethod
    def _attend(i: int, attn: Attention, q: torch.Tensor, cache: KVCache, kv_len: int, mask: torch.Tensor | None,
                bitmask: torch.Tensor | None, backend: Literal["triton", "reference"]) -> torch.Tensor:
        """Layer i's attention of q over its cache, the new rows already written at lengths[b] + j."""
        if bitmask is None:
            k_all, v_all = cache.view(i, kv_len)
            return attend(q, k_all, v_all, mask)
        k_all, v_all = cache.view(i, cache.max_len)
        return tree_attention(q, k_all, v_all, cache.lengths, None, None, bitmask, q.shape[-1] ** -0.5,
                              backend=backend, out=attn.out_buffer(q))

    def _finish(
        self,
        x: torch.Tensor,
        taps: dict[int, torch.Tensor],
        tap_layers: list[int] | None,
        logit_positions: torch.Tensor | None,
        normed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """normed: model.norm(x) when the caller has it already."""
        normed = self.model.norm(x) if normed is None else normed
        last = self.config.num_hidden_layers - 1
        if last in taps:
            # HF's hidden_states[-1] is taken after the final norm; keep the z-lab convention exact
            taps[last] = normed
        if logit_positions is not None:
            idx = logit_positions[:, :, None].expand(-1, -1, normed.shape[-1])
            normed = torch.gather(normed, 1, idx)
        return self.lm_head(normed), self._collect(taps, tap_layers)

    # -- training ----------------------------------------------------------------------------
    def forward_train(
        self, input_ids: torch.Tensor, tap_layers: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids[bs, T] -> (logits[bs, T, V] f32, taps[bs, T, len(tap_layers)*D]); causal, no cache."""
        if self.norms_folded:
            raise RuntimeError("forward_train: the norms are folded into the projections (an inference state)")
        bs, n = input_ids.shape
        self._check_taps(tap_layers)
        positions = torch.arange(n, device=input_ids.device)[None, :].expand(bs, n)
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed(input_ids)
        taps: dict[int, torch.Tensor] = {}
        wanted = set(tap_layers or [])
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            rep = attn.n_heads // attn.n_kv
            o = F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True
            )
            x = x + attn.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in wanted:
                taps[i] = x
        return self._finish(x, taps, tap_layers, None)


def init_target(config: TargetConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = None) -> Target:
    """A randomly initialised target (normal(0, 0.02) weights, unit norms, zero biases), built on `device`.

    The same seed gives the same weights on the same device type (the generator lives on the device).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    with torch.device(device):
        model = Target(config)
    init_weights_(model, gen)
    return model.to(dtype=dtype)


@torch.no_grad()
def init_weights_(model: nn.Module, gen: torch.Generator | None) -> None:
    """normal(0, 0.02) for matrices and embeddings, 1 for norms, 0 for biases (in place)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
