"""One factory for the service backends, from explicit arguments: `ddtree service` and the suite both call it.

Each front end turns its own flags into these arguments and words its own usage errors: a missing
argument raises MissingBackendArgument, which says which one, so the caller can name its flag.
Backend modules are imported only when chosen (systemd's ssh plumbing, the fake server).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddtree.errors import ConfigError
from ddtree.service.base import ServiceBackend
from ddtree.service.dialects import Dialect

BACKENDS = ("local", "sglang", "systemd", "url", "fake")  # fake: the model-free stand-in server
LAUNCHED = ("local", "sglang", "fake")  # backends that start the server as this process's child


class MissingBackendArgument(ConfigError):
    """A backend was asked for without an argument it needs (`argument`: the factory's parameter name)."""

    def __init__(self, kind: str, argument: str) -> None:
        super().__init__(f"the {kind} backend needs {argument}")
        self.kind = kind
        self.argument = argument


def build_backend(
    kind: str,
    *,
    model_path: str | os.PathLike[str] | None = None,
    draft_model_path: str | os.PathLike[str] | None = None,
    url: str | None = None,
    ssh_host: str | None = None,
    unit: str | None = None,
    ssh_config: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str | None = None,
    max_running_requests: int | None = None,
    extra_args: Sequence[str] = (),
    log_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    dialect: Dialect | None = None,
) -> ServiceBackend:
    """The backend `kind` (one of BACKENDS).

    url: `url` is the running service. systemd: `unit` on `ssh_host` (None: this machine), `url`
    optional (else derived from the unit's --host/--port). local, sglang: a server started from
    `model_path` and `draft_model_path` on `host`:`port` (0: a free port); fake takes the same
    arguments but no model. `log` gets the backend's progress lines (None: quiet). A dialect of None
    is the backend's default (ddtree; sglang-ddtree for sglang).
    """
    if kind not in BACKENDS:
        raise ConfigError(f"backend: {kind!r} is not one of {', '.join(BACKENDS)}")
    quiet: dict[str, Any] = {} if log is None else {"log": log}
    if kind == "url":
        if not url:
            raise MissingBackendArgument(kind, "url")
        from ddtree.service.url import UrlBackend

        return UrlBackend(url, dialect=dialect)
    if kind == "systemd":
        if not unit:
            raise MissingBackendArgument(kind, "unit")
        from ddtree.service.systemd import SystemdBackend

        return SystemdBackend(ssh_host, unit, base_url=url, ssh_config=ssh_config, dialect=dialect, **quiet)
    server: dict[str, Any] = {"host": host, "port": port, "device": device,
                              "max_running_requests": max_running_requests, "extra_args": extra_args,
                              "log_dir": log_dir, "env": env, "dialect": dialect, **quiet}
    if kind == "fake":
        from ddtree.service.fake import FakeBackend

        return FakeBackend(**server)
    if not model_path:
        raise MissingBackendArgument(kind, "model_path")
    from ddtree.service.local import LocalBackend
    from ddtree.service.sglang import SGLangBackend

    backend_class = SGLangBackend if kind == "sglang" else LocalBackend
    return backend_class(model_path, draft_model_path, **server)
