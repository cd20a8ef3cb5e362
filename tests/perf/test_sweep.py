"""The sweep: one test per grid cell (config x context x load), measured against its floor.

    pytest -m perf --config-grid smoke        # ids like b8-k4-w2048-bs8-ctx60-c1 (-r2: 2 requests/s)

The cell runner is ddtree.suite.sweep.run_cell: it measures the cell, writes its file and judges it
(pace-normalised throughput, acceptance; docs/results.md, "How a verdict is computed"); a config's last
cell also carries its config's verdict, the medians over its cells of tok/s and speed-up over AR. This
file only declares the test, so that `-k`, `--collect-only` and node ids name the cells.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddtree.grid import Cell
from ddtree.service.manager import ServiceManager
from ddtree.suite.options import SuiteOptions
from ddtree.suite.pace import PaceLog
from ddtree.suite.sweep import run_cell

pytestmark = pytest.mark.perf


def test_sweep(
    request: pytest.FixtureRequest,
    cell: Cell,
    resume_skip: None,
    deployed: ServiceManager,
    suite: SuiteOptions,
    prompt_maker: Callable[[int, int], list[list[int]]],
    pace: PaceLog,
) -> None:
    run_cell(request.config, cell, deployed, suite, prompt_maker, pace)

