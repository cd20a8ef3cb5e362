"""Random-weight target/drafter pairs of a chosen shape, saved as model folders the engine loads.

A benchmark of verify cost against tree size and batch needs a target of a realistic size, not a
trained one: `build_random_pair(folder, "1b")` writes a ~1B-parameter Qwen3-shaped target and a
2-layer DFlash drafter of the same width, with the fixture tokenizer's vocabulary (so the held-out
code prompts tokenize into it) and the fixture card's held-out file list (so `heldout_prompts`
works on the folder). Acceptance on these weights means nothing; timings do.

The target ties its head to an embedding scaled up so that the residual stream is dominated by
the current token: greedy decoding then has a wide top-1 margin and cannot flip on bf16 noise
between the AR and the tree-verify kernels (a near-uniform random model would make the lossless
check a coin toss). Such a target mostly repeats its input, so its lossless check is weak evidence;
the compute per token is that of the shape, whatever the weights hold.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.errors import ConfigError
from ddtree.models import (
    DFlashDrafter,
    DrafterConfig,
    Target,
    TargetConfig,
    build_target_layer_ids,
    init_drafter,
    init_target,
    save_drafter,
    save_target,
)

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"
EMBED_SCALE = 100.0  # embedding std 2 vs ~1 added per layer: a top-1 margin far above bf16 noise (module doc)
MARKER = "random_pair.json"  # written last: a folder without it is an interrupted build


@dataclass(frozen=True)
class Shape:
    """A target shape; the drafter takes its width and heads with `draft_layers` layers."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_context: int = 8192
    draft_layers: int = 2
    block_size: int = 8
    draft_window: int = 2048
    vocab: int | None = None  # None: the fixture tokenizer's (its ids are valid in any larger vocabulary)


# "1b": Qwen3-1.7B's width (hidden 2048, 16/8 heads of 128, intermediate 6144) at 20 layers, ~1.0B
# parameters with a 4096-token vocabulary. "8b": Qwen3-8B's shape (hidden 4096, 36 layers, 32/8 heads of 128,
# intermediate 12288, vocabulary 151936; the head tied to the embedding, so 7.6B parameters, 15.1 GB in
# bfloat16, where Qwen3-8B's untied head adds an embedding table no decode step reads). "tiny": unit tests.
# "narrow": the least real width (hidden = layers.SKINNY_MIN_K) in 4 layers, for GPU tests of the real-width paths.
SHAPES: dict[str, Shape] = {
    "1b": Shape(hidden=2048, layers=20, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    "8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936),
    "tiny": Shape(hidden=48, layers=4, heads=4, kv_heads=2, head_dim=12, intermediate=96, max_context=512),
    "narrow": Shape(hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128, intermediate=3072, max_context=2048),
}


def shape_of(name: str) -> Shape:
    if name not in SHAPES:
        raise ConfigError(f"shape: {name!r} is not a random-model shape; allowed: {', '.join(sorted(SHAPES))}")
    return SHAPES[name]


def fixture_vocab(tokenizer_dir: Path = FIXTURE_TARGET) -> int:
    """The vocabulary size of the fixture target (its config.json), which its tokenizer.json matches."""
    return int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])


def parameter_count(folder: Path) -> int:
    """Parameters of a saved pair's target (from its marker file)."""
    return int(json.loads((folder / MARKER).read_text())["target_parameters"])


def random_models(shape: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0, draft_layers: int | None = None,
                  tokenizer_dir: Path = FIXTURE_TARGET) -> tuple[Target, DFlashDrafter]:
    """A random-weight target and drafter of `shape`, built in memory on `device` in `dtype` (no folder).

    draft_layers overrides the shape's drafter depth (a 1-layer drafter reads fewer bytes per round).
    Weights are drawn in float32 and cast, as `build_random_pair` saves them.
    """
    spec = shape_of(shape)
    vocab = spec.vocab if spec.vocab is not None else fixture_vocab(tokenizer_dir)
    target_cfg = TargetConfig(
        model_type="qwen3", vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_context, tie_word_embeddings=True,
        eos_token_id=None,  # random weights: no token means "stop"
    )
    with torch.no_grad():
        target = init_target(target_cfg, device=device, seed=seed).eval()
        target.model.embed_tokens.weight.mul_(EMBED_SCALE)
        target = target.to(dtype)
    return target, random_drafter(target, shape, draft_layers=draft_layers, seed=seed + 1)


def random_drafter(target: Target, shape: str, *, draft_layers: int | None = None, seed: int = 1) -> DFlashDrafter:
    """A random DFlash drafter of `shape`'s width for `target` (in its dtype, on its device)."""
    spec = shape_of(shape)
    n_draft = spec.draft_layers if draft_layers is None else draft_layers
    if n_draft < 1:
        raise ConfigError(f"draft_layers: {n_draft} is out of range (allowed >= 1)")
    drafter_cfg = DrafterConfig(
        hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=n_draft,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        vocab_size=target.config.vocab_size, block_size=spec.block_size,
        target_layer_ids=tuple(build_target_layer_ids(spec.layers, n_draft)),
        mask_token_id=1, num_target_layers=spec.layers, max_position_embeddings=spec.max_context,
        layer_types=("sliding_attention",) * n_draft, sliding_window=spec.draft_window,
    )
    with torch.no_grad():
        return init_drafter(drafter_cfg, target, seed=seed).eval()


def build_random_pair(folder: Path, shape: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, tokenizer_dir: Path = FIXTURE_TARGET) -> tuple[Path, Path]:
    """Write folder/target and folder/drafter for `shape` (once: an existing complete build is reused).

    Returns (target_dir, drafter_dir). Weights are drawn on `device` (fast on a GPU) and saved in `dtype`.
    """
    spec = shape_of(shape)
    folder = Path(folder)
    target_dir, drafter_dir = folder / "target", folder / "drafter"
    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("shape") == shape:
        return target_dir, drafter_dir
    target, drafter = random_models(shape, device=device, dtype=dtype, seed=seed, tokenizer_dir=tokenizer_dir)
    n_params = sum(p.numel() for p in target.parameters())
    save_target(target, target_dir)
    save_drafter(drafter, drafter_dir)
    del target, drafter
    for d in (target_dir, drafter_dir):
        shutil.copy(tokenizer_dir / "tokenizer.json", d / "tokenizer.json")
        (d / "README.md").write_text(_card(shape, spec, n_params, tokenizer_dir))
    marker.write_text(json.dumps({"shape": shape, "target_parameters": n_params, "seed": seed,
                                  "weights": "random"}, indent=2) + "\n")
    return target_dir, drafter_dir


def _card(shape: str, spec: Shape, n_params: int, tokenizer_dir: Path) -> str:
    """A model card that says the weights are random and keeps the fixture's held-out file list."""
    card = (tokenizer_dir / "README.md").read_text()
    heldout = next((ln for ln in card.splitlines() if ln.startswith("- Held out")), "")
    return (
        f"# Random-weight {shape} pair (benchmark only)\n\n"
        f"RANDOM WEIGHTS: acceptance and outputs mean nothing; only timings do.\n\n"
        f"- Target: Qwen3 shape, hidden {spec.hidden}, {spec.layers} layers, {spec.heads}/{spec.kv_heads} heads of "
        f"{spec.head_dim}, intermediate {spec.intermediate}, {n_params / 1e9:.2f}B parameters\n"
        f"- Drafter: DFlash, {spec.draft_layers} layers of the same width, block {spec.block_size}\n"
        f"- Tokenizer: copied from {tokenizer_dir}\n"
        f"{heldout}\n"
    )
