"""Per-request timestamps across the server's processes, for `python -m ddtree.profiling.timeline`.

Off unless the environment names a folder in DDTREE_TIMELINE when this module is first imported; then
each process keeps (request id, stage, CLOCK_MONOTONIC ns) rows in memory and writes them to
`<folder>/<role>-<pid>.tsv` when it stops (and whenever 10 000 rows have gathered). CLOCK_MONOTONIC
(time.monotonic_ns on Linux) is one clock for every process of a machine, so the client's, the HTTP
process's and the engine process's stamps of one request line up; perf_counter is not promised to be.

    ON                          # the module-level switch: every call site tests it first (`if stamps.ON:`)
    stamp(rid, stage)           # one row, now
    dump(role)                  # append this process's rows to its file; reset() forgets them unwritten
    meta(key, value)            # one fact about the process (its event loop, its HTTP protocol)
    mark(scope, stage)          # a stamp for the request an ASGI scope carries, before its id is known;
    attach(scope, rids)         #   then stamped for each of `rids` (with the protocol's first-bytes time)
    FirstLast(first, last)      # stamps an event stream's first event with tokens and its finish, per request
    StampedBatch(batch)         # the engine process's batch, stamping each request's prefill and last round
    stamped_deliver(deliver)    # the scheduler's deliver, stamping first tokens and finishes as they leave

Costs nothing but one attribute test per site when off (the rows are not even allocated).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

ENV = "DDTREE_TIMELINE"
FOLDER: str | None = os.environ.get(ENV) or None
ON = FOLDER is not None
FLUSH_ROWS = 10_000  # a long-running server with the switch on writes as it goes, not all at the end

_rows: list[tuple[str, str, int]] = []
_meta: dict[str, str] = {}


def stamp(rid: str, stage: str, at: int | None = None) -> None:
    _rows.append((rid, stage, time.monotonic_ns() if at is None else at))
    if len(_rows) >= FLUSH_ROWS:
        dump(_role)


def meta(key: str, value: Any) -> None:
    _meta[key] = str(value)


_role = "process"


def set_role(role: str) -> None:
    """What this process's file is called (http, engine); a forked child calls it with reset()."""
    global _role
    _role = role


def reset() -> None:
    """Forget the rows and facts recorded so far (a forked child's inherited copy)."""
    _rows.clear()
    _meta.clear()


def dump(role: str | None = None) -> Path | None:
    """Append the rows so far to `<FOLDER>/<role>-<pid>.tsv` (facts as `#key<TAB>value` lines) and forget them."""
    if FOLDER is None:
        return None
    path = Path(FOLDER) / f"{role or _role}-{os.getpid()}.tsv"
    rows, facts = list(_rows), dict(_meta)
    _rows.clear()
    _meta.clear()
    lines = [f"#{k}\t{v}\n" for k, v in facts.items()] + [f"{rid}\t{stage}\t{t}\n" for rid, stage, t in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(lines)
    return path


def read_folder(folder: str | os.PathLike[str]) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, str]]]:
    """Every file's rows, as {rid: {stage: ns}} (a stage stamped twice keeps its first time), and each
    file's facts, by file name."""
    by_rid: dict[str, dict[str, int]] = {}
    facts: dict[str, dict[str, str]] = {}
    for path in sorted(Path(folder).glob("*.tsv")):
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                key, _, value = line[1:].partition("\t")
                facts.setdefault(path.name, {})[key] = value
                continue
            rid, stage, t = line.split("\t")
            by_rid.setdefault(rid, {}).setdefault(stage, int(t))
    return by_rid, facts


SCOPE_IN = "ddtree.t_in"  # the ASGI scope's key for when its request's first bytes were read
SCOPE_MARKS = "ddtree.marks"


def mark(scope: dict[str, Any], stage: str) -> None:
    scope.setdefault(SCOPE_MARKS, []).append((stage, time.monotonic_ns()))


def attach(scope: dict[str, Any], rids: list[str]) -> None:
    marks = scope.pop(SCOPE_MARKS, [])
    if SCOPE_IN in scope:
        marks.insert(0, ("h_in", scope[SCOPE_IN]))
    for rid in rids:
        for stage, at in marks:
            stamp(rid, stage, at)


class FirstLast:
    """Stamps `first` at a request's first event that brought tokens and `last` at its finish (or failure)."""

    def __init__(self, first: str, last: str) -> None:
        self.first, self.last = first, last
        self._started: set[str] = set()

    def __call__(self, rid: str, tokens: bool, finished: bool) -> None:
        if tokens and rid not in self._started:
            self._started.add(rid)
            stamp(rid, self.first)
        if finished:
            self._started.discard(rid)
            stamp(rid, self.last)


def stamped_deliver(deliver: Any) -> Any:
    """`deliver` (the scheduler's hand-out of [(sink, event)]) stamping `e_first_out`/`e_last_out` before it."""
    seen = FirstLast("e_first_out", "e_last_out")

    def stamped(items: list[tuple[Any, Any]]) -> None:
        for _, event in items:
            tokens = bool(getattr(event, "new_token_ids", None))
            seen(event.request_id, tokens, getattr(event, "finished", True))
        deliver(items)

    return stamped


class StampedBatch:
    """A DecodeBatch that stamps, per request, its prefill's start and end (`e_admit`, `e_prefilled`) and the
    round that finished it (`e_last`); everything else is the batch's own: attribute reads look through to it, so it
    offers every member of the scheduler's batch protocol (ddtree.serving.admission.DecodeBatchLike)."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch
        if hasattr(batch, "add"):
            self.add = self._prefill(batch.add, lambda request: [request])
        if hasattr(batch, "add_many"):
            self.add_many = self._prefill(batch.add_many, lambda requests: requests)
        for name in ("step", "collect", "settle"):
            if hasattr(batch, name):
                setattr(self, name, self._round(getattr(batch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    @staticmethod
    def _prefill(add: Any, requests_of: Any) -> Any:
        def stamped(arg: Any) -> Any:
            for request in requests_of(arg):
                stamp(request.request_id, "e_admit")
            return _stamp_outputs(add(arg), "e_prefilled")

        return stamped

    @staticmethod
    def _round(run: Any) -> Any:
        def stamped(*args: Any, **kwargs: Any) -> Any:  # collect(run_ahead=True) too
            return _stamp_outputs(run(*args, **kwargs))

        return stamped


def _stamp_outputs(outputs: Any, stage: str | None = None) -> Any:
    now = time.monotonic_ns()
    for out in outputs or ():
        if stage is not None:
            stamp(out.request_id, stage, now)
        if out.finished:
            stamp(out.request_id, "e_last", now)
    return outputs


def stamped_protocol(base: type) -> type:
    """uvicorn's HTTP protocol class `base`, putting the time a request's first bytes were read into its scope."""

    class Stamped(base):  # type: ignore[misc, valid-type]
        def data_received(self, data: bytes) -> None:
            at = time.monotonic_ns()
            before = getattr(self, "scope", None)
            super().data_received(data)
            scope = getattr(self, "scope", None)
            if scope is not None and scope is not before:  # a request began in these bytes
                scope[SCOPE_IN] = at

    Stamped.__name__ = Stamped.__qualname__ = f"Stamped{base.__name__}"
    return Stamped
