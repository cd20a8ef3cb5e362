"""Root pytest configuration: markers (the suite's options and fixtures come from the installed
`ddtree` pytest plugin, ddtree/suite/plugin.py, which pyproject's `ddtree_suite = true` turns on)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]  # the suite's own tests run inner pytests

MARKERS = {
    "perf": "the sweep: throughput/latency per grid cell and floors (not part of a bare `pytest` unless selected)",
    "bench": "benchmarks outside the sweep: tree core CPU micro-benchmarks, server throughput (opt-in: -m bench or the file)",
    "quality": "output-quality gates: coding pass@k, lossless check, acceptance floor",
    "kernels": "correctness of the DDTree core and kernels against slow references",
    "gpu": "needs a CUDA device; skipped with a reason elsewhere",
    "slow": "takes more than a few seconds on 2 CPU cores",
    "systemd": "boots a real systemd in namespaces (root, systemd, openssh-server); skipped elsewhere, failed in CI",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
