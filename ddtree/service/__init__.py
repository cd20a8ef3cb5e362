"""Service lifecycle: deploy a serving config, wait until ready, verify it, restore the default.

Backends (one module each) sit behind the ServiceBackend Protocol; readiness, verification and
the ServiceManager are written once against it.
"""

from ddtree.service.base import Deployment, ServiceBackend, VerifyReport
from ddtree.service.fake import FakeBackend
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
