"""Root pytest configuration: markers (the suite's options and fixtures come from ddtree.suite)."""

from __future__ import annotations

import pytest

MARKERS = {
    "perf": "throughput/latency measurements and floors (not part of a bare `pytest` pass/fail unless selected)",
    "quality": "output-quality gates: coding pass@k, lossless check, acceptance floor",
    "kernels": "correctness of the DDTree core and kernels against slow references",
    "gpu": "needs a CUDA device; skipped with a reason elsewhere",
    "slow": "takes more than a few seconds on 2 CPU cores",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
