"""ServiceManager: one deploy per config change, crash redeploys, the default always comes back."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ServiceStartError
from ddtree.service.fake import FakeBackend
from ddtree.service.manager import ServiceManager

DEFAULT = SpecConfig()
A = SpecConfig(budget=16, topk=4)
B = SpecConfig(budget=4, topk=2, draft_window=None)
MakeManager = Callable[..., ServiceManager]


@pytest.fixture
def make_manager(tmp_path) -> Iterator[MakeManager]:
    made: list[ServiceManager] = []

    def make(**env: object) -> ServiceManager:
        backend = FakeBackend(log_dir=tmp_path, env={k: str(v) for k, v in env.items()}, stop_timeout_s=2)
        manager = ServiceManager(backend, DEFAULT, startup_timeout_s=20, log=lambda _: None, poll_s=0.05)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.backend.stop()


def _kill(manager: ServiceManager) -> None:
    pid = manager.backend.pid  # type: ignore[attr-defined]
    os.killpg(pid, signal.SIGKILL)
    manager.backend._proc.wait(5)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("sequence", "deploys"), [
    pytest.param([A, A], [A], id="A-A"),
    pytest.param([A, B, A], [A, B, A], id="A-B-A"),
    pytest.param([A, A, B, A], [A, B, A], id="A-A-B-A"),
    pytest.param([A, B, B, B], [A, B], id="A-B-B-B"),
])
def test_deploys_only_when_the_config_changes(make_manager: MakeManager, sequence: list[SpecConfig],
                                             deploys: list[SpecConfig]) -> None:
    manager = make_manager()
    for spec in sequence:
        report = manager.ensure(spec)
        assert report.ok and report.spec == spec and manager.current == spec
    assert manager.deploy_count == len(deploys)
    assert manager.deploy_history == deploys


def test_crashed_service_is_redeployed_at_next_ensure(make_manager: MakeManager) -> None:
    manager = make_manager()
    manager.ensure(A)
    _kill(manager)
    assert manager.backend.is_alive()[0] is False
    assert manager.ensure(A).ok
    assert manager.deploy_history == [A, A]


def test_a_failed_start_is_retried_once_then_the_config_is_not_started_again(make_manager: MakeManager) -> None:
    manager = make_manager(DDTREE_FAKE_CRASH_AFTER_S=0.2, DDTREE_FAKE_LOAD_S=30)
    manager.start_retries = 1
    with pytest.raises(ServiceStartError, match=rf"{A.id}: start failed \(2 attempts; not started again\): .*died"):
        manager.ensure(A)
    assert manager.current is None and manager.deploy_count == 2
    manager.backend.env.clear()  # a start would work now, but an 11-minute start is not tried per cell
    with pytest.raises(ServiceStartError, match="not started again") as again:
        manager.ensure(A)
    assert manager.deploy_count == 2 and "simulated crash" in again.value.log_tail
    assert manager.ensure(B).ok and manager.deploy_count == 3  # another config still starts


@pytest.mark.parametrize("error", [RuntimeError("cell failed"), KeyboardInterrupt()],
                         ids=["exception", "ctrl-c"])
def test_exit_restores_and_verifies_the_default(make_manager: MakeManager, error: BaseException) -> None:
    manager = make_manager()
    with pytest.raises(type(error)), manager:
        manager.ensure(A)
        raise error
    assert manager.restore_report is not None and manager.restore_report.ok
    assert manager.restore_report.spec == DEFAULT
    assert manager.restore_report.log_ok and manager.restore_report.settings_ok
    assert manager.deploy_history == [A, DEFAULT]
    assert "restored and verified" in manager.restore_outcome
    assert manager.backend.is_alive()[0] is False  # our child is stopped after the restore


def test_restore_restarts_a_dead_default(make_manager: MakeManager) -> None:
    manager = make_manager()
    manager.ensure(DEFAULT)
    assert manager.restore_default().ok and manager.deploy_count == 1  # running: verified, not restarted
    _kill(manager)
    assert manager.restore_default().ok
    assert manager.deploy_history == [DEFAULT, DEFAULT]


def test_failed_restore_is_recorded_and_noted_on_the_original_error(make_manager: MakeManager) -> None:
    manager = make_manager()
    with pytest.raises(RuntimeError) as info, manager:
        manager.ensure(A)
        manager.backend.env.update(DDTREE_FAKE_LOAD_S="30", DDTREE_FAKE_CRASH_AFTER_S="0.2")
        raise RuntimeError("cell failed")
    assert str(info.value) == "cell failed"  # the original error is what propagates
    assert any("restoring the default b8-k4-w2048-bs8 also failed" in n for n in info.value.__notes__)
    assert isinstance(manager.restore_error, ServiceStartError) and manager.restore_report is None
    assert "NOT restored" in manager.restore_outcome


def test_failed_restore_without_an_error_raises(make_manager: MakeManager) -> None:
    manager = make_manager()
    with pytest.raises(ServiceStartError), manager:
        manager.ensure(A)
        manager.backend.env.update(DDTREE_FAKE_LOAD_S="30", DDTREE_FAKE_CRASH_AFTER_S="0.2")


def test_two_start_failures_are_the_same_error_whatever_their_ports_pids_and_configs() -> None:
    from ddtree.service.manager import start_error_signature

    def failure(port: int, pid: int, config: str, last: str) -> ServiceStartError:
        return ServiceStartError(f"sglang service at http://gpu1:{port} died while starting (pid {pid} exited "
                                 f"with code 1) after {pid / 100:.1f} s",
                                 log_tail=f"=== ddtree service start {config}: ...\nTraceback\n{last}\n")
    missing = "ModuleNotFoundError: No module named 'flash_attn'"
    one, two = failure(30001, 4242, "b8-k4-w2048-bs8", missing), failure(30002, 977, "dflash-wnone-bs16", missing)
    assert start_error_signature(one) == start_error_signature(two)
    assert start_error_signature(one) != start_error_signature(failure(30001, 4242, "ar", "CUDA out of memory"))


def test_start_retries_is_zero_or_one(make_manager: MakeManager) -> None:
    with pytest.raises(ConfigError, match="start_retries: 2; allowed: 0 or 1"):
        ServiceManager(FakeBackend(port=1), DEFAULT, start_retries=2)
