"""Training the fixture DFlash drafter on the frozen fixture target (docs/architecture.md, "The DDTree round").

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
    label_description,
    rollout_section,
    write_json,
)
from ddtree.train.corpus import MASK_ID, load_tokens, read_manifest
from ddtree.train.drafter_init import init_from_drafter, init_from_target
from ddtree.train.loop import (
    FIXTURE_COMPUTE_DTYPE,
    BatchSampler,
    Progress,
    TrainOptions,
    make_optimizer,
    matmul_precision,
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
    soft_weight: float = 0.0  # share of the loss that is KL to the target's whole distribution (0: hard labels only)
    intermediate_size: int | None = None  # None: the target's
    target_layer_ids: tuple[int, ...] | None = None  # None: z-lab's spread over the target's layers
    init: str = "random"  # "random" | "target" (copy the target's last layers)
    init_from: str | None = None  # a drafter folder to start from (fine-tuning); see ddtree.train.drafter_init

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
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ConfigError(f"soft_weight: {self.soft_weight} is outside [0, 1]")
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
            torch_dtype=FIXTURE_COMPUTE_DTYPE,
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
    return sample_anchors_between(torch.ones(bs, dtype=torch.long), torch.full((bs,), hi), seq_len, num_anchors, gen)


def sample_anchors_between(
    lo: torch.Tensor, hi: torch.Tensor, seq_len: int, num_anchors: int, gen: torch.Generator
) -> torch.Tensor:
    """anchors[bs, A] long: distinct positions in [lo[b], hi[b]] (inclusive) per row, sorted.

    A = min(num_anchors, the narrowest row's range): one fixed shape per batch.
    """
    lo, hi = lo.cpu().long(), hi.cpu().long()
    width = int((hi - lo + 1).min())
    if width < 1:
        raise ConfigError(f"anchors: a row has no valid anchor (lo {lo.tolist()}, hi {hi.tolist()})")
    pos = torch.arange(seq_len)[None, :]
    valid = (pos >= lo[:, None]) & (pos <= hi[:, None])  # [bs, T]
    scores = torch.rand(lo.shape[0], seq_len, generator=gen).masked_fill(~valid, -1.0)
    return scores.topk(min(num_anchors, width), dim=1).indices.sort(dim=1).values


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """labels[bs, A, block-1]: token anchor + k for k = 1..block-1."""
    offs = torch.arange(1, block_size, device=input_ids.device)
    idx = anchors[:, :, None] + offs  # [bs, A, L]
    return torch.gather(input_ids, 1, idx.reshape(idx.shape[0], -1)).view_as(idx)


def draft_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted CE: logits[bs, A, L, V] f32, labels[bs, A, L], weights[L] -> scalar."""
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])


