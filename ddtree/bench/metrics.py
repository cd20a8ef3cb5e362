"""Benchmark metrics: per-repeat summaries of request records and per-cell medians with MAD.

Pure functions over numbers; no I/O and no knowledge of the service. Key names follow vLLM's
`vllm bench serve` result keys where one exists (output_throughput, median_tpot_ms, p99_ttft_ms).

Acceptance length is token-weighted: sum(completion_tokens) / sum(spec_verify_ct) over the
requests that report verify counts. A per-request mean would let a 3-token request that happened
to accept everything weigh as much as a 500-token one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

# Latency families and the statistics reported for each (vLLM names: mean_ttft_ms, p99_itl_ms...).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_STATS = ("mean", "median", "p90", "p99")

# Per-repeat keys that a cell summarises as median and MAD across repeats.
CELL_METRICS = (
    "output_throughput",
    "request_throughput",
    "total_token_throughput",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "median_e2el_ms",
    "p90_e2el_ms",
    "p99_e2el_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


class RecordLike(Protocol):
    """What summarize_repeat reads from a request record (ddtree.bench.loadgen.RequestRecord)."""

    ok: bool
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    itl_s: list[float]
    tpot_s: float | None
    spec_verify_ct: int | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q: {q} is out of range (allowed 0..100)")
    data = sorted(values)
    if not data:
        return None
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def mad(values: Iterable[float | None]) -> float | None:
    """Median absolute deviation from the median (unscaled); None when there is no value."""
    data = [v for v in values if v is not None]
    if not data:
        return None
    center = statistics.median(data)
    return statistics.median(abs(v - center) for v in data)


def _stats(values: Sequence[float], name: str) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": statistics.median(ms) if ms else None,
        f"p90_{name}_ms": percentile(ms, 90),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def accept_length(completion_tokens: int, verify_ct: int) -> float | None:
    """Token-weighted acceptance: tokens committed per verify round; None without verify counts."""
    return completion_tokens / verify_ct if verify_ct > 0 else None


def summarize_repeat(records: Sequence[RecordLike], duration_s: float) -> dict[str, Any]:
    """One repeat's numbers: counts, throughputs, latency statistics (ms) and acceptance length.

    Only successful requests count towards tokens and latencies (as in vLLM); failed ones are
    counted in `failed`. `duration_s` is the wall time of the repeat (first send to last answer).
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s: {duration_s!r} must be > 0 seconds")
    done = [r for r in records if r.ok]
    out_tokens = sum(r.completion_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    spec = [r for r in done if r.spec_verify_ct is not None]
    spec_tokens = sum(r.completion_tokens for r in spec)
    spec_verify = sum(int(r.spec_verify_ct or 0) for r in spec)
    result: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    result.update(_stats([r.ttft_s for r in done if r.ttft_s is not None], "ttft"))
    result.update(_stats([r.tpot_s for r in done if r.tpot_s is not None], "tpot"))
    result.update(_stats([gap for r in done for gap in r.itl_s], "itl"))
    result.update(_stats([r.e2e_s for r in done if r.e2e_s is not None], "e2el"))
    # Raw sums travel with the repeat so a cell can weight acceptance by tokens across repeats.
    result["spec_tokens"] = spec_tokens
    result["spec_verify_ct"] = spec_verify
    result["accept_length"] = accept_length(spec_tokens, spec_verify)
    return result


def summarize_cell(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and MAD across repeats (key and key + "_mad"), totals, token-weighted acceptance.

    `accept_length` pools every request of every repeat (token-weighted); `accept_length_mad` is
    the MAD of the per-repeat values, a stability hint.
    """
    if not repeats:
        raise ValueError("repeats: need at least 1 repeat summary, got 0")
    cell: dict[str, Any] = {
        "repeats": len(repeats),
        "completed": sum(int(r.get("completed", 0)) for r in repeats),
        "failed": sum(int(r.get("failed", 0)) for r in repeats),
        "total_output_tokens": sum(int(r.get("total_output_tokens", 0)) for r in repeats),
    }
    for key in CELL_METRICS:
        values = [r.get(key) for r in repeats]
        cell[key] = median(values)
        cell[f"{key}_mad"] = mad(values)
    tokens = sum(int(r.get("spec_tokens") or 0) for r in repeats)
    verify = sum(int(r.get("spec_verify_ct") or 0) for r in repeats)
    cell["accept_length"] = accept_length(tokens, verify)
    cell["accept_length_mad"] = mad(r.get("accept_length") for r in repeats)
    return cell


def records_duration_s(records: Sequence[Any]) -> float:
    """Wall time from the first send to the last answer, from the records' own clocks."""
    spans = [(r.started_at, r.started_at + (r.e2e_s or 0.0)) for r in records]
    if not spans:
        raise ValueError("records: need at least 1 record to measure a duration")
    return max(end for _, end in spans) - min(start for start, _ in spans)
