"""Root pytest configuration: markers (the suite's options and fixtures come from ddtree.suite)."""

from __future__ import annotations

import pytest

# The suite (options, cells, the service fixture) is a plugin module so that pytester runs and
# other checkouts can load it with `-p ddtree.suite.plugin`; pytester tests the plugin itself.
pytest_plugins = ["pytester", "ddtree.suite.plugin"]

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
