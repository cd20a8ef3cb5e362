"""The pytest plugin that turns a configuration grid into a test run.

Installed as the pytest11 entry point `ddtree` (pyproject), so its options exist before pytest
reads the command line, from any directory and with any paths (`-p no:ddtree` turns it off).
Only the hooks every run needs live here as module functions: the options (this module's and
those of ddtree.suite.baseline, .slo and .plan), the rootdir repair, the xdist distribution mode,
and pytest_configure, which decides whether the run is the suite's: the ini sets `ddtree_suite =
true` (this repository's pyproject does) or a ddtree option is given. Only then does it register
the session object (ddtree.suite.session.SuiteSession), the fixtures (ddtree.suite.fixtures), and,
when asked for, the baseline check and the plan printer. In another project's run no option is
required, nothing is deselected or reordered, and no other ddtree hook or fixture exists.

Selection: perf items are measurements (minutes per config, numbers that depend on the machine),
so a bare `pytest` deselects them (and says so); they are selected when `-m` mentions perf, when
--config-grid is given, or when a path or node id inside their directory is named. `bench` items
(the tree core's CPU micro-benchmarks, the server throughput bench) are opt-in the same way but
only by `-m bench` or by naming their file, so `-m perf` is the sweep alone. Quality items
(the lossless check and the coding gate on the smoke grid) run in a bare `pytest` against the
embedded service: they are correctness, and take well under a minute with the fixture models.

Order: items without a config first, unchanged; then config items grouped by config in deploy
order (NONE baseline, then the default, then the grid file's order), within a config by test
function, context and concurrency.

xdist: with `-n N` and no --dist, `--dist loadgroup` is chosen; every cell of a config carries
`xdist_group(<config id>)`, each worker owns its own service, and the controller merges the
cell files of the shared results directory into one summary at the end.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from ddtree.suite import baseline, plan, slo
from ddtree.suite.cells import Expansion
from ddtree.suite.options import add_options, option_flags, parse_options, suite_requested
from ddtree.suite.rootdir import redo_ini_setup
from ddtree.suite.session import SESSION_PLUGIN, SuiteSession
from ddtree.suite.state import OPTIONS_KEY, STATE_KEY, SuiteState

FIXTURES_MODULE = "ddtree.suite.fixtures"
BASELINE_PLUGIN = "ddtree-baseline"
PLAN_PLUGIN = "ddtree-plan"
SUITE_MARKERS = {
    "perf": "the sweep: one test per grid cell (config x context x concurrency), measured against its floor",
    "bench": "benchmarks outside the sweep (tree core CPU micro-benchmarks, server throughput); opt-in",
    "quality": "output-quality gates: coding pass@k, lossless check, acceptance floor",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)
    baseline.add_options(parser)
    slo.add_options(parser)
    plan.add_options(parser)


@pytest.hookimpl(tryfirst=True)  # before the initial conftests load from the rootdir
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    redo_ini_setup(early_config, parser, args, option_flags(parser))


def _choose_loadgroup(config: pytest.Config) -> None:
    """With `-n N` and no explicit --dist, cells of one config must share a worker: --dist loadgroup.

    Done both before and after xdist's own pytest_cmdline_main (which turns -n into --dist load),
    since the order of tryfirst hooks differs between pytest releases; xdist reads the value only
    when its session starts, in its trylast pytest_configure.
    """
    if not getattr(config.option, "numprocesses", None) or getattr(config, "workerinput", None):
        return
    args = config.invocation_params.args
    if any(a in ("--dist", "-d") or a.startswith("--dist=") for a in args):
        return  # the user chose a distribution mode
    config.option.dist = "loadgroup"
    config.option.loadgroup = True


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if suite_requested(config):
        _choose_loadgroup(config)


def pytest_configure(config: pytest.Config) -> None:
    """Activate the suite in its own runs: validate every option, then register the session's hooks."""
    if not suite_requested(config):
        return
    _choose_loadgroup(config)
    for name, text in SUITE_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.addinivalue_line("markers", "xdist_group(name): cells of one server config share a worker")
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    results_dir = Path(workerinput["ddtree_results_dir"]) if workerinput and "ddtree_results_dir" in workerinput else None
    if workerinput and workerinput.get("ddtree_loadgroup"):
        config.option.loadgroup = True  # workers re-parse the args, which may lack --dist
    options = parse_options(config, results_dir)
    state = SuiteState(Expansion.of(options.grid, options.max_context))
    slo.apply_slo(config, options)
    earlier_run = baseline.load_baseline(config, options)
    config.stash[OPTIONS_KEY] = options
    config.stash[STATE_KEY] = state
    stop_on_sigterm()
    manager = config.pluginmanager
    manager.register(SuiteSession(config, options, state), SESSION_PLUGIN)
    if earlier_run is not None:
        manager.register(baseline.BaselineCheck(earlier_run, options, state), BASELINE_PLUGIN)
    if config.getoption("ddtree_plan") and workerinput is None:
        manager.register(plan.PlanPrinter(options, state), PLAN_PLUGIN)
    if not manager.has_plugin(FIXTURES_MODULE):
        manager.import_plugin(FIXTURES_MODULE)


def stop_on_sigterm() -> None:
    """SIGTERM (a CI job's timeout, `kill`, a systemd stop) ends the run as Ctrl-C does: the session
    fixtures tear down, so the default is restored and verified and a local service is stopped. Left
    alone when another handler is installed."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
