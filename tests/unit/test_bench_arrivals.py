"""Arrival rates: the seeded Poisson schedule, and the rates and queue computed from an open-loop run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest

from ddtree.bench.arrivals import KEEP_UP_SHARE, arrival_stats, load_label, poisson_offsets, summarize_arrivals
from ddtree.errors import ConfigError


def test_the_schedule_is_seeded_starts_at_zero_and_ascends() -> None:
    a, b = poisson_offsets(4.0, 50, seed=7), poisson_offsets(4.0, 50, seed=7)
    assert a == b and a[0] == 0.0 and a == sorted(a) and len(a) == 50
    assert poisson_offsets(4.0, 50, seed=8) != a
    assert poisson_offsets(4.0, 0, seed=1) == [] and poisson_offsets(4.0, 1, seed=1) == [0.0]


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_the_schedule_keeps_its_rate_with_exponential_gaps(rate: float) -> None:
    offsets = poisson_offsets(rate, 4001, seed=0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    # 4000 gaps: the mean's relative standard error is 1/sqrt(4000) = 1.6%; 5% is three of them
    assert (len(gaps) / offsets[-1]) == pytest.approx(rate, rel=0.05)
    # exponential gaps: the standard deviation equals the mean (coefficient of variation 1)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)


def test_bad_rates_and_counts_are_refused() -> None:
    for rate in (0, -1, float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="requests per second > 0"):
            poisson_offsets(rate, 3, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="count"):
        poisson_offsets(1.0, -1, seed=0)


@dataclass
class Rec:
    started_at: float
    e2e_s: float | None
    scheduled_at: float | None
    ok: bool = True


def run(sends: list[float], latencies: list[float], lag: float = 0.0) -> list[Rec]:
    return [Rec(s + lag, e, s) for s, e in zip(sends, latencies)]


def test_a_service_that_keeps_up_serves_at_the_arrival_rate() -> None:
    sends = [0.5 * i for i in range(10)]
    stats = arrival_stats(run(sends, [0.2, 0.25] * 5, lag=0.001), offered_rate=2.0)
    assert stats["achieved_request_rate"] == pytest.approx(2.0)
    assert stats["scheduled_request_rate"] == pytest.approx(2.0)
    assert abs(stats["latency_slope"]) < 0.01 and stats["served_request_rate"] == pytest.approx(2.0, rel=0.02)
    assert stats["keeps_up"] is True
    assert (stats["mean_in_flight"], stats["max_in_flight"]) == (1.0, 1)
    assert stats["mean_send_lag_ms"] == pytest.approx(1.0)


def behind(n: int, gap: float, service_s: float) -> list[Rec]:
    """Arrivals every `gap` s at a server that takes `service_s` per request, one at a time: a queue."""
    sends = [gap * i for i in range(n)]
    done = [service_s * (i + 1) for i in range(n)]
    return run(sends, [d - s for s, d in zip(sends, done)])


def test_a_service_that_falls_behind_is_reported_with_the_rate_it_served() -> None:
    stats = arrival_stats(behind(20, 0.5, 1.0), offered_rate=2.0)  # 2 req/s offered, 1 req/s served
    assert stats["achieved_request_rate"] == pytest.approx(2.0)
    assert stats["latency_slope"] == pytest.approx(1.0) and stats["served_request_rate"] == pytest.approx(1.0)
    assert stats["keeps_up"] is False
    assert stats["max_in_flight"] == 11  # the last arrival (9.5 s) finds requests 9..18 still queued


def test_serving_just_below_the_arrivals_is_within_the_keep_up_share() -> None:
    slightly = arrival_stats(behind(20, 0.5, 0.5 / (KEEP_UP_SHARE + 0.05)), offered_rate=2.0)
    assert slightly["keeps_up"] is True
    too_slow = arrival_stats(behind(20, 0.5, 0.5 / (KEEP_UP_SHARE - 0.05)), offered_rate=2.0)
    assert too_slow["keeps_up"] is False


def test_a_burst_or_a_noisy_run_is_not_judged() -> None:
    # eight arrivals in 0.07 s at a service that takes 0.3 s: over before a queue could show
    burst = arrival_stats(run([0.01 * i for i in range(8)], [0.3] * 8), offered_rate=100.0)
    assert burst["keeps_up"] is None and burst["achieved_request_rate"] == pytest.approx(100.0)
    noisy = arrival_stats(run([1.0 * i for i in range(6)], [0.1, 3.0, 0.1, 0.1, 3.0, 0.1]), offered_rate=1.0)
    assert noisy["latency_slope_se"] > 0.2 and noisy["keeps_up"] is None


def test_a_failed_request_means_the_rate_was_not_kept() -> None:
    records = run([0.0, 1.0, 2.0], [0.1] * 3)
    records[1].ok = False
    assert arrival_stats(records, 1.0)["keeps_up"] is False


def test_the_cell_keeps_up_only_when_no_repeat_fell_behind() -> None:
    good = arrival_stats(run([0.5 * i for i in range(10)], [0.2] * 10), 2.0)
    bad = arrival_stats(behind(20, 0.5, 1.0), 2.0)
    unjudged = arrival_stats(run([0.01 * i for i in range(8)], [0.3] * 8), 2.0)
    cell = summarize_arrivals([good, good, bad])
    assert cell["keeps_up"] is False and cell["keeps_up_repeats"] == "2 of 3 judged, 3 run"
    assert cell["max_in_flight"] == max(good["max_in_flight"], bad["max_in_flight"])
    assert summarize_arrivals([good, unjudged])["keeps_up"] is True
    assert summarize_arrivals([unjudged, unjudged])["keeps_up"] is None
    assert summarize_arrivals([{"request_throughput": 1.0}]) == {}  # a closed-loop cell has no rate numbers


def test_load_labels() -> None:
    assert (load_label(4, None), load_label(0, 2.0), load_label(0, 0.25)) == ("c4", "r2", "r0.25")


def test_a_flat_latency_proves_keeping_up_only_over_several_typical_latencies() -> None:
    """A batching server falling behind over a short run can show a flat latency (its last arrivals finish
    fast as the batch drains): over less than JUDGE_SPANS median latencies a flat slope is no verdict."""
    def flat(n: int) -> list[Rec]:
        return run([0.1 * i for i in range(n)], [0.2 if i == 5 else 1.0 for i in range(n)])
    assert arrival_stats(flat(20), offered_rate=10.0)["keeps_up"] is None  # 1.9 s of arrivals, 1 s latencies
    assert arrival_stats(flat(50), offered_rate=10.0)["keeps_up"] is True  # 4.9 s: long enough to show a queue
