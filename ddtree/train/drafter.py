"""Training the fixture DFlash drafter on the frozen fixture target (DESIGN section 2).

Each sequence gets random anchors; the block at anchor a is [token a, MASK x (block-1)], sees the
target's tapped hidden states at positions a - window <= p < a, and is scored by cross-entropy at
block positions k = 1..block-1 against token a + k, weighted exp(-(k-1)/gamma): an early miss ends
the accepted run, so early positions matter most. The target's taps are computed under no_grad.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.errors import ConfigError
from ddtree.models.configs import DrafterConfig, TargetConfig, build_target_layer_ids
from ddtree.train.card import (
    GATE_STATEMENT,
    copy_tokenizer,
    corpus_section,
    environment,
    fmt,
    write_json,
)
from ddtree.train.corpus import MASK_ID, load_tokens, read_manifest
from ddtree.train.loop import (
    BatchSampler,
    Progress,
    TrainOptions,
    autocast,
    make_optimizer,
    resolve_device,
    run_steps,
)


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's size and training geometry."""

    num_hidden_layers: int = 2
    block_size: int = 8
    window: int = 2048  # training context window; declared as the drafter's sliding_window
    num_anchors: int = 64  # per sequence
    gamma: float = 4.0  # loss decay over block positions (ModelOpt's default for block 8)
    intermediate_size: int | None = None  # None: the target's
    target_layer_ids: tuple[int, ...] | None = None  # None: z-lab's spread over the target's layers
    init: str = "random"  # "random" | "target" (copy the target's last layers)

    def __post_init__(self) -> None:
        if self.num_hidden_layers < 1:
            raise ConfigError(f"num_hidden_layers: {self.num_hidden_layers} must be >= 1")
        if not 2 <= self.block_size <= 64:
            raise ConfigError(f"block_size: {self.block_size} is outside [2, 64]")
        if self.window < 1:
            raise ConfigError(f"window: {self.window} must be >= 1")
        if self.num_anchors < 1:
            raise ConfigError(f"num_anchors: {self.num_anchors} must be >= 1")
        if not self.gamma > 0:
            raise ConfigError(f"gamma: {self.gamma} must be > 0")
        if self.init not in ("random", "target"):
            raise ConfigError(f"init: {self.init!r}; allowed: random, target")

    def config(self, target: TargetConfig) -> DrafterConfig:
        n = self.num_hidden_layers
        ids = self.target_layer_ids or tuple(build_target_layer_ids(target.num_hidden_layers, n))
        return DrafterConfig(
            hidden_size=target.hidden_size,
            intermediate_size=self.intermediate_size or target.intermediate_size,
            num_hidden_layers=n,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            block_size=self.block_size,
            target_layer_ids=tuple(ids),
            mask_token_id=MASK_ID,
            num_target_layers=target.num_hidden_layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            layer_types=("sliding_attention",) * n,
            sliding_window=self.window,
            torch_dtype="bfloat16",
        )


def position_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """w[k-1] = exp(-(k-1)/gamma) for block positions k = 1..block_size-1."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def sample_anchors(bs: int, seq_len: int, num_anchors: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """anchors[bs, A] long: distinct positions in [1, seq_len - block_size] per row, sorted.

    Position 0 has no context to draft from; the upper bound keeps every label a + k in the row.
    """
    hi = seq_len - block_size
    if hi < 1:
        raise ConfigError(f"seq_len: {seq_len} must exceed block_size {block_size} to place an anchor")
    a = min(num_anchors, hi)
    scores = torch.rand(bs, hi, generator=gen)
    return scores.topk(a, dim=1).indices.sort(dim=1).values + 1


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """labels[bs, A, block-1]: token anchor + k for k = 1..block-1."""
    offs = torch.arange(1, block_size, device=input_ids.device)
    idx = anchors[:, :, None] + offs  # [bs, A, L]
    return torch.gather(input_ids, 1, idx.reshape(idx.shape[0], -1)).view_as(idx)


def draft_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted CE: logits[bs, A, L, V] f32, labels[bs, A, L], weights[L] -> scalar."""
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])


