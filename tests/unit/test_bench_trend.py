"""`ddtree sweep-report --compare OLD NEW` and `--trend DIR...` on synthetic result folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.bench.report import main
from ddtree.bench.trend import load_runs
from tests.unit.test_bench_baseline import DEFAULT, make_cell, quiet_run, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_compare_writes_its_report_and_plot_and_exits_1_on_a_regression(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = write_run(tmp_path / "old", quiet_run())
    now_cells = quiet_run()
    now_cells[0] = make_cell(DEFAULT, 60, 1, [79.2, 80.8], [2.0, 2.2])
    new = write_run(tmp_path / "new", now_cells)
    assert main(["--compare", str(old), str(new)]) == 1
    out = capsys.readouterr()
    assert "REGRESSED b8-k4-w2048-bs8 @ ctx60 c1: regressed: output tok/s 80.0" in out.err
    assert "verdict: REGRESSION (8 cells compared, 0 improved, 0 missing now)" in out.out
    text = (new / "vs_baseline.md").read_text()
    assert text.startswith(f"# {new} vs baseline")
    assert "| b8-k4-w2048-bs8 | 80.0 [" in text and "| 0.80 | 2.20 | 2.20 | regressed |" in text
    assert (new / "plots" / "vs_baseline.png").read_bytes().startswith(PNG_MAGIC)
    # the same pair within tolerance passes; a wider tolerance lets the 20% drop through
    assert main(["--compare", str(old), str(old), "--no-plots"]) == 0
    assert main(["--compare", str(old), str(new), "--tolerance", "0.25", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "vs_baseline.md").is_file()


@pytest.mark.parametrize(("args", "message"), [
    pytest.param(["--compare", "missing", "{new}"], "--compare OLD: missing has no cells/ directory", id="no-old"),
    pytest.param(["--compare", "{new}", "{new}", "--tolerance", "1.5"], "--tolerance: 1.5 is not a fraction in [0, 1)", id="tolerance"),
    pytest.param(["{new}", "--trend", "{new}"], "give one of RESULTS_DIR, --compare OLD NEW or --trend DIR...",
                 id="two-modes"),
    pytest.param(["--trend", "{empty}"], "has no cell files", id="empty-run"),
])
def test_bad_usage_names_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      args: list[str], message: str) -> None:
    new = write_run(tmp_path / "new", quiet_run())
    (tmp_path / "empty" / "cells").mkdir(parents=True)
    with pytest.raises(SystemExit) as err:
        main([a.format(new=new, empty=tmp_path / "empty") for a in args])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_trend_plots_each_context_and_concurrency_over_runs_by_date(tmp_path: Path) -> None:
    dates = ("2026-11-29T02:00:00+00:00", "2026-11-27T02:00:00+00:00", "2026-11-28T02:00:00+00:00")
    dirs = [write_run(tmp_path / f"night-{i}", quiet_run(scale=1.0 + i / 10, started_at=d, commit=f"{i}" * 40))
            for i, d in enumerate(dates)]
    dirs[2] = write_run(dirs[2], [make_cell(DEFAULT, 512, 4, [300.0, 310.0], [2.5, 2.6], started_at=dates[2])])
    out = tmp_path / "trend"
    assert main(["--trend", *map(str, dirs), "--out", str(out)]) == 0
    assert [r.path.name for r in load_runs(dirs)] == ["night-1", "night-2", "night-0"]  # by date
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["trend_ctx512_c4.png", "trend_ctx60_c1.png", "trend_ctx60_c4.png"]
    assert all((out / p).read_bytes().startswith(PNG_MAGIC) for p in pngs)
    text = (out / "trend.md").read_text()
    assert "1. 2026-11-27 02:00 1111111: " in text and "3. 2026-11-29 02:00 0000000: " in text
    assert "## context 60, concurrency 1" in text and "![trend](trend_ctx60_c1.png)" in text
    # night-1 (x1.1), night-2 (x1.2), night-0 (x1.0), oldest first; acceptance in brackets
    assert "| b8-k4-w2048-bs8 | 110.0 (2.20) | 120.0 (2.20) | 100.0 (2.20) |" in text
    assert "| b8-k4-w2048-bs8 | - | 305.0 (2.60) | - |" in text  # measured by one run only


def test_rate_cells_trend_apart_from_each_other_and_from_concurrency_cells(tmp_path: Path) -> None:
    cells = [make_cell(DEFAULT, 60, 1, [100.0]), make_cell(DEFAULT, 60, 0, [50.0]), make_cell(DEFAULT, 60, 0, [80.0])]
    cells[1].request_rate, cells[2].request_rate = 0.5, 4.0
    run = write_run(tmp_path / "night", cells)
    out = tmp_path / "trend"
    assert main(["--trend", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["trend_ctx60_c1.png", "trend_ctx60_r0.5.png", "trend_ctx60_r4.png"]
    text = (out / "trend.md").read_text()
    assert text.index("## context 60, concurrency 1") < text.index("## context 60, 0.5 requests/s") \
        < text.index("## context 60, 4 requests/s")
    assert "| b8-k4-w2048-bs8 | 50.0 |" in text and "| b8-k4-w2048-bs8 | 80.0 |" in text
