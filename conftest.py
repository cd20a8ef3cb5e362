"""Root pytest configuration: markers and torch's thread count for tests (the suite's options and fixtures come
from the installed `ddtree` pytest plugin, ddtree/suite/plugin.py, which pyproject's `ddtree_suite = true` turns on)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

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


MEASURED = ("perf", "bench")  # items whose numbers are the point: they run with torch's own thread count
_torch_default_threads: list[int] = []  # torch's own count, read before the first change


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests run torch on tiny models in this process: one intra-op thread is fastest, and more spin-wait for
    each other on a busy 2-core machine or beside another xdist worker (engine tests took 3-20x as long).
    Processes the tests start keep torch's default; so do perf and bench items."""
    torch = sys.modules.get("torch")  # not imported here: pytester's inner runs copy this file and may not need it
    if torch is not None:
        if not _torch_default_threads:
            _torch_default_threads.append(torch.get_num_threads())
        measured = any(request.node.get_closest_marker(m) for m in MEASURED)
        wanted = _torch_default_threads[0] if measured else 1
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
    yield


@pytest.fixture(autouse=True)
def _unfreeze_the_heap() -> Iterator[None]:
    """Code under test may gc.freeze() this process (the server and the in-process bench do: no full collection
    walks their start-up heap). Frozen objects are never collected: later tests would run on a heap the test
    left, and at exit Triton's bindings report the compile garbage frozen with it as leaked ("nanobind: leaked
    ... functions"). What a test froze goes back to the collector when it ends."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
