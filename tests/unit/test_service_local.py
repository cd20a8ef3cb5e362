"""LocalBackend, SGLangBackend, UrlBackend: the command line, the process group, stop, url checks."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError, ServiceError
from ddtree.service import ServiceBackend
from ddtree.service.fake import FakeBackend
from ddtree.service.local import LocalBackend, free_port
from ddtree.service.manager import ServiceManager
from ddtree.service.readiness import wait_ready
from ddtree.service.sglang import SGLangBackend
from ddtree.service.systemd import SystemdBackend
from ddtree.service.url import UrlBackend
from ddtree.service.verify import verify

DEFAULT = SpecConfig()


@pytest.fixture
def running(tmp_path) -> Iterator[FakeBackend]:
    backend = FakeBackend(log_dir=tmp_path, stop_timeout_s=2)
    backend.start(DEFAULT)
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    yield backend
    backend.stop()


def test_sglang_command_line_speaks_the_pr_29907_fork() -> None:
    """No SGLang fork has --speculative-ddtree-topk: the fork reads top-k from SGLANG_DDTREE_MAX_TOPK."""
    backend = SGLangBackend("/models/qwen3-8b", "/models/dflash", port=30000, max_running_requests=32,
                            extra_args=["--tp", "2"], env={"SGLANG_DDTREE_MAX_TOPK": "9"})
    assert backend.dialect.name == "sglang-ddtree"
    assert backend.command(DEFAULT) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen3-8b",
        "--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "8",
        "--speculative-draft-window-size", "2048", "--speculative-ddtree-budget", "8",
        "--speculative-draft-model-path", "/models/dflash",
        "--host", "127.0.0.1", "--port", "30000", "--device", "cuda", "--max-running-requests", "32",
        "--tp", "2"]
    assert backend.spec_env(DEFAULT)["SGLANG_DDTREE_MAX_TOPK"] == "4"  # the spec's, not the stale 9
    assert "SGLANG_DDTREE_MAX_TOPK" not in backend.spec_env(SpecConfig(Algorithm.DFLASH))
    assert "--speculative-draft-window-size" not in backend.command(SpecConfig(draft_window=None))  # omitted
    assert backend.base_url == "http://127.0.0.1:30000"


def test_local_command_for_ar_has_no_draft_flags() -> None:
    cmd = LocalBackend("/m/t", "/m/d", port=4000).command(SpecConfig(Algorithm.NONE))
    assert cmd[1:] == ["-m", "ddtree.server", "--model-path", "/m/t", "--speculative-algorithm", "NONE",
                       "--host", "127.0.0.1", "--port", "4000", "--device", "cpu"]


@pytest.mark.parametrize("backend", [
    pytest.param(LocalBackend("/m", port=1), id="local"),
    pytest.param(SGLangBackend("/m", port=1), id="sglang"),
    pytest.param(FakeBackend(port=1), id="fake"),
    pytest.param(UrlBackend("http://127.0.0.1:1"), id="url"),
    pytest.param(SystemdBackend("h", "u.service", base_url="http://h:1"), id="systemd"),
])
def test_every_backend_satisfies_the_protocol(backend: object) -> None:
    assert isinstance(backend, ServiceBackend)


@pytest.mark.parametrize(("kwargs", "field"), [
    pytest.param({"port": 70000}, "port", id="port-too-big"),
    pytest.param({"max_running_requests": 0}, "max_running_requests", id="zero-requests"),
])
def test_bad_local_options_name_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        LocalBackend("/m", **kwargs)


def test_free_port_is_picked_once_and_kept(tmp_path) -> None:
    backend = FakeBackend(log_dir=tmp_path)
    assert backend.port > 0 and backend.base_url.endswith(f":{backend.port}")


def test_log_records_the_exact_command_and_stop_is_idempotent(tmp_path) -> None:
    logged: list[str] = []
    backend = FakeBackend(log_dir=tmp_path, log=logged.append, stop_timeout_s=2)
    deployment = backend.start(DEFAULT)
    assert any(" ".join(deployment.command) in line for line in logged)
    assert backend.is_alive() == (True, "")
    backend.stop()
    backend.stop()
    assert backend.is_alive() == (False, "stopped")


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path) -> None:
    backend = FakeBackend(log_dir=tmp_path, env={"DDTREE_FAKE_IGNORE_SIGTERM": "1"}, stop_timeout_s=0.5)
    backend.start(DEFAULT)
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    proc = backend._proc
    started = time.monotonic()
    backend.stop()
    assert proc is not None and proc.returncode == -9  # SIGKILL
    assert time.monotonic() - started < 3


def test_url_backend_verifies_without_restarting(running: FakeBackend) -> None:
    url = UrlBackend(running.base_url)
    assert url.start(DEFAULT).command == []
    report = verify(url, DEFAULT)
    assert report.ok and report.log_ok is None  # the log is not reachable: reported, not passed
    assert any("not available" in line for line in report.lines())
    with pytest.raises(ServiceError, match="url backend cannot reconfigure.*budget 8 .wanted 16"):
        url.start(SpecConfig(budget=16))


def test_url_backend_is_dead_when_nothing_answers() -> None:
    alive, reason = UrlBackend(f"http://127.0.0.1:{free_port()}").is_alive()
    assert not alive and "ConnectError" in reason


def test_url_must_have_a_scheme() -> None:
    with pytest.raises(ConfigError, match="base_url"):
        UrlBackend("gpu1:30000")


def test_package_exports_exactly_its_public_names() -> None:
    import ddtree.service as service

    assert service.__all__ == sorted(service.__all__)
    for name in service.__all__:
        assert getattr(service, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        service.Nope  # noqa: B018


@pytest.mark.slow
def test_real_server_is_deployed_verified_and_restored(tmp_path) -> None:
    """LocalBackend driving `python -m ddtree.server` on the tiny random pair (about 15 s)."""
    from tests.unit.tiny_server import save_tiny_pair

    target, drafter = save_tiny_pair(tmp_path / "models")
    other = SpecConfig(budget=16, topk=2, draft_window=None)
    backend = LocalBackend(target, drafter, log_dir=tmp_path / "logs")
    with ServiceManager(backend, DEFAULT, startup_timeout_s=300, log=lambda _: None) as manager:
        report = manager.ensure(other)
        assert report.ok, report.lines()
        assert "tree_budget=16, topk=2, draft_window_size=None" in report.details["init_line"]
        assert report.details["generation"]["spec_verify_ct"] > 0
    assert manager.restore_report is not None and manager.restore_report.ok, manager.restore_outcome
    assert manager.deploy_history == [other, DEFAULT]
