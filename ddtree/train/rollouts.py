"""Self-distillation data for the drafter: the target's own greedy continuations of corpus windows.

Speculative acceptance is measured against the target's greedy output, not against the data; a
tiny overfit target's greedy text differs a lot from the data, so a drafter trained on the data's
next tokens learns the wrong thing. Rollouts record what the target actually says.

Layout of a rollouts folder:

    rollouts.npz   tokens (uint16, flat), offsets (int64 [n+1]), prompt_lens, gen_lens (int32 [n]):
                   sequence i is tokens[offsets[i]:offsets[i+1]] = prompt + generated
    rollouts.json  counts, lengths, command, timings
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from ddtree.errors import ConfigError
from ddtree.train.card import environment, write_json
from ddtree.train.corpus import EOT_ID, load_tokens, read_manifest

ROLLOUTS_NPZ = "rollouts.npz"
ROLLOUTS_JSON = "rollouts.json"
PROMPT_LENGTHS = ("per-batch", "per-sequence")


@dataclass(frozen=True)
class RolloutSpec:
    """How many windows, how long their prompts and continuations, how many per engine batch."""

    num: int = 4096
    prompt_len_min: int = 32
    prompt_len_max: int = 1024
    gen_len: int = 128
    batch_size: int = 256
    seed: int = 0
    time_budget_s: float | None = None  # stop between batches and save what exists
    # "per-batch": one prompt length drawn per engine batch (no padding); "per-sequence": one per sequence,
    # the sequences sorted by length into batches of near-equal lengths (right-padded), run in random order
    prompt_lengths: str = "per-batch"

    def __post_init__(self) -> None:
        checks: list[tuple[str, float, float, float]] = [
            ("num", self.num, 1, 10**8),
            ("prompt_len_min", self.prompt_len_min, 1, 1 << 20),
            ("prompt_len_max", self.prompt_len_max, self.prompt_len_min, 1 << 20),
            ("gen_len", self.gen_len, 1, 1 << 20),
            ("batch_size", self.batch_size, 1, 1 << 16),
        ]
        for name, value, lo, hi in checks:
            if not lo <= value <= hi:
                raise ConfigError(f"{name}: {value} is outside [{lo}, {hi}]")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"time_budget_s: {self.time_budget_s} must be > 0 (or unset)")
        if self.prompt_lengths not in PROMPT_LENGTHS:
            raise ConfigError(f"prompt_lengths: {self.prompt_lengths!r} is not one of {PROMPT_LENGTHS}")


@dataclass
class Rollouts:
    """Prompt + generated token sequences, stored flat."""

    tokens: np.ndarray  # [sum of lengths] uint16
    offsets: np.ndarray  # [n + 1] int64
    prompt_lens: np.ndarray  # [n] int32
    gen_lens: np.ndarray  # [n] int32

    def __len__(self) -> int:
        return int(self.prompt_lens.size)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, prompts: list[list[int]], gens: list[list[int]]) -> Rollouts:
        seqs = [p + g for p, g in zip(prompts, gens)]
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = np.fromiter((t for s in seqs for t in s), dtype=np.uint16, count=int(lens.sum()))
        return cls(flat, offsets, np.array([len(p) for p in prompts], dtype=np.int32),
                   np.array([len(g) for g in gens], dtype=np.int32))

    @classmethod
    def from_batches(cls, batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Rollouts:
        """(prompts[rows, n], generated[rows, g], prompt lengths[rows]) blocks: row i's prompt is its first
        lengths[i] tokens (the rest is padding)."""
        if not batches:
            return cls.from_lists([], [])
        flat = np.concatenate([np.concatenate([p[i, :n], g[i]]) for p, g, lens in batches
                               for i, n in enumerate(lens.tolist())]).astype(np.uint16)
        prompt_lens = np.concatenate([lens for _, _, lens in batches]).astype(np.int32)
        gen_lens = np.concatenate([np.full(g.shape[0], g.shape[1], dtype=np.int32) for _, g, _ in batches])
        offsets = np.concatenate([[0], np.cumsum(prompt_lens.astype(np.int64) + gen_lens)]).astype(np.int64)
        return cls(flat, offsets, prompt_lens, gen_lens)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / (ROLLOUTS_NPZ + ".tmp.npz")
        np.savez(tmp, tokens=self.tokens, offsets=self.offsets, prompt_lens=self.prompt_lens, gen_lens=self.gen_lens)
        tmp.replace(out_dir / ROLLOUTS_NPZ)

    @classmethod
    def load(cls, folder: str | Path) -> Rollouts:
        path = Path(folder) / ROLLOUTS_NPZ
        if not path.exists():
            raise ConfigError(f"rollouts: {path} does not exist (run `ddtree train rollouts` first)")
        with np.load(path) as z:
            r = cls(z["tokens"], z["offsets"], z["prompt_lens"], z["gen_lens"])
        if r.offsets.size != len(r) + 1 or int(r.offsets[-1]) != r.tokens.size:
            raise ConfigError(f"rollouts: {path} is inconsistent (offsets do not cover the token array)")
        return r


# KV-cache slots one rollout batch may hold (rows x (prompt + generated)); ~12 GiB for the fixture target in float32
KV_TOKENS_PER_BATCH = 1 << 21
# query x key elements of one prefill forward (its attention mask and scores stay ~0.5 GiB)
PREFILL_ELEMENTS = 1 << 27


@torch.no_grad()
def greedy_continue(target: Any, prompts: torch.Tensor, gen_len: int, chunk: int = 512,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
    """prompts[B, L] long -> the target's greedy continuations [B, gen_len] (CPU). With `lengths` [B], row b's
    prompt is its first lengths[b] tokens (right padding after them is never attended to); without, all L.

    Plain greedy decoding straight on the target's KV cache: the prefill runs in chunks of rows and
    tokens so its attention mask stays small, then one forward per generated token for the whole
    batch, with no per-request bookkeeping and no host sync until the end. The engine's AR path gives
    the same tokens (tests/unit/test_train.py checks it) but spends its time on scheduling, which
    rollouts of tens of thousands of sequences cannot afford.
    """
    bs, n = prompts.shape
    dev = target.device
    prompts = prompts.to(dev)
    lens = (torch.full((bs,), n) if lengths is None else lengths.to(torch.long)).to(dev)
    cache = target.new_cache(bs, n + gen_len)
    rows = max(1, min(bs, PREFILL_ELEMENTS // (chunk * (n + gen_len))))
    last = torch.zeros(bs, dtype=torch.long, device=dev)
    for r0 in range(0, bs, rows):
        part = cache.rows(r0, min(bs, r0 + rows))
        ends = lens[r0 : r0 + part.batch] - 1  # each row's last prompt position: its first token comes from there
        for c0 in range(0, n, chunk):
            ids = prompts[r0 : r0 + part.batch, c0 : c0 + chunk]
            q = ids.shape[1]
            pos = torch.arange(c0, c0 + q, device=dev)[None, :].expand(part.batch, q)
            logits, _ = target.forward(ids, pos, part, kv_len_hint=c0 + q,
                                       logit_positions=(ends - c0).clamp(0, q - 1)[:, None])
            part.advance(torch.full((part.batch,), q, device=dev))
            here = (ends >= c0) & (ends < c0 + q)
            last[r0 : r0 + part.batch] = torch.where(here, logits[:, -1].argmax(-1), last[r0 : r0 + part.batch])
    cache.lengths.copy_(lens)  # a padded row goes on from its own end; its padding's slots are overwritten
    out = torch.empty(bs, gen_len, dtype=torch.long, device=dev)
    out[:, 0] = last
    one = torch.ones(bs, dtype=torch.long, device=dev)
    for t in range(1, gen_len):
        pos = (lens + t - 1)[:, None]
        logits, _ = target.forward(out[:, t - 1 : t], pos, cache, kv_len_hint=n + t)
        cache.advance(one)
        out[:, t] = logits[:, -1].argmax(-1)
    return out.cpu()


def _groups(spec: RolloutSpec, rng: np.random.Generator, hi: int) -> list[np.ndarray]:
    """Prompt lengths of the engine batches, in the order they run. "per-batch": one length per batch, drawn
    as it starts (a function of the batches run so far, so `num` and the budget decide the draws).
    "per-sequence": spec.num lengths sorted into batches of neighbours (batch_size rows, KV_TOKENS_PER_BATCH
    slots at the batch's longest), shuffled so that a run stopped by its time budget still spans the range."""
    lens = np.sort(rng.integers(spec.prompt_len_min, hi + 1, size=spec.num))
    groups, i = [], 0
    while i < lens.size:
        rows = min(spec.batch_size, lens.size - i)
        while rows > 1 and rows * (int(lens[i + rows - 1]) + spec.gen_len) > KV_TOKENS_PER_BATCH:
            rows -= 1
        groups.append(lens[i : i + rows])
        i += rows
    return [groups[k] for k in rng.permutation(len(groups))]


def generate_rollouts(
    target: Any, tokens: np.ndarray, spec: RolloutSpec, stream: TextIO | None = None
) -> tuple[Rollouts, dict[str, Any]]:
    """Greedy (T=0, EOS ignored) continuations by `target` of spec.num random windows of `tokens`.

    Prompt lengths are uniform in [prompt_len_min, prompt_len_max], one per batch or one per sequence
    (spec.prompt_lengths, see _groups), at random starts; a batch holds at most spec.batch_size rows and
    KV_TOKENS_PER_BATCH slots.
    """
    rng = np.random.default_rng(spec.seed)
    hi = min(spec.prompt_len_max, int(tokens.size) - 1)
    if hi < spec.prompt_len_min:
        raise ConfigError(f"prompt_len_min: {spec.prompt_len_min} exceeds the {tokens.size} tokens of the data")
    batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (prompts[rows, n], generated, lengths[rows])
    done = 0
    t0 = time.perf_counter()
    last_batch_s = 0.0
    stopped_early = False
    groups = _groups(spec, rng, hi) if spec.prompt_lengths == "per-sequence" else None
    while done < spec.num:
        elapsed = time.perf_counter() - t0
        # a batch that would not finish inside the budget is not started
        if spec.time_budget_s is not None and elapsed + last_batch_s > spec.time_budget_s:
            stopped_early = True
            print(f"[rollouts] time budget: stopping after {done} of {spec.num} sequences", file=stream, flush=True)
            break
        tb = time.perf_counter()
        if groups is not None:
            lens = groups[len(batches)]
            n, rows = int(lens.max()), lens.size
        else:
            n = int(rng.integers(spec.prompt_len_min, hi + 1))
            rows = max(1, min(spec.batch_size, spec.num - done, KV_TOKENS_PER_BATCH // (n + spec.gen_len)))
            lens = np.full(rows, n)
        # per batch: the draws of the one-length batches as they always were (a card's command reproduces them)
        starts = rng.integers(0, tokens.size - n + 1, size=rows) if groups is None else rng.integers(0, tokens.size - lens + 1)
        batch = np.full((rows, n), EOT_ID, dtype=np.int64)
        for row, (start, length) in enumerate(zip(starts.tolist(), lens.tolist())):
            batch[row, :length] = tokens[start : start + length]
        ragged = None if groups is None else torch.from_numpy(lens.astype(np.int64))
        out = greedy_continue(target, torch.from_numpy(batch), spec.gen_len, lengths=ragged)
        batches.append((batch.astype(np.uint16), out.numpy().astype(np.uint16), lens.astype(np.int32)))
        done += rows
        last_batch_s = time.perf_counter() - tb
        gen_tps = rows * spec.gen_len / max(last_batch_s, 1e-9)
        shape = f"{rows} x {n}" if groups is None else f"{rows} x {int(lens.min())}..{n}"
        print(f"[rollouts] {done}/{spec.num} sequences (batch {shape}+{spec.gen_len}), "
              f"{gen_tps:,.0f} generated tok/s, elapsed {time.perf_counter() - t0:.0f}s", file=stream, flush=True)
    rollouts = Rollouts.from_batches(batches)
    info = {
        "sequences": len(rollouts),
        "requested": spec.num,
        "stopped_early": stopped_early,
        "generated_tokens": int(rollouts.gen_lens.sum()),
        "prompt_tokens": int(rollouts.prompt_lens.sum()),
        "time_s": round(time.perf_counter() - t0, 1),
    }
    return rollouts, info


def make_rollouts(
    data_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    spec: RolloutSpec,
    device: str = "cpu",
    command: str = "",
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """Load the target (the dtype the engine would serve it in), roll out, save the folder; return the summary."""
    from ddtree.models import load_target
    from ddtree.train.loop import resolve_device

    data, out = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data)
    dev = resolve_device(device)
    torch.manual_seed(spec.seed)
    target = load_target(target_dir, device=dev)  # dtype as served: config's on CUDA, float32 on the CPU
    target.requires_grad_(False)
    if target.config.vocab_size != manifest.get("vocab_size"):
        raise ConfigError(
            f"target: vocab_size {target.config.vocab_size} != the corpus tokenizer's {manifest.get('vocab_size')}"
        )
    tokens = load_tokens(data, "train")
    print(f"[rollouts] target {target_dir} ({target.dtype}) on {dev}; {spec.num} windows of "
          f"{spec.prompt_len_min}..{spec.prompt_len_max} tokens + {spec.gen_len} generated", file=stream, flush=True)
    rollouts, info = generate_rollouts(target, tokens, spec, stream)
    if len(rollouts) == 0:
        raise ConfigError(f"time_budget_s: {spec.time_budget_s} left no time for one batch of {spec.batch_size}")
    rollouts.save(out)
    summary = {
        "kind": "rollouts",
        "command": command,
        "target": str(target_dir),
        "data": str(data_dir),
        "device": str(dev),
        "dtype": str(target.dtype).removeprefix("torch."),
        "spec": asdict(spec),
        **info,
        "environment": environment(),
    }
    write_json(out / ROLLOUTS_JSON, summary)
    print(f"[rollouts] saved {info['sequences']} sequences ({info['generated_tokens']:,} generated tokens) "
          f"in {info['time_s']}s -> {out}", file=stream, flush=True)
    return summary


def read_rollouts_info(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / ROLLOUTS_JSON
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


class RolloutRows:
    """Rollout sequences as fixed-length training rows: one sequence per row, right-padded with EOT.

    A sequence longer than seq_len keeps its last seq_len tokens (the generated part survives).
    Valid anchors lie where the whole block's labels are generated tokens: anchor >= prompt_len - 1
    (the last prompt token or a generated one) and anchor + block - 1 < the sequence's end.
    """

    def __init__(self, rollouts: Rollouts, seq_len: int, block_size: int, seed: int) -> None:
        self.rollouts, self.seq_len, self.block_size = rollouts, seq_len, block_size
        self.rng = np.random.default_rng(seed)
        lens = np.minimum(np.diff(rollouts.offsets), seq_len)
        cut = np.diff(rollouts.offsets) - lens
        self.lens = lens
        self.lo = np.maximum(1, rollouts.prompt_lens.astype(np.int64) - cut - 1)
        self.hi = lens - block_size
        self.usable = np.flatnonzero(self.hi >= self.lo)
        if self.usable.size == 0:
            raise ConfigError(
                f"rollouts: no sequence has a generated part of >= block_size - 1 = {block_size - 1} tokens "
                f"inside seq_len {seq_len} (gen_len {int(rollouts.gen_lens.max(initial=0))})"
            )

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids[n, seq_len] long, lo[n], hi[n]): rows and their inclusive anchor ranges (CPU)."""
        picks = self.usable[self.rng.integers(0, self.usable.size, size=n)]
        ids = np.full((n, self.seq_len), EOT_ID, dtype=np.int64)
        for row, i in enumerate(picks):
            seq = self.rollouts.sequence(int(i))
            ids[row, : self.lens[i]] = seq[seq.size - self.lens[i] :]
        return torch.from_numpy(ids), torch.from_numpy(self.lo[picks]), torch.from_numpy(self.hi[picks])
