"""verify: check a running service against the SpecConfig it was deployed with, three ways.

1. settings: what the service reports (/server_info, or the unit file for systemd) equals the spec;
2. log: the init lines of the *current* start (backend.log_since_start()) parse to the spec's
   values; which lines and keys, and which /server_info keys, come from the backend's server
   dialect (ddtree/service/dialects.py): ddtree's "Initialized DDTree worker. block_size=8,
   tree_budget=8, ...", SGLang's "Initialized DFLASH draft runner. ... block_size=8, ...", the
   PR 29907 fork's DFLASH line and then "Initialized DDTree worker. ... max_tree_nodes=9";
3. generation: one tiny greedy /generate shows spec_verify_ct > 0 when speculation is on.

The first two are independent on purpose: a stale /server_info or a log left over from an
older start must not make a wrong deployment look right.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from ddtree.config import AUTO, Algorithm, SpecConfig, parse_window
from ddtree.errors import ConfigError, ServiceError, ServiceVerifyError
from ddtree.service.base import ServiceBackend, VerifyReport, http_client
from ddtree.service.dialects import Dialect, default_dialect

MISSING = "<missing>"
_KV_RE = re.compile(r"(\w+)=([^,\s]+)")
_READY_LINE = "The server is fired up and ready to roll!"


# -- 1. settings ---------------------------------------------------------------------------------
def normalise(field: str, value: Any) -> Any:
    """Bring a reported value to SpecConfig's form: window 0/None/"none" -> None, "8" -> 8, "AUTO" -> "auto"."""
    if field == "algorithm":
        text = "" if value is None else str(value).strip().upper()
        return "NONE" if text in ("", "NONE", "NULL") else text
    if field in ("draft_window", "draft_window_size"):
        try:
            return parse_window(None if value == "None" else value)
        except ConfigError:
            return value
    if field == "compact_cache" and isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if field in ("budget", "tree_budget") and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO  # a budget chosen per round is reported as the word, in any case
    return value


def compare_settings(spec: SpecConfig, reported: dict[str, Any], dialect: Dialect | None = None,
                     prefix: str = "") -> dict[str, dict[str, Any]]:
    """{knob: {key, expected, reported, ok}} for every knob the spec uses that `reported` carries.

    `reported` is /server_info (keys from the dialect; a knob without a server_info key is not
    reported there and is skipped), or a systemd unit's {"unit_file": {knob: value}} with the live
    service's /server_info nested under "server_info" when it was reachable.
    """
    dialect = dialect or default_dialect()
    out = {}
    unit = reported.get("unit_file")
    for name, want in dialect.expected(spec).items():
        knob = dialect.knobs[name]
        if isinstance(unit, dict):
            key, raw = knob.where, unit.get(name, MISSING)
        elif knob.server_info:
            key, raw = knob.server_info, reported.get(knob.server_info, MISSING)
        elif knob.env and isinstance(reported.get("environment"), dict):  # what the launched process got
            key, raw = knob.where, reported["environment"].get(knob.env, MISSING)
        else:
            continue
        got = raw if raw == MISSING else normalise(name, raw)
        out[prefix + name] = {"key": key, "expected": want, "reported": got, "ok": got == want}
    nested = reported.get("server_info")
    if isinstance(nested, dict):  # systemd: the unit file first, the live service too when reachable
        out |= compare_settings(spec, nested, dialect, prefix="server_info.")
    return out


def unreported_knobs(spec: SpecConfig, dialect: Dialect) -> list[str]:
    """Knobs `spec` uses that /server_info does not carry in this dialect (set by env, e.g. top-k)."""
    return [f"{n} ({dialect.knobs[n].where})" for n in dialect.used_knobs(spec) if not dialect.knobs[n].server_info]


# -- 2. init log line -------------------------------------------------------------------------------
def find_line(log: str, prefix: str) -> tuple[str, dict[str, str]] | None:
    """(line, key=value pairs after the prefix) of the last line of `log` containing `prefix`."""
    at = log.rfind(prefix)
    if at < 0:
        return None
    end = log.find("\n", at)
    rest = log[at + len(prefix): None if end < 0 else end]
    start = log.rfind("\n", 0, at) + 1
    return log[start: None if end < 0 else end].strip(), dict(_KV_RE.findall(rest))


def compare_init_line(spec: SpecConfig, log: str, dialect: Dialect | None = None,
                      ) -> tuple[dict[str, dict[str, Any]], str | None, str | None]:
    """(per-key comparison, the init line(s), an error when a line the dialect promises is missing)."""
    dialect = dialect or default_dialect()
    prefixes = sorted({line.prefix for line in dialect.init_lines})
    if spec.algorithm is Algorithm.NONE:
        spec_lines = [found[0] for p in prefixes if (found := find_line(log, p))]
        if spec_lines:
            return {}, spec_lines[-1], f"speculative init line for an AR deployment: {spec_lines[-1]!r}"
        if dialect.ar_line and (found := find_line(log, dialect.ar_line)):
            return {}, found[0], None
        if _READY_LINE in log:  # a server without an AR line: no speculative line is the check
            return {}, None, None
        return {}, None, "no init line and no ready line in this start's log"
    out: dict[str, dict[str, Any]] = {}
    shown = []
    for line in dialect.lines_for(spec):
        found = find_line(log, line.prefix)
        if found is None:
            return out, "; ".join(shown) or None, (
                f"no speculative init line {line.prefix!r} in this start's log (dialect {dialect.name})")
        text, values = found
        shown.append(text)
        for key, knob in line.keys.items():
            want = dialect.value_of(spec, knob)
            raw = values.get(key, MISSING)
            got = raw if raw == MISSING else normalise(knob, raw)
            name = key if key not in out else f"{line.prefix.split()[1]}.{key}"
            out[name] = {"expected": want, "reported": got, "ok": got == want}
    return out, "; ".join(shown) or None, None


