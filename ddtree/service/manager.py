"""ServiceManager: deploy a config only when it changes, and always put the default back.

    with ServiceManager(backend, DEFAULT_SPEC, startup_timeout_s=900) as service:
        for spec in grid:
            service.ensure(spec)        # restart + wait_ready + verify, only when spec changed
            ...                         # measure
    # here the default is deployed and verified again, whatever happened inside (service.restore_report)

A deploy is start -> wait_ready -> verify_or_raise; the manager trusts nothing it has not
verified: after a failed deploy the current config is unknown, and a service found dead at the
next ensure() is redeployed (once per config: a second death, like a failed start, fails the
config's remaining cells at once).

Failing fast, because a real start can take many minutes: a config whose start failed gets
`start_retries` more attempts (0, the default, or 1), then is not started again; every later ensure() of it
raises the same error with the same log tail. When two different configs in a row fail to start
with the same error (the same first line and the same last log line, numbers aside: a missing
module, a bad flag, no GPU) the sweep is aborted with SweepAborted: no other config could start.
The default is still restored (attempted, and the outcome reported) by the context manager.

Every deploy, failed ones and the restore included, leaves a DeployTiming in `deploy_timings`: seconds
from the start command to ready and to verified (what a restart costs the sweep).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from types import TracebackType

from ddtree.config import DEFAULT_SPEC, SpecConfig
from ddtree.errors import ConfigError, ServiceError, ServiceStartError
from ddtree.service.base import Deployment, ServiceBackend, VerifyReport
from ddtree.service.readiness import wait_ready
from ddtree.service.verify import verify_or_raise


class ServiceDied(ServiceError):
    """The service died under a measurement; carries the log tail of its start."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- service log tail ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class SweepAborted(ServiceError):
    """Two configs in a row failed to start with the same error: no other config will start either."""


