"""Service lifecycle: deploy a serving config, wait until ready, verify it, restore the default.

Backends (one module each) sit behind the ServiceBackend Protocol; readiness, verification and
the ServiceManager are written once against it. Names load on first use, so that
`python -m ddtree.service.fake` does not import itself through this package first.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Deployment": "base",
    "FakeBackend": "fake",
    "LocalBackend": "local",
    "SGLangBackend": "sglang",
    "ServiceBackend": "base",
    "ServiceManager": "manager",
    "SystemdBackend": "systemd",
    "UrlBackend": "url",
    "VerifyReport": "base",
    "free_port": "local",
    "verify": "verify",
    "verify_or_raise": "verify",
    "wait_ready": "readiness",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ddtree.service' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ddtree.service.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return __all__
