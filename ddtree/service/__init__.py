"""Service lifecycle: deploy a serving config, wait until ready, verify it, restore the default.

Backends (one module each) sit behind the ServiceBackend Protocol; readiness, verification and
the ServiceManager are written once against it. FakeBackend loads on first use, so that
`python -m ddtree.service.fake` does not import itself through this package first.
"""

from __future__ import annotations

from typing import Any

from ddtree.service.base import Deployment, ServiceBackend, VerifyReport
from ddtree.service.local import LocalBackend, free_port
from ddtree.service.manager import ServiceManager
from ddtree.service.readiness import wait_ready
from ddtree.service.sglang import SGLangBackend
from ddtree.service.systemd import SystemdBackend
from ddtree.service.url import UrlBackend
from ddtree.service.verify import verify, verify_or_raise

__all__ = [
    "Deployment",
    "FakeBackend",
    "LocalBackend",
    "SGLangBackend",
    "ServiceBackend",
    "ServiceManager",
    "SystemdBackend",
    "UrlBackend",
    "VerifyReport",
    "free_port",
    "verify",
    "verify_or_raise",
    "wait_ready",
]


def __getattr__(name: str) -> Any:
    if name == "FakeBackend":
        from ddtree.service.fake import FakeBackend

        return FakeBackend
    raise AttributeError(f"module 'ddtree.service' has no attribute {name!r}")
