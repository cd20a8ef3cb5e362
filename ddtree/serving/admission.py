"""Admission: the batch as the scheduler sees it, which queued arrivals join it now, how they are prefilled,
and the warm-up generations a graphed batch runs before serving.

A burst of arrivals (each within BURST_GAP_S of the one before) is held back from admission until it stops
(BURST_GAP_S with no arrival), fills one prefill forward (the batch's prefill_tokens), or its oldest has waited
BURST_WAIT_S: then it is prefilled as one group, not as several, each a prefill of its own with decode rounds
in between. An arrival with none in the BURST_GAP_S before it (a lone request: every one at concurrency 1)
is never held. Rows already running keep running their rounds meanwhile.

The scheduler (ddtree.serving.scheduler) keeps the queue and calls these on its thread, between rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree.cuda_graphs import ROW_BUCKETS
from ddtree.errors import RequestError
from ddtree.prefill import prefill_chunks
from ddtree.request import Request, StepOutput

log = logging.getLogger("ddtree.server")

BURST_GAP_S = 0.001
BURST_WAIT_S = 0.004
WARM_PREFILL_WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096)  # lone prompts a graphed batch replays a prefill for
WARM_NEW_TOKENS = 40  # tokens per warm-up request: >= 3 rounds at block 16 (budget auto captures from its second)


class DecodeBatchLike(Protocol):
    """Every member the scheduler uses of ddtree.decode.DecodeBatch (and what the fakes provide).

    A round is `launch()` then `collect()`; `collect(run_ahead=True)` may launch the next round before it reads
    this one's tokens (a batch that never runs ahead ignores it): `round_ahead` says one is in flight, and it
    must be taken back with `settle()` before requests join (add, add_many) or leave (cancel, clear)."""

    max_len: int  # a request's prompt + new tokens fit in this (the warm-up's prefill widths)
    prefill_tokens: int | None  # padded tokens per prefill forward (None: no bound; admission groups by it)
    forward_cost: int  # what one more prefill forward costs, in padded tokens (ddtree.prefill.prefill_chunks)

    @property
    def graphs(self) -> object | None: ...  # not None: rounds are CUDA graphs, captured when first met

    @property
    def last_budget(self) -> int | None: ...  # the latest round's tree size (None before any)

    @property
    def budget_rounds(self) -> int: ...  # rounds counted in budget_total (0: none yet, or an AR batch)

    @property
    def budget_total(self) -> int: ...  # tree sizes summed over those rounds

    @property
    def free_slots(self) -> int: ...  # slots requests may join (after settle(), where a round ahead is in flight)

    @property
    def active(self) -> int: ...  # rows still running

    @property
    def round_ahead(self) -> bool: ...  # a round launched ahead is in flight

    def validate(self, request: Request) -> None: ...  # raises the RequestError add would, without a forward
    def add(self, request: Request) -> list[StepOutput]: ...  # the prefill: the first token(s)
    def add_many(self, requests: Sequence[Request]) -> list[StepOutput]: ...  # several in shared forwards
    def launch(self) -> None: ...
    def collect(self, run_ahead: bool = False) -> list[StepOutput]: ...
    def settle(self) -> list[StepOutput]: ...  # the round ahead's outputs ([] where none is in flight)
    def cancel(self, request_id: str) -> object: ...
    def clear(self) -> None: ...  # drop every row (and a round ahead with them)


@dataclass
class Ticket:
    """A request queued or running in the scheduler, with where its events go."""

    request: Request
    sink: Callable[[Any], None]  # the scheduler's Sink: this request's events (StepOutput or Failure)
    counted: bool = True  # False for the server's own warm-up and health probes: kept out of metrics
    verify_steps: int = 0  # last cumulative count seen, to turn it into per-round deltas
    arrived: float = 0.0  # time.perf_counter() at submit
    in_burst: bool = False  # it arrived within burst_gap_s of the arrival before it
    held_at: float | None = None  # when the scheduler first held it back for the rest of its burst


def admit_now(pending: Sequence[Ticket], room: int, last_arrival: float, gap_s: float, wait_s: float,
              prefill_tokens: int | None, now: float) -> tuple[int, float]:
    """How many of the queued arrivals `pending` join now (the oldest first; `room`: slots they may take), and,
    when none, how much longer they wait for the rest of their burst. Marks when the oldest was first held.

    All that fits joins unless the oldest came within gap_s of an arrival before it, the latest
    (`last_arrival`) came less than gap_s ago, the oldest has been held back less than wait_s (time spent
    queued behind a prefill or a round, when it could not have joined anyway, does not count) and more could
    still fit. Then only whole prefill forwards join (prefill_tokens over the longest prompt, in rows), the
    rest waiting for more of the burst to fill theirs; none where the batch has no such bound (None)."""
    take = min(room, len(pending))
    first = pending[0]
    if not first.in_burst or take == room:
        return take, 0.0  # a lone arrival, or all the room's worth: waiting gains nothing
    if first.held_at is None:
        first.held_at = now
    left = min(last_arrival + gap_s, first.held_at + wait_s) - now
    if left <= 0:
        return take, 0.0  # the burst is over, or its oldest has waited long enough
    if prefill_tokens is not None:
        rows = max(1, prefill_tokens // max(len(t.request.prompt_ids) for t in pending))  # a forward's
        if take >= rows:
            return take - take % rows, 0.0  # the full forwards; the rest waits to fill its own
    return 0, left


def prefill_groups(valid: list[Ticket], prefill_tokens: int | None, forward_cost: int) -> list[list[Ticket]]:
    """Validated tickets cut into prefill forwards as the batch would cut them (ddtree.prefill.prefill_chunks);
    one group where the batch has no bound on a forward's padded tokens."""
    if prefill_tokens is None or len(valid) < 2:
        return [valid]
    lengths = [len(t.request.prompt_ids) for t in valid]
    return [[valid[i] for i in chunk] for chunk in prefill_chunks(lengths, prefill_tokens, forward_cost)]


