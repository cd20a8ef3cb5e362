"""Held-out prompts for the acceptance bench: which files, which windows, from which stdlib copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddtree.bench.acceptance import heldout_files, heldout_prompts
from ddtree.text import load_tokenizer

FIXTURE_TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target"


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A target folder whose card holds out two files, and a stdlib copy holding them."""
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(FIXTURE_TARGET / "tokenizer.json", target / "tokenizer.json")
    (target / "README.md").write_text("# card\n\n- Held out for acceptance (3 names, one missing): a/long.py, short.py, gone.py\n")
    root = tmp_path / "stdlib"
    (root / "a").mkdir(parents=True)
    (root / "a" / "long.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200)))
    (root / "short.py").write_text("import os\nprint(os.getcwd())\n")
    return target, root


def test_files_resolve_against_the_named_root_and_skip_missing_ones(pair: tuple[Path, Path]) -> None:
    target, root = pair
    assert heldout_files(target, root) == [root / "a" / "long.py", root / "short.py"]


def test_per_file_takes_the_next_non_overlapping_windows(pair: tuple[Path, Path]) -> None:
    target, root = pair
    ids = load_tokenizer(target).encode((root / "a" / "long.py").read_text())  # type: ignore[union-attr]
    ctx = 100
    assert len(ids) > 3 * ctx + 1
    one = heldout_prompts(target, 1, ctx, root)
    assert one == [ids[:ctx]]
    three = heldout_prompts(target, 3, ctx, root, per_file=3)
    assert three == [ids[:ctx], ids[ctx : 2 * ctx], ids[2 * ctx : 3 * ctx]]
    with pytest.raises(SystemExit, match="only 1 held-out prompts"):
        heldout_prompts(target, 2, ctx, root)  # the short file has fewer than ctx tokens
    with pytest.raises(SystemExit, match="--per-file"):
        heldout_prompts(target, 1, ctx, root, per_file=0)
