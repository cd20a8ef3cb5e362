"""ddtree.bench re-exports its public API, sorted, and does not pull in matplotlib."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ddtree.bench


def test_all_is_sorted_and_importable() -> None:
    names = ddtree.bench.__all__
    assert names == sorted(names)
    public = {n for n in dir(ddtree.bench) if not n.startswith("_")}
    assert set(names) <= public
    for name in names:
        assert getattr(ddtree.bench, name) is not None


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, ddtree.bench; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(ddtree.bench.__file__).parents[2])
    assert out.stdout.strip() == "False"
