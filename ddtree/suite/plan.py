"""`--plan`: print the sweep's deploy order, deploys, cells and estimated wall time, then start nothing.

    pytest -m perf --config-grid full --plan                       # no estimate without a previous run
    pytest -m perf --config-grid full --plan --baseline latest     # times from the newest earlier run

Its option joins the "ddtree" group; PlanPrinter's hook is registered only with --plan. The plan
is printed at session start, after every option was checked and before xdist starts a worker or any
fixture runs, and the run then exits (status 0): no service is started or contacted. The estimate's
previous run is --baseline's (DIR or latest), else --results-dir when it already holds a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.baseline import is_results_dir, resolve_baseline
from ddtree.bench.plan import Plan, deploy_steps, estimate, render_plan
from ddtree.suite.options import SuiteOptions, raw_option
from ddtree.suite.state import SuiteState

HELP = ("print the deploy order, the number of deploys and cells and an estimate of the wall time (from --baseline "
        "DIR|latest or an existing --results-dir), then exit without starting anything")
RESTARTING = ("local", "sglang", "systemd", "fake")  # url only observes


def add_options(parser: pytest.Parser) -> None:
    parser.getgroup("ddtree").addoption("--plan", dest="ddtree_plan", action="store_true", default=False, help=HELP)


def previous_run(config: pytest.Config, options: SuiteOptions) -> Path | None:
    """The run the estimate reads: --baseline's, else --results-dir when it holds one; None otherwise."""
    results = options.results_dir
    arg, _ = raw_option(config, "baseline")
    if arg:
        try:
            return resolve_baseline(str(arg), results)
        except ValueError as err:
            raise pytest.UsageError(str(err)) from err
    return results if is_results_dir(results) else None


def build(config: pytest.Config, options: SuiteOptions, state: SuiteState) -> Plan:
    plan = Plan(deploy_steps(state.expansion.kept, options.grid.default.id), restarts=options.service in RESTARTING)
    previous = previous_run(config, options)
    return estimate(plan, options.grid, previous) if previous is not None else plan


class PlanPrinter:
    """The hook of a --plan run (registered by ddtree.suite.plugin only then, and not in xdist workers)."""

    def __init__(self, options: SuiteOptions, state: SuiteState) -> None:
        self.options = options
        self.state = state

    @pytest.hookimpl(tryfirst=True)  # before xdist starts workers and before the session header
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        config, options = session.config, self.options
        lines = render_plan(build(config, options, self.state), options.grid, options.service,
                            len(self.state.expansion.removed))
        if options.grid.slo is not None:
            lines.append(f"SLO: {options.grid.slo.describe()}")
        reporter: Any = config.pluginmanager.get_plugin("terminalreporter")
        for line in lines:
            if reporter is not None:
                reporter.write_line(line)
            else:
                print(line)
        pytest.exit("--plan: nothing was started", returncode=0)
