"""ServiceManager: deploy a config only when it changes, and always put the default back.

    with ServiceManager(backend, DEFAULT_SPEC, startup_timeout_s=900) as service:
        for spec in grid:
            service.ensure(spec)        # restart + wait_ready + verify, only when spec changed
            ...                         # measure
    # here the default is deployed and verified again, whatever happened inside (service.restore_report)

A deploy is start -> wait_ready -> verify_or_raise; the manager trusts nothing it has not
verified: after a failed deploy the current config is unknown, and a service found dead at the
next ensure() is redeployed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from ddtree.config import DEFAULT_SPEC, SpecConfig
from ddtree.errors import ConfigError
from ddtree.service.base import Deployment, ServiceBackend, VerifyReport
from ddtree.service.readiness import wait_ready
from ddtree.service.verify import verify_or_raise


class ServiceManager:
    """Owns one backend's lifecycle for a run: ensure(spec), restore_default(), close()."""

    def __init__(
        self,
        backend: ServiceBackend,
        default_spec: SpecConfig = DEFAULT_SPEC,
        startup_timeout_s: float = 900.0,
        log: Callable[[str], None] = print,
        *,
        poll_s: float = 0.5,
        verify_generation: bool = True,
        restore_on_exit: bool = True,
    ) -> None:
        if startup_timeout_s <= 0:
            raise ConfigError(f"startup_timeout_s: {startup_timeout_s} must be > 0 seconds")
        self.backend = backend
        self.default_spec = default_spec
        self.startup_timeout_s = startup_timeout_s
        self.log = log
        self.poll_s = poll_s
        self.verify_generation = verify_generation
        self.restore_on_exit = restore_on_exit
        self.current: SpecConfig | None = None  # the config last deployed *and verified*
        self.deployment: Deployment | None = None
        self.last_report: VerifyReport | None = None
        self.deploy_count = 0  # restarts issued (a url backend never restarts)
        self.deploy_history: list[SpecConfig] = []
        self.restore_report: VerifyReport | None = None
        self.restore_error: Exception | None = None

    # -- deploying -------------------------------------------------------------------------------
    def ensure(self, spec: SpecConfig) -> VerifyReport:
        """Make the service run `spec`: nothing to do when it already does and is alive."""
        if spec == self.current and self.last_report is not None:
            alive, reason = self.backend.is_alive()
            if alive:
                return self.last_report
            self.log(f"[{self.backend.name}] service running {spec.id} is down ({reason}); redeploying")
        return self.deploy(spec)

    def deploy(self, spec: SpecConfig) -> VerifyReport:
        """Start (or, for url, check) `spec`, wait until ready, verify; raise ServiceError on failure."""
        name = self.backend.name
        self.current = None  # unknown until this deploy is verified
        started = time.monotonic()
        if self.backend.can_restart:
            self.log(f"[{name}] deploying {spec.id}")
            self.deployment = self.backend.start(spec)
            self.deploy_count += 1
            self.deploy_history.append(spec)
            wait_ready(self.backend, timeout_s=self.startup_timeout_s, poll_s=self.poll_s,
                       progress=self.log)
        else:
            self.deployment = self.backend.start(spec)  # raises when the running config differs
        report = verify_or_raise(self.backend, spec, generate=self.verify_generation)
        self.log(f"[{name}] {spec.id} ready and verified in {time.monotonic() - started:.1f} s "
                 f"(settings, init log line, generation)")
        self.current, self.last_report = spec, report
        return report

    def restore_default(self) -> VerifyReport:
        """Deploy the default when needed (always when the service died) and verify it again."""
        spec = self.default_spec
        alive, reason = self.backend.is_alive()
        if spec != self.current or not alive:
            if spec == self.current:
                self.log(f"[{self.backend.name}] default {spec.id} is down ({reason}); restarting")
            return self.deploy(spec)
        report = verify_or_raise(self.backend, spec, generate=self.verify_generation)
        self.last_report = report
        self.log(f"[{self.backend.name}] default {spec.id} is running and verified")
        return report

    @property
    def restore_outcome(self) -> str:
        """One line for a run summary: whether the default came back."""
        if self.restore_report is not None:
            return f"default {self.default_spec.id} restored and verified"
        if self.restore_error is not None:
            return f"default {self.default_spec.id} NOT restored: {self.restore_error}"
        return "default not restored (no restore attempted)"

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the service when we own its process (a systemd unit or a url is left running)."""
        if self.backend.owns_process:
            self.backend.stop()
        self.current = None

    def __enter__(self) -> ServiceManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self.restore_on_exit:
                self._restore_on_exit(exc)
        finally:
            self.close()

    def _restore_on_exit(self, exc: BaseException | None) -> None:
        why = "" if exc is None else f" after {type(exc).__name__}"
        self.log(f"[{self.backend.name}] restoring default {self.default_spec.id}{why}")
        try:
            self.restore_report = self.restore_default()
        except Exception as err:
            self.restore_error = err
            self.log(f"[{self.backend.name}] {self.restore_outcome}")
            if exc is None:
                raise
            exc.add_note(f"restoring the default {self.default_spec.id} also failed: {err}")
            return
        self.log(f"[{self.backend.name}] {self.restore_outcome}")
