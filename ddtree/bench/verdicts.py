"""How a run's cells were judged, kept beside them: verdicts.json, and its part of the sweep summary.

verdicts.json (written by the suite at the end of a run) holds the floors file and profile, the pace
probe, the tolerances, the cells that had no floor and the notes on cells judged another way than
the usual one (absolute tok/s where a floor has no pace). The summary's "Pace and verdicts" part
reads it with the pace logs (pace/*.json) and the cells' own pace records: files only, like the
rest of the summary.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddtree.bench.normalise import DEFAULT_BASIS, throughput_label
from ddtree.bench.results import CellResult, read_json_object, read_pace_logs, write_json_object

VERDICTS_JSON = "verdicts.json"


def write_verdicts(results_dir: str | Path, record: dict[str, Any]) -> Path:
    return write_json_object(Path(results_dir) / VERDICTS_JSON, record)


def read_verdicts(results_dir: str | Path) -> dict[str, Any] | None:
    return read_json_object(Path(results_dir) / VERDICTS_JSON)


def pace_range(scores: Sequence[float]) -> str:
    return (f"median {statistics.median(scores):.3f}, range {min(scores):.3f}-{max(scores):.3f} "
            f"over {len(scores)} readings")


def pace_lines(cells: Sequence[CellResult], results_dir: str | Path) -> list[str]:
    """Markdown: the machine's pace over the run (every reading), the last reading, cells without one."""
    logs = read_pace_logs(results_dir)
    readings = [r for log in logs for r in log.get("readings") or []]
    lines = []
    if readings:
        scores = [float(r["score"]) for r in readings]
        probes = sorted({str(r.get("probe")) for r in readings})
        where = sorted({str(r.get("where")) for r in readings})
        end = [r for r in readings if r.get("label") == "end"]
        lines.append(f"- Pace ({', '.join(probes)}, measured on {', '.join(where)}): {pace_range(scores)}"
                     + (f"; at the end {float(end[-1]['score']):.3f}" if end else "") + ".")
    for log in logs:
        if log.get("unavailable"):
            lines.append(f"- Pace probe unavailable ({log.get('file')}): {log['unavailable']}; cells after that "
                         f"were judged in absolute tok/s.")
    no_pace = [f"{c.config_id} ctx{c.context} c{c.concurrency}" for c in cells if not (c.pace or {}).get("score")]
    if no_pace:
        lines.append(f"- Cells without a pace reading ({len(no_pace)}): {', '.join(no_pace)}.")
    return lines


def verdict_lines(record: dict[str, Any] | None) -> list[str]:
    """Markdown: the floors, tolerances and probe the cells were judged with, cells without a floor."""
    if record is None:
        return []
    tol = record.get("tolerances") or {}
    lines = [f"- Floors: {record.get('profile')} ({record.get('path')}), recorded with probe "
             f"{record.get('floors_probe') or 'none'}; tolerances: a cell's "
             f"{throughput_label(tol.get('basis') or DEFAULT_BASIS)} {tol.get('throughput')}, "
             f"a config's median {tol.get('config')}, accept length {tol.get('accept')}, a config's speed-up over AR "
             f"{tol.get('speedup')}."]
    no_floor = record.get("no_floor") or []
    if no_floor:
        verdict = "failed (--require-floors)" if record.get("require_floors") else "passed without a floor check"
        lines.append(f"- No floor ({len(no_floor)} cells, {verdict}): {', '.join(no_floor)}.")
    for note, ids in sorted((record.get("notes") or {}).items()):
        lines.append(f"- {note}: {len(ids)} cells ({', '.join(ids[:6])}{', ...' if len(ids) > 6 else ''}).")
    return lines
