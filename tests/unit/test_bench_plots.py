"""Plots are written as non-empty PNGs, one set per context, from the cell files."""

from __future__ import annotations

from pathlib import Path

from ddtree.bench.plots import write_plots
from ddtree.bench.results import CellResult, write_cell
from ddtree.config import SpecConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cell(config_id: str, context: int, concurrency: int, tps: float, accept: float | None) -> CellResult:
    metrics = {"output_throughput": tps, "median_tpot_ms": 1000.0 * concurrency / tps,
               "accept_length": accept, "failed": 0, "completed": 8}
    return CellResult(config_id=config_id, spec=SpecConfig.from_id(config_id).to_dict(),
                      context=context, concurrency=concurrency, repeats=1, metrics=metrics,
                      per_repeat=[], backend="fake")


def test_plots_are_non_empty_pngs(tmp_path: Path) -> None:
    for context in (128, 1024):
        for c in (1, 8):
            for budget in (4, 8, 16):
                for topk in (2, 4):
                    write_cell(tmp_path, cell(f"b{budget}-k{topk}-w2048-bs8", context, c,
                                              10.0 * budget * c / topk, 2.0 + budget / 8))
            write_cell(tmp_path, cell("dflash-w2048-bs8", context, c, 50.0 * c, 2.5))
            write_cell(tmp_path, cell("ar", context, c, 20.0 * c, None))
    paths = write_plots(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["budget_ctx1024.png", "budget_ctx128.png", "latency_ctx1024.png", "latency_ctx128.png",
                     "pareto_ctx1024.png", "pareto_ctx128.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, (path, len(data))


def test_no_cells_no_plots(tmp_path: Path) -> None:
    assert write_plots(tmp_path) == []


def test_baselines_only(tmp_path: Path) -> None:
    cells = [cell("ar", 64, 1, 20.0, None), cell("dflash-wnone-bs4", 64, 1, 30.0, 2.0)]
    paths = write_plots(tmp_path, cells)
    assert len(paths) == 3 and all(p.stat().st_size > 0 for p in paths)


def test_no_pareto_plot_without_a_median_tpot(tmp_path: Path) -> None:
    """A service that does not stream has no TPOT: no point to put on a frontier, so no pareto plot."""
    cells = [cell("ar", 64, 1, 20.0, None)]
    cells[0].metrics["median_tpot_ms"] = None
    names = sorted(p.name for p in write_plots(tmp_path, cells))
    assert names == ["budget_ctx64.png", "latency_ctx64.png"]


def test_rate_cells_plot_beside_concurrency_cells(tmp_path: Path) -> None:
    cells = [cell("ar", 64, 1, 20.0, None), cell("ar", 64, 0, 30.0, None), cell("ar", 64, 0, 35.0, None)]
    cells[1].request_rate, cells[2].request_rate = 0.5, 2.0
    cells[1].metrics["median_tpot_ms"] = cells[2].metrics["median_tpot_ms"] = 40.0
    paths = write_plots(tmp_path, cells)
    assert len(paths) == 3 and all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
