"""Arrival rates: Poisson schedules from a seed, and what an open-loop run of one did.

A rate cell sends its requests at Poisson arrival times (exponential gaps of mean 1 / rate, the first
request at 0), drawn from a seed so that every config of a sweep meets the same arrivals, and sends
each at its time whatever is in flight (ddtree.bench.loadgen.run_open_loop).

What a repeat reports, from its records alone:

    offered_request_rate    the rate asked for (req/s)
    scheduled_request_rate  this seed's draw: (n - 1) / last arrival time (a few Poisson arrivals stray
                            far from the mean; this is the rate the schedule really asked for)
    achieved_request_rate   (n - 1) / (last send - first send): what the client managed to send
    mean_in_flight, max_in_flight   requests in flight (itself included) just after each send: the
                            queue the arrivals met
    mean_send_lag_ms, max_send_lag_ms   the client's lateness behind the schedule
    latency_slope, latency_slope_se   the least-squares slope of E2E latency against send time (s of
                            latency per s of arrivals) and its standard error
    served_request_rate     achieved / (1 + slope): the rate the service served at
    keeps_up                false when a request failed, or the slope is above KEEP_UP_SLOPE by more
                            than two standard errors; true when it is below by as much over a long
                            enough run (below); else null

Why the latency's slope: a service that keeps up answers each request about as fast as the last,
however many come; one that serves at mu < lambda builds a queue, and a request arriving t seconds
later waits t x (lambda / mu - 1) longer, so slope = lambda / mu - 1 and mu = lambda / (1 + slope).
KEEP_UP_SLOPE is the slope of serving at KEEP_UP_SHARE of the arrival rate. Every request counts, not
the first and last answers: a batching server finishes several requests at once. A run whose arrivals
span less than JUDGE_SPANS of its fastest request's latency is a burst, not a rate, and a noisy run may
not resolve the slope: keeps_up is null there (too short or too noisy to tell), never a guess. A flat
slope says "kept up" only when the arrivals spanned JUDGE_SPANS median latencies too: a batching server
shares its steps among everything in flight, and over a shorter run the last arrivals finish fast as
the batch drains, so its latency need not grow while it falls behind (a steep slope is evidence either
way).

The cell keeps up only when no repeat fell behind: falling behind is reported (`keeps_up: false`), never
averaged away.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ddtree.bench.metrics import median
from ddtree.errors import ConfigError

KEEP_UP_SHARE = 0.85  # served below this share of the arrival rate: the queue grew through the run
KEEP_UP_SLOPE = 1.0 / KEEP_UP_SHARE - 1.0  # the latency slope of serving at KEEP_UP_SHARE of the arrivals
JUDGE_SPANS = 4  # arrivals spanning fewer fastest-request latencies than this are a burst: not judged
MAX_RATE = 10_000.0  # requests per second; more is a typo
RATE_KEYS = ("scheduled_request_rate", "achieved_request_rate", "served_request_rate", "latency_slope",
             "latency_slope_se", "mean_in_flight", "max_in_flight", "mean_send_lag_ms", "max_send_lag_ms")


class ArrivalRecord(Protocol):
    """What the rate statistics read from a request record (ddtree.bench.loadgen.RequestRecord)."""

    ok: bool
    started_at: float
    e2e_s: float | None
    scheduled_at: float | None


def check_rate(rate: float, where: str = "request_rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= MAX_RATE:
        raise ConfigError(f"{where}: {rate!r} must be a number of requests per second > 0 and <= {MAX_RATE:g}")
    return float(rate)


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """`count` arrival times (seconds from the start) of a Poisson process at `rate` req/s, the first at 0.

    The same (rate, count, seed) always gives the same times (random.Random's generator is fixed
    across Python versions for expovariate's inputs).
    """
    check_rate(rate)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"count: {count!r} must be an integer >= 0")
    draw = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += draw.expovariate(rate)
        offsets.append(now)
    return offsets


def _rate(count: int, span_s: float) -> float | None:
    return (count - 1) / span_s if count > 1 and span_s > 0 else None


def latency_trend(records: Sequence[ArrivalRecord]) -> tuple[float, float] | None:
    """(slope, standard error) of E2E latency against send time over the answered requests; None below 4."""
    points = [(r.started_at, r.e2e_s) for r in records if r.ok and r.e2e_s is not None]
    if len(points) < 4:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residuals = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
    return slope, (residuals / (len(points) - 2) / sxx) ** 0.5


def _keeps_up(records: Sequence[ArrivalRecord], trend: tuple[float, float] | None, span: float) -> bool | None:
    if any(not r.ok for r in records):
        return False  # a request the service dropped or timed out was not kept up with
    latencies = [r.e2e_s for r in records if r.e2e_s is not None]
    if trend is None or not latencies or span < JUDGE_SPANS * min(latencies):
        return None  # a burst: the arrivals ended before the queue could show
    slope, se = trend
    if slope - 2 * se > KEEP_UP_SLOPE:
        return False
    # a flat slope proves keeping up only over a span of several typical latencies: a batching server
    # falling behind over a shorter run serves its last arrivals fast as the batch drains
    long_enough = span >= JUDGE_SPANS * statistics.median(latencies)
    return True if slope + 2 * se <= KEEP_UP_SLOPE and long_enough else None


def arrival_stats(records: Sequence[ArrivalRecord], offered_rate: float) -> dict[str, Any]:
    """One open-loop repeat: offered, scheduled, achieved and served rates, the queue, the lag, keeps_up."""
    sends = sorted(r.started_at for r in records)
    scheduled = sorted(r.scheduled_at for r in records if r.scheduled_at is not None)
    intervals = [(r.started_at, r.started_at + (r.e2e_s or 0.0)) for r in records]
    in_flight = [1 + sum(1 for j, (s, e) in enumerate(intervals) if j != i and s <= t < e)
                 for i, (t, _) in enumerate(intervals)]
    lags = [(r.started_at - r.scheduled_at) * 1000.0 for r in records if r.scheduled_at is not None]
    span = sends[-1] - sends[0] if sends else 0.0
    achieved = _rate(len(sends), span)
    trend = latency_trend(records)
    return {
        "offered_request_rate": offered_rate,
        "scheduled_request_rate": _rate(len(scheduled), scheduled[-1] - scheduled[0]) if scheduled else None,
        "achieved_request_rate": achieved,
        "served_request_rate": None if achieved is None or trend is None else achieved / (1.0 + max(trend[0], 0.0)),
        "latency_slope": None if trend is None else trend[0],
        "latency_slope_se": None if trend is None else trend[1],
        "mean_in_flight": statistics.fmean(in_flight) if in_flight else None,
        "max_in_flight": max(in_flight) if in_flight else None,
        "mean_send_lag_ms": statistics.fmean(lags) if lags else None,
        "max_send_lag_ms": max(lags) if lags else None,
        "keeps_up": _keeps_up(records, trend, span),
    }


def summarize_arrivals(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The cell's rate numbers: medians over repeats, the worst queue; keeps_up false when a repeat fell
    behind, true when none did and one was judged, null when no repeat was long enough to judge."""
    if not repeats or "offered_request_rate" not in repeats[0]:
        return {}
    cell: dict[str, Any] = {"offered_request_rate": repeats[0]["offered_request_rate"]}
    for key in RATE_KEYS:
        cell[key] = median(r.get(key) for r in repeats)
    queues = [r["max_in_flight"] for r in repeats if r.get("max_in_flight") is not None]
    cell["max_in_flight"] = max(queues) if queues else None  # the worst queue, not a typical one
    verdicts = [r.get("keeps_up") for r in repeats]
    judged = [v for v in verdicts if v is not None]
    cell["keeps_up"] = None if not judged else all(judged)
    cell["keeps_up_repeats"] = f"{sum(judged)} of {len(judged)} judged, {len(verdicts)} run"
    return cell


def load_label(concurrency: int, request_rate: float | None) -> str:
    """A cell's load in ids and file names: `c<N>` (N in flight, closed loop) or `r<R>` (R req/s, open loop)."""
    return f"c{concurrency}" if request_rate is None else f"r{request_rate:g}"
