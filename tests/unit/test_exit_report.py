"""A test run ends with pytest's summary, not with Triton's nanobind leak report.

Code under test may gc.freeze() the pytest process (the server and the in-process bench do). Garbage frozen
with it is never collected, and at exit Triton's bindings count the objects it holds as leaked and print a
report of hundreds of lines after the summary. The root conftest hands frozen objects back to the collector
after each test; this checks that in a fresh process, with a cycle holding a Triton IR object.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LEAK = "nanobind: leaked"
FROZEN_CYCLE = """
import gc


def test_freezes_a_cycle_holding_triton_ir() -> None:
    from triton._C.libtriton import ir

    cycle: list = [ir.context()]
    cycle.append(cycle)
    del cycle
    gc.freeze()
"""


# At import, not in the fixture: pytester drops the modules a test imported when it ends, and a second import of
# Triton's native module in one process aborts it (and its dropped first copy prints the leak report at exit).
pytest.importorskip("triton._C.libtriton", reason="triton is not installed")


@pytest.fixture
def frozen_cycle_run(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_frozen=FROZEN_CYCLE)
    return pytester


def test_the_root_conftest_leaves_no_leak_report(frozen_cycle_run: pytest.Pytester) -> None:
    frozen_cycle_run.makeconftest((REPO / "conftest.py").read_text())
    result = frozen_cycle_run.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert LEAK not in result.stderr.str() + result.stdout.str(), result.stderr.str()[:2000]


def test_without_it_triton_reports_the_frozen_objects(frozen_cycle_run: pytest.Pytester) -> None:
    """The check above can fail: the same run without the conftest ends with the report."""
    result = frozen_cycle_run.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:ddtree")
    result.assert_outcomes(passed=1)
    assert LEAK in result.stderr.str(), "no leak report without the conftest: Triton no longer reports frozen objects"
