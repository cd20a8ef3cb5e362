"""The suite's session: one object holding the hooks of an active run (registered by ddtree.suite.plugin).

It exists only in the suite's own runs: ddtree.suite.plugin's pytest_configure registers it under
SESSION_PLUGIN once the suite is requested, so in other projects' runs no hook below is even called.
It owns the report header, cell parametrization, opt-in selection of perf and bench items, the
order of collected items, the cell counts per config, a service's death under a cell, xdist wiring
and the end of the run (the result files and the terminal section).
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.deploys import write_deploys
from ddtree.bench.report import write_sweep_summary
from ddtree.bench.results import read_quality, write_summary_csv
from ddtree.bench.verdicts import pace_lines, write_verdicts
from ddtree.service.manager import ServiceDied
from ddtree.suite.cells import CELL_ARG, CONFIG_ARG, parametrize, sort_items
from ddtree.suite.floors import write_floors
from ddtree.suite.options import SuiteOptions
from ddtree.suite.state import SuiteState
from ddtree.suite.verdict import Tolerances

SESSION_PLUGIN = "ddtree-session"
OPT_IN_MARKERS = ("perf", "bench")
SUMMARY_TITLE = "ddtree sweep"
OPT_IN_NOTE = ("deselected {n} perf/bench items: measurements are opt-in; select them with -m perf "
               "(the sweep), -m bench, --config-grid NAME or by naming their folder (bench: their file)")


class SuiteSession:
    """The hooks of one suite run, over its validated options and its state."""

    def __init__(self, config: pytest.Config, options: SuiteOptions, state: SuiteState) -> None:
        self.config = config
        self.options = options
        self.state = state
        self.is_worker = hasattr(config, "workerinput")

    # -- xdist (optional hooks: absent without the xdist plugin) ------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["ddtree_results_dir"] = str(self.options.results_dir)
        node.workerinput["ddtree_loadgroup"] = self.config.getvalue("dist") == "loadgroup"

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        wire = getattr(node, "workeroutput", {}).get("ddtree")
        if wire:
            self.state.absorb(wire)

    # -- header, parametrization, selection and order ----------------------------------------------

    def pytest_report_header(self) -> list[str]:
        o, e = self.options, self.state.expansion
        lines = [
            f"ddtree grid: {o.grid.name} ({o.grid.path}): {len(e.configs)} configs, {len(e.kept)} cells, "
            f"{len(e.removed)} removed as impossible; repeats {o.repeats}",
            f"ddtree service: {o.service}; device: {o.device}; model: {o.model_path}; drafter: {o.draft_model_path}; "
            f"dialect: {o.dialect.name}; tokens: {o.tokenize}; start retries: {o.start_retries}",
            f"ddtree results: {o.results_dir}; floors: {floors_text(o)}, probe "
            f"{o.floors.probe or 'none'}; {tolerances_text(o)}{'; recording floors' if o.update_floors else ''}"
            f"{'; cells without a floor fail' if o.require_floors else ''}",
        ]
        if o.grid.slo is not None:
            lines.append(f"ddtree SLO: {o.grid.slo.describe()} (reported, never failed)")
        return lines

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if CELL_ARG in metafunc.fixturenames or CONFIG_ARG in metafunc.fixturenames:
            parametrize(metafunc, self.state.expansion)

    def opted_in(self, item: pytest.Item, marker: str) -> bool:
        """Whether the run selected this perf or bench item: by -m, --config-grid (perf) or by naming it."""
        config = self.config
        if re.search(rf"\b{marker}\b", config.option.markexpr or ""):
            return True
        if marker == "perf" and self.options.grid_explicit:
            return True
        folder = item.path.parent if marker == "perf" else item.path  # a bench opts in by its file
        for arg in config.args:
            target = Path(arg.split("::")[0])
            target = target if target.is_absolute() else config.invocation_params.dir / target
            if target.resolve().is_relative_to(folder):
                return True
        return False

    @pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        kept, dropped = [], []
        for item in items:
            needs = [m for m in OPT_IN_MARKERS if item.get_closest_marker(m)]
            if needs and not all(self.opted_in(item, m) for m in needs):
                dropped.append(item)
            else:
                kept.append(item)
        if dropped:
            self.state.opt_in_deselected = len(dropped)
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        sort_items(items, self.state.expansion)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """How many sweep cells of each config run (after -k, -m and --deselect): a config's verdict over
        its cells comes with the last of them."""
        counts = self.state.selected_cells
        for item in session.items:
            cell = getattr(item, "callspec", None) and item.callspec.params.get(CELL_ARG)  # type: ignore[attr-defined]
            if cell is not None:
                counts[cell.config_id] = counts.get(cell.config_id, 0) + 1

    # -- a service that dies under a cell ------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        """A cell that fails while its service is dead fails with that reason and the log tail, not
        with whatever the client saw (a connection reset); the next cell of the config redeploys."""
        try:
            return (yield)
        except Exception as err:
            manager = getattr(item, "funcargs", {}).get("deployed")
            if manager is None:
                raise
            alive, reason = manager.backend.is_alive()
            if alive:
                raise
            raise ServiceDied(f"service died during {item.callspec.id} ({reason})",  # type: ignore[attr-defined]
                              log_tail=manager.backend.log_tail()) from err

    # -- end of the run ------------------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)  # after the session fixtures (the service) are torn down
    def pytest_sessionfinish(self) -> None:
        state, options = self.state, self.options
        if self.is_worker:
            self.config.workeroutput["ddtree"] = state.to_wire()  # type: ignore[attr-defined]
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
        restore = merged_restore(state, options.grid.default.id) or {}
        restore = {**restore, "deploys": len(state.deploys), "deploy_order": state.deploys}  # kept in restore.json
        write_sweep_summary(results, options.grid.default.id, restore)
        if options.update_floors and state.floor_updates:  # measurements first: a failing plot must not lose them
            write_floors(options.floors, state.floor_updates, probe=state.floor_probe,
                         recorded=floors_recorded(results, self.config.invocation_params.args))
        if any((results / "cells").glob("*.json")):
            from ddtree.bench.plots import write_plots  # matplotlib only when there is something to plot

            write_plots(results)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state, options = self.state, self.options
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
        restore = merged_restore(state, options.grid.default.id)
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
        unsafe = [cid for cid, record in read_quality(options.results_dir).items()
                  if record.get("isolation") == "best-effort"]
        if unsafe:
            tr.write_line(f"coding gate: model-written programs ran with best-effort isolation, not in namespaces "
                          f"(--unsafe-exec): {', '.join(unsafe)}", red=True)
        tr.write_line(f"results: {options.results_dir}")


def floors_text(options: SuiteOptions) -> str:
    floors = options.floors
    if floors.none:
        return "none (no floors file: cells are listed without a floor; --floors NAME --update-floors records one)"
    return f"{floors.profile} ({floors.path})"


def tolerances_text(options: SuiteOptions) -> str:
    t = Tolerances.of(options.floors, options.tolerance)
    return (f"tolerance: a cell's {t.throughput_label} {t.throughput:g}, a config's median {t.config:g}, accept length "
            f"{t.accept:g}, a config's speed-up over AR {t.speedup:g}")


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


def merged_restore(state: SuiteState, default_id: str) -> dict[str, Any] | None:
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
