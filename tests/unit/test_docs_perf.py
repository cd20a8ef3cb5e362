"""docs/perf.md holds each measure's latest table, each one saying when, where, at which commit and how.

The convention the file states at its top: every table follows a paragraph that starts with `Measured:`,
and from that line to the table the text names a date (YYYY-MM-DD), a device (H200 or CPU), a commit
(`commit <hash>`) and a command (`python -m ddtree.<module>` or `pytest ...`). The file stays within
MAX_LINES; history lives in `git log -p docs/perf.md`, not in the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

PERF_MD = Path(__file__).resolve().parents[2] / "docs" / "perf.md"
MAX_LINES = 400
MEASURED = "Measured:"
# What the text from a `Measured:` line to its table must name, by what it is called in a failure.
REQUIRED = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a device": re.compile(r"\b(H200|CPU)\b"),
    "a commit": re.compile(r"\bcommit [0-9a-f]{7,40}\b"),
    "a command": re.compile(r"python -m ddtree\.[a-z_.]+|\bpytest "),
}


class Table(NamedTuple):
    line: int  # 1-based line of the table's header row
    preamble: list[str]  # the lines since the last heading or table, before this table


def tables(lines: list[str]) -> list[Table]:
    """Each markdown table with the lines between it and the heading or table before it."""
    found: list[Table] = []
    since: list[str] = []
    in_table = False
    for number, line in enumerate(lines, start=1):
        if line.startswith("|"):
            if not in_table:
                found.append(Table(number, since))
            in_table, since = True, []
            continue
        in_table = False
        since = [] if line.startswith("#") else since + [line]
    return found


def missing(table: Table) -> list[str]:
    """What the table's `Measured:` paragraph fails to name (all of it when there is no such paragraph)."""
    starts = [i for i, line in enumerate(table.preamble) if line.startswith(MEASURED)]
    if not starts:
        return [f"a paragraph starting with {MEASURED!r}"]
    text = " ".join(table.preamble[starts[-1]:])
    return [what for what, pattern in REQUIRED.items() if not pattern.search(text)]


def test_perf_md_is_at_most_max_lines() -> None:
    count = len(PERF_MD.read_text(encoding="utf-8").splitlines())
    assert count <= MAX_LINES, f"docs/perf.md has {count} lines, the limit is {MAX_LINES}: keep latest tables only"


def test_every_table_says_when_where_which_commit_and_how() -> None:
    lines = PERF_MD.read_text(encoding="utf-8").splitlines()
    found = tables(lines)
    assert found, "docs/perf.md has no tables"
    failures = [f"line {t.line}: no {', '.join(gaps)}" for t in found if (gaps := missing(t))]
    assert not failures, "tables in docs/perf.md without their Measured: paragraph's facts:\n" + "\n".join(failures)


def test_commands_name_the_profiling_tools_where_they_live() -> None:
    # The engine-profiling tools run as `python -m ddtree.profiling.<tool>`; ddtree.bench is the sweep's runtime.
    text = PERF_MD.read_text(encoding="utf-8")
    assert "python -m ddtree.bench" not in text


def test_the_convention_is_stated_and_checked_on_a_table_without_it() -> None:
    assert MEASURED in PERF_MD.read_text(encoding="utf-8").split("\n## ")[0]
    bare = ["## A measure", "", "Some prose, 2026-12-01.", "", "| a | b |", "|---|---|", "| 1 | 2 |"]
    assert missing(tables(bare)[0]) == [f"a paragraph starting with {MEASURED!r}"]
    partial = ["Measured: CPU, 2026-12-01, `python -m ddtree.profiling.paired`.", "", "| a |", "|---|"]
    assert missing(tables(partial)[0]) == ["a commit"]
