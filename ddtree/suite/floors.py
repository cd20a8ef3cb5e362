"""Floors files: per-cell minimum throughput and acceptance, the check against them, and recording.

    tolerance: 0.15
    floors:
      b8-k4-w2048-bs8:
        ctx60-c1: {output_throughput: 12.3, accept_length: 2.9}

A profile name (`cpu-fixture`) resolves to fixtures/floors/<name>.yaml. A measured median fails
when it is below floor x (1 - tolerance). `--update-floors` records the measured medians
themselves: the tolerance is the one headroom knob, so the file holds what was really measured.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddtree.errors import ConfigError

FLOORS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "floors"
DEFAULT_TOLERANCE = 0.15
FLOOR_METRICS = {"output_throughput": ("tok/s", 1), "accept_length": ("accepted tokens/step", 2)}  # unit, digits

Table = dict[str, dict[str, dict[str, float]]]  # config id -> "ctx<C>-c<N>" -> metric -> value


@dataclass
class Floors:
    path: Path
    tolerance: float = DEFAULT_TOLERANCE
    table: Table = field(default_factory=dict)
    header: str = ""  # the file's leading comment block, kept when recording

    @property
    def profile(self) -> str:
        return self.path.stem

    def floor_for(self, config_id: str, key: str) -> dict[str, float] | None:
        return self.table.get(config_id, {}).get(key)


def resolve_floors_path(path_or_profile: str | Path) -> Path:
    text = str(path_or_profile)
    if "/" in text or text.endswith((".yaml", ".yml")):
        return Path(text)
    return FLOORS_DIR / f"{text}.yaml"


def load_floors(path_or_profile: str | Path) -> Floors:
    """Read a floors file; a profile whose file does not exist yet is an empty table."""
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
        raise ConfigError(f"{path}: expected a mapping with keys 'tolerance' and 'floors'")
    unknown = sorted(set(data) - {"tolerance", "floors", "recorded"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: ['tolerance', 'floors', 'recorded']")
    tolerance = data.get("tolerance", DEFAULT_TOLERANCE)
    check_tolerance(tolerance, f"{path}: tolerance")
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
    return Floors(path=path, tolerance=float(tolerance), table=table, header=header)


def check_tolerance(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{where}: {value!r} is not a fraction in [0, 1)")
    return float(value)


def check_cell(
    measured: dict[str, float], floor: dict[str, float], tolerance: float, config_id: str, context: int, conc: int
) -> list[str]:
    """One message per metric below floor x (1 - tolerance); empty when the cell passes."""
    failures = []
    for metric, floor_value in floor.items():
        value = measured.get(metric)
        if value is None:
            failures.append(f"{metric} was not measured, floor {floor_value}, {config_id} @ ctx{context} c{conc}")
            continue
        if value < floor_value * (1.0 - tolerance):
            unit, digits = FLOOR_METRICS[metric]
            failures.append(
                f"{value:.{digits}f} {unit} < floor {floor_value:.{digits}f} x (1-{tolerance:g}), "
                f"{config_id} @ ctx{context} c{conc}"
            )
    return failures


def merge(table: Table, updates: Table) -> Table:
    out = {cid: {k: dict(v) for k, v in cells.items()} for cid, cells in table.items()}
    for cid, cells in updates.items():
        out.setdefault(cid, {}).update({k: dict(v) for k, v in cells.items()})
    return out


def write_floors(floors: Floors, updates: Table, recorded: dict[str, Any] | None = None) -> Path:
    """Merge measured values into the floors file, atomically (temp file + rename)."""
    data: dict[str, Any] = {"tolerance": floors.tolerance, "floors": merge(floors.table, updates)}
    if recorded:
        data["recorded"] = recorded
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
    floors.table = data["floors"]
    return floors.path
