"""The sweep: one test per grid cell (config x context x load), measured against its floor.

    pytest -m perf --config-grid smoke        # ids like b8-k4-w2048-bs8-ctx60-c1 (-r2: 2 requests/s)

How a cell is measured and judged is ddtree.suite.sweep's (pace-normalised throughput, acceptance;
docs/results.md, "How a verdict is computed"); a config's last cell also carries its config's verdict,
the medians over its cells of tok/s and speed-up over AR.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddtree.grid import Cell
from ddtree.service.manager import ServiceManager
from ddtree.suite.options import SuiteOptions
from ddtree.suite.pace import PaceLog
from ddtree.suite.sweep import judge, measure_cell

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
    result = measure_cell(cell, deployed, suite, prompt_maker, pace)
    judge(request.config, suite, cell, result)