def soft_loss(logits: torch.Tensor, target_logits: torch.Tensor, anchors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted KL(target || drafter) at block positions k = 1..L: logits[bs, A, L, V], target_logits[bs, T, V].

    The target's distribution at position anchor + k - 1 (what it would put at anchor + k): the tree
    drafts the drafter's top-k per position, so the order of the runners-up matters, not only the argmax.
    """
    bs, n_anchor, n_pos, vocab = logits.shape
    idx = (anchors[:, :, None] + torch.arange(n_pos, device=anchors.device)).reshape(bs, -1)
    t = torch.gather(target_logits, 1, idx[:, :, None].expand(-1, -1, vocab)).view(bs, n_anchor, n_pos, vocab)
    kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(t.float(), -1), log_target=True,
                  reduction="none").sum(-1)  # [bs, A, L]
    return (kl * weights).sum() / (weights.sum() * bs * n_anchor)


def target_labels(target_logits: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """labels[bs, A, block-1]: the target's argmax at position anchor + k - 1 for k = 1..block-1.

    What the target itself would put at anchor + k given the sequence up to anchor + k - 1; the
    drafter is judged against the target's choices, not the data's.
    """
    offs = torch.arange(0, block_size - 1, device=anchors.device)
    idx = anchors[:, :, None] + offs  # [bs, A, L]
    pred = target_logits.argmax(-1)  # [bs, T]
    return torch.gather(pred, 1, idx.reshape(idx.shape[0], -1)).view_as(idx)


LABEL_MODES = ("target", "data")


@dataclass
class DraftBatch:
    """ids[bs, T]; anchors may sit in [lo[b], hi[b]]; own_labels[b]: the row's own tokens are the
    labels even when labelling by the target (rollout rows are the target's greedy output already)."""

    ids: torch.Tensor
    lo: torch.Tensor | None = None  # [bs] long, None: 1
    hi: torch.Tensor | None = None  # [bs] long, None: T - block_size
    own_labels: torch.Tensor | None = None  # [bs] bool, None: all False


def drafter_step(
    drafter: Any, target: Any, batch: torch.Tensor | DraftBatch, shape: DrafterShape, gen: torch.Generator,
    weights: torch.Tensor, label: str = "data",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch ids[bs, T] -> (loss, logits[bs, A, L, V], labels[bs, A, L])."""
    if label not in LABEL_MODES:
        raise ConfigError(f"label: {label!r}; allowed: {', '.join(LABEL_MODES)}")
    b = batch if isinstance(batch, DraftBatch) else DraftBatch(batch)
    ids = b.ids
    bs, n = ids.shape
    # the frozen target's matmuls in IEEE float32, as the engine serves it: its labels are the engine's choices
    with torch.no_grad(), matmul_precision(ids.device, tf32=False):
        t_logits, taps = target.forward_train(ids, list(drafter.config.target_layer_ids))  # [bs, T, n_taps*D]
    if b.lo is None and b.hi is None:
        anchors = sample_anchors(bs, n, shape.num_anchors, shape.block_size, gen)
    else:
        lo = b.lo if b.lo is not None else torch.ones(bs, dtype=torch.long)
        hi = b.hi if b.hi is not None else torch.full((bs,), n - shape.block_size)
        anchors = sample_anchors_between(lo, hi, n, shape.num_anchors, gen)
    anchors = anchors.to(ids.device)
    logits = drafter.forward_train(taps, ids, anchors, shape.block_size, shape.window)
    labels = block_labels(ids, anchors, shape.block_size)
    if label == "target":
        by_target = target_labels(t_logits, anchors, shape.block_size)
        if b.own_labels is not None:
            keep = b.own_labels.to(ids.device)[:, None, None]
            by_target = torch.where(keep, labels, by_target)
        labels = by_target
    loss = draft_loss(logits, labels, weights)
    if shape.soft_weight > 0:
        loss = (1 - shape.soft_weight) * loss + shape.soft_weight * soft_loss(logits, t_logits, anchors, weights)
    return loss, logits, labels


@torch.no_grad()
def evaluate_drafter(
    drafter: Any, target: Any, tokens: np.ndarray, opts: TrainOptions, shape: DrafterShape, device: torch.device
) -> dict[str, Any] | None:
    """Held-out loss, top-1 accuracy per block position and the mean accepted run (1 + leading hits),
    against the data's next tokens and against the target's own argmax (teacher-forced on the data)."""
    if opts.eval_batches == 0 or tokens.size <= shape.block_size + 1:
        return None
    result: dict[str, Any] = {}
    for label in ("data", "target"):
        sampler = BatchSampler(tokens, opts.seq_len, doc_start_prob=0.0, seed=4321)
        gen = torch.Generator().manual_seed(4321)
        weights = position_weights(shape.block_size, shape.gamma, device)
        drafter.eval()
        loss_sum, hits, runs, blocks = 0.0, torch.zeros(shape.block_size - 1), 0.0, 0
        for _ in range(opts.eval_batches):
            ids = sampler.sample(opts.batch_size).to(device)
            # float32, no autocast: with no gradient the layers take their inference kernels on CUDA, which
            # want inputs in their weights' dtype
            loss, logits, labels = drafter_step(drafter, target, ids, shape, gen, weights, label)
            ok = (logits.argmax(-1) == labels).float()  # [bs, A, L]
            loss_sum += float(loss)
            hits += ok.sum((0, 1)).cpu()
            runs += float((1 + ok.cumprod(-1).sum(-1)).sum())
            blocks += ok.shape[0] * ok.shape[1]
        drafter.train()
        acc = (hits / blocks).tolist()
        part = {
            "loss": loss_sum / opts.eval_batches,
            "accuracy_per_position": [round(a, 4) for a in acc],
            "mean_accepted_run": runs / blocks,
            "blocks": blocks,
        }
        if label == "data":
            result.update(part)
        else:
            result["vs_target"] = part
    return result


def train_drafter(
    data_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    opts: TrainOptions,
    shape: DrafterShape | None = None,
    command: str = "",
    log_stream: Any = None,
    rollouts_dir: str | Path | None = None,
    rollout_share: float = 0.8,
    label: str = "target",
) -> dict[str, Any]:
    """Train a drafter for the target folder; save its folder; return the summary.

    rollouts_dir: the target's greedy rollouts (ddtree.train.rollouts); rollout_share of every
    batch's rows are rollout sequences, the rest corpus windows. label "target": block labels are
    the target's argmax (rollout rows: their own tokens, which are that already); "data": the data.
    """
    from ddtree.models import init_drafter, load_drafter, load_target, save_drafter
    from ddtree.train.rollouts import RolloutRows, Rollouts, read_rollouts_info

    data, out = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data)
    shape = shape or DrafterShape()
    device = resolve_device(opts.device)
    if opts.seq_len <= shape.block_size:
        raise ConfigError(f"seq_len: {opts.seq_len} must exceed block_size {shape.block_size}")
    if label not in LABEL_MODES:
        raise ConfigError(f"label: {label!r}; allowed: {', '.join(LABEL_MODES)}")
    if not 0.0 <= rollout_share <= 1.0:
        raise ConfigError(f"rollout_share: {rollout_share} is outside [0, 1]")
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
    grown: list[int] = []
    added_taps: list[int] = []
    if shape.init_from is not None:
        start = load_drafter(shape.init_from, target, device=device, dtype=torch.float32)
        grown = init_from_drafter(drafter, start, shape.init_from)
        added_taps = [t for t in config.target_layer_ids if t not in start.config.target_layer_ids]
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    optimizer = make_optimizer(list(drafter.named_parameters()), opts, device)
    train_tokens = load_tokens(data, "train")
    heldout_tokens = load_tokens(data, "heldout")
    sampler = BatchSampler(train_tokens, opts.seq_len, opts.doc_start_prob, opts.seed)
    rows, n_roll, roll_info = None, 0, None
    if rollouts_dir is not None:
        rollouts = Rollouts.load(rollouts_dir)
        rows = RolloutRows(rollouts, sampler.seq_len, shape.block_size, opts.seed + 1)
        n_roll = round(rollout_share * opts.batch_size)
        roll_info = {
            "dir": str(rollouts_dir), "sequences": len(rollouts), "usable": int(rows.usable.size),
            "generated_tokens": int(rollouts.gen_lens.sum()),
            "gen_len": int(rollouts.gen_lens.max(initial=0)),
            "prompt_len_range": [int(rollouts.prompt_lens.min()), int(rollouts.prompt_lens.max())] if len(rollouts) else [0, 0],
            "share": rollout_share, "rows_per_batch": n_roll, "source": read_rollouts_info(rollouts_dir),
        }
    gen = torch.Generator().manual_seed(opts.seed)
    weights = position_weights(shape.block_size, shape.gamma, device)
    step_drafter = torch.compile(drafter) if opts.compile else drafter
    progress = Progress("drafter", opts, log_stream)
    print(f"[drafter] {n_params:,} parameters, taps {list(config.target_layer_ids)}, init {shape.init_from or shape.init}, device {device}",
          file=progress.stream, flush=True)
    mix = ("no rollouts" if roll_info is None else
           f"{n_roll}/{opts.batch_size} rows from {roll_info['usable']} rollout sequences")
    print(f"[drafter] labels: {label}; {mix}", file=progress.stream, flush=True)

    def next_batch() -> DraftBatch | torch.Tensor:
        if rows is None or n_roll == 0:
            return sampler.sample(opts.batch_size).to(device, non_blocking=True)
        r_ids, r_lo, r_hi = rows.sample(n_roll)
        n_c = opts.batch_size - n_roll
        t = r_ids.shape[1]
        c_ids = sampler.sample(n_c) if n_c else torch.empty(0, t, dtype=r_ids.dtype)
        return DraftBatch(
            ids=torch.cat([r_ids, c_ids]).to(device, non_blocking=True),
            lo=torch.cat([r_lo, torch.ones(n_c, dtype=torch.long)]),
            hi=torch.cat([r_hi, torch.full((n_c,), t - shape.block_size, dtype=torch.long)]),
            own_labels=torch.arange(opts.batch_size) < n_roll,
        )

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, float]]:
        batch = next_batch()
        ids = batch.ids if isinstance(batch, DraftBatch) else batch
        with matmul_precision(device, tf32=True):
            loss, logits, labels = drafter_step(step_drafter, target, batch, shape, gen, weights, label)
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
    save_drafter(drafter, out, compute_dtype=FIXTURE_COMPUTE_DTYPE)
    copy_tokenizer(data, out)
    summary = {
        "kind": "drafter",
        "command": command,
        "target": str(target_dir),
        "options": opts.to_dict(),
        "shape": asdict(shape) | {"target_layer_ids": list(config.target_layer_ids)},
        "init_copied_target_layers": copied,
        "init_grown_layers": grown,
        "init_added_taps": added_taps,
        "label": label,
        "rollouts": roll_info,
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
    line = (f"- {name} ({ev['blocks']} blocks): loss {ev['loss']:.4f}; top-1 accuracy per block position {accs}; "
            f"mean accepted run vs. the data (1 + leading hits) {ev['mean_accepted_run']:.3f}")
    vt = ev.get("vs_target")
    if vt:
        accs = ", ".join(f"k={k + 1}: {a:.3f}" for k, a in enumerate(vt["accuracy_per_position"]))
        line += (f"\n  - against the target's argmax (teacher-forced on the data): top-1 accuracy {accs}; "
                 f"mean accepted run {vt['mean_accepted_run']:.3f}")
    return line


def drafter_card(s: dict[str, Any], manifest: dict[str, Any]) -> str:
    o, sh = s["options"], s["shape"]
    init = ("random (normal 0.02)" if sh["init"] == "random"
            else f"layers copied from target layers {s['init_copied_target_layers']}")
    # a fine-tune must not read as trained from scratch
    origin = "trained from scratch"
    if sh.get("init_from"):
        init = f"the weights of the drafter in `{sh['init_from']}` (fine-tuned from there; see its own card)"
        if s.get("init_grown_layers"):
            init += (f"; layers {s['init_grown_layers']} added, random with their attention output and MLP down "
                     "projections zeroed, so training starts from the smaller drafter's outputs")
        if s.get("init_added_taps"):
            init += (f"; target layers {s['init_added_taps']} added to the taps, their columns of the fusion (fc) "
                     "zeroed, so training starts from the drafter's outputs without them")
        origin = f"fine-tuned from the drafter in `{sh['init_from']}`"
    gamma_note = f"exp(-(k-1)/{sh['gamma']:g})"
    label_note = label_description(s.get("label", "data"))
    if sh.get("soft_weight"):
        label_note += (f" ({1 - sh['soft_weight']:g} of the loss; the other {sh['soft_weight']:g} is KL from the target's "
                       "whole distribution at the same positions)")
    return f"""# ddtree fixture DFlash drafter

A block-diffusion DFlash drafter (z-lab `DFlashDraftModel` layout) for the ddtree fixture target
(`{s['target']}`), {origin} for the ddtree test suite. It shares the target's
embedding and output head (not stored here).

- {sh['num_hidden_layers']} Qwen3-style layers, hidden = the target's, {s['parameters']:,} parameters, bfloat16;
  block size {sh['block_size']}, taps (target_layer_ids) {sh['target_layer_ids']}, mask token id {MASK_ID}
  (`<|mask|>`); sliding_window {sh['window']} (the context window used in training).
- Initialisation: {init}.

{corpus_section(manifest)}

## Training

- Command: `{s['command'] or '(API call)'}`
- Steps: {s['steps']} of {o['steps']} (batch {o['batch_size']} x {o['seq_len']} tokens, up to {sh['num_anchors']} random anchors per
  sequence at positions >= 1), {s['tokens_seen']:,} tokens, {s['train_time_s']} s on {o['device']}
  ({', '.join(f'{k} {v}' for k, v in s['environment'].items())}).
- Loss: cross-entropy at block positions k = 1..{sh['block_size'] - 1} against {label_note}, weighted {gamma_note};
  a block sees the frozen target's tapped hidden states at positions anchor - {sh['window']} <= p < anchor, and itself.
{rollout_section(s.get('rollouts'), o['batch_size'])}
- AdamW (betas 0.9/0.95, weight decay {o['weight_decay']}), lr {o['lr']}, {o['warmup_steps']} warm-up steps, cosine to
  {o['lr'] * o['min_lr_ratio']:.2g}, gradient clipping {o['grad_clip']}, float32 with TF32 matmuls on CUDA; seed {o['seed']}.
- First/last step loss {fmt(s['first_loss'])} / {fmt(s['last_loss'])}.

## Results

{_eval_lines('Held-out stdlib files', s['heldout'])}
{_eval_lines('Training data', s['train_eval'])}

Accuracy is against the data's next tokens, and against the target's argmax with the data as the
prefix (exact for k = 1, an approximation deeper in the block); speculative acceptance, measured by
the suite (tests/quality) and `ddtree.profiling.acceptance`, is against the target's own greedy choices.

## Intended use

Fixture for ddtree's tests and benchmarks only. {GATE_STATEMENT}
"""

