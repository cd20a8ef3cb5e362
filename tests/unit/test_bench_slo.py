"""SLOs: per-request judging, attainment and goodput arithmetic, the cell's pooling, parsing and --slo."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ddtree.bench.slo import DEFAULT_TARGET, SLO_KEYS, judge_repeat, parse_slo, parse_slo_flag, request_meets, summarize_slo
from ddtree.errors import ConfigError


@dataclass
class Rec:
    ok: bool = True
    ttft_s: float | None = 0.1
    tpot_s: float | None = 0.01
    e2e_s: float | None = 1.0
    itl_s: list[float] = field(default_factory=lambda: [0.02] * 10)


SPEC = parse_slo({"ttft_p99_ms": 200, "tpot_p90_ms": 20, "itl_p99_ms": 50, "e2el_p90_ms": 2000})


def test_a_request_meets_every_objective_or_names_what_it_missed() -> None:
    assert request_meets(Rec(), SPEC) == (True, [], [])
    assert request_meets(Rec(ttft_s=0.3), SPEC) == (False, ["ttft_p99_ms"], [])
    assert request_meets(Rec(tpot_s=0.021, e2e_s=2.5), SPEC) == (False, ["tpot_p90_ms", "e2el_p90_ms"], [])
    # a threshold is inclusive: exactly at it is met
    assert request_meets(Rec(ttft_s=0.2), SPEC)[0]


def test_itl_is_judged_on_the_requests_own_percentile_of_its_gaps() -> None:
    spec = parse_slo({"itl_p90_ms": 50})
    one_slow = [0.01] * 19 + [0.5]  # the p90 of these 20 gaps is 10 ms: one stall in 20 is allowed at p90
    assert request_meets(Rec(itl_s=one_slow), spec)[0]
    five_slow = [0.01] * 15 + [0.5] * 5  # a quarter of the gaps slow: its p90 is 500 ms
    assert request_meets(Rec(itl_s=five_slow), spec) == (False, ["itl_p90_ms"], [])
    assert not request_meets(Rec(itl_s=one_slow), parse_slo({"itl_p99_ms": 50}))[0]  # p99 sees the stall


def test_failed_requests_never_meet_and_missing_values_are_counted_not_judged() -> None:
    assert request_meets(Rec(ok=False), SPEC) == (False, [], [])
    met, missed, unjudged = request_meets(Rec(ttft_s=None, itl_s=[]), SPEC)
    assert met and missed == [] and unjudged == ["ttft_p99_ms", "itl_p99_ms"]


def test_attainment_and_goodput_arithmetic() -> None:
    records = [Rec()] * 6 + [Rec(ttft_s=0.5)] * 2 + [Rec(ok=False)] * 2 + [Rec(ttft_s=None)] * 2
    out = judge_repeat(records, 4.0, SPEC)
    assert out["slo_requests"] == 12 and out["slo_met"] == 8  # 6 good + 2 unjudged on TTFT
    assert out["slo_attainment"] == pytest.approx(8 / 12)
    assert out["request_goodput"] == pytest.approx(8 / 4.0)  # req/s meeting every SLO
    assert out["slo_missed_by"] == {"ttft_p99_ms": 2} and out["slo_unjudged"] == {"ttft_p99_ms": 2}
    assert judge_repeat(records, 4.0, None) == {}
    with pytest.raises(ValueError, match="duration_s"):
        judge_repeat(records, 0.0, SPEC)


def test_the_cell_pools_requests_for_attainment_and_takes_goodputs_median() -> None:
    spec = parse_slo({"tpot_p90_ms": 20, "attainment_target": 0.9})
    repeats = [judge_repeat([Rec()] * 10, 2.0, spec), judge_repeat([Rec()] * 9 + [Rec(tpot_s=1.0)], 2.0, spec),
               judge_repeat([Rec()] * 8 + [Rec(tpot_s=1.0)] * 2, 4.0, spec)]
    cell = summarize_slo(repeats, spec)
    assert (cell["slo_requests"], cell["slo_met"]) == (30, 27)
    assert cell["slo_attainment"] == pytest.approx(0.9) and cell["slo_attained"] is True  # target is inclusive
    assert cell["request_goodput"] == pytest.approx(4.5)  # median of 5.0, 4.5, 2.0
    assert cell["request_goodput_mad"] == pytest.approx(0.5)
    assert cell["slo_missed_by"] == {"tpot_p90_ms": 3}
    strict = summarize_slo(repeats, parse_slo({"tpot_p90_ms": 20, "attainment_target": 0.95}))
    assert strict["slo_attained"] is False


def test_parse_names_the_key_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"slo: unknown key\(s\) \['ttft_p98_ms'\]; allowed: ttft_median_ms, .*"
                                          r"attainment_target"):
        parse_slo({"ttft_p98_ms": 1})
    with pytest.raises(ConfigError, match=r"slo.tpot_p90_ms: 'fast' is not a number \(allowed > 0 and <= 1e\+07\)"):
        parse_slo({"tpot_p90_ms": "fast"})
    with pytest.raises(ConfigError, match=r"slo.tpot_p90_ms: -5 is out of range"):
        parse_slo({"tpot_p90_ms": -5})
    with pytest.raises(ConfigError, match=r"slo.attainment_target: 1.5 is out of range \(allowed > 0 and <= 1\)"):
        parse_slo({"tpot_p90_ms": 5, "attainment_target": 1.5})
    with pytest.raises(ConfigError, match="no threshold given"):
        parse_slo({"attainment_target": 0.9})
    assert parse_slo({"e2el_median_ms": 100}).attainment_target == DEFAULT_TARGET
    assert "attainment_target" in SLO_KEYS


def test_the_flag_overrides_the_grids_keys_and_keeps_the_rest() -> None:
    grid = parse_slo({"ttft_p99_ms": 2000, "tpot_p90_ms": 50})
    merged = parse_slo_flag("tpot_p90_ms=30, attainment_target=0.95", grid)
    assert merged.to_dict() == {"ttft_p99_ms": 2000, "tpot_p90_ms": 30, "attainment_target": 0.95}
    assert parse_slo_flag("itl_p99_ms=80", None).to_dict() == {"itl_p99_ms": 80, "attainment_target": DEFAULT_TARGET}
    with pytest.raises(ConfigError, match=r"--slo: 'ttft' is not KEY=VALUE"):
        parse_slo_flag("ttft", grid)
    with pytest.raises(ConfigError, match=r"--slo: unknown key\(s\) \['ttft_ms'\]"):
        parse_slo_flag("ttft_ms=3", grid)
    with pytest.raises(ConfigError, match=r"--slo.tpot_p90_ms: 'x' is not a number"):
        parse_slo_flag("tpot_p90_ms=x", grid)
