"""The exception hierarchy of ddtree.

    DDTreeError
    ├── ConfigError (also ValueError)   a configuration value is outside its allowed range
    ├── ModelLoadError                  a model folder is missing, malformed or does not fit its partner
    ├── RequestError (also ValueError)  one request is bad; the server answers 4xx and keeps serving
    ├── SandboxUnavailable              model-written code cannot be run inside namespaces on this machine
    └── ServiceError                    the service lifecycle failed
        ├── ServiceStartError           the process died or never became ready (carries the log tail)
        └── ServiceVerifyError          the running service does not match what was deployed

Callers catch at the level they care about; every message names the field or the setting.
"""

from __future__ import annotations


class DDTreeError(Exception):
    """Base of every error ddtree raises on purpose."""


class ConfigError(DDTreeError, ValueError):
    """A configuration value is outside its allowed range (raised before anything expensive)."""


class ModelLoadError(DDTreeError):
    """A model folder cannot be loaded, or a drafter does not fit its target."""


class RequestError(DDTreeError, ValueError):
    """A single request is malformed or out of range."""

    def __init__(self, message: str, *, field: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status_code = status_code


class SandboxUnavailable(DDTreeError):
    """The namespace sandbox cannot start here (no bubblewrap, user namespaces disabled, an
    interpreter the user cannot run); the message says how to enable it."""


class ServiceError(DDTreeError):
    """The service lifecycle (start, readiness, verification, restore) failed."""


class ServiceStartError(ServiceError):
    """The service process died or did not become ready in time."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- service log tail ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class ServiceVerifyError(ServiceError):
    """The running service reports settings other than the ones deployed."""

    def __init__(self, message: str, *, expected: object = None, reported: object = None) -> None:
        super().__init__(f"{message} (expected {expected!r}, reported {reported!r})")
        self.expected = expected
        self.reported = reported