Joined = Callable[[list[Ticket], list[StepOutput]], None]  # tickets now running, and their first outputs
Refused = Callable[[Ticket, str, int, str | None], None]  # a ticket refused: message, status code, field


def prefill(batch: DecodeBatchLike, tickets: list[Ticket], joined: Joined, refused: Refused,
            between: Callable[[], None]) -> None:
    """Prefill admitted tickets, together where the batch can (one padded forward, not one each).

    Each request is validated on its own first, so a bad one is refused alone; the valid ones are cut into
    forwards as the batch would cut them (prefill_groups), `between()` running after each when there are
    several (the scheduler hands that forward's first tokens out before the next one runs: TTFT)."""
    if len(tickets) < 2:
        for ticket in tickets:
            _prefill_one(batch, ticket, joined, refused)
        return
    valid = []
    for ticket in tickets:
        try:
            batch.validate(ticket.request)
        except RequestError as err:
            refused(ticket, str(err), err.status_code, err.field)
        else:
            valid.append(ticket)
    groups = prefill_groups(valid, batch.prefill_tokens, batch.forward_cost)
    for group in groups:
        _prefill_group(batch, group, joined, refused)
        if len(groups) > 1:
            between()


def _prefill_group(batch: DecodeBatchLike, valid: list[Ticket], joined: Joined, refused: Refused) -> None:
    """Validated tickets in one add_many (one alone: add, a graphed batch's lone prefill)."""
    if len(valid) < 2:
        for ticket in valid:
            _prefill_one(batch, ticket, joined, refused)
        return
    try:
        first = batch.add_many([t.request for t in valid])
    except Exception:
        # Whatever went wrong, give each request its own chance and its own error: undo any that
        # joined before the failure, then admit them one at a time.
        log.exception("batched prefill of %d requests failed; admitting them one by one", len(valid))
        for ticket in valid:
            try:
                batch.cancel(ticket.request.request_id)
            except Exception:
                log.exception("cancel after a failed batched prefill failed for %s", ticket.request.request_id)
        for ticket in valid:
            _prefill_one(batch, ticket, joined, refused)
        return
    joined(valid, first)


def _prefill_one(batch: DecodeBatchLike, ticket: Ticket, joined: Joined, refused: Refused) -> None:
    request = ticket.request
    try:
        first = batch.add(request)  # the prefill; it yields the first token
    except RequestError as err:
        refused(ticket, str(err), err.status_code, err.field)
        return
    except Exception as err:  # an engine bug must not take the server down with it
        log.exception("prefill failed for request %s", request.request_id)
        refused(ticket, f"prefill failed: {err}", 500, None)
        return
    joined([ticket], first)


def warm_up(batch: DecodeBatchLike, max_running: int, token: int) -> tuple[list[int], list[int]]:
    """A generation at every row bucket up to max_running (largest first) and a lone prefill at every width a
    graph serves, run as serving runs them, on an idle graphed batch; the row buckets and widths it ran. Greedy
    rounds only: a sampled round's graphs (temperature > 0) are still captured when first met. A warm-up that
    fails is logged and dropped: it costs speed, not service (what it missed is captured when met)."""
    buckets = sorted({b for b in ROW_BUCKETS if b < max_running} | {max_running}, reverse=True)
    widths = [w for w in WARM_PREFILL_WIDTHS if w + WARM_NEW_TOKENS < batch.max_len]
    runs = [[Request(f"warm-{rows}-{i}", [token], WARM_NEW_TOKENS, ignore_eos=True) for i in range(rows)]
            for rows in buckets if rows <= batch.free_slots]
    runs += [[Request(f"warm-prefill-{w}", [token] * w, 1, ignore_eos=True)] for w in widths]
    try:
        for requests in runs:
            _generate(batch, requests)
    except Exception:
        log.exception("warm-up of the batch's CUDA graphs failed; serving without it")
        batch.clear()  # the warm-up's rows (nothing else runs yet), a round launched ahead with them
    return buckets[::-1], widths


def _generate(batch: DecodeBatchLike, requests: list[Request]) -> None:
    """Prefill `requests` together (one alone: the lone prefill) and run rounds until every one has finished."""
    first = batch.add_many(requests) if len(requests) > 1 else batch.add(requests[0])
    left = {r.request_id for r in requests} - {o.request_id for o in first if o.finished}
    while left:
        batch.launch()
        left -= {o.request_id for o in batch.collect(run_ahead=True) if o.finished}
    batch.settle()  # the round launched ahead of the last finish (theirs only: nothing to hand out)
