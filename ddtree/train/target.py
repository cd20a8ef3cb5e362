"""Training the fixture target: a small Qwen3-family code model, causal LM on the token arrays.

Reads only the corpus folder's token arrays and tokenizer (built on the CPU host), so it runs the
same on a GPU host with another Python. Writes a Hugging Face-shaped folder: config.json,
model.safetensors (bfloat16), tokenizer.json, tokenizer_config.json (special tokens, chat template),
README.md (model card) and train_log.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.errors import ConfigError
from ddtree.models.configs import TargetConfig
from ddtree.train.card import (
    CHAT_TEMPLATE_NOTE,
    GATE_STATEMENT,
    copy_tokenizer,
    corpus_section,
    environment,
    fmt,
    write_json,
    write_tokenizer_config,
)
from ddtree.train.corpus import EOT_ID, load_tokens, read_manifest
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
class TargetShape:
    """The target's size. Defaults: ~6M parameters with tied embeddings (~12 MB in bfloat16)."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192  # twice the training length; longer contexts are extrapolation

    def config(self, vocab_size: int) -> TargetConfig:
        return TargetConfig(
            model_type="qwen3",
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-6,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            eos_token_id=EOT_ID,
            bos_token_id=EOT_ID,
            torch_dtype=FIXTURE_COMPUTE_DTYPE,
        )


def lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ids[bs, T+1] (inputs ids[:, :-1], labels ids[:, 1:])."""
    logits, _ = model.forward_train(ids[:, :-1])  # [bs, T, V] float32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate_lm(model: Any, tokens: np.ndarray, opts: TrainOptions, device: torch.device) -> float | None:
    """Mean loss over opts.eval_batches fixed (seeded) windows; None when there is nothing to score."""
    if opts.eval_batches == 0 or tokens.size < 2:
        return None
    sampler = BatchSampler(tokens, opts.seq_len + 1, doc_start_prob=0.0, seed=1234)
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(opts.eval_batches):
        ids = sampler.sample(opts.batch_size).to(device)
        # float32, no autocast: with no gradient the layers take their inference kernels on CUDA, which
        # want inputs in their weights' dtype
        total += float(lm_loss(model, ids))
    model.train(was_training)
    return total / opts.eval_batches


def train_target(
    data_dir: str | Path,
    out_dir: str | Path,
    opts: TrainOptions,
    shape: TargetShape | None = None,
    command: str = "",
    log_stream: Any = None,
) -> dict[str, Any]:
    """Train, save the folder, return the summary written into train_log.json."""
    from ddtree.models import init_target, save_target

    data, out = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data)
    vocab = manifest.get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(f"data: {data / 'manifest.json'} has no vocab_size; run `ddtree train corpus` to tokenize")
    shape = shape or TargetShape()
    config = shape.config(vocab)
    device = resolve_device(opts.device)
    torch.manual_seed(opts.seed)
    train_tokens = load_tokens(data, "train")
    heldout_tokens = load_tokens(data, "heldout")

    model = init_target(config, device=device, dtype=torch.float32, seed=opts.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(list(model.named_parameters()), opts, device)
    step_model = torch.compile(model) if opts.compile else model
    sampler = BatchSampler(train_tokens, opts.seq_len + 1, opts.doc_start_prob, opts.seed)
    progress = Progress("target", opts, log_stream)
    print(f"[target] {n_params:,} parameters, {train_tokens.size:,} train tokens, device {device}", file=progress.stream, flush=True)

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, float]]:
        ids = sampler.sample(opts.batch_size).to(device, non_blocking=True)
        with matmul_precision(device, tf32=True):
            loss = lm_loss(step_model, ids)
        return loss, ids.shape[0] * (ids.shape[1] - 1), {}

    # keep a few percent of the budget for evaluation and saving
    reserve = 0.0 if opts.time_budget_s is None else min(30.0, 0.05 * opts.time_budget_s)
    t0 = time.perf_counter()
    steps_done, losses = run_steps(opts, progress, optimizer, step_fn, reserve)
    train_time = time.perf_counter() - t0

    train_loss = evaluate_lm(model, train_tokens, opts, device)
    heldout_loss = evaluate_lm(model, heldout_tokens, opts, device)
    print(f"[target] done: {steps_done} steps in {train_time:.0f}s; train loss {fmt(train_loss)}, held-out loss {fmt(heldout_loss)}",
          file=progress.stream, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)  # stored small; run in float32 (see FIXTURE_COMPUTE_DTYPE)
    save_target(model, out, compute_dtype=FIXTURE_COMPUTE_DTYPE)
    copy_tokenizer(data, out)
    write_tokenizer_config(out, shape.max_position_embeddings)
    summary = {
        "kind": "target",
        "command": command,
        "options": opts.to_dict(),
        "shape": shape.__dict__,
        "parameters": n_params,
        "steps": steps_done,
        "train_time_s": round(train_time, 1),
        "tokens_seen": progress.tokens,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "final_train_loss": train_loss,
        "final_heldout_loss": heldout_loss,
        "environment": environment(),
        "log": progress.records,
        "losses": losses,
    }
    write_json(out / "train_log.json", summary)
    (out / "README.md").write_text(target_card(summary, manifest), encoding="utf-8")
    return summary


def target_card(s: dict[str, Any], manifest: dict[str, Any]) -> str:
    o, sh = s["options"], s["shape"]
    return f"""# ddtree fixture target

A tiny Qwen3-family causal language model for Python code, trained from scratch for the ddtree
test suite (speculative-decoding correctness and speed fixtures). It is not a useful code model.

- Architecture: Qwen3 (q/k RMSNorm, SwiGLU, RoPE theta {sh['rope_theta']}), {sh['num_hidden_layers']} layers,
  hidden {sh['hidden_size']}, {sh['num_attention_heads']} heads / {sh['num_key_value_heads']} KV heads,
  head_dim {sh['head_dim']}, MLP {sh['intermediate_size']}, tied embeddings, {s['parameters']:,} parameters,
  weights in bfloat16. Max positions {sh['max_position_embeddings']} (trained at {o['seq_len']}).
- Tokenizer: byte-level BPE, vocabulary {manifest.get('vocab_size')}; `<|endoftext|>` = 0 (eos/bos),
  `<|mask|>` = 1 (the drafter's mask token). Lossless: decode(encode(text)) == text.
{CHAT_TEMPLATE_NOTE}

{corpus_section(manifest)}

## Training

- Command: `{s['command'] or '(API call)'}`
- Steps: {s['steps']} of {o['steps']} (batch {o['batch_size']} x {o['seq_len']} tokens; windows at random
  offsets, {o['doc_start_prob']:.0%} of them starting at a document boundary), {s['tokens_seen']:,} tokens,
  {s['train_time_s']} s on {o['device']} ({', '.join(f'{k} {v}' for k, v in s['environment'].items())}).
- AdamW (betas 0.9/0.95, weight decay {o['weight_decay']}), lr {o['lr']} with {o['warmup_steps']} warm-up steps then
  cosine to {o['lr'] * o['min_lr_ratio']:.2g}, gradient clipping {o['grad_clip']}, float32 with TF32 matmuls on CUDA; seed {o['seed']}.
- Final train loss {fmt(s['final_train_loss'])}, held-out loss {fmt(s['final_heldout_loss'])}
  (nats/token, {o['eval_batches']} batches each); first/last step loss {fmt(s['first_loss'])} / {fmt(s['last_loss'])}.

## Intended use

Fixture for ddtree's tests and benchmarks only. {GATE_STATEMENT}
"""
