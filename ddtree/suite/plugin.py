"""The pytest plugin that turns a configuration grid into a test run.

Installed as the pytest11 entry point `ddtree` (pyproject), so its options exist before pytest
reads the command line, from any directory and with any paths (`-p no:ddtree` turns it off). It
is inert unless the run is the suite's: the ini sets `ddtree_suite = true` (this repository's
pyproject does) or a ddtree option is given. Otherwise no option is required, nothing is
deselected or reordered, no fixture is registered and every hook returns at once.

When active it owns the options, the report
header, cell parametrization, the order of collected items (each server config deployed once),
opt-in selection of perf items, xdist wiring and the end-of-run summary. The fixtures
(`service`, `deployed`, ...) live in ddtree.suite.fixtures.

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

import os
import re
import signal
import statistics
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.deploys import write_deploys
from ddtree.bench.report import write_sweep_summary
from ddtree.bench.results import read_quality, write_summary_csv
from ddtree.bench.verdicts import pace_lines, write_verdicts
from ddtree.service.manager import ServiceDied
from ddtree.suite.cells import CELL_ARG, CONFIG_ARG, Expansion, parametrize, sort_items
from ddtree.suite.floors import write_floors
from ddtree.suite.options import add_options, option_flags, parse_options, suite_requested
from ddtree.suite.rootdir import redo_ini_setup
from ddtree.suite.state import OPTIONS_KEY, STATE_KEY, SuiteState, suite_active, suite_options, suite_state
from ddtree.suite.verdict import Tolerances

# Sibling plugin modules that add options (loaded with this one, inert like it); the fixtures
# module is registered only in the suite's own runs (pytest_configure).
pytest_plugins = ["ddtree.suite.baseline", "ddtree.suite.slo", "ddtree.suite.plan"]
FIXTURES_MODULE = "ddtree.suite.fixtures"

OPT_IN_MARKERS = ("perf", "bench")
SUITE_MARKERS = {
    "perf": "the sweep: one test per grid cell (config x context x concurrency), measured against its floor",
    "bench": "benchmarks outside the sweep (tree core CPU micro-benchmarks, server throughput); opt-in",
    "quality": "output-quality gates: coding pass@k, lossless check, acceptance floor",
}
SUMMARY_TITLE = "ddtree sweep"
OPT_IN_NOTE = ("deselected {n} perf/bench items: measurements are opt-in; select them with -m perf "
               "(the sweep), -m bench, --config-grid NAME or by naming their folder (bench: their file)")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


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
    config.stash[OPTIONS_KEY] = options
    stop_on_sigterm()
    config.stash[STATE_KEY] = SuiteState(Expansion.of(options.grid, options.max_context))
    if not config.pluginmanager.has_plugin(FIXTURES_MODULE):
        config.pluginmanager.import_plugin(FIXTURES_MODULE)


def stop_on_sigterm() -> None:
    """SIGTERM (a CI job's timeout, `kill`, a systemd stop) ends the run as Ctrl-C does: the session
    fixtures tear down, so the default is restored and verified and a local service is stopped. Left
    alone when another handler is installed."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


# -- xdist (optional hooks: absent without the xdist plugin) ----------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if not suite_active(node.config):
        return
    node.workerinput["ddtree_results_dir"] = str(suite_options(node.config).results_dir)
    node.workerinput["ddtree_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    if not suite_active(node.config):
        return
    wire = getattr(node, "workeroutput", {}).get("ddtree")
    if wire:
        suite_state(node.config).absorb(wire)


# -- header, parametrization, selection and order ------------------------------------------------


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not suite_active(config):
        return []
    o = suite_options(config)
    e = suite_state(config).expansion
    return [
        f"ddtree grid: {o.grid.name} ({o.grid.path}): {len(e.configs)} configs, {len(e.kept)} cells, "
        f"{len(e.removed)} removed as impossible; repeats {o.repeats}",
        f"ddtree service: {o.service}; device: {o.device}; model: {o.model_path}; drafter: {o.draft_model_path}; "
        f"dialect: {o.dialect.name}; tokens: {o.tokenize}; start retries: {o.start_retries}",
        f"ddtree results: {o.results_dir}; floors: {o.floors.profile} ({o.floors.path}), probe "
        f"{o.floors.probe or 'none'}; {_tolerances_text(o)}{'; recording floors' if o.update_floors else ''}"
        f"{'; cells without a floor fail' if o.require_floors else ''}",
    ]


def _tolerances_text(options: Any) -> str:
    t = Tolerances.of(options.floors, options.tolerance)
    return (f"tolerance: a cell's pace-normalised tok/s {t.throughput:g}, a config's median {t.config:g}, accept length "
            f"{t.accept:g}, a config's speed-up over AR {t.speedup:g}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not suite_active(metafunc.config):
        return
    if CELL_ARG in metafunc.fixturenames or CONFIG_ARG in metafunc.fixturenames:
        parametrize(metafunc, suite_state(metafunc.config).expansion)


def _opted_in(config: pytest.Config, item: pytest.Item, marker: str) -> bool:
    if re.search(rf"\b{marker}\b", config.option.markexpr or ""):
        return True
    if marker == "perf" and suite_options(config).grid_explicit:
        return True
    folder = item.path.parent if marker == "perf" else item.path  # a bench opts in by its file
    for arg in config.args:
        target = Path(arg.split("::")[0])
        target = target if target.is_absolute() else config.invocation_params.dir / target
        if target.resolve().is_relative_to(folder):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not suite_active(config):
        return
    kept, dropped = [], []
    for item in items:
        needs = [m for m in OPT_IN_MARKERS if item.get_closest_marker(m)]
        if needs and not all(_opted_in(config, item, m) for m in needs):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        suite_state(config).opt_in_deselected = len(dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    sort_items(items, suite_state(config).expansion)


def pytest_collection_finish(session: pytest.Session) -> None:
    """How many sweep cells of each config run (after -k, -m and --deselect): a config's verdict over
    its cells comes with the last of them."""
    if not suite_active(session.config):
        return
    counts = suite_state(session.config).selected_cells
    for item in session.items:
        cell = getattr(item, "callspec", None) and item.callspec.params.get(CELL_ARG)  # type: ignore[attr-defined]
        if cell is not None:
            counts[cell.config_id] = counts.get(cell.config_id, 0) + 1


# -- a service that dies under a cell --------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A cell that fails while its service is dead fails with that reason and the log tail, not
    with whatever the client saw (a connection reset); the next cell of the config redeploys."""
    try:
        return (yield)
    except Exception as err:
        manager = getattr(item, "funcargs", {}).get("deployed") if suite_active(item.config) else None
        if manager is None:
            raise
        alive, reason = manager.backend.is_alive()
        if alive:
            raise
        raise ServiceDied(f"service died during {item.callspec.id} ({reason})",  # type: ignore[attr-defined]
                          log_tail=manager.backend.log_tail()) from err


# -- end of the run ------------------------------------------------------------------------------


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)  # after the session fixtures (the service) are torn down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not suite_active(config):
        return
    state, options = suite_state(config), suite_options(config)
    if _is_worker(config):
        config.workeroutput["ddtree"] = state.to_wire()  # type: ignore[attr-defined]
        return
    if not state.service_used:
        return
    results = options.results_dir
    results.mkdir(parents=True, exist_ok=True)
    write_summary_csv(results)
    tolerances = Tolerances.of(options.floors, options.tolerance)
    write_verdicts(results, {"profile": options.floors.profile, "path": str(options.floors.path),
                             "floors_probe": options.floors.probe, "require_floors": options.require_floors,
                             "tolerances": vars(tolerances), "no_floor": state.no_floor,
                             "notes": state.verdict_notes})
    write_deploys(results, state.deploy_timings)
    restore = _merged_restore(state, options.grid.default.id) or {}
    restore = {**restore, "deploys": len(state.deploys), "deploy_order": state.deploys}  # kept in restore.json
    write_sweep_summary(results, options.grid.default.id, restore)
    if options.update_floors and state.floor_updates:  # measurements first: a failing plot must not lose them
        write_floors(options.floors, state.floor_updates, probe=state.floor_probe,
                     recorded=floors_recorded(results, config.invocation_params.args))
    if any((results / "cells").glob("*.json")):
        from ddtree.bench.plots import write_plots  # matplotlib only when there is something to plot

        write_plots(results)


def floors_recorded(results: Path, args: Sequence[str]) -> dict[str, Any]:
    """What a floors file keeps about its recording: when, where, the command and the run's pace."""
    import platform

    from ddtree.bench.results import gpu_name, now_iso, read_pace_logs

    scores = [float(r["score"]) for log in read_pace_logs(results) for r in log.get("readings") or []]
    return {"date": now_iso(), "machine": f"{platform.machine()}, {os.cpu_count()} cores"
            + (f", {gpu_name()}" if gpu_name() else ""), "command": "pytest " + " ".join(args),
            "results_dir": str(results),
            "pace": {"median": round(statistics.median(scores), 4), "min": round(min(scores), 4),
                     "max": round(max(scores), 4), "readings": len(scores)} if scores else None}


def _merged_restore(state: SuiteState, default_id: str) -> dict[str, Any] | None:
    """One restore record for the run; with xdist, ok only when every worker's restore was ok."""
    outcomes = [w["restore"] for w in state.workers if w.get("restore")] or ([state.restore] if state.restore else [])
    if not outcomes:
        return {"ok": False, "config_id": default_id, "checks": [], "error": "no restore outcome was recorded"}
    if len(outcomes) == 1:
        return outcomes[0]
    bad = [o for o in outcomes if not o.get("ok")]
    return {
        "ok": not bad,
        "config_id": default_id,
        "checks": [f"{len(outcomes)} workers"] + [c for o in outcomes for c in (o.get("checks") or [])],
        "error": "; ".join(str(o.get("error")) for o in bad) or None,
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not suite_active(config):
        return
    state, options = suite_state(config), suite_options(config)
    if not (state.service_used or state.expansion.removed or state.opt_in_deselected):
        return
    tr = terminalreporter
    tr.section(SUMMARY_TITLE)
    if state.opt_in_deselected:
        tr.write_line(OPT_IN_NOTE.format(n=state.opt_in_deselected))
    quiet_removed = state.opt_in_deselected and not state.service_used  # a bare run selected no cells
    for cell, reason in [] if quiet_removed else state.expansion.removed:
        tr.write_line(f"removed impossible cell {cell.id}: {reason}")
    if not state.service_used:
        return
    tr.write_line(f"deploys: {len(state.deploys)} ({', '.join(state.deploys) or 'none'})")
    restore = _merged_restore(state, options.grid.default.id)
    if restore and restore.get("ok"):
        tr.write_line(f"restore: default {restore['config_id']} restored and verified "
                      f"({'; '.join(restore.get('checks') or [])})")
    else:
        tr.write_line(f"restore: default {options.grid.default.id} NOT restored: "
                      f"{(restore or {}).get('error')}", red=True)
    for line in pace_lines([], results_dir=options.results_dir):
        tr.write_line(line.removeprefix("- "))
    if state.no_floor:
        verdict = "failed: --require-floors" if options.require_floors else "passed without a floor check"
        tr.write_line(f"no floor in {options.floors.profile} for {len(state.no_floor)} cells ({verdict}): "
                      f"{', '.join(state.no_floor)}", red=options.require_floors)
    for note, ids in sorted(state.verdict_notes.items()):
        tr.write_line(f"{note}: {len(ids)} cells")
    if state.resumed:
        tr.write_line(f"resumed: {len(state.resumed)} cells kept from an earlier run: {', '.join(state.resumed)}")
    if options.update_floors:
        n = sum(len(v) for v in state.floor_updates.values())
        tr.write_line(f"floors recorded: {n} cells into {options.floors.path}")
    unsafe = [cid for cid, record in read_quality(options.results_dir).items() if record.get("isolation") == "best-effort"]
    if unsafe:
        tr.write_line(f"coding gate: model-written programs ran with best-effort isolation, not in namespaces "
                      f"(--unsafe-exec): {', '.join(unsafe)}", red=True)
    tr.write_line(f"results: {options.results_dir}")
