"""Service-level objectives: which requests met them, attainment and goodput.

An SLO set is a few latency thresholds plus an attainment target:

    slo: {ttft_p99_ms: 2000, tpot_p90_ms: 50, itl_p99_ms: 200, e2el_p90_ms: 8000, attainment_target: 0.99}

Keys are `<metric>_<stat>_ms` with metric one of ttft, tpot, itl, e2el and stat one of median,
p50, p90, p95, p99. How a key applies to one request:

    ttft, tpot, e2el   one value per request: the request's own TTFT, TPOT or E2E latency must be
                       at most the threshold. The stat names the share of requests the deployment
                       cares about: `tpot_p90_ms: 50` holds for the cell when at least 90 % of its
                       requests have TPOT <= 50 ms, which is what per-request attainment counts.
    itl                many gaps per request: the request's own <stat> over its inter-token gaps
                       must be at most the threshold (`itl_p99_ms: 200`: the p99 of this request's
                       gaps <= 200 ms).

A request meets the SLO set when it succeeded and meets every key. A failed request never does.
A key that a request has no value for (TTFT and ITL without streaming, TPOT below 2 tokens) is not
judged for that request and is counted in `slo_unjudged`, so a missing measurement is never
hidden. `slo_attainment` = met / sent; `request_goodput` = met / the repeat's wall time (req/s).
The attainment target (default 0.99) is what "attainment holds" means in the summary's answer.
An SLO is a criterion for the answer, never a floor: a cell that misses it still passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree.bench.metrics import mad, median, percentile
from ddtree.errors import ConfigError

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_STATS = {"median": 50.0, "p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
TARGET_KEY = "attainment_target"
DEFAULT_TARGET = 0.99
MAX_THRESHOLD_MS = 1e7  # about three hours: anything above is a typo, not an objective
SLO_KEYS = tuple(f"{m}_{s}_ms" for m in SLO_METRICS for s in SLO_STATS) + (TARGET_KEY,)


class SloRecord(Protocol):
    """What judging reads from a request record (ddtree.bench.loadgen.RequestRecord)."""

    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itl_s: list[float]


@dataclass(frozen=True)
class Objective:
    """One threshold: `metric` (ttft, tpot, itl, e2el) at `stat` must be <= `threshold_ms`."""

    metric: str
    stat: str
    threshold_ms: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}_ms"

    def value_ms(self, record: SloRecord) -> float | None:
        """This request's value for the objective, in ms; None when the request has none."""
        if self.metric == "itl":
            return percentile([gap * 1000.0 for gap in record.itl_s], SLO_STATS[self.stat]) if record.itl_s else None
        seconds = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2e_s}[self.metric]
        return None if seconds is None else seconds * 1000.0


@dataclass(frozen=True)
class SloSpec:
    """The objectives of a sweep and the attainment target that the answer holds them to."""

    objectives: tuple[Objective, ...]
    attainment_target: float = DEFAULT_TARGET

    def to_dict(self) -> dict[str, float]:
        return {**{o.key: o.threshold_ms for o in self.objectives}, TARGET_KEY: self.attainment_target}

    def describe(self) -> str:
        parts = [f"{o.key} <= {o.threshold_ms:g}" for o in self.objectives]
        return f"{', '.join(parts) or 'no thresholds'}; attainment target {self.attainment_target:g}"


def _number(value: Any, where: str, low: float, high: float, low_open: bool) -> float:
    allowed = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a number (allowed {allowed})") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"{where}: {value!r} is not a number (allowed {allowed})")
    if not (low < value if low_open else low <= value) or not value <= high:
        raise ConfigError(f"{where}: {value:g} is out of range (allowed {allowed})")
    return float(value)


def parse_slo(data: Mapping[str, Any], where: str = "slo") -> SloSpec:
    """An SloSpec from a mapping of SLO_KEYS to numbers; errors name the key and what is allowed."""
    unknown = sorted(str(k) for k in data if k not in SLO_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(SLO_KEYS)}")
    objectives = []
    for key in SLO_KEYS[:-1]:
        if key in data:
            metric, stat, _ = key.split("_")
            objectives.append(Objective(metric, stat, _number(data[key], f"{where}.{key}", 0.0, MAX_THRESHOLD_MS,
                                                              low_open=True)))
    if not objectives:
        raise ConfigError(f"{where}: no threshold given; give at least one of {', '.join(SLO_KEYS[:-1])}")
    target = data.get(TARGET_KEY, DEFAULT_TARGET)
    return SloSpec(tuple(objectives), _number(target, f"{where}.{TARGET_KEY}", 0.0, 1.0, low_open=True))


