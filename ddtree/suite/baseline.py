"""`--baseline DIR|latest`: every sweep cell judged against the same cell of an earlier run.

    pytest -m perf --config-grid smoke --baseline latest       # latest: the newest other run beside --results-dir
    pytest -m perf --config-grid full --baseline results/night-41 --baseline-tolerance 0.05

A plugin of its own (loaded by ddtree.suite.plugin): its options join the "ddtree" group. The
baseline is resolved once per process at configure (a missing or empty one is a usage error). Right
after a sweep cell's test body passes, its cell file is compared with the baseline's
(ddtree.bench.baseline: ratio of medians, tolerance, non-overlapping spreads); a regressed cell
fails with measured, baseline, ratio, tolerance and both spreads. A config whose coding gate passed
in the baseline and fails now fails its gate item the same way. At the end of the run the
baseline's path, commit and GPU go to RESULTS/baseline.json, from which the sweep summary draws
its "vs baseline" column and "what moved" list, and the terminal summary lists what moved.
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
    compare_cells,
    compare_runs,
    resolve_baseline,
    write_baseline_record,
)
from ddtree.bench.results import CELLS_DIR, CellResult, cell_filename, read_cells, read_quality
from ddtree.suite.cells import CELL_ARG, CONFIG_ARG
from ddtree.suite.state import suite_active, suite_options, suite_state

HELP = {
    "baseline": "compare every cell with an earlier results directory: DIR, or `latest` (the newest other "
                "run beside --results-dir); a cell slower beyond tolerance and noise fails",
    "baseline_tolerance": f"fraction a median may drop before it can regress, in [0, 1) (default {DEFAULT_TOLERANCE:g})",
}
SECTION = "ddtree baseline"


@dataclass
class Baseline:
    """The resolved baseline of this run: where it is, what was asked for, its cells and gates."""

    path: Path
    requested: str
    tolerance: float
    cells: list[CellResult]
    gates: dict[str, dict[str, Any]]
    gate_threshold: float | None


BASELINE_KEY = pytest.StashKey[Baseline | None]()


def _baseline(config: pytest.Config) -> Baseline | None:
    """This run's baseline; None without --baseline and in runs that are not the suite's."""
    return config.stash.get(BASELINE_KEY, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddtree")
    for name, metavar in (("baseline", "DIR|latest"), ("baseline-tolerance", "FRACTION")):
        dest = name.replace("-", "_")
        group.addoption(f"--{name}", dest=f"ddtree_{dest}", metavar=metavar, help=HELP[dest])
        parser.addini(f"ddtree_{dest}", HELP[dest], default=None)


def _raw(config: pytest.Config, dest: str) -> tuple[Any, str]:
    value = config.getoption(f"ddtree_{dest}")
    if value is not None:
        return value, "--" + dest.replace("_", "-")
    return config.getini(f"ddtree_{dest}") or None, f"ini key ddtree_{dest}"


def load_baseline(config: pytest.Config) -> Baseline | None:
    """The baseline the options name, read once; None without --baseline."""
    arg, where = _raw(config, "baseline")
    if not arg:
        return None
    tol_value, tol_where = _raw(config, "baseline_tolerance")
    try:
        tolerance = check_tolerance(float(tol_value), tol_where) if tol_value is not None else DEFAULT_TOLERANCE
    except ValueError as err:
        raise pytest.UsageError(f"{tol_where}: {tol_value!r} is not valid; expected a fraction in [0, 1), "
                                f"e.g. 0.1 ({err})") from err
    options = suite_options(config)
    try:
        path = resolve_baseline(str(arg), options.results_dir)
    except ValueError as err:
        raise pytest.UsageError(f"{where}: {err}") from err
    if path == options.results_dir.resolve():
        raise pytest.UsageError(f"{where}: {path} is this run's own --results-dir; name an earlier run")
    return Baseline(path, str(arg), tolerance, read_cells(path), read_quality(path),
                    options.grid.quality.threshold)


@pytest.hookimpl(trylast=True)  # after ddtree.suite.plugin has parsed the suite's options
def pytest_configure(config: pytest.Config) -> None:
    if suite_active(config):  # inert in runs that are not the suite's: every other hook sees no baseline
        config.stash[BASELINE_KEY] = load_baseline(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    b = _baseline(config)
    if b is None:
        return []
    record = baseline_record(b.path, b.requested, b.tolerance)
    return [f"ddtree baseline: {b.path} ({b.requested}): {len(b.cells)} cells, commit {record['commit']}, "
            f"GPU {record['gpu']}; tolerance {b.tolerance:g}"]


def _judge(item: pytest.Item, b: Baseline) -> list[str]:
    """Failures of this item against the baseline: a regressed cell, or a gate that flipped."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    results = suite_options(item.config).results_dir
    if CELL_ARG in params:
        cell = params[CELL_ARG]
        path = results / CELLS_DIR / cell_filename(cell.config_id, cell.context, cell.concurrency)
        if not path.is_file():  # a test with a `cell` that writes no cell file has nothing to judge
            return []
        current = [c for c in read_cells(results) if c.filename == path.name]
        comparison = compare_cells(current, b.cells, b.tolerance, baseline_path=str(b.path))
        return comparison.failures()
    if CONFIG_ARG in params:
        config_id = params[CONFIG_ARG].id
        now = read_quality(results).get(config_id)
        if now is None or config_id not in b.gates:
            return []
        comparison = compare_cells([], [], b.tolerance, current_gates={config_id: now},
                                   baseline_gates={config_id: b.gates[config_id]}, gate_threshold=b.gate_threshold)
        return comparison.failures()
    return []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield  # a test body that failed on its own is reported as it is
    b = _baseline(item.config)
    if b is not None:
        failures = _judge(item, b)
        if failures:
            pytest.fail("regression against baseline " + str(b.path) + ": " + " | ".join(failures), pytrace=False)
    return result


def _comparison(config: pytest.Config) -> Comparison | None:
    b = _baseline(config)
    results = suite_options(config).results_dir
    if b is None or not suite_state(config).service_used or not (results / CELLS_DIR).is_dir():
        return None
    return compare_runs(results, b.path, b.tolerance, b.gate_threshold)


@pytest.hookimpl(tryfirst=True)  # before ddtree.suite.plugin writes the summary, which reads baseline.json
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    b = _baseline(config)
    if b is None or hasattr(config, "workerinput") or not suite_state(config).service_used:
        return
    record = baseline_record(b.path, b.requested, b.tolerance)
    write_baseline_record(suite_options(config).results_dir, {**record, "gate_threshold": b.gate_threshold})


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    comparison = _comparison(config)
    if comparison is None:
        return
    tr = terminalreporter
    tr.section(SECTION)
    tr.write_line(f"baseline: {comparison.baseline_path} (commit {comparison.baseline['commit']}, "
                  f"GPU {comparison.baseline['gpu']}); tolerance {comparison.tolerance:g}")
    for note in comparison.differences():
        tr.write_line(f"note: {note}")
    moved = comparison.moved()
    for line in moved or ["nothing moved beyond tolerance and noise"]:
        tr.write_line(line, red=line.startswith("REGRESSED"), green=line.startswith("improved"))
    tr.write_line(f"verdict: {'no regression' if comparison.ok else 'REGRESSION'} "
                  f"({len(comparison.cells)} cells compared)", red=not comparison.ok)
