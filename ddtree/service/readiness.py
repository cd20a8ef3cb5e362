"""wait_ready: poll /health_generate until 200, failing at once when the process dies.

During start-up a refused connection, a reset, a request timeout or a 503 is normal and never
ends the wait; only a dead process (checked on every poll) or the overall timeout does, and both
raise ServiceStartError with the tail of this start's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from ddtree.errors import ConfigError, ServiceStartError
from ddtree.service.base import ServiceBackend, http_client

LOG_TAIL_LINES = 40


def wait_ready(
    backend: ServiceBackend,
    base_url: str | None = None,
    timeout_s: float = 900.0,
    poll_s: float = 0.5,
    progress: Callable[[str], None] | None = None,
    *,
    progress_every_s: float = 10.0,
    request_timeout_s: float = 10.0,
) -> float:
    """Block until GET /health_generate answers 200; return the seconds waited."""
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s: {timeout_s} must be > 0 seconds")
    if not 0 < poll_s <= 60:
        raise ConfigError(f"poll_s: {poll_s} is out of range (allowed 0 < poll_s <= 60; 0.5-1 s usual)")
    base = (base_url or backend.base_url).rstrip("/")
    url = base + "/health_generate"
    started = time.monotonic()
    next_progress = started + progress_every_s
    last_status = "no answer yet"
    with http_client(min(request_timeout_s, timeout_s)) as client:
        while True:
            alive, reason = backend.is_alive()
            elapsed = time.monotonic() - started
            if not alive:
                raise ServiceStartError(
                    f"{backend.name} service at {base} died while starting ({reason}) "
                    f"after {elapsed:.1f} s", log_tail=backend.log_tail(LOG_TAIL_LINES))
            try:
                response = client.get(url)
                last_status = str(response.status_code)
                if response.status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError as err:  # refused, reset, timed out: still loading
                last_status = type(err).__name__
            now = time.monotonic()
            elapsed = now - started
            if elapsed >= timeout_s:
                raise ServiceStartError(
                    f"{backend.name} service at {base} not ready after {elapsed:.1f} s "
                    f"(timeout {timeout_s:g} s, last status {last_status})",
                    log_tail=backend.log_tail(LOG_TAIL_LINES))
            if progress is not None and now >= next_progress:
                progress(f"waiting for {backend.name} service at {base}: {elapsed:.0f} s, "
                         f"last status {last_status}")
                next_progress = now + progress_every_s
            time.sleep(min(poll_s, max(timeout_s - elapsed, 0.01)))
