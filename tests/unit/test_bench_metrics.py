"""Metrics against small hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree.bench.loadgen import RequestRecord
from ddtree.bench.metrics import (
    mad,
    median,
    percentile,
    records_duration_s,
    summarize_cell,
    summarize_repeat,
)


def rec(tokens: int, verify: int | None, ttft: float, e2e: float, itl: list[float],
        ok: bool = True, prompt: int = 10, started: float = 0.0) -> RequestRecord:
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    return RequestRecord(ok=ok, prompt_tokens=prompt, completion_tokens=tokens, ttft_s=ttft,
                         e2e_s=e2e, itl_s=itl, tpot_s=tpot, spec_verify_ct=verify,
                         started_at=started, error=None if ok else "HTTP 500: x")


def test_percentile_by_hand() -> None:
    data = [4.0, 1.0, 3.0, 2.0]
    assert percentile(data, 50) == pytest.approx(2.5)
    assert percentile(data, 90) == pytest.approx(3.7)  # rank 2.7 between 3 and 4
    assert percentile(data, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    rng = np.random.default_rng(0)
    sample = rng.exponential(size=101).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    with pytest.raises(ValueError, match="q: 101"):
        percentile(data, 101)


def test_median_and_mad_by_hand() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, None, 4.0]) == 2.5
    assert median([None]) is None
    # median 3; absolute deviations 2, 1, 0, 1, 97 -> median 1 (robust to the outlier)
    assert mad([1.0, 2.0, 3.0, 4.0, 100.0]) == 1.0
    assert mad([7.0]) == 0.0
    assert mad([]) is None


def test_token_weighted_acceptance_differs_from_per_request_mean() -> None:
    long = rec(100, 25, 0.1, 1.09, [0.01] * 24)  # 4.0 tokens per round
    short = rec(2, 1, 0.1, 0.2, [])  # 2.0 tokens per round
    out = summarize_repeat([long, short], duration_s=2.0)
    naive = (100 / 25 + 2 / 1) / 2
    assert naive == 3.0
    assert out["accept_length"] == pytest.approx(102 / 26)
    assert out["accept_length"] != pytest.approx(naive)


def test_summarize_repeat_by_hand() -> None:
    a = rec(11, 5, ttft=0.2, e2e=1.2, itl=[0.1, 0.3], prompt=8)  # tpot 0.1
    b = rec(21, None, ttft=0.4, e2e=2.4, itl=[0.2], prompt=12)  # tpot 0.1, no verify count
    bad = rec(0, None, ttft=0.0, e2e=0.5, itl=[], ok=False)
    out = summarize_repeat([a, b, bad], duration_s=4.0)
    assert out["completed"] == 2 and out["failed"] == 1
    assert out["total_input_tokens"] == 20 and out["total_output_tokens"] == 32
    assert out["output_throughput"] == pytest.approx(8.0)
    assert out["request_throughput"] == pytest.approx(0.5)
    assert out["total_token_throughput"] == pytest.approx(13.0)
    assert out["mean_ttft_ms"] == pytest.approx(300.0)
    assert out["median_ttft_ms"] == pytest.approx(300.0)
    assert out["p90_ttft_ms"] == pytest.approx(380.0)
    assert out["median_tpot_ms"] == pytest.approx(100.0)
    assert out["median_itl_ms"] == pytest.approx(200.0)
    assert out["p99_itl_ms"] == pytest.approx(298.0)
    assert out["mean_e2el_ms"] == pytest.approx(1800.0)  # the failed request is not counted
    # only the request that reports verify rounds counts towards acceptance
    assert out["accept_length"] == pytest.approx(11 / 5)


def test_summarize_repeat_without_speculation_or_success() -> None:
    out = summarize_repeat([rec(0, None, 0.0, 0.1, [], ok=False)], duration_s=1.0)
    assert out["accept_length"] is None
    assert out["median_tpot_ms"] is None and out["completed"] == 0 and out["failed"] == 1
    with pytest.raises(ValueError, match="duration_s"):
        summarize_repeat([], duration_s=0.0)


def test_summarize_cell_median_mad_and_pooled_acceptance() -> None:
    repeats = [
        {"output_throughput": 100.0, "median_tpot_ms": 10.0, "completed": 4, "failed": 0,
         "spec_tokens": 400, "spec_verify_ct": 100, "accept_length": 4.0},
        {"output_throughput": 110.0, "median_tpot_ms": 12.0, "completed": 4, "failed": 1,
         "spec_tokens": 40, "spec_verify_ct": 20, "accept_length": 2.0},
        {"output_throughput": 130.0, "median_tpot_ms": 11.0, "completed": 3, "failed": 0,
         "spec_tokens": 300, "spec_verify_ct": 100, "accept_length": 3.0},
    ]
    cell = summarize_cell(repeats)
    assert cell["repeats"] == 3 and cell["completed"] == 11 and cell["failed"] == 1
    assert cell["output_throughput"] == 110.0
    assert cell["output_throughput_mad"] == 10.0  # deviations 10, 0, 20
    assert cell["median_tpot_ms"] == 11.0 and cell["median_tpot_ms_mad"] == 1.0
    assert cell["accept_length"] == pytest.approx(740 / 220)  # pooled, not the median 3.0
    assert cell["accept_length_mad"] == 1.0
    assert cell["p99_ttft_ms"] is None  # absent in every repeat
    with pytest.raises(ValueError, match="repeats"):
        summarize_cell([])


def test_records_duration() -> None:
    records = [rec(2, 1, 0.1, 1.0, [], started=10.0), rec(2, 1, 0.1, 0.5, [], started=10.8)]
    assert records_duration_s(records) == pytest.approx(1.3)
