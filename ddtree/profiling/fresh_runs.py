"""A bench run again in fresh processes, and the median of its ratios over the runs (http_vs_engine's --runs).

On the H200 host the fixture pair's rounds are host-bound, and their time moves by up to ~8% from one
process start to the next (the in-process batch's and the server's engine alike; pinning the engine
process to CPUs of its own did not steady it), while the repeats inside one run agree within ~2%. A
ratio of two processes' rounds is then as much which starts it drew as what the server costs: each run
here is a new bench process with new servers, and the summary is each cell's median ratio over the
runs, with the lowest and highest.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HTTP_MODES = ("stream", "plain")
STOP_WAIT_S = 60.0  # for a run told to stop to stop its servers and write its rows


def without_options(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """argv less each `--name value` / `--name=value` of `names` (the driver's own: every run gets its own --out)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_paths(out: Path | None, runs: int, scratch: Path) -> list[Path]:
    """Where run i writes its rows: beside --out as <stem>.run<i>.json, else in `scratch`."""
    if out is None:
        return [scratch / f"run{i}.json" for i in range(1, runs + 1)]
    return [out.with_name(f"{out.stem}.run{i}{out.suffix or '.json'}") for i in range(1, runs + 1)]


def summarize_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per cell (config, context, concurrency) met in any run: per HTTP mode the runs' ratios, their
    median, lowest and highest, and the median tok/s, round ms and p90 / median E2E per mode."""
    cells: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            cells.setdefault((row["config"], row["context"], row["concurrency"]), []).append(row)
    summary = []
    for (config, context, concurrency), rows in cells.items():
        entry: dict[str, Any] = {"config": config, "context": context, "concurrency": concurrency, "runs": len(rows)}
        for mode in ("engine", *HTTP_MODES):
            present = [r[mode] for r in rows if mode in r]
            if not present:
                continue
            part: dict[str, Any] = {key: _median([m.get(key) for m in present])
                                    for key in ("tok_per_s", "round_ms", "ttft_ms", "p90_over_median_e2e")}
            ratios = [m["ratio"] for m in present if m.get("ratio") is not None]
            if ratios:
                part |= {"ratios": ratios, "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios)}
            entry[mode] = part
        summary.append(entry)
    return summary


def _median(values: list[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def format_summary(summary: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'config':20} {'ctx':>5} {'C':>3} {'runs':>4} {'mode':6} {'ratio':>6} {'min':>6} {'max':>6} "
             f"{'tok/s':>9} {'in proc':>9} {'round ms':>8} {'in proc':>8} {'p90/med':>7}"]
    for s in summary:
        engine = s.get("engine", {})
        for mode in HTTP_MODES:
            m = s.get(mode)
            if m is None or "ratio" not in m:
                continue
            lines.append(f"{s['config']:20} {s['context']:5} {s['concurrency']:3} {s['runs']:4} {mode:6} "
                         f"{m['ratio']:6.3f} {m['ratio_min']:6.3f} {m['ratio_max']:6.3f} {_f(m['tok_per_s']):>9} "
                         f"{_f(engine.get('tok_per_s')):>9} {_f(m['round_ms'], 3):>8} {_f(engine.get('round_ms'), 3):>8} "
                         f"{_f(m['p90_over_median_e2e'], 2):>7}")
    return "\n".join(lines)


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def drive(module: str, argv: Sequence[str], runs: int, out: Path | None, scratch: Path, meta: dict[str, Any],
          log: Callable[..., None] = print) -> int:
    """Run `python -m module argv --out run_i` `runs` times, one after another; after each, the summary so far
    (printed, and written to `out` with every run's rows: a run cut short keeps its rows so far and the runs
    before it). The exit status is the first failing run's (1: outputs differed or requests failed; 130: stopped)."""
    child = without_options(argv, ("--runs", "--out"))
    status = 0
    done: list[list[dict[str, Any]]] = []
    for i, path in enumerate(run_paths(out, runs, scratch), start=1):
        log(f"=== run {i}/{runs}: {path}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([sys.executable, "-m", module, *child, "--out", str(path)])
        try:
            code = process.wait()
        except KeyboardInterrupt:  # stopped (Ctrl-C, timeout -s INT): the run stops too, and what it measured is kept
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
            code = 130
        if code and not status:
            status = code if code > 0 else 1  # < 0: killed by a signal
        if path.is_file():
            done.append(json.loads(path.read_text())["rows"])
        if code not in (0, 1):
            log(f"run {i} stopped with status {code}; the summary holds its rows so far and the runs before it", flush=True)
        summary = summarize_runs(done)
        log(f"--- over {len(done)} run(s): median HTTP / in-process ratio, lowest, highest", flush=True)
        log(format_summary(summary), flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": done}, indent=2) + "\n")
        if code not in (0, 1):
            break
    return status