def start_error_signature(err: BaseException) -> str:
    """What makes two start failures "the same": the error's first line and the log tail's last
    non-empty line, with numbers (ports, pids, seconds, config values) and config ids blanked."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    tail = [line for line in getattr(err, "log_tail", "").splitlines() if line.strip()]
    text = f"{type(err).__name__}: {first} | {tail[-1] if tail else ''}"
    text = re.sub(r"\b(b(auto)?\d*-k\d+-w(none|\d+)-bs\d+|dflash-w(none|\d+)-bs\d+|ar)\b", "<config>", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


@dataclass
class DeployTiming:
    """One deploy: seconds from the start command to ready and to verified (None where it never got there)."""

    config_id: str
    purpose: str  # "sweep" (a config's cells need it) or "restore" (the default put back at the end)
    restarted: bool  # False for a backend that only observes (url): nothing was started
    started_at: str  # ISO 8601, UTC: when the start command was issued
    ready_s: float | None = None
    verified_s: float | None = None
    spent_s: float | None = None  # what the deploy took, failed or not
    ok: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The fields and `cold_start_s`: start command to verified, the time before cells can run (None if it failed)."""
        return {**asdict(self), "cold_start_s": self.verified_s if self.ok else None}


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
        start_retries: int = 0,
    ) -> None:
        if startup_timeout_s <= 0:
            raise ConfigError(f"startup_timeout_s: {startup_timeout_s} must be > 0 seconds")
        if start_retries not in (0, 1):
            raise ConfigError(f"start_retries: {start_retries!r}; allowed: 0 or 1 (extra attempts per config)")
        self.start_retries = start_retries
        self.failed: dict[str, ServiceError] = {}  # config id -> why it is not started again
        self.deaths: dict[str, int] = {}  # config id -> times its service died after a verified start
        self.aborted: SweepAborted | None = None
        self._last_failure: tuple[str, str] | None = None  # (config id, signature) of the last failed deploy
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
        self.deploy_timings: list[DeployTiming] = []
        self.restore_report: VerifyReport | None = None
        self.restore_error: Exception | None = None

    # -- deploying -------------------------------------------------------------------------------
    def ensure(self, spec: SpecConfig) -> VerifyReport:
        """Make the service run `spec`: nothing to do when it already does and is alive.

        Raises the recorded error at once for a config whose start failed, and SweepAborted (for
        every config) once the sweep was aborted.
        """
        if self.aborted is not None:
            raise self.aborted
        if spec.id in self.failed:
            raise self.failed[spec.id]
        if spec == self.current and self.last_report is not None:
            alive, reason = self.backend.is_alive()
            if alive:
                return self.last_report
            self.deaths[spec.id] = self.deaths.get(spec.id, 0) + 1
            if self.deaths[spec.id] > 1:
                err = ServiceStartError(f"{spec.id}: not started again: its service died twice under "
                                        f"cells ({reason})", log_tail=self.backend.log_tail())
                self.failed[spec.id] = err
                raise err
            self.log(f"[{self.backend.name}] service running {spec.id} is down ({reason}); redeploying once")
        return self.deploy_or_give_up(spec)

    def deploy_or_give_up(self, spec: SpecConfig) -> VerifyReport:
        """deploy() with at most `start_retries` more attempts after a failed start; then the config
        is marked failed, and a second config in a row failing the same way aborts the sweep."""
        for attempt in range(1 + self.start_retries):
            try:
                report = self.deploy(spec)
            except ServiceStartError as err:
                error: ServiceError = err
                if attempt < self.start_retries:
                    self.log(f"[{self.backend.name}] {spec.id} did not start ({str(err).splitlines()[0]}); "
                             f"attempt {attempt + 2} of {1 + self.start_retries}")
                    continue
            except ServiceError as err:  # started but not what was asked for: another start will not help
                error = err
            else:
                self._last_failure = None
                return report
            break
        attempts = attempt + 1
        head = f"{spec.id}: start failed ({attempts} attempt{'s' if attempts != 1 else ''}; not started again): "
        if isinstance(error, ServiceStartError):  # keep the log tail once, after the message
            message = str(error).split("\n--- service log tail ---")[0]
            failed: ServiceError = ServiceStartError(head + message, log_tail=error.log_tail)
        else:
            failed = ServiceError(head + str(error))
        self.failed[spec.id] = failed
        signature = start_error_signature(error)
        previous, self._last_failure = self._last_failure, (spec.id, signature)
        if previous is not None and previous[0] != spec.id and previous[1] == signature:
            tail = getattr(error, "log_tail", "")
            self.aborted = SweepAborted(
                f"sweep aborted: {previous[0]} and {spec.id} failed to start in a row with the same error "
                f"({str(error).splitlines()[0]}); no other config is started"
                + (f"\n--- service log tail ---\n{tail}" if tail else ""))
            raise self.aborted from failed
        raise failed

    def deploy(self, spec: SpecConfig, purpose: str = "sweep") -> VerifyReport:
        """Start (or, for url, check) `spec`, wait until ready, verify; raise ServiceError on failure."""
        name = self.backend.name
        self.current = None  # unknown until this deploy is verified
        timing = DeployTiming(spec.id, purpose, self.backend.can_restart,
                              datetime.now(UTC).isoformat(timespec="seconds"))
        self.deploy_timings.append(timing)
        started = time.monotonic()
        try:
            if self.backend.can_restart:
                self.log(f"[{name}] deploying {spec.id}")
                self.deployment = self.backend.start(spec)
                self.deploy_count += 1
                self.deploy_history.append(spec)
                wait_ready(self.backend, timeout_s=self.startup_timeout_s, poll_s=self.poll_s,
                           progress=self.log)
            else:
                self.deployment = self.backend.start(spec)  # raises when the running config differs
            timing.ready_s = round(time.monotonic() - started, 3)
            report = verify_or_raise(self.backend, spec, generate=self.verify_generation)
        except BaseException as err:
            timing.spent_s = round(time.monotonic() - started, 3)
            timing.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise
        timing.verified_s = timing.spent_s = round(time.monotonic() - started, 3)
        timing.ok = True
        self.log(f"[{name}] {spec.id} ready and verified in {timing.verified_s:.1f} s "
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
            return self.deploy(spec, purpose="restore")
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