# -- 3. generation ---------------------------------------------------------------------------------
# Token ids, not text: a server may run without a tokenizer, and small ids exist in every vocabulary.
PROBE_IDS = [2, 3, 4, 5, 6, 7, 8, 9]


def tiny_generation(base_url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """POST one 8-token greedy request; return its meta_info (or {"error": ...})."""
    body = {"input_ids": PROBE_IDS,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    url = base_url.rstrip("/") + "/generate"
    try:
        with http_client(timeout_s) as client:
            response = client.post(url, json=body)
            if response.status_code != 200:
                return {"error": f"POST {url} answered {response.status_code}: {response.text[:300]}"}
            data = response.json()
    except (httpx.HTTPError, ValueError) as err:
        return {"error": f"POST {url}: {type(err).__name__}: {err}"}
    if isinstance(data, list):
        data = data[0] if data else {}
    meta = data.get("meta_info") if isinstance(data, dict) else None
    return meta if isinstance(meta, dict) else {"error": f"no meta_info in response {data!r}"}


# -- the report --------------------------------------------------------------------------------------
def verify(backend: ServiceBackend, spec: SpecConfig, *, generate: bool = True) -> VerifyReport:
    """Check the running service against `spec`; never raises for a mismatch (see .ok)."""
    dialect: Dialect = getattr(backend, "dialect", None) or default_dialect()
    details: dict[str, Any] = {"backend": backend.name, "config": spec.id, "dialect": dialect.name,
                               "settings_source": getattr(backend, "settings_source", "server_info")}
    if unreported := unreported_knobs(spec, dialect):
        details["not_in_server_info"] = unreported
    try:
        reported = backend.reported_settings()
        settings = compare_settings(spec, reported, dialect)
        if "server_info_error" in reported:  # systemd: the unit was read, the live service was not
            details["server_info_error"] = reported["server_info_error"]
        states = reported.get("internal_states") or [{}]
        if isinstance(states, list) and states and isinstance(states[0], dict):
            details["avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
    except ServiceError as err:
        settings = {}
        details["settings_error"] = str(err)
    details["settings"] = settings
    settings_ok = bool(settings) and all(v["ok"] for v in settings.values())

    log_ok: bool | None = None
    if backend.has_log:
        log_values, line, error = compare_init_line(spec, backend.log_since_start(), dialect)
        details |= {"init_line": line, "log_values": log_values}
        if error:
            details["log_error"] = error
        log_ok = error is None and all(v["ok"] for v in log_values.values())

    generation_ok = True
    if generate:
        meta = tiny_generation(backend.base_url)
        details["generation"] = {k: meta.get(k) for k in ("error", "completion_tokens", "spec_verify_ct")
                                 if k in meta}
        verify_ct = meta.get("spec_verify_ct") or 0
        generation_ok = "error" not in meta and (verify_ct > 0 if spec.speculative else True)
    return VerifyReport(spec, settings_ok, log_ok, generation_ok, details)


def verify_or_raise(backend: ServiceBackend, spec: SpecConfig, *, generate: bool = True) -> VerifyReport:
    """verify(), raising ServiceVerifyError naming every expected vs reported value that differs."""
    report = verify(backend, spec, generate=generate)
    if report.ok:
        return report
    expected: dict[str, Any] = {}
    reported: dict[str, Any] = {}
    problems = []
    d = report.details
    if not report.settings_ok:
        bad = {k: v for k, v in d.get("settings", {}).items() if not v["ok"]}
        problems.append(f"settings: {d['settings_error']}" if "settings_error" in d else
                        "settings: " + ", ".join(f"{k} expected {v['expected']!r}, reported "
                                                 f"{v['reported']!r}" for k, v in bad.items()))
        expected |= {k: v["expected"] for k, v in bad.items()}
        reported |= {k: v["reported"] for k, v in bad.items()}
    if report.log_ok is False:
        bad = {k: v for k, v in d.get("log_values", {}).items() if not v["ok"]}
        problems.append(f"init log line: {d['log_error']}" if "log_error" in d else
                        f"init log line {d.get('init_line')!r}: " + ", ".join(
                            f"{k} expected {v['expected']!r}, logged {v['reported']!r}"
                            for k, v in bad.items()))
        expected |= {f"log.{k}": v["expected"] for k, v in bad.items()}
        reported |= {f"log.{k}": v["reported"] for k, v in bad.items()}
    if not report.generation_ok:
        gen = d.get("generation", {})
        problems.append(f"generation: {gen.get('error') or 'spec_verify_ct is 0 or missing'}")
        expected["spec_verify_ct"] = "> 0" if spec.speculative else "a completion"
        reported["spec_verify_ct"] = gen.get("error") or gen.get("spec_verify_ct")
    raise ServiceVerifyError(
        f"{backend.name} service does not run {spec.id}: " + "; ".join(problems),
        expected=expected, reported=reported)
