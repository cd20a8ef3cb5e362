"""Root pytest configuration: markers (the suite's options and fixtures come from the installed
`ddtree` pytest plugin, ddtree/suite/plugin.py, which pyproject's `ddtree_suite = true` turns on)."""

from __future__ import annotations

import sys

import pytest

# The suite is the installed pytest11 plugin `ddtree` (loaded before this file). In a checkout that was
# not pip-installed this loads it instead (then a `--flag PATH` option must follow a test path or be
# written --flag=PATH: pytest reads paths before it reads this file).
_SUITE = [] if "ddtree.suite.plugin" in sys.modules else ["ddtree.suite.plugin"]
pytest_plugins = ["pytester", *_SUITE]

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
