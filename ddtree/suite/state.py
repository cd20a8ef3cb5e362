"""Per-run state of the suite, kept in the pytest config's stash (one typed key each).

The keys are set only in the suite's own runs (ddtree.suite.plugin's pytest_configure), where the
session object, the fixtures and the cell runner read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ddtree.suite.cells import Expansion
from ddtree.suite.floors import Table
from ddtree.suite.options import SuiteOptions


@dataclass
class SuiteState:
    """What the run learned: deploys, the restore outcome, floors to record, cells without floors."""

    expansion: Expansion
    deploys: list[str] = field(default_factory=list)  # config ids in deploy order (all workers)
    deploy_timings: list[dict[str, Any]] = field(default_factory=list)  # DeployTiming.to_dict(), restore too
    service_used: bool = False
    restore: dict[str, Any] | None = None  # the shape bench.report.restore_line reads
    floor_updates: Table = field(default_factory=dict)
    no_floor: list[str] = field(default_factory=list)  # cell ids measured without a floor
    floor_probe: str | None = None  # the pace probe of the recorded floors (--update-floors)
    verdict_notes: dict[str, list[str]] = field(default_factory=dict)  # how cells were judged -> cell ids
    # config id -> (cell id, measured, floor) of its cells judged by this process, for the config's verdict
    config_cells: dict[str, list[tuple[str, dict[str, Any], dict[str, float]]]] = field(default_factory=dict)
    selected_cells: dict[str, int] = field(default_factory=dict)  # config id -> its sweep cells selected to run
    cells_seen: dict[str, int] = field(default_factory=dict)  # config id -> its cells judged so far
    resumed: list[str] = field(default_factory=list)
    opt_in_deselected: int = 0  # perf/quality items a bare run left out
    measured: int = 0  # cells measured by this process (progress lines)
    workers: list[dict[str, Any]] = field(default_factory=list)  # per xdist worker (controller)

    def to_wire(self) -> dict[str, Any]:
        """The part an xdist worker sends to the controller (JSON-able)."""
        return {"deploys": self.deploys, "deploy_timings": self.deploy_timings,
                "service_used": self.service_used, "restore": self.restore,
                "floor_updates": self.floor_updates, "no_floor": self.no_floor, "resumed": self.resumed,
                "floor_probe": self.floor_probe, "verdict_notes": self.verdict_notes}

    def absorb(self, wire: dict[str, Any]) -> None:
        self.workers.append(wire)
        self.deploys += wire.get("deploys", [])
        self.deploy_timings += wire.get("deploy_timings", [])
        self.service_used |= bool(wire.get("service_used"))
        self.no_floor += wire.get("no_floor", [])
        self.resumed += wire.get("resumed", [])
        self.floor_probe = self.floor_probe or wire.get("floor_probe")
        for note, ids in (wire.get("verdict_notes") or {}).items():
            self.verdict_notes.setdefault(note, []).extend(ids)
        for cid, cells in (wire.get("floor_updates") or {}).items():
            self.floor_updates.setdefault(cid, {}).update(cells)


OPTIONS_KEY = pytest.StashKey[SuiteOptions]()
STATE_KEY = pytest.StashKey[SuiteState]()


def suite_options(config: pytest.Config) -> SuiteOptions:
    return config.stash[OPTIONS_KEY]


def suite_state(config: pytest.Config) -> SuiteState:
    return config.stash[STATE_KEY]
