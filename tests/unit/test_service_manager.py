"""ServiceManager: one deploy per config change, crash redeploys, the default always comes back."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from ddtree.config import SpecConfig
from ddtree.errors import ServiceStartError
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


def test_failed_deploy_leaves_the_config_unknown(make_manager: MakeManager) -> None:
    manager = make_manager(DDTREE_FAKE_CRASH_AFTER_S=0.2, DDTREE_FAKE_LOAD_S=30)
    with pytest.raises(ServiceStartError, match="died while starting"):
        manager.ensure(A)
    assert manager.current is None
    manager.backend.env.clear()  # the next start is healthy
    assert manager.ensure(A).ok and manager.deploy_count == 2


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