def parse_slo_flag(text: str, base: SloSpec | None, where: str = "--slo") -> SloSpec:
    """`KEY=VALUE,...` over `base` (the grid's): a key given here replaces the grid's, others stay."""
    given: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{where}: {part!r} is not KEY=VALUE (allowed keys: {', '.join(SLO_KEYS)})")
        given[key.strip()] = value.strip()
    if not given:
        raise ConfigError(f"{where}: {text!r} gives no KEY=VALUE (allowed keys: {', '.join(SLO_KEYS)})")
    merged: dict[str, Any] = {**(base.to_dict() if base else {}), **given}
    return parse_slo(merged, where)


# -- judging ---------------------------------------------------------------------------------------


def request_meets(record: SloRecord, spec: SloSpec) -> tuple[bool, list[str], list[str]]:
    """(met every objective, keys missed, keys not judged for want of a value)."""
    if not record.ok:
        return False, [], []
    missed, unjudged = [], []
    for objective in spec.objectives:
        value = objective.value_ms(record)
        if value is None:
            unjudged.append(objective.key)
        elif value > objective.threshold_ms:
            missed.append(objective.key)
    return not missed, missed, unjudged


def judge_repeat(records: Sequence[SloRecord], duration_s: float, spec: SloSpec | None) -> dict[str, Any]:
    """One repeat's SLO counts: requests sent, met, per-key misses and unjudged, attainment, goodput."""
    if spec is None:
        return {}
    if not duration_s > 0:
        raise ValueError(f"duration_s: {duration_s!r} must be > 0 seconds")
    met = 0
    missed_by: dict[str, int] = {}
    unjudged: dict[str, int] = {}
    for record in records:
        ok, missed, blind = request_meets(record, spec)
        met += ok
        for key in missed:
            missed_by[key] = missed_by.get(key, 0) + 1
        for key in blind:
            unjudged[key] = unjudged.get(key, 0) + 1
    return {
        "slo_requests": len(records),
        "slo_met": met,
        "slo_missed_by": missed_by,
        "slo_unjudged": unjudged,
        "slo_attainment": met / len(records) if records else None,
        "request_goodput": met / duration_s,
    }


def summarize_slo(repeats: Sequence[Mapping[str, Any]], spec: SloSpec | None) -> dict[str, Any]:
    """The cell's SLO numbers from its repeats; empty without an SLO.

    Attainment pools every request of every repeat (met / sent); goodput is the median over
    repeats with its MAD, like the cell's other rates; `slo_attained` says attainment >= target.
    """
    if spec is None:
        return {}
    sent = sum(int(r.get("slo_requests") or 0) for r in repeats)
    met = sum(int(r.get("slo_met") or 0) for r in repeats)
    missed: dict[str, int] = {}
    blind: dict[str, int] = {}
    for r in repeats:
        for total, part in ((missed, r.get("slo_missed_by") or {}), (blind, r.get("slo_unjudged") or {})):
            for key, n in part.items():
                total[key] = total.get(key, 0) + int(n)
    attainment = met / sent if sent else None
    return {
        "slo_requests": sent,
        "slo_met": met,
        "slo_missed_by": missed,
        "slo_unjudged": blind,
        "slo_attainment": attainment,
        "slo_attained": attainment is not None and attainment >= spec.attainment_target,
        "request_goodput": median(r.get("request_goodput") for r in repeats),
        "request_goodput_mad": mad(r.get("request_goodput") for r in repeats),
    }


def spec_of(client: Mapping[str, Any]) -> SloSpec | None:
    """The SloSpec a cell file recorded in its `client` settings, or None."""
    data = client.get("slo")
    return parse_slo(data, "cell client.slo") if isinstance(data, Mapping) else None
