"""wait_ready: refused connections and 503s are waited through; death and timeout fail fast with the log."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ServiceStartError
from ddtree.service.fake import FakeBackend
from ddtree.service.local import free_port
from ddtree.service.readiness import wait_ready

MakeBackend = Callable[..., FakeBackend]


@pytest.fixture
def make_backend(tmp_path) -> Iterator[MakeBackend]:
    made: list[FakeBackend] = []

    def make(**env: object) -> FakeBackend:
        backend = FakeBackend(log_dir=tmp_path, env={k: str(v) for k, v in env.items()}, stop_timeout_s=2)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.stop()


def test_waits_through_refused_connections_and_503_then_succeeds(make_backend: MakeBackend) -> None:
    backend = make_backend(DDTREE_FAKE_LOAD_S=0.8, DDTREE_FAKE_WARMUP_S=0.8)
    backend.start(SpecConfig())
    messages: list[str] = []
    waited = wait_ready(backend, timeout_s=20, poll_s=0.1, progress=messages.append, progress_every_s=0.2)
    assert waited >= 1.4, f"ready after {waited:.2f} s, but load + warm-up take 1.6 s"
    statuses = " ".join(messages)
    assert "ConnectError" in statuses, messages  # the port refused while "loading"
    assert "last status 503" in statuses, messages  # then warm-up answered 503
    assert "The server is fired up" in backend.log_since_start()


def test_dead_process_fails_at_once_with_log_tail(make_backend: MakeBackend) -> None:
    backend = make_backend(DDTREE_FAKE_LOAD_S=60, DDTREE_FAKE_CRASH_AFTER_S=0.3)
    backend.start(SpecConfig())
    started = time.monotonic()
    with pytest.raises(ServiceStartError) as info:
        wait_ready(backend, timeout_s=120, poll_s=0.1)
    took = time.monotonic() - started
    assert took < 15, f"death reported after {took:.1f} s; it must not wait for the 120 s timeout"
    assert "exited with code 3" in str(info.value)
    assert "simulated crash" in info.value.log_tail


def test_timeout_reports_elapsed_last_status_and_tail(make_backend: MakeBackend) -> None:
    backend = make_backend(DDTREE_FAKE_WARMUP_S=60)
    backend.start(SpecConfig())
    started = time.monotonic()
    with pytest.raises(ServiceStartError) as info:
        wait_ready(backend, timeout_s=1.5, poll_s=0.1)
    took = time.monotonic() - started
    assert 1.5 <= took < 10, f"timed out after {took:.1f} s, timeout was 1.5 s"
    message = str(info.value)
    assert "not ready after 1." in message and "timeout 1.5 s" in message and "last status 503" in message
    assert "Initialized DDTree worker." in info.value.log_tail


class _Flaky:
    """An in-process backend: alive for `alive_polls` polls, nothing ever listens on its port."""

    name = "flaky"
    has_log = True

    def __init__(self, alive_polls: int) -> None:
        self.polls = 0
        self.alive_polls = alive_polls
        self.base_url = f"http://127.0.0.1:{free_port()}"

    def is_alive(self) -> tuple[bool, str]:
        self.polls += 1
        return (True, "") if self.polls <= self.alive_polls else (False, "exited with code 9")

    def log_tail(self, n: int = 40) -> str:
        return "last words"


def test_is_alive_is_checked_on_every_poll() -> None:
    backend = _Flaky(alive_polls=3)
    with pytest.raises(ServiceStartError, match="died while starting .exited with code 9") as info:
        wait_ready(backend, timeout_s=30, poll_s=0.05)  # type: ignore[arg-type]
    assert backend.polls == 4  # three refused polls were fine; the fourth saw the death
    assert info.value.log_tail == "last words"


@pytest.mark.parametrize(("kwargs", "field"), [
    pytest.param({"timeout_s": 0}, "timeout_s", id="zero-timeout"),
    pytest.param({"poll_s": 0}, "poll_s", id="zero-poll"),
    pytest.param({"poll_s": 120}, "poll_s", id="huge-poll"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        wait_ready(_Flaky(1), **kwargs)  # type: ignore[arg-type]
