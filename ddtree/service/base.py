"""The ServiceBackend Protocol and the records the lifecycle passes around (no process or HTTP logic).

A backend knows how to (re)start one service with a SpecConfig and how to read back what that
start did: whether the process lives, the log of *this* start only, and the settings the
service reports. Readiness, verification and restore-default are written once against this
Protocol (readiness.py, verify.py, manager.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx

from ddtree.config import SpecConfig


@runtime_checkable
class ServiceBackend(Protocol):
    """One service that can be (re)started with a config and inspected afterwards.

    name          short backend name for messages ("local", "sglang", "systemd", "url", "fake")
    base_url      where the HTTP API answers, e.g. "http://127.0.0.1:30000"
    can_restart   False for a backend that only observes (url)
    owns_process  True when close() should stop the service (a child we started); a systemd
                  unit or an external url is left running
    has_log       False when the service log cannot be read (url); verify then reports the log
                  check as "not available" instead of passing it
    """

    name: str
    can_restart: bool
    owns_process: bool
    has_log: bool

    @property
    def base_url(self) -> str: ...

    def start(self, spec: SpecConfig) -> Deployment:
        """Start, or restart, with `spec`; return once launched (not ready) with a start marker."""
        ...

    def stop(self) -> None:
        """Stop the service; safe to call twice or when never started."""
        ...

    def is_alive(self) -> tuple[bool, str]:
        """(True, "") while the process lives, else (False, why)."""
        ...

    def log_since_start(self) -> str:
        """The service log written since the last start() (an older start's lines never appear)."""
        ...

    def log_tail(self, n: int = 40) -> str:
        """The last `n` lines of log_since_start()."""
        ...

    def reported_settings(self) -> dict[str, Any]:
        """The resolved settings the service reports, keyed like /server_info."""
        ...


@dataclass(frozen=True)
class Deployment:
    """One start of a service: what ran and where its log begins (offset, journal cursor, time)."""

    spec: SpecConfig
    started_at: float  # time.time() at launch
    command: list[str]
    marker: Any = None


@dataclass
class VerifyReport:
    """The outcome of verifying a running service against the config that was deployed.

    settings_ok    the reported settings equal the spec
    log_ok         the init line of the current start parses to the spec; None when the backend
                   cannot read the service log (url), which is reported, not treated as a pass
    generation_ok  one tiny /generate answered (with spec_verify_ct > 0 when speculating)
    details        what was compared: expected/reported values, the init line, the generation
    """

    spec: SpecConfig
    settings_ok: bool
    log_ok: bool | None
    generation_ok: bool
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.settings_ok and self.log_ok is not False and self.generation_ok

    def lines(self) -> list[str]:
        """Human-readable lines: one per check, with what was compared."""
        out = []
        settings = self.details.get("settings", {})
        compared = ", ".join(
            f"{name} {v['expected']!r}{' == ' if v['ok'] else ' != '}{v['reported']!r}"
            for name, v in settings.items()
        )
        out.append(f"settings ({self.details.get('settings_source', 'server')}): "
                   f"{_word(self.settings_ok)} [{compared}]")
        unchecked = [k for k in self.details.get("not_in_server_info", []) if k.split()[0] not in settings]
        if unchecked:
            out.append(f"not checked (the server does not report them): {', '.join(unchecked)}")
        line = self.details.get("init_line")
        log_detail = self.details.get("log_error") or (line if line else "no init line")
        out.append(f"init log line of this start: {_word(self.log_ok)} [{log_detail}]")
        gen = self.details.get("generation", {})
        out.append(f"generation: {_word(self.generation_ok)} {gen}")
        return out


def _word(ok: bool | None) -> str:
    return "not available" if ok is None else ("ok" if ok else "FAILED")


def http_client(timeout_s: float) -> httpx.Client:
    # trust_env=False: proxy variables meant for package registries must not capture
    # requests to the service under test.
    return httpx.Client(timeout=timeout_s, trust_env=False)


def now() -> float:
    return time.time()
