"""deploys.json: what each deploy of a sweep cost, and the summary's table of them.

One entry per deploy (a config's start, a failed start, the restore of the default at the end), in
the order they happened, as ddtree.service.manager.DeployTiming.to_dict() writes it:

    config_id, purpose (sweep | restore), restarted (false: a url backend, nothing was started),
    started_at, ready_s (start command -> ready), verified_s (-> verified), cold_start_s (= verified_s
    when the deploy succeeded: the time before a config's cells can run), spent_s, ok, error

A run into an existing results directory (--resume) appends its deploys to the file's.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddtree.bench.results import atomic_write_text

DEPLOYS_JSON = "deploys.json"


def read_deploys(results_dir: str | Path) -> list[dict[str, Any]]:
    """The entries of RESULTS/deploys.json, [] when there is none."""
    path = Path(results_dir) / DEPLOYS_JSON
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, list) or not all(isinstance(e, dict) and "config_id" in e for e in data):
        raise ValueError(f"{path}: expected a list of deploy entries, each with a config_id")
    return data


def write_deploys(results_dir: str | Path, entries: Iterable[Mapping[str, Any]]) -> Path:
    """Append this run's entries to RESULTS/deploys.json (written atomically)."""
    path = Path(results_dir) / DEPLOYS_JSON
    everything = read_deploys(results_dir) + [dict(e) for e in entries]
    atomic_write_text(path, json.dumps(everything, indent=2) + "\n")
    return path


def cold_starts(entries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """config id -> median cold start (s) over its successful restarts."""
    times: dict[str, list[float]] = {}
    for e in entries:
        if e.get("ok") and e.get("restarted") and isinstance(e.get("cold_start_s"), int | float):
            times.setdefault(str(e["config_id"]), []).append(float(e["cold_start_s"]))
    return {k: statistics.median(v) for k, v in times.items()}


def _s(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.1f}"


def deploy_table(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The summary's "Deploys" part: one row per deploy and the total time spent deploying."""
    if not entries:
        return ["## Deploys", "", "No deploy was recorded (deploys.json is missing or empty).", ""]
    lines = ["## Deploys", "", "| # | config | purpose | start -> ready s | start -> verified s | outcome |",
             "|---|---|---|---|---|---|"]
    for i, e in enumerate(entries, 1):
        outcome = "ok" if e.get("ok") else f"FAILED: {e.get('error') or 'no detail'}"
        if not e.get("restarted"):
            outcome += " (checked, not restarted)"
        lines.append(f"| {i} | {e.get('config_id')} | {e.get('purpose', '-')} | {_s(e.get('ready_s'))} | "
                     f"{_s(e.get('verified_s'))} | {outcome} |")
    spent = sum(float(e.get("spent_s") or 0.0) for e in entries)
    restarts = sum(1 for e in entries if e.get("restarted"))
    minutes = f" ({spent / 60:.1f} min)" if spent >= 60 else ""
    lines += ["", f"Total: {len(entries)} deploys ({restarts} restarts), {spent:.1f} s spent deploying{minutes}.", ""]
    return lines