def drafter_step(
    drafter: Any, target: Any, ids: torch.Tensor, shape: DrafterShape, gen: torch.Generator, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch ids[bs, T] -> (loss, logits[bs, A, L, V], labels[bs, A, L])."""
    bs, n = ids.shape
    with torch.no_grad():
        _, taps = target.forward_train(ids, list(drafter.config.target_layer_ids))  # [bs, T, n_taps*D]
    anchors = sample_anchors(bs, n, shape.num_anchors, shape.block_size, gen).to(ids.device)
    logits = drafter.forward_train(taps, ids, anchors, shape.block_size, shape.window)
    labels = block_labels(ids, anchors, shape.block_size)
    return draft_loss(logits, labels, weights), logits, labels


@torch.no_grad()
def evaluate_drafter(
    drafter: Any, target: Any, tokens: np.ndarray, opts: TrainOptions, shape: DrafterShape, device: torch.device
) -> dict[str, Any] | None:
    """Held-out loss, top-1 accuracy per block position and the mean accepted run (1 + leading hits)."""
    if opts.eval_batches == 0 or tokens.size <= shape.block_size + 1:
        return None
    sampler = BatchSampler(tokens, opts.seq_len, doc_start_prob=0.0, seed=4321)
    gen = torch.Generator().manual_seed(4321)
    weights = position_weights(shape.block_size, shape.gamma, device)
    drafter.eval()
    loss_sum, hits, runs, blocks = 0.0, torch.zeros(shape.block_size - 1), 0.0, 0
    for _ in range(opts.eval_batches):
        ids = sampler.sample(opts.batch_size).to(device)
        with autocast(device):
            loss, logits, labels = drafter_step(drafter, target, ids, shape, gen, weights)
        ok = (logits.argmax(-1) == labels).float()  # [bs, A, L]
        loss_sum += float(loss)
        hits += ok.sum((0, 1)).cpu()
        runs += float((1 + ok.cumprod(-1).sum(-1)).sum())
        blocks += ok.shape[0] * ok.shape[1]
    drafter.train()
    acc = (hits / blocks).tolist()
    return {
        "loss": loss_sum / opts.eval_batches,
        "accuracy_per_position": [round(a, 4) for a in acc],
        "mean_accepted_run": runs / blocks,
        "blocks": blocks,
    }


def init_from_target(drafter: Any, target: Any) -> list[int]:
    """Copy the target's last num_hidden_layers layers into the drafter's layers (same names)."""
    n_t, n_d = target.config.num_hidden_layers, len(drafter.layers)
    if n_d > n_t:
        raise ConfigError(f"init: the drafter has {n_d} layers but the target only {n_t}")
    src = list(range(n_t - n_d, n_t))
    for dst, s in zip(drafter.layers, src):
        try:
            dst.load_state_dict(target.model.layers[s].state_dict())
        except RuntimeError as err:
            raise ConfigError(f"init: target layer {s} does not fit a drafter layer ({err})") from err
    return src


def train_drafter(
    data_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    opts: TrainOptions,
    shape: DrafterShape | None = None,
    command: str = "",
    log_stream: Any = None,
) -> dict[str, Any]:
    """Train a drafter for the target folder; save its folder; return the summary."""
    from ddtree.models import init_drafter, load_target, save_drafter

    data, out = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data)
    shape = shape or DrafterShape()
    device = resolve_device(opts.device)
    if opts.seq_len <= shape.block_size:
        raise ConfigError(f"seq_len: {opts.seq_len} must exceed block_size {shape.block_size}")
    torch.manual_seed(opts.seed)
    target = load_target(target_dir, device=device, dtype=torch.float32)
    target.requires_grad_(False)
    if target.config.vocab_size != manifest.get("vocab_size"):
        raise ConfigError(
            f"target: vocab_size {target.config.vocab_size} != the corpus tokenizer's {manifest.get('vocab_size')}"
        )
    config = shape.config(target.config)
    drafter = init_drafter(config, target, seed=opts.seed).to(torch.float32)
    copied = init_from_target(drafter, target) if shape.init == "target" else []
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    optimizer = make_optimizer(list(drafter.named_parameters()), opts, device)
    train_tokens = load_tokens(data, "train")
    heldout_tokens = load_tokens(data, "heldout")
    sampler = BatchSampler(train_tokens, opts.seq_len, opts.doc_start_prob, opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    weights = position_weights(shape.block_size, shape.gamma, device)
    step_drafter = torch.compile(drafter) if opts.compile else drafter
    progress = Progress("drafter", opts, log_stream)
    print(f"[drafter] {n_params:,} parameters, taps {list(config.target_layer_ids)}, init {shape.init}, device {device}",
          file=progress.stream, flush=True)

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, float]]:
        ids = sampler.sample(opts.batch_size).to(device, non_blocking=True)
        with autocast(device):
            loss, logits, labels = drafter_step(step_drafter, target, ids, shape, gen, weights)
        extra: dict[str, float] = {}
        if (step + 1) % opts.log_every == 0:
            extra["acc1"] = float((logits[:, :, 0].argmax(-1) == labels[:, :, 0]).float().mean())
        return loss, ids.numel(), extra

    reserve = 0.0 if opts.time_budget_s is None else min(30.0, 0.05 * opts.time_budget_s)
    t0 = time.perf_counter()
    steps_done, losses = run_steps(opts, progress, optimizer, step_fn, reserve)
    train_time = time.perf_counter() - t0
    heldout = evaluate_drafter(drafter, target, heldout_tokens, opts, shape, device)
    train_eval = evaluate_drafter(drafter, target, train_tokens, opts, shape, device)
    print(f"[drafter] done: {steps_done} steps in {train_time:.0f}s; held-out "
          f"{'n/a' if heldout is None else heldout['accuracy_per_position']}", file=progress.stream, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    drafter = drafter.to(torch.bfloat16)
    save_drafter(drafter, out)
    copy_tokenizer(data, out)
    summary = {
        "kind": "drafter",
        "command": command,
        "target": str(target_dir),
        "options": opts.to_dict(),
        "shape": asdict(shape) | {"target_layer_ids": list(config.target_layer_ids)},
        "init_copied_target_layers": copied,
        "parameters": n_params,
        "steps": steps_done,
        "train_time_s": round(train_time, 1),
        "tokens_seen": progress.tokens,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "heldout": heldout,
        "train_eval": train_eval,
        "environment": environment(),
        "log": progress.records,
        "losses": losses,
    }
    write_json(out / "train_log.json", summary)
    (out / "README.md").write_text(drafter_card(summary, manifest), encoding="utf-8")
    return summary


def _eval_lines(name: str, ev: dict[str, Any] | None) -> str:
    if ev is None:
        return f"- {name}: n/a (no data)"
    accs = ", ".join(f"k={k + 1}: {a:.3f}" for k, a in enumerate(ev["accuracy_per_position"]))
    return (f"- {name} ({ev['blocks']} blocks): loss {ev['loss']:.4f}; top-1 accuracy per block position {accs}; "
            f"mean accepted run vs. the data (1 + leading hits) {ev['mean_accepted_run']:.3f}")


def drafter_card(s: dict[str, Any], manifest: dict[str, Any]) -> str:
    o, sh = s["options"], s["shape"]
    init = ("random (normal 0.02)" if sh["init"] == "random"
            else f"layers copied from target layers {s['init_copied_target_layers']}")
    gamma_note = f"exp(-(k-1)/{sh['gamma']:g})"
    return f"""# ddtree fixture DFlash drafter

A block-diffusion DFlash drafter (z-lab `DFlashDraftModel` layout) for the ddtree fixture target
(`{s['target']}`), trained from scratch for the ddtree test suite. It shares the target's
embedding and output head (not stored here).

- {sh['num_hidden_layers']} Qwen3-style layers, hidden = the target's, {s['parameters']:,} parameters, bfloat16;
  block size {sh['block_size']}, taps (target_layer_ids) {sh['target_layer_ids']}, mask token id {MASK_ID}
  (`<|mask|>`); sliding_window {sh['window']} (the context window used in training).
- Initialisation: {init}.

{corpus_section(manifest)}

## Training

- Command: `{s['command'] or '(API call)'}`
- Steps: {s['steps']} of {o['steps']} (batch {o['batch_size']} x {o['seq_len']} tokens, {sh['num_anchors']} random anchors per
  sequence at positions >= 1), {s['tokens_seen']:,} tokens, {s['train_time_s']} s on {o['device']}
  ({', '.join(f'{k} {v}' for k, v in s['environment'].items())}).
- Loss: cross-entropy at block positions k = 1..{sh['block_size'] - 1} against token anchor + k, weighted {gamma_note};
  a block sees the frozen target's tapped hidden states at positions anchor - {sh['window']} <= p < anchor, and itself.
- AdamW (betas 0.9/0.95, weight decay {o['weight_decay']}), lr {o['lr']}, {o['warmup_steps']} warm-up steps, cosine to
  {o['lr'] * o['min_lr_ratio']:.2g}, gradient clipping {o['grad_clip']}, bf16 autocast on CUDA; seed {o['seed']}.
- First/last step loss {fmt(s['first_loss'])} / {fmt(s['last_loss'])}.

## Results

{_eval_lines('Held-out stdlib files', s['heldout'])}
{_eval_lines('Training data', s['train_eval'])}

Accuracy here is against the data's next tokens; speculative acceptance is measured against the
target's own choices by the suite (tests/quality).

## Intended use

Fixture for ddtree's tests and benchmarks only. {GATE_STATEMENT}
"""

