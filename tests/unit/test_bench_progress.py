"""Progress lines are plain text (no escape codes) when the output is not a terminal."""

from __future__ import annotations

import io

import pytest

from ddtree.bench.progress import Progress


def test_one_plain_line_per_cell() -> None:
    out = io.StringIO()
    progress = Progress(3, file=out)
    progress.cell_done("b8-k4-w2048-bs8", 1024, 32,
                       {"output_throughput": 812.44, "accept_length": 3.414, "failed": 0})
    progress.cell_skipped("ar", 1024, 32, "exists, --resume")
    progress.cell_failed("b16-k4-w2048-bs8", 1024, 32, "service died\nlog tail ...")
    lines = out.getvalue().splitlines()
    assert lines == [
        "[1/3] b8-k4-w2048-bs8 ctx=1024 c=32 ... 812.4 tok/s, accept 3.41, 0 failed",
        "[2/3] ar ctx=1024 c=32 ... skipped (exists, --resume)",
        "[3/3] b16-k4-w2048-bs8 ctx=1024 c=32 ... FAILED: service died",
    ]
    assert "\x1b" not in out.getvalue()


def test_missing_numbers_and_long_lines_do_not_wrap() -> None:
    out = io.StringIO()
    line = Progress(1, file=out).cell_done("x" * 300, 1, 1, {"failed": 2})
    assert line.endswith("- tok/s, accept -, 2 failed")
    assert out.getvalue() == line + "\n"
    with pytest.raises(ValueError, match="total"):
        Progress(-1)
