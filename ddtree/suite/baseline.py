"""`--baseline DIR|latest`: every sweep cell judged against the same cell of an earlier run.

    pytest -m perf --config-grid smoke --baseline latest       # latest: the newest other run beside --results-dir
    pytest -m perf --config-grid full --baseline results/night-41 --baseline-tolerance 0.05

Its options join the "ddtree" group. The baseline is resolved once per process at configure (a
missing or empty one is a usage error), and only then are BaselineCheck's hooks registered. At
the end of the run (the controller, under xdist) every cell is compared with the baseline's
(ddtree.bench.baseline: per-cell verdicts, shifts over all cells and per config, coding gates).
The verdicts wait for the whole run because the noise between two runs is read from the scatter of
all their cells' ratios. Anything regressed fails the run (exit status 1) and the terminal section
"ddtree baseline" names it with measured, baseline, ratio, tolerance and both spreads. The
baseline's path, commit and GPU go to RESULTS/baseline.json, from which the sweep summary draws
its "vs baseline" column and "what moved" list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.baseline import (
    DEFAULT_TOLERANCE,
    Comparison,
    baseline_record,
    check_tolerance,
    compare_runs,
    resolve_baseline,
    write_baseline_record,
)
from ddtree.bench.results import CELLS_DIR, CellResult, read_cells
from ddtree.suite.options import SuiteOptions, raw_option
from ddtree.suite.state import SuiteState

HELP = {
    "baseline": "compare every cell with an earlier results directory: DIR, or `latest` (the newest other "
                "run beside --results-dir); a cell slower beyond tolerance and noise fails",
    "baseline_tolerance": f"fraction a median may drop before it can regress, in [0, 1) (default {DEFAULT_TOLERANCE:g})",
}
SECTION = "ddtree baseline"


@dataclass
class Baseline:
    """The resolved baseline of this run: where it is, what was asked for, its cells."""

    path: Path
    requested: str
    tolerance: float
    cells: list[CellResult]
    gate_threshold: float | None


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddtree")
    for name, metavar in (("baseline", "DIR|latest"), ("baseline-tolerance", "FRACTION")):
        dest = name.replace("-", "_")
        group.addoption(f"--{name}", dest=f"ddtree_{dest}", metavar=metavar, help=HELP[dest])
        parser.addini(f"ddtree_{dest}", HELP[dest], default=None)


def load_baseline(config: pytest.Config, options: SuiteOptions) -> Baseline | None:
    """The baseline the options name, read once per process at configure; None without --baseline."""
    arg, where = raw_option(config, "baseline")
    if not arg:
        return None
    tol_value, tol_where = raw_option(config, "baseline_tolerance")
    try:
        tolerance = check_tolerance(float(tol_value), tol_where) if tol_value is not None else DEFAULT_TOLERANCE
    except ValueError as err:
        raise pytest.UsageError(f"{tol_where}: {tol_value!r} is not valid; expected a fraction in [0, 1), "
                                f"e.g. 0.1 ({err})") from err
    try:
        path = resolve_baseline(str(arg), options.results_dir)
    except ValueError as err:
        raise pytest.UsageError(f"{where}: {err}") from err
    if path == options.results_dir.resolve():
        raise pytest.UsageError(f"{where}: {path} is this run's own --results-dir; name an earlier run")
    return Baseline(path, str(arg), tolerance, read_cells(path), options.grid.quality.threshold)


class BaselineCheck:
    """The hooks of a run with a baseline (registered by ddtree.suite.plugin only then): the header line,
    the judgement at the end of the run and its terminal section."""

    def __init__(self, baseline: Baseline, options: SuiteOptions, state: SuiteState) -> None:
        self.baseline = baseline
        self.options = options
        self.state = state
        self.comparison: Comparison | None = None

    def pytest_report_header(self) -> list[str]:
        b = self.baseline
        record = baseline_record(b.path, b.requested, b.tolerance)
        return [f"ddtree baseline: {b.path} ({b.requested}): {len(b.cells)} cells, commit {record['commit']}, "
                f"GPU {record['gpu']}; tolerance {b.tolerance:g}"]

    @pytest.hookimpl(tryfirst=True)  # before the suite's session writes the summary, which reads baseline.json
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Record the baseline, judge the run against it, and fail the run when something regressed."""
        b = self.baseline
        if hasattr(session.config, "workerinput") or not self.state.service_used:
            return
        results = self.options.results_dir
        if not (results / CELLS_DIR).is_dir():
            return
        record = baseline_record(b.path, b.requested, b.tolerance)
        write_baseline_record(results, {**record, "gate_threshold": b.gate_threshold})
        self.comparison = compare_runs(results, b.path, b.tolerance, b.gate_threshold, self.options.floors.basis)
        if not self.comparison.ok and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # what pytest returns after sessionfinish

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        comparison = self.comparison
        if comparison is None:
            return
        tr = terminalreporter
        tr.section(SECTION, red=not comparison.ok)
        tr.write_line(f"baseline: {comparison.baseline_path} (commit {comparison.baseline['commit']}, "
                      f"GPU {comparison.baseline['gpu']}); tolerance {comparison.tolerance:g}")
        for note in comparison.differences():
            tr.write_line(f"note: {note}")
        moved = comparison.moved()
        for line in moved or ["nothing moved beyond tolerance and noise"]:
            tr.write_line(line, red=line.startswith("REGRESSED"), green=line.startswith("improved"))
        verdict = "no regression" if comparison.ok else "REGRESSION: the run fails"
        tr.write_line(f"verdict: {verdict} ({len(comparison.cells)} cells compared, pair noise sigma "
                      f"{comparison.noise:.1%})", red=not comparison.ok)
