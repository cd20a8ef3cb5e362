"""UrlBackend: a service someone else runs; we can only observe and verify it, never restart it.

start(spec) checks that the running settings already equal `spec` and raises a ServiceError
saying so when they do not. The service log is not reachable, so verify's log check is
reported as "not available" (has_log = False).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ServiceError
from ddtree.service.base import Deployment, http_client
from ddtree.service.dialects import Dialect, default_dialect
from ddtree.service.local import fetch_server_info
from ddtree.service.verify import compare_settings


class UrlBackend:
    name = "url"
    can_restart = False
    owns_process = False
    has_log = False

    def __init__(self, base_url: str, *, timeout_s: float = 10.0, dialect: Dialect | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url: {base_url!r} must start with http:// or https://")
        self._base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.dialect = dialect or default_dialect()
        self.deployment: Deployment | None = None

    @property
    def base_url(self) -> str:
        return self._base_url

    def start(self, spec: SpecConfig) -> Deployment:
        settings = compare_settings(spec, self.reported_settings(), self.dialect)
        bad = {k: v for k, v in settings.items() if not v["ok"]}
        if bad:
            diff = ", ".join(f"{k} {v['reported']!r} (wanted {v['expected']!r})" for k, v in bad.items())
            raise ServiceError(
                f"the url backend cannot reconfigure a service: {self._base_url} runs {diff}; "
                f"restart it with {spec.id} yourself, or use --backend local/sglang/systemd")
        self.deployment = Deployment(spec, time.time(), [], marker=None)
        return self.deployment

    def stop(self) -> None:
        pass  # not ours to stop

    def is_alive(self) -> tuple[bool, str]:
        try:
            with http_client(self.timeout_s) as client:
                client.get(self._base_url + "/health_generate")  # any HTTP answer means it lives
        except httpx.TransportError as err:
            return False, f"no answer from {self._base_url}: {type(err).__name__}"
        return True, ""

    def log_since_start(self) -> str:
        return ""

    def log_tail(self, n: int = 40) -> str:
        return ""

    def reported_settings(self) -> dict[str, Any]:
        return fetch_server_info(self._base_url, self.timeout_s)
