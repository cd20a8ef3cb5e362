"""Sweep progress: one plain line per cell, readable in a terminal and in CI logs alike.

    [3/14] b8-k4-w2048-bs8 ctx=1024 c=32 ... 812.4 tok/s, accept 3.41, 0 failed

Uses rich's Console, which drops colour and never wraps when the output is not a terminal.
"""

from __future__ import annotations

from typing import IO, Any

from rich.console import Console
from rich.markup import escape


class Progress:
    """Counts cells and prints one line each; `total` is the number of cells planned."""

    def __init__(self, total: int, *, file: IO[str] | None = None, console: Console | None = None) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total: {total!r} must be an integer >= 0")
        self.total = total
        self.done = 0
        self.console = console or Console(file=file, highlight=False, soft_wrap=True)

    def _prefix(self, config_id: str, context: int, concurrency: int) -> str:
        self.done += 1
        return f"[{self.done}/{self.total}] {config_id} ctx={context} c={concurrency} ..."

    def _print(self, line: str) -> str:
        self.console.print(escape(line))
        return line

    def cell_done(self, config_id: str, context: int, concurrency: int,
                  metrics: dict[str, Any]) -> str:
        tps = metrics.get("output_throughput")
        accept = metrics.get("accept_length")
        parts = [
            "- tok/s" if tps is None else f"{tps:.1f} tok/s",
            "accept -" if accept is None else f"accept {accept:.2f}",
            f"{int(metrics.get('failed') or 0)} failed",
        ]
        return self._print(f"{self._prefix(config_id, context, concurrency)} {', '.join(parts)}")

    def cell_skipped(self, config_id: str, context: int, concurrency: int, reason: str) -> str:
        return self._print(f"{self._prefix(config_id, context, concurrency)} skipped ({reason})")

    def cell_failed(self, config_id: str, context: int, concurrency: int, error: str) -> str:
        first = error.strip().splitlines()[0] if error.strip() else "unknown error"
        return self._print(f"{self._prefix(config_id, context, concurrency)} FAILED: {first}")
