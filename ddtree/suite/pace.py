"""The sweep's pace readings: the probe (ddtree.bench.pace) in a child process, and its log.

The probe runs where the service runs: a child `python -m ddtree.bench.pace --serve` beside a local
or SGLang service, the probe's own source through ssh (`python3 -c SOURCE --serve`) on a systemd
unit's host. It stays up for the session, so torch's import and the warm-up are paid once and a
reading costs the probe's own fraction of a second. Against a bare URL the pace is this machine's,
and the readings say so.

Every reading is appended to RESULTS/pace/<worker>.json as it is taken (atomically), so a run that
dies keeps the pace of every cell it measured.
"""

from __future__ import annotations

import importlib.util
import json
import math
import select
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ddtree.bench.results import atomic_write_text

READY_TIMEOUT_S = 300.0  # torch's first import on a cold remote host
READING_TIMEOUT_S = 120.0


class PaceUnavailable(RuntimeError):
    """The probe could not start or answer; verdicts fall back to absolute tok/s and say why."""


def local_argv(device: str) -> list[str]:
    return [sys.executable, "-m", "ddtree.bench.pace", "--serve", "--device", device]


def standalone_argv(device: str, python: str = "python3") -> list[str]:
    """The probe as one command for a host without ddtree: its own source, run by `python`."""
    spec = importlib.util.find_spec("ddtree.bench.pace")  # its file, without importing torch here
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text(encoding="utf-8")
    return [python, "-c", source, "--serve", "--device", device]


class PaceProbe:
    """One probe process, asked for readings on demand."""

    def __init__(self, argv: Sequence[str], where: str) -> None:
        self.where = where
        try:
            self.process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as err:
            raise PaceUnavailable(f"pace probe on {where} did not start: {err}") from err
        ready = self._line(READY_TIMEOUT_S)
        if not ready.get("ready"):
            self.close()
            raise PaceUnavailable(f"pace probe on {where} did not get ready: {ready}")
        self.probe = str(ready.get("probe"))

    def _line(self, timeout_s: float) -> dict[str, Any]:
        out: IO[str] = self.process.stdout  # type: ignore[assignment]
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else ""
        if not line:
            self.process.kill()
            _, err = self.process.communicate(timeout=10)
            reason = "no answer in time" if not ready else f"exited with {self.process.returncode}"
            raise PaceUnavailable(f"pace probe on {self.where}: {reason}: {(err or '').strip()[-600:]}")
        try:
            return dict(json.loads(line))
        except (json.JSONDecodeError, TypeError, ValueError) as err:
            raise PaceUnavailable(f"pace probe on {self.where} answered {line.strip()[:200]!r}") from err

    def measure(self) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise PaceUnavailable(f"pace probe on {self.where} has exited ({self.process.returncode})")
        assert self.process.stdin is not None
        self.process.stdin.write("probe\n")
        self.process.stdin.flush()
        reading = self._line(READING_TIMEOUT_S)
        if "score" not in reading:
            raise PaceUnavailable(f"pace probe on {self.where} answered {reading}")
        return reading

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@dataclass
class PaceLog:
    """The session's probe (or why there is none) and every reading taken, kept in a file."""

    path: Path
    where: str  # "this machine", "gpu1 (over ssh)", ...
    start: Callable[[], PaceProbe] | None
    readings: list[dict[str, Any]] = field(default_factory=list)
    unavailable: str | None = None
    probe: PaceProbe | None = None

    def read(self, label: str) -> dict[str, Any] | None:
        """A reading labelled `label` ("b8-k4-w2048-bs8-ctx60-c1 repeat 1", "end"), or None without a probe."""
        if self.unavailable is not None:
            return None
        try:
            if self.probe is None:
                if self.start is None:
                    raise PaceUnavailable("no pace probe for this service")
                self.probe = self.start()
            reading = {**self.probe.measure(), "label": label, "where": self.where}
        except PaceUnavailable as err:
            self.unavailable = str(err)
            self._write()
            return None
        self.readings.append(reading)
        self._write()
        return reading

    def _write(self) -> None:
        record = {"where": self.where, "unavailable": self.unavailable, "readings": self.readings}
        atomic_write_text(self.path, json.dumps(record, indent=2) + "\n")

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def cell_pace(readings: Sequence[dict[str, Any] | None], loaded: bool = False) -> dict[str, Any] | None:
    """A cell's pace record from the readings taken between its repeats (before the first, after
    each): per repeat the geometric mean of the readings either side of it. `loaded`: the readings'
    `score_loaded` (a cell with several requests in flight), else `score`. None when any is missing."""
    if len(readings) < 2 or any(r is None for r in readings):
        return None
    key = "score_loaded" if loaded else "score"
    scores = [float(r.get(key, r["score"])) for r in readings]  # type: ignore[union-attr]
    per_repeat = [math.sqrt(a * b) for a, b in zip(scores, scores[1:])]
    return {"probe": readings[0]["probe"], "where": readings[0].get("where"),  # type: ignore[index]
            "score_key": key, "score": round(geometric_mean(scores), 4), "readings": [round(s, 4) for s in scores],
            "per_repeat": [round(p, 4) for p in per_repeat]}
