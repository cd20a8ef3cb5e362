"""Result files: one JSON per sweep cell (written atomically), the summary CSV, the restore record.

Layout under a results directory (schema in docs/results.md):

    cells/<config_id>__ctx<context>__c<concurrency>.json   one CellResult each (__r<rate>.json: a rate cell)
    summary.csv                                            one row per cell
    restore.json                                           outcome of restoring the default
    deploys.json                                           what each deploy took (deploys.py)
    sweep_summary.md, plots/*.png                          written by report.py / plots.py

Writers never leave a partial file: they write a temporary file in the same directory and
os.replace it into place, so an interrupted sweep keeps exactly the cells it finished.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ddtree.bench.arrivals import load_label
from ddtree.bench.metrics import summarize_cell

SCHEMA_VERSION = 1
CELLS_DIR = "cells"
SUMMARY_CSV = "summary.csv"
RESTORE_JSON = "restore.json"
QUALITY_DIR = "quality"  # quality/<config id>.json, written by the coding gate
PACE_DIR = "pace"  # pace/<worker>.json: the pace probe's readings (ddtree.suite.pace)


@dataclass
class CellResult:
    """One (config, context, concurrency) cell of a sweep and everything needed to trust it."""

    config_id: str
    spec: dict[str, Any]  # SpecConfig.to_dict()
    context: int  # prompt length in tokens
    concurrency: int
    repeats: int
    metrics: dict[str, Any]  # summarize_cell(per_repeat)
    per_repeat: list[dict[str, Any]]  # summarize_repeat(...) per repeat
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    gpu: str | None = None
    commit: str = "unknown"
    backend: str = "unknown"  # service backend: local, sglang, systemd, url, fake
    started_at: str = ""  # ISO 8601, UTC
    finished_at: str = ""
    schema_version: int = SCHEMA_VERSION
    client: dict[str, Any] = field(default_factory=dict)  # max_new_tokens, num_prompts, ...
    quality: dict[str, Any] | None = None  # {pass_at_k, k, n, problems}
    pace: dict[str, Any] | None = None  # {probe, score, readings, per_repeat, where}: the machine's pace around it
    request_rate: float | None = None  # a rate cell's req/s (open loop; concurrency 0)

    @classmethod
    def build(cls, *, config_id: str, spec: dict[str, Any], context: int, concurrency: int,
              per_repeat: list[dict[str, Any]], backend: str, started_at: str,
              finished_at: str | None = None, client: dict[str, Any] | None = None,
              quality: dict[str, Any] | None = None, repo_dir: str | Path | None = None,
              pace: dict[str, Any] | None = None, request_rate: float | None = None) -> CellResult:
        """A cell from its repeat summaries, filling metrics, machine, GPU and commit."""
        return cls(
            config_id=config_id, spec=dict(spec), context=context, concurrency=concurrency,
            repeats=len(per_repeat), metrics=summarize_cell(per_repeat),
            per_repeat=list(per_repeat), machine=machine_info(), gpu=gpu_name(),
            commit=git_commit(repo_dir), backend=backend, started_at=started_at,
            finished_at=finished_at or now_iso(), client=dict(client or {}), quality=quality, pace=pace,
            request_rate=request_rate,
        )

    @property
    def filename(self) -> str:
        return cell_filename(self.config_id, self.context, self.concurrency, self.request_rate)

    @property
    def load(self) -> str:
        """`c<N>` (closed loop) or `r<R>` (open loop at R req/s)."""
        return load_label(self.concurrency, self.request_rate)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "cell") -> CellResult:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"{where}: schema_version {version!r} is not supported "
                             f"(this ddtree reads {SCHEMA_VERSION})")
        known = {f.name for f in fields(cls)}
        missing = sorted(k for k in ("config_id", "context", "concurrency", "metrics") if k not in data)
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})


# -- environment -------------------------------------------------------------------------------

def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def gpu_name() -> str | None:
    """The first GPU's name, or None; never imports torch just to ask (it is slow)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return names[0] if names else None
    return None


def git_commit(repo_dir: str | Path | None = None) -> str:
    """The commit the results come from: `DDTREE_COMMIT` when set (a copied tree whose git state is
    not its own), else `git rev-parse HEAD` of the working tree (the package's repo by default), with
    "+dirty" when tracked files differ from it; "unknown" if neither."""
    pinned = os.environ.get("DDTREE_COMMIT", "").strip()
    if pinned:
        return pinned
    where = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    if not commit:
        return "unknown"
    try:
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=where,
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return commit
    return commit + "+dirty" if diff.returncode == 1 else commit


# -- files -------------------------------------------------------------------------------------

