"""Machinery shared by the target and drafter trainers: options, batches, schedule, progress, budget.

Knows nothing of either model: the trainers pass a `step` callable and read back a log.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np
import torch

from ddtree.errors import ConfigError
from ddtree.train.corpus import EOT_ID

# What trained fixtures run in (their config's torch_dtype). Weights are stored in bfloat16 to stay small;
# computing in float32 keeps a verify over n tokens and a one-token step numerically alike, so greedy
# outputs compare token for token across AR, DFLASH and DDTREE on a GPU too (in bfloat16 the two shapes
# round differently and near-tied tokens flip).
FIXTURE_COMPUTE_DTYPE = "float32"


@dataclass(frozen=True)
class TrainOptions:
    """One training run. With a time budget, the cosine schedule follows elapsed time so a
    budget-stopped run still ends annealed."""

    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 4096
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "cpu"
    time_budget_s: float | None = None
    log_every: int = 10
    eval_batches: int = 4
    doc_start_prob: float = 0.5  # share of sequences that begin at a document boundary
    seed: int = 0
    compile: bool = False  # torch.compile the model (CUDA only; worth it for long runs)

    def __post_init__(self) -> None:
        checks: list[tuple[str, float, float, float]] = [
            ("steps", self.steps, 1, 10**9),
            ("batch_size", self.batch_size, 1, 4096),
            ("seq_len", self.seq_len, 2, 1 << 20),
            ("lr", self.lr, 1e-8, 1.0),
            ("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0),
            ("warmup_steps", self.warmup_steps, 0, 10**9),
            ("weight_decay", self.weight_decay, 0.0, 10.0),
            ("grad_clip", self.grad_clip, 0.0, 1e6),
            ("log_every", self.log_every, 1, 10**9),
            ("eval_batches", self.eval_batches, 0, 10**6),
            ("doc_start_prob", self.doc_start_prob, 0.0, 1.0),
        ]
        for name, value, lo, hi in checks:
            if not lo <= value <= hi:
                raise ConfigError(f"{name}: {value} is outside [{lo}, {hi}]")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"time_budget_s: {self.time_budget_s} must be > 0 (or unset)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: {self.device!r}; allowed: cpu, cuda, cuda:N")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available here")
    return torch.device(name)


class BatchSampler:
    """Random windows of a token array; some begin at a document start (right after or at an EOT).

    Windows at random offsets put every context length up to seq_len in distribution; windows at
    document starts teach the model to begin a document with nothing (or only EOT) before it,
    which is how prompts arrive at inference.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, doc_start_prob: float, seed: int) -> None:
        if tokens.size < 2:
            raise ConfigError(f"data: a token array of {tokens.size} tokens is too short to train on")
        self.tokens = tokens
        self.seq_len = min(seq_len, int(tokens.size))  # tiny test corpora: shrink, never fail
        self.doc_start_prob = doc_start_prob
        self.rng = np.random.default_rng(seed)
        last = tokens.size - self.seq_len
        eots = np.flatnonzero(np.asarray(tokens) == EOT_ID)
        self.doc_starts = eots[eots <= last]

    def sample(self, batch: int) -> torch.Tensor:
        """ids[batch, seq_len] long (CPU)."""
        last = self.tokens.size - self.seq_len
        starts = self.rng.integers(0, last + 1, size=batch)
        if self.doc_starts.size:
            aligned = self.rng.random(batch) < self.doc_start_prob
            picks = self.doc_starts[self.rng.integers(0, self.doc_starts.size, size=batch)]
            skip_eot = self.rng.integers(0, 2, size=batch)  # start at the EOT or just after it
            starts = np.where(aligned, np.minimum(picks + skip_eot, last), starts)
        rows = [np.asarray(self.tokens[s : s + self.seq_len], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


def lr_at(opts: TrainOptions, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine to lr * min_lr_ratio over max(step, time) progress."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    if opts.time_budget_s:
        progress = max(progress, elapsed_s / opts.time_budget_s)
    progress = min(1.0, progress)
    floor = opts.lr * opts.min_lr_ratio
    return floor + (opts.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]], opts: TrainOptions, device: torch.device) -> torch.optim.AdamW:
    # no decay on norms and biases: decaying a gain towards zero only fights the loss
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


@contextlib.contextmanager
def matmul_precision(device: torch.device, tf32: bool) -> Iterator[None]:
    """Float32 matmuls (and cuDNN convolutions) in TF32 (tf32=True) or IEEE float32 inside the block, on CUDA.

    Training runs in float32 with TF32 matmuls rather than under bf16 autocast: the models' norm/rope
    ops take their weights in the input's dtype (ddtree.kernels.norm_rope), which autocast's bf16
    activations with float32 norm weights break. A no-op on the CPU.
    """
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


class Progress:
    """Progress lines with loss, throughput and an ETA bounded by the step count and the time budget."""

    def __init__(self, name: str, opts: TrainOptions, stream: TextIO | None = None) -> None:
        self.name = name
        self.opts = opts
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self.tokens = 0
        self.window_tokens = 0
        self.window_start = self.start
        self.records: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self, reserve_s: float) -> bool:
        return self.opts.time_budget_s is not None and self.elapsed() >= self.opts.time_budget_s - reserve_s

    def step(self, step: int, loss: float, lr: float, tokens: int, extra: dict[str, float] | None = None) -> None:
        self.tokens += tokens
        self.window_tokens += tokens
        done = step + 1
        if done % self.opts.log_every and done != self.opts.steps:
            return
        now = time.perf_counter()
        tps = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_tokens, self.window_start = 0, now
        elapsed = now - self.start
        eta = elapsed / done * (self.opts.steps - done)
        if self.opts.time_budget_s is not None:
            eta = min(eta, max(0.0, self.opts.time_budget_s - elapsed))
        rec = {"step": done, "loss": round(loss, 5), "lr": lr, "tokens_per_s": round(tps, 1), "elapsed_s": round(elapsed, 2)}
        rec.update(extra or {})
        self.records.append(rec)
        more = "".join(f" {k} {v:.4g}" for k, v in (extra or {}).items())
        print(
            f"[{self.name}] step {done}/{self.opts.steps} loss {loss:.4f}{more} lr {lr:.2e} "
            f"tok/s {tps:,.0f} elapsed {elapsed:.0f}s eta {eta:.0f}s",
            file=self.stream,
            flush=True,
        )


def run_steps(
    opts: TrainOptions,
    progress: Progress,
    optimizer: torch.optim.Optimizer,
    step_fn: Callable[[int], tuple[torch.Tensor, int, dict[str, float]]],
    reserve_s: float,
) -> tuple[int, list[float]]:
    """Run up to opts.steps optimiser steps (or until the time budget minus reserve_s is spent).

    step_fn(step) -> (loss with grad, tokens in the batch, extra scalars to log); the loop does
    zero_grad, backward, clipping, the LR update and logging. Returns (steps done, losses).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    losses: list[float] = []
    step = 0
    for step in range(opts.steps):
        if progress.out_of_time(reserve_s):
            print(f"[{progress.name}] time budget reached after {step} steps; stopping", file=progress.stream, flush=True)
            return step, losses
        lr = lr_at(opts, step, progress.elapsed())
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss, tokens, extra = step_fn(step)
        loss.backward()
        if opts.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optimizer.step()
        # one host sync per step is fine here: the loss is logged and watched for divergence
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {step + 1}; lower --lr")
        losses.append(value)
        progress.step(step, value, lr, tokens, extra)
    return opts.steps, losses
