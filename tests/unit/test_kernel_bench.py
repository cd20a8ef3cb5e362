"""ddtree.kernels.bench's pieces that run without a GPU: tiling variants, row recording, checks."""

from __future__ import annotations

import argparse

import pytest
import torch

from ddtree.kernels import bench


def test_tile_variants_parse_and_reject() -> None:
    assert bench._tile_variant("t16") == {"block_t": 16}
    assert bench._tile_variant("t16m32w8") == {"block_t": 16, "block_m": 32, "num_warps": 8}
    for bad in ("x1", "t", "t16q", "16"):
        with pytest.raises(SystemExit, match="--tile-variants"):
            bench._tile_variant(bad)


def test_record_keeps_a_failing_row_and_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    rows: list[dict] = []
    row = {"op": "tree_steps", "bs": 1, "budget": 8, "topk": 4, "L": 7, "vocab": 10, "path": "fused",
           "matches_torch": None}

    def boom() -> None:
        raise RuntimeError("no kernel")

    bench._record(rows, row, boom)
    assert rows == [row] and row["error"] == "RuntimeError: no kernel"
    assert "ERROR RuntimeError: no kernel" in capsys.readouterr().out


def test_checked_row_times_and_adds_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_timings", lambda fn, rep_ms, graphs: {"eager_ms": 2.0, "graph_ms": 1.0})
    calls: list[int] = []
    row: dict = {"bytes": 4_000_000}
    args = argparse.Namespace(rep_ms=1)
    check = bench._ran_and_equal
    pair = (torch.ones(3), torch.ones(3))
    bench._checked_row(row, lambda: calls.append(1), lambda: check(lambda: calls.append(2), pair), "matches_torch",
                       args, graphs=True)
    assert row["matches_torch"] is True and calls == [2]
    assert row["eager_GBps"] == pytest.approx(2.0) and row["graph_GBps"] == pytest.approx(4.0)
    assert bench._ran_and_equal(lambda: None, (torch.ones(2), torch.zeros(2))) is False
