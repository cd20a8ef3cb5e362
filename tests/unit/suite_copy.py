"""A pytester directory that runs the suite as this repository does: the real root conftest and the real
sweep test, with no DDTREE_FAKE_* variables of the outer run leaking in (shared by the plugin's tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def copy_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in [n for n in os.environ if n.startswith("DDTREE_FAKE_")]:
        monkeypatch.delenv(name)
    pytester.makeconftest((REPO / "conftest.py").read_text())
    perf = pytester.mkdir("tests").joinpath("perf")
    perf.mkdir()
    (perf / "test_sweep.py").write_text((REPO / "tests/perf/test_sweep.py").read_text())
    return pytester