def cell_filename(config_id: str, context: int, concurrency: int, request_rate: float | None = None) -> str:
    return f"{config_id}__ctx{context}__{load_label(concurrency, request_rate)}.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_cell(results_dir: str | Path, cell: CellResult) -> Path:
    path = Path(results_dir) / CELLS_DIR / cell.filename
    atomic_write_text(path, json.dumps(cell.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def read_cells(results_dir: str | Path) -> list[CellResult]:
    """Every cell file, sorted by (context, concurrency, then rate, config_id); temp files are ignored."""
    cells_dir = Path(results_dir) / CELLS_DIR
    if not cells_dir.is_dir():
        return []
    cells = []
    for path in sorted(cells_dir.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        cells.append(CellResult.from_dict(data, where=str(path)))
    return sorted(cells, key=lambda c: (c.context, c.request_rate is not None, c.concurrency, c.request_rate or 0.0,
                                        c.config_id))


def cell_exists(results_dir: str | Path, config_id: str, context: int, concurrency: int,
                request_rate: float | None = None) -> bool:
    return (Path(results_dir) / CELLS_DIR / cell_filename(config_id, context, concurrency, request_rate)).is_file()


CSV_SPEC = ("algorithm", "budget", "topk", "draft_window", "block_size")
CSV_METRICS = (
    "completed", "failed", "output_throughput", "output_throughput_mad", "request_throughput",
    "median_tpot_ms", "median_tpot_ms_mad", "p90_tpot_ms", "p99_tpot_ms",
    "median_ttft_ms", "median_ttft_ms_mad", "p90_ttft_ms", "p99_ttft_ms",
    "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms", "median_itl_ms",
    "accept_length", "accept_length_mad", "pace_normalized_throughput", "speedup_vs_ar",
    "slo_attainment", "slo_attained", "request_goodput", "request_goodput_mad",  # bench/slo.py
    "scheduled_request_rate", "achieved_request_rate", "served_request_rate", "max_in_flight", "keeps_up",  # arrivals.py
)
CSV_COLUMNS = ("config_id", *CSV_SPEC, "context", "concurrency", "request_rate", "repeats", *CSV_METRICS,
               "pace", "pace_probe", "pass_at_k", "k", "backend", "gpu", "commit", "finished_at")


def cell_row(cell: CellResult) -> dict[str, Any]:
    quality = cell.quality or {}
    row: dict[str, Any] = {"config_id": cell.config_id, "context": cell.context,
                           "concurrency": cell.concurrency, "request_rate": cell.request_rate,
                           "repeats": cell.repeats}
    row.update({k: cell.spec.get(k) for k in CSV_SPEC})
    row.update({k: cell.metrics.get(k) for k in CSV_METRICS})
    pace = cell.pace or {}
    row.update({"pace": pace.get("score"), "pace_probe": pace.get("probe"),
                "pass_at_k": quality.get("pass_at_k"), "k": quality.get("k"),
                "backend": cell.backend, "gpu": cell.gpu, "commit": cell.commit,
                "finished_at": cell.finished_at})
    return row


def write_summary_csv(results_dir: str | Path) -> Path:
    """summary.csv from the cell files (empty cells are written as empty strings)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for cell in read_cells(results_dir):
        writer.writerow({k: ("" if v is None else v) for k, v in cell_row(cell).items()})
    path = Path(results_dir) / SUMMARY_CSV
    atomic_write_text(path, buffer.getvalue())
    return path


def write_json_object(path: Path, record: dict[str, Any]) -> Path:
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A run's one-object JSON file (restore.json, verdicts.json), or None when it is not there."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_restore(results_dir: str | Path, restore: dict[str, Any]) -> Path:
    return write_json_object(Path(results_dir) / RESTORE_JSON, restore)


def read_restore(results_dir: str | Path) -> dict[str, Any] | None:
    return read_json_object(Path(results_dir) / RESTORE_JSON)


def read_quality(results_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The coding gate's records (quality/<config id>.json) by config id; temp files are ignored."""
    folder = Path(results_dir) / QUALITY_DIR
    gates: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name.startswith("."):
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable quality record ({err})") from err
        gates[str(record.get("config_id", path.stem))] = record
    return gates


def read_pace_logs(results_dir: str | Path) -> list[dict[str, Any]]:
    """Every pace log of a run (pace/<worker>.json, one per xdist worker); unreadable ones are skipped."""
    folder = Path(results_dir) / PACE_DIR
    logs = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name.startswith("."):
            continue
        try:
            logs.append({"file": path.name, **json.loads(path.read_text(encoding="utf-8"))})
        except (OSError, json.JSONDecodeError):
            continue
    return logs
