"""Sweep summary winners, recommendation and the sweep-report command on synthetic cells."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.bench.report import OBJECTIVES, main, pick_winner, recommend, write_sweep_summary
from ddtree.bench.results import CellResult, read_restore, write_cell
from ddtree.config import SpecConfig

DEFAULT = "b8-k4-w2048-bs8"
BIG = "b16-k4-w2048-bs8"
CHAIN = "dflash-w2048-bs8"


def cell(config_id: str, context: int, concurrency: int, tps: float, tpot: float,
         failed: int = 0) -> CellResult:
    metrics = {"output_throughput": tps, "output_throughput_mad": tps / 20,
               "median_tpot_ms": tpot, "median_tpot_ms_mad": 0.1, "median_ttft_ms": 50.0,
               "accept_length": 3.5, "completed": 16 - failed, "failed": failed}
    return CellResult(config_id=config_id, spec=SpecConfig.from_id(config_id).to_dict(),
                      context=context, concurrency=concurrency, repeats=3, metrics=metrics,
                      per_repeat=[], commit="abc", backend="fake")


def grid() -> list[CellResult]:
    """BIG wins latency (c=1), DEFAULT wins throughput (c=8), CHAIN wins long context (2048)."""
    return [
        cell(DEFAULT, 128, 1, 100.0, 10.0), cell(BIG, 128, 1, 110.0, 9.0),
        cell(CHAIN, 128, 1, 90.0, 11.0), cell("ar", 128, 1, 40.0, 25.0),
        cell(DEFAULT, 128, 8, 700.0, 11.0), cell(BIG, 128, 8, 600.0, 13.0),
        cell(CHAIN, 128, 8, 550.0, 12.0), cell("ar", 128, 8, 300.0, 26.0),
        cell(DEFAULT, 2048, 1, 80.0, 12.5), cell(BIG, 2048, 1, 85.0, 11.8),
        cell(CHAIN, 2048, 1, 95.0, 10.5), cell("ar", 2048, 1, 35.0, 28.0),
        cell(DEFAULT, 2048, 8, 500.0, 16.0), cell(BIG, 2048, 8, 450.0, 17.0),
        cell(CHAIN, 2048, 8, 560.0, 14.0), cell("ar", 2048, 8, 250.0, 30.0),
    ]


def winners(cells: list[CellResult], default: str = DEFAULT) -> dict[str, str | None]:
    return {o.name: pick_winner(o, cells, default).config_id for o in OBJECTIVES}


def test_winner_per_objective_and_tie_goes_to_default() -> None:
    cells = grid()
    # latency: mean over contexts of best/value at c=1 -> CHAIN (9/11 + 10.5/10.5)/2 = 0.909
    # vs BIG (1 + 10.5/11.8)/2 = 0.945 -> BIG
    assert winners(cells) == {"latency": BIG, "throughput": DEFAULT, "long_context": CHAIN}
    ws = [pick_winner(o, cells, DEFAULT) for o in OBJECTIVES]
    assert recommend(ws, DEFAULT) == DEFAULT  # one win each: the current default stays
    assert recommend(ws, "ar") == CHAIN  # no default among the tied: higher total score


def test_most_wins_replaces_the_default() -> None:
    cells = [c for c in grid() if not (c.config_id == BIG and c.context == 128 and c.concurrency == 8)]
    cells.append(cell(BIG, 128, 8, 900.0, 9.0))
    w = winners(cells)
    assert w["latency"] == BIG and w["throughput"] == BIG
    assert recommend([pick_winner(o, cells, DEFAULT) for o in OBJECTIVES], DEFAULT) == BIG


def test_failed_cells_cannot_win() -> None:
    cells = [c for c in grid() if not (c.config_id == CHAIN and c.context == 2048)]
    cells += [cell(CHAIN, 2048, 1, 95.0, 10.5, failed=2), cell(CHAIN, 2048, 8, 560.0, 14.0, failed=1)]
    assert winners(cells)["long_context"] == DEFAULT


def test_summary_markdown(tmp_path: Path) -> None:
    for c in grid():
        write_cell(tmp_path, c)
    restore = {"ok": True, "config_id": DEFAULT, "checks": ["/server_info settings", "init log line"]}
    path = write_sweep_summary(tmp_path, DEFAULT, restore)
    text = path.read_text()
    assert path.name == "sweep_summary.md"
    for header in ("## context 128, concurrency 1", "## context 2048, concurrency 8"):
        assert header in text
    assert f"Single-request latency (lowest concurrency, lowest median TPOT): **{BIG}**" in text
    assert f"Aggregate throughput (highest concurrency, highest output tok/s): **{DEFAULT}**" in text
    assert f"Long context (longest context, highest output tok/s): **{CHAIN}**" in text
    assert f"Recommended default: **{DEFAULT}** (keep the current default)" in text
    assert "**verified** (checked: /server_info settings, init log line)" in text
    assert "| 700.0 ± 35.0 |" in text
    assert read_restore(tmp_path) == restore


def test_failed_restore_and_empty_sweep(tmp_path: Path) -> None:
    restore = {"ok": False, "config_id": DEFAULT, "checks": ["init log line"],
               "error": "server_info reports budget 16"}
    text = write_sweep_summary(tmp_path, DEFAULT, restore).read_text()
    assert "No cells were measured." in text
    assert "**FAILED**: server_info reports budget 16" in text


def test_sweep_report_command_rebuilds_from_files(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for c in grid():
        write_cell(tmp_path, c)
    (tmp_path / "restore.json").write_text('{"ok": true, "config_id": "%s", "checks": "unit"}' % BIG)
    assert main([str(tmp_path), "--no-plots"]) == 0
    text = (tmp_path / "sweep_summary.md").read_text()
    assert f"current default `{BIG}`" in text  # taken from restore.json
    assert "**verified** (checked: unit)" in text
    assert (tmp_path / "summary.csv").read_text().count("\n") == 17
    assert "sweep_summary.md" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing")])


def test_the_coding_gate_of_each_config_shows_in_its_rows(tmp_path: Path) -> None:
    for c in grid():
        write_cell(tmp_path, c)
    (tmp_path / "quality").mkdir()
    (tmp_path / "quality" / f"{CHAIN}.json").write_text(
        '{"config_id": "%s", "k": 1, "n": 2, "pass_at_k": 0.75, "accept_length": 2.1}' % CHAIN)
    text = write_sweep_summary(tmp_path, DEFAULT, None).read_text()
    chain_rows = [line for line in text.splitlines() if line.startswith(f"| {CHAIN} ")]
    assert len(chain_rows) == 4 and all("0.750 (k=1, n=2)" in row for row in chain_rows)
    other_rows = [line for line in text.splitlines() if line.startswith(f"| {BIG} ")]
    assert other_rows and all("| - |" in row for row in other_rows)  # no gate ran for BIG


def test_a_gate_that_ran_outside_namespaces_says_so_in_its_rows(tmp_path: Path) -> None:
    for c in grid():
        write_cell(tmp_path, c)
    (tmp_path / "quality").mkdir()
    for config_id, isolation in ((CHAIN, "best-effort"), (BIG, "namespaces")):
        (tmp_path / "quality" / f"{config_id}.json").write_text(
            '{"config_id": "%s", "k": 1, "n": 1, "pass_at_k": 1.0, "isolation": "%s"}' % (config_id, isolation))
    lines = write_sweep_summary(tmp_path, DEFAULT, None).read_text().splitlines()
    chain_rows = [line for line in lines if line.startswith(f"| {CHAIN} ")]
    assert chain_rows and all("1.000 (k=1, n=1, best-effort isolation: --unsafe-exec)" in row for row in chain_rows)
    big_rows = [line for line in lines if line.startswith(f"| {BIG} ")]
    assert big_rows and all("1.000 (k=1, n=1) |" in row for row in big_rows)
