"""Cell files: atomic writes, read-back, resume checks and the summary CSV."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.metrics import summarize_cell
from ddtree.bench.results import (
    SCHEMA_VERSION,
    CellResult,
    cell_exists,
    git_commit,
    read_cells,
    read_restore,
    write_cell,
    write_restore,
    write_summary_csv,
)
from ddtree.config import SpecConfig


def make_cell(config_id: str, context: int, concurrency: int, tps: float,
              quality: dict[str, Any] | None = None) -> CellResult:
    repeats = [{"output_throughput": tps * f, "median_tpot_ms": 1000.0 / tps, "completed": 8,
                "failed": 0, "spec_tokens": 300, "spec_verify_ct": 100, "accept_length": 3.0}
               for f in (0.9, 1.0, 1.2)]
    return CellResult(config_id=config_id, spec=SpecConfig.from_id(config_id).to_dict(),
                      context=context, concurrency=concurrency, repeats=3,
                      metrics=summarize_cell(repeats), per_repeat=repeats, commit="abc123",
                      backend="fake", started_at="2026-01-01T00:00:00+00:00",
                      finished_at="2026-01-01T00:01:00+00:00", quality=quality)


def test_write_read_round_trip(tmp_path: Path) -> None:
    cell = make_cell("b8-k4-w2048-bs8", 1024, 32, 800.0,
                     quality={"pass_at_k": 0.5, "k": 1, "n": 4, "problems": 10})
    path = write_cell(tmp_path, cell)
    assert path == tmp_path / "cells" / "b8-k4-w2048-bs8__ctx1024__c32.json"
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    (back,) = read_cells(tmp_path)
    assert back == cell
    assert cell_exists(tmp_path, "b8-k4-w2048-bs8", 1024, 32)
    assert not cell_exists(tmp_path, "b8-k4-w2048-bs8", 1024, 16)


def test_crash_mid_write_leaves_no_partial_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    old = make_cell("ar", 128, 1, 100.0)
    write_cell(tmp_path, old)

    def boom(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        write_cell(tmp_path, make_cell("ar", 128, 1, 999.0))  # would overwrite
    with pytest.raises(OSError, match="disk gone"):
        write_cell(tmp_path, make_cell("ar", 256, 1, 999.0))  # would be new
    monkeypatch.undo()
    files = sorted(p.name for p in (tmp_path / "cells").iterdir())
    assert files == ["ar__ctx128__c1.json"], files  # no temp file, no new cell
    assert read_cells(tmp_path) == [old]  # the old content is intact
    assert not cell_exists(tmp_path, "ar", 256, 1)


def test_read_cells_sorted_and_errors_name_the_file(tmp_path: Path) -> None:
    assert read_cells(tmp_path) == []
    for cid, ctx, c in [("b8-k4-w2048-bs8", 512, 4), ("ar", 128, 4), ("ar", 128, 1)]:
        write_cell(tmp_path, make_cell(cid, ctx, c, 10.0))
    assert [(x.context, x.concurrency, x.config_id) for x in read_cells(tmp_path)] == [
        (128, 1, "ar"), (128, 4, "ar"), (512, 4, "b8-k4-w2048-bs8")]
    bad = tmp_path / "cells" / "broken__ctx1__c1.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="broken__ctx1__c1.json"):
        read_cells(tmp_path)
    bad.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version 99"):
        read_cells(tmp_path)


def test_summary_csv_round_trip(tmp_path: Path) -> None:
    cells = [make_cell("b8-k4-w2048-bs8", 1024, 1, 50.0, {"pass_at_k": 0.25, "k": 1, "n": 4}),
             make_cell("dflash-w2048-bs8", 1024, 1, 40.0)]
    for cell in cells:
        write_cell(tmp_path, cell)
    path = write_summary_csv(tmp_path)
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["config_id"] for r in rows] == ["b8-k4-w2048-bs8", "dflash-w2048-bs8"]
    first = rows[0]
    assert float(first["output_throughput"]) == pytest.approx(cells[0].metrics["output_throughput"])
    assert float(first["output_throughput_mad"]) == pytest.approx(5.0)
    assert first["budget"] == "8" and first["algorithm"] == "DDTREE"
    assert float(first["accept_length"]) == pytest.approx(3.0)
    assert first["pass_at_k"] == "0.25" and rows[1]["pass_at_k"] == ""


def test_restore_record_and_commit(tmp_path: Path) -> None:
    assert read_restore(tmp_path) is None
    write_restore(tmp_path, {"ok": True, "config_id": "ar", "checks": ["server_info"]})
    assert read_restore(tmp_path) == {"ok": True, "config_id": "ar", "checks": ["server_info"]}
    assert git_commit(tmp_path) == "unknown"  # not a repository


def test_commit_is_pinned_or_marked_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDTREE_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")  # a tree that is not its HEAD says so
    assert git_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("DDTREE_COMMIT", "abc1234")  # a copied tree names its commit
    assert git_commit(tmp_path) == "abc1234"


def test_build_fills_environment(tmp_path: Path) -> None:
    repeats = [{"output_throughput": 10.0, "completed": 1, "failed": 0}]
    cell = CellResult.build(config_id="ar", spec=SpecConfig.from_id("ar").to_dict(), context=8,
                            concurrency=1, per_repeat=repeats, backend="fake",
                            started_at="2026-01-01T00:00:00+00:00", repo_dir=tmp_path)
    assert cell.metrics["output_throughput"] == 10.0 and cell.repeats == 1
    assert cell.commit == "unknown" and cell.machine["cores"] == os.cpu_count()
    assert cell.finished_at
