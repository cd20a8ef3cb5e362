"""Floors files: per-cell throughput, acceptance and speed-up over AR, the pace they were recorded at.

    probe: cpu-v4                 # the pace probe that measured `pace` (ddtree.bench.pace)
    basis: pace                   # tok/s judged per unit of pace (pace), or as measured (absolute)
    tolerance: 0.4                # one cell's pace-normalised tok/s may fall this fraction below its floor
    config_tolerance: 0.2         # the median over a config's cells of that ratio
    accept_tolerance: 0.05        # accept_length (deterministic at T = 0: tight)
    speedup_tolerance: 0.25       # the median over a config's cells of speedup_vs_ar / its floor
    floors:
      b8-k4-w2048-bs8:
        ctx60-c1: {output_throughput: 80.2, pace: 0.97, accept_length: 1.77, speedup_vs_ar: 0.71}

A profile name (`cpu-fixture`) resolves to fixtures/floors/<name>.yaml. How a cell is judged
against its entry is ddtree.suite.verdict's. `--update-floors` records the measured values
themselves: the tolerances are the only headroom, so the file holds what was really measured.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddtree.bench.baseline import check_tolerance
from ddtree.bench.normalise import BASES, DEFAULT_BASIS
from ddtree.errors import ConfigError

FLOORS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "floors"
DEFAULT_TOLERANCE = 0.15
DEFAULT_ACCEPT_TOLERANCE = 0.05  # a 10% drop in acceptance must fail; T = 0 acceptance does not depend on the machine
DEFAULT_CONFIG_TOLERANCE = 0.15  # a config's median ratio and its speed-up's, where a floors file sets none
FLOOR_METRICS = {  # unit, digits
    "output_throughput": ("tok/s", 1),
    "pace": ("pace", 3),  # the machine's pace when output_throughput was recorded (not judged itself)
    "accept_length": ("accepted tokens/step", 2),
    "speedup_vs_ar": ("x AR", 3),  # pace-normalised tok/s over AR's at the same context and concurrency
}
FILE_KEYS = ("probe", "basis", "tolerance", "config_tolerance", "accept_tolerance", "speedup_tolerance", "floors", "recorded")

Table = dict[str, dict[str, dict[str, float]]]  # config id -> "ctx<C>-c<N>" -> metric -> value


@dataclass
class Floors:
    path: Path
    tolerance: float = DEFAULT_TOLERANCE
    table: Table = field(default_factory=dict)
    header: str = ""  # the file's leading comment block, kept when recording
    accept_tolerance: float = DEFAULT_ACCEPT_TOLERANCE
    speedup_tolerance: float = DEFAULT_CONFIG_TOLERANCE
    config_tolerance: float = DEFAULT_CONFIG_TOLERANCE
    probe: str | None = None  # the pace probe id the floors' `pace` values come from
    basis: str = DEFAULT_BASIS
    recorded: dict[str, Any] = field(default_factory=dict)

    @property
    def none(self) -> bool:
        """`--floors none`: no file behind it."""
        return str(self.path) == NO_FLOORS

    @property
    def profile(self) -> str:
        return self.path.stem

    def floor_for(self, config_id: str, key: str) -> dict[str, float] | None:
        return self.table.get(config_id, {}).get(key)


NO_FLOORS = "none"  # `--floors none`: no floors file; every cell is listed as having no floor


def resolve_floors_path(path_or_profile: str | Path) -> Path:
    text = str(path_or_profile)
    if "/" in text or text.endswith((".yaml", ".yml")):
        return Path(text)
    return FLOORS_DIR / f"{text}.yaml"


def load_floors(path_or_profile: str | Path) -> Floors:
    """Read a floors file; a profile whose file does not exist yet is an empty table, and so is `none`."""
    if str(path_or_profile) == NO_FLOORS:
        return Floors(path=Path(NO_FLOORS))
    path = resolve_floors_path(path_or_profile)
    if not path.is_file():
        if path.parent == FLOORS_DIR:  # a new profile: recording creates it
            return Floors(path=path)
        raise ConfigError(f"floors file {str(path)!r} not found (give a profile name or a path)")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {list(FILE_KEYS)}")
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {list(FILE_KEYS)}")
    tolerance = data.get("tolerance", DEFAULT_TOLERANCE)
    check_tolerance(tolerance, f"{path}: tolerance")
    accept_tolerance = check_tolerance(data.get("accept_tolerance", DEFAULT_ACCEPT_TOLERANCE), f"{path}: accept_tolerance")
    speedup_tolerance = check_tolerance(data.get("speedup_tolerance", DEFAULT_CONFIG_TOLERANCE), f"{path}: speedup_tolerance")
    config_tolerance = check_tolerance(data.get("config_tolerance", DEFAULT_CONFIG_TOLERANCE), f"{path}: config_tolerance")
    probe = data.get("probe")
    if probe is not None and not isinstance(probe, str):
        raise ConfigError(f"{path}: probe: {probe!r} is not a probe id such as 'cpu-v4'")
    basis = data.get("basis", DEFAULT_BASIS)
    if basis not in BASES:
        raise ConfigError(f"{path}: basis: {basis!r} is not valid; expected one of {', '.join(BASES)}")
    recorded = data.get("recorded") or {}
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path}: recorded must be a mapping (date, machine, command, pace)")
    table = data.get("floors") or {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: floors must map config id -> cell key -> metrics")
    for config_id, per_cell in table.items():
        if not isinstance(per_cell, dict):
            raise ConfigError(f"{path}: floors.{config_id} must map 'ctx<C>-c<N>' -> metrics")
        for key, metrics in per_cell.items():
            if not isinstance(metrics, dict):
                raise ConfigError(f"{path}: floors.{config_id}.{key} must map metric -> number")
            for metric, value in metrics.items():
                if metric not in FLOOR_METRICS:
                    raise ConfigError(
                        f"{path}: floors.{config_id}.{key}: unknown metric {metric!r}; allowed: {list(FLOOR_METRICS)}"
                    )
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ConfigError(f"{path}: floors.{config_id}.{key}.{metric}: {value!r} is not a number >= 0")
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    return Floors(path=path, tolerance=float(tolerance), table=table, header=header,
                  accept_tolerance=accept_tolerance, speedup_tolerance=speedup_tolerance,
                  config_tolerance=config_tolerance, probe=probe, basis=basis, recorded=recorded)


def merge(table: Table, updates: Table) -> Table:
    out = {cid: {k: dict(v) for k, v in cells.items()} for cid, cells in table.items()}
    for cid, cells in updates.items():
        out.setdefault(cid, {}).update({k: dict(v) for k, v in cells.items()})
    return out


def write_floors(floors: Floors, updates: Table, recorded: dict[str, Any] | None = None,
                 probe: str | None = None) -> Path:
    """Merge measured values into the floors file, atomically (temp file + rename).

    `probe` is the pace probe of the updates; a file recorded with another probe keeps none of its
    old entries (their pace values would not compare with the new ones).
    """
    table = floors.table if probe is None or floors.probe in (None, probe) else {}
    data: dict[str, Any] = {"tolerance": floors.tolerance, "config_tolerance": floors.config_tolerance,
                            "accept_tolerance": floors.accept_tolerance, "speedup_tolerance": floors.speedup_tolerance,
                            "basis": floors.basis, "floors": merge(table, updates)}
    if probe or floors.probe:
        data["probe"] = probe or floors.probe
    if recorded or floors.recorded:
        data["recorded"] = recorded or floors.recorded
    body = floors.header + yaml.safe_dump(data, sort_keys=True, default_flow_style=None)
    floors.path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=floors.path.parent, prefix=f".{floors.path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(body)
        os.replace(tmp, floors.path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    floors.table, floors.probe = data["floors"], data.get("probe")
    return floors.path
