"""The engine: a target (and optionally a DFlash drafter) ready to decode with AR, DFLASH or DDTREE.

`Engine` loads the models, picks the verify attention and whether rounds run as CUDA graphs, measures
budget auto's cost model once, opens decode batches and runs `generate` over one. A batch is ddtree.decode
(DecodeBatch, the slots), its round ddtree.round (draft -> verify -> accept); the batch's parts sit beside them
(ddtree.slots, ddtree.prefill, ddtree.round_graphs, ddtree.round_costs). Token ids only, no text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ddtree.budget import VerifyCostModel, default_node_counts, default_row_counts, measure_verify_cost
from ddtree.config import SpecConfig
from ddtree.cuda_graphs import GraphCache, tree_sizes
from ddtree.decode import DecodeBatch
from ddtree.errors import ConfigError
from ddtree.kernels.tree_attention import triton_available
from ddtree.models import layers
from ddtree.prefill import PREFILL_TOKENS, prefill_chunks
from ddtree.request import GenerationResult, Request, StepOutput
from ddtree.round_costs import CALIBRATE_EVERY, CHOOSE_EVERY
from ddtree.round_graphs import STAGES, StageTimer

__all__ = [
    "ATTENTION_BACKENDS",
    "CALIBRATE_EVERY",
    "CHOOSE_EVERY",
    "POOLED_BATCHES",
    "STAGES",
    "DecodeBatch",
    "Engine",
    "GenerationResult",
    "Request",
    "StepOutput",
    "prefill_chunks",
    "resolve_attention",
]

COST_PROFILE_CONTEXT = 1024  # committed tokens the auto budget's cost model is measured on (at most)
COST_PROFILE_ROWS = 8  # rows measured at least, so batches up to 8 never re-measure (e.g. after a 1-row warm-up)
POOLED_BATCHES = 4  # graphed batches generate() keeps for reuse (each holds its KV cache and graphs)


def folding_pays(target) -> bool:
    """Whether Engine folds the target's norms by default: a 16-bit target on CUDA whose few-row GEMMs take
    the skinny kernel (real width), where an AR step or a verify then runs four GEMMs a layer and no add + norm
    kernel (H200, docs/perf.md "The engine at real width": a 1.02B AR step 5-8% faster, 8B 1%). Elsewhere it changes nothing but the
    rounding."""
    return (target.device.type == "cuda" and target.dtype in (torch.float16, torch.bfloat16)
            and triton_available() and layers.GEMV_MAX_ROWS > 0
            and target.config.hidden_size >= layers.SKINNY_MIN_K and target.fold_refusal() is None)


class Engine:
    """A target (and optionally a DFlash drafter) ready to decode with AR, DFLASH or DDTREE."""

    def __init__(self, target, drafter=None, attention: str = "auto", cuda_graphs: bool | None = None,
                 fold_norms: bool | None = None) -> None:
        """attention: "auto" (the Triton tree-attention kernel on CUDA when Triton is installed, else
        "sdpa"), "sdpa", "triton" or "reference" (the kernel's torch reference; tests). cuda_graphs: None
        = on wherever possible (CUDA with a kernel attention); graphs need static shapes, which only the
        kernel attention gives (it reads each row's prefix length on the device). fold_norms: multiply the
        target's layer norms into its GEMMs (Target.fold_norms); None = where the few-row GEMMs take the
        skinny kernel (folding_pays), the only place it pays."""
        self.target, self.drafter = target, drafter
        # one GEMM for q/k/v and one for gate/up per layer: small forwards are launch-bound on a GPU. On
        # the CPU the fused GEMM gave the same bits as the separate ones (fixture models, f32 and bf16;
        # tests/unit/test_layers.py checks it), so the CPU runs the same code path as the GPU
        target.fuse_projections()
        if drafter is not None:
            drafter.fuse_projections()
        self.device = next(target.parameters()).device
        if fold_norms is None:
            fold_norms = folding_pays(target)
        elif fold_norms and (why := target.fold_refusal()) is not None:
            raise ConfigError(f"fold_norms: {why}")
        if fold_norms and not target.norms_folded:
            target.fold_norms()
        self.norms_folded: bool = target.norms_folded
        self.attention = resolve_attention(attention, self.device)
        can_graph = self.device.type == "cuda" and self.attention != "sdpa"
        if cuda_graphs and not can_graph:
            raise ConfigError(f"cuda_graphs: need a CUDA device and a kernel attention (device {self.device}, "
                              f"attention {self.attention!r})")
        self.cuda_graphs: bool = can_graph if cuda_graphs is None else bool(cuda_graphs)
        if self.device.type == "cuda" and target.dtype == torch.float32:
            # Process-wide. cuBLAS's default heuristics run float32 GEMMs of 8-13 rows 2-3x slower than
            # cuBLASLt on the H200 (35-62 vs 19 us; a whole fixture verify 1.96 vs 0.59 ms, docs/perf.md),
            # and verify widths x rows land right there
            torch.backends.cuda.preferred_blas_library("cublaslt")
        cfg = target.config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_id: int | None = _first_id(getattr(cfg, "eos_token_id", None))
        self.max_context: int = cfg.max_position_embeddings
        self.tap_layers: list[int] | None = None
        self.mask_token_id: int | None = None
        self.trained_block_size: int | None = None
        if drafter is not None:
            self.tap_layers = list(drafter.config.target_layer_ids)
            self.mask_token_id = drafter.config.mask_token_id
            self.trained_block_size = drafter.config.block_size
        # budget auto: a profile set here (e.g. from --speculative-ddtree-cost-profile) is used as is;
        # otherwise the first auto batch measures one and later batches reuse it
        self.cost_model: VerifyCostModel | None = None
        self._measured: dict[tuple, VerifyCostModel] = {}
        # generate() reuses its batches when graphed, so a repeated call replays instead of recapturing
        self._pooled: dict[tuple, DecodeBatch] = {}

    @classmethod
    def from_pretrained(cls, target_path, draft_path=None, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, attention: str = "auto",
                        cuda_graphs: bool | None = None, fold_norms: bool | None = None) -> Engine:
        from ddtree.models import load_drafter, load_target

        target = load_target(target_path, device=device, dtype=dtype)
        drafter = load_drafter(draft_path, target, device=device, dtype=dtype) if draft_path else None
        return cls(target, drafter, attention=attention, cuda_graphs=cuda_graphs, fold_norms=fold_norms)

    def check_spec(self, spec: SpecConfig) -> None:
        """Reject a config this engine cannot run, before any forward pass."""
        if spec.speculative and self.drafter is None:
            raise ConfigError(f"algorithm: {spec.algorithm.value} needs a draft model "
                              "(--speculative-draft-model-path); this engine has none")

    def budget_cost_model(self, spec: SpecConfig, max_batch: int) -> VerifyCostModel:
        """The round cost model for an auto budget: the loaded profile, else measured (once per setting).

        Measured on min(1024, context) committed tokens for 1..max(max_batch, 8) rows (at most 4 sizes) and
        verify widths up to max_budget + 1 (_cost_widths); larger batches extrapolate. A handful of
        forwards: ~1 s on CPU.
        """
        if self.cost_model is not None:
            return self.cost_model
        key = (spec.budget_cap, spec.topk, spec.block_size, spec.draft_window)
        cached = self._measured.get(key)
        if cached is None or max(cached.rows) < max_batch:
            context = max(1, min(COST_PROFILE_CONTEXT, self.max_context - spec.max_nodes - spec.block_size))
            cached = measure_verify_cost(
                self, default_row_counts(max(max_batch, COST_PROFILE_ROWS)), self._cost_widths(spec.budget_cap), context,
                block_size=spec.block_size, draft_window=spec.draft_window, topk=spec.topk)
            self._measured[key] = cached
        return cached

    def _cost_widths(self, cap: int) -> list[int]:
        """Verify widths the auto budget's cost model measures: graphed, exactly the captured tree sizes
        (+ the root) it chooses among, since graphed verify time need not be smooth in width; eagerly,
        a few powers of two that it interpolates between."""
        if self.cuda_graphs:
            return [b + 1 for b in tree_sizes(cap)]
        return default_node_counts(cap)

    def open_batch(self, spec: SpecConfig, max_batch: int, max_len: int | None = None,
                   profile: bool | None = None, prefill_tokens: int = PREFILL_TOKENS,
                   run_ahead: bool = True) -> DecodeBatch:
        """profile: synchronise the device around each stage so the per-stage timings are exact.
        None (the default) = only where that is free (the CPU); on CUDA the stage clocks then time
        the host's enqueueing, and the round runs without waiting on the device. run_ahead: collect() may
        launch the next round before reading this one's tokens (ddtree.decode; not while profiling)."""
        max_len = max_len if max_len is not None else self.max_context + spec.max_nodes
        if profile is None:
            profile = self.device.type != "cuda"
        return DecodeBatch(self, spec, max_batch, max_len, profile=profile, prefill_tokens=prefill_tokens,
                           graph_cache=GraphCache if self.cuda_graphs else None, run_ahead=run_ahead)

    def pooled_batch(self, spec: SpecConfig, max_batch: int, max_len: int, profile: bool | None) -> DecodeBatch:
        """The batch generate() runs on, empty: a fresh one, or (graphed engines) a pooled one of the same spec
        and rows whose cache is long enough: its graphs replay instead of being captured again."""
        if not self.cuda_graphs:
            return self.open_batch(spec, max_batch, max_len, profile=profile)
        key = (spec, max_batch, profile)
        batch = self._pooled.pop(key, None)
        if batch is None or batch.max_len < max_len:
            batch = self.open_batch(spec, max_batch, max_len, profile=profile)
        batch.clear()  # a generate that raised may have left rows behind
        batch.runner.timer = StageTimer(self.device, sync=batch.timer.sync)  # this generation's stage times
        self._pooled[key] = batch  # most recent last
        while len(self._pooled) > POOLED_BATCHES:
            self._pooled.pop(next(iter(self._pooled)))
        return batch

    def release_pooled(self) -> None:
        """Drop the batches generate() keeps for graph reuse (their KV caches and graphs free up)."""
        self._pooled.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        spec: SpecConfig | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        max_batch: int | None = None,
        profile: bool | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        min_new_tokens: int = 0,
        return_logprob: bool = False,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (a list of ids) or several (a list of lists) in one batch (the sampling
        options are ddtree.request.Request's)."""
        spec = spec if spec is not None else SpecConfig()
        single = len(prompt_ids) == 0 or isinstance(prompt_ids[0], int)
        if single:
            prompts = [list(cast(Sequence[int], prompt_ids))]
        else:
            prompts = [list(p) for p in cast(Sequence[Sequence[int]], prompt_ids)]
        longest = max(len(p) for p in prompts)
        batch = self.pooled_batch(spec, max_batch or len(prompts), longest + max_new_tokens + spec.max_nodes,
                                     profile)
        reqs = [Request(str(i), p, max_new_tokens, temperature, seed, tuple(stop_token_ids or ()), ignore_eos,
                        top_p=top_p, top_k=top_k, min_p=min_p, min_new_tokens=min_new_tokens,
                        return_logprob=return_logprob)
                for i, p in enumerate(prompts)]
        for r in reqs:  # validate every request before any forward pass
            batch.validate(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        accepts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        budgets: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        logprobs: dict[str, list[float]] = {r.request_id: [] for r in reqs}
        final: dict[str, StepOutput] = {}
        pending = list(reqs)

        def absorb(outs: list[StepOutput]) -> None:
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
                accepts[o.request_id].extend(o.accept_lengths)
                budgets[o.request_id].extend(o.budgets)
                logprobs[o.request_id].extend(o.logprobs)
                if o.finished:
                    final[o.request_id] = o

        while pending or batch.active:
            while pending and batch.free_slots:  # a request finished at its first token frees its slot again
                absorb(batch.settle())  # a round launched ahead comes back before anyone joins
                joining, pending = pending[: batch.free_slots], pending[batch.free_slots :]
                absorb(batch.add_many(joining))
            absorb(batch.step())
        batch.settle()  # the round ahead of the last finished rows (theirs only): the batch is idle again
        out = [
            GenerationResult(
                token_ids=tokens[r.request_id], prompt_tokens=len(r.prompt_ids),
                finish_reason=final[r.request_id].finish_reason or "length",
                verify_steps=final[r.request_id].verify_steps,
                accept_lengths=accepts[r.request_id], timings=dict(batch.timer.totals),
                budgets=budgets[r.request_id], logprobs=logprobs[r.request_id],
            )
            for r in reqs
        ]
        return out[0] if single else out


ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "reference")


def resolve_attention(attention: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "sdpa"; anything else is checked."""
    if attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if attention == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if attention == "triton" and not triton_available():
        raise ConfigError("attention: 'triton' needs the triton package (pip install triton)")
    return attention


def _first_id(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value) if value is not None else None
