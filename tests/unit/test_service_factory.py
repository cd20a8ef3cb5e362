"""The one backend factory: each kind from explicit arguments, a missing one named, nothing started."""

from __future__ import annotations

import pytest

from ddtree.errors import ConfigError
from ddtree.service.dialects import load_dialect
from ddtree.service.factory import BACKENDS, MissingBackendArgument, build_backend
from ddtree.service.fake import FakeBackend
from ddtree.service.local import LocalBackend
from ddtree.service.sglang import SGLangBackend
from ddtree.service.systemd import SystemdBackend
from ddtree.service.url import UrlBackend


@pytest.mark.parametrize(("kind", "arguments", "backend_class"), [
    pytest.param("url", {"url": "http://gpu1:30000"}, UrlBackend, id="url"),
    pytest.param("systemd", {"ssh_host": "gpu1", "unit": "sglang.service", "url": "http://gpu1:30000"},
                 SystemdBackend, id="systemd"),
    pytest.param("fake", {"port": 30123}, FakeBackend, id="fake"),
    pytest.param("local", {"model_path": "m", "draft_model_path": "d", "port": 30123}, LocalBackend, id="local"),
    pytest.param("sglang", {"model_path": "m", "port": 30123}, SGLangBackend, id="sglang"),
])
def test_each_kind_builds_its_backend(kind: str, arguments: dict[str, object], backend_class: type) -> None:
    backend = build_backend(kind, **arguments)  # type: ignore[arg-type]
    assert type(backend) is backend_class and backend.name == kind
    assert kind in BACKENDS


def test_server_arguments_reach_a_launched_backend(tmp_path) -> None:
    lines: list[str] = []
    backend = build_backend("local", model_path="m", draft_model_path="d", host="127.0.0.2", port=30123,
                            device="cuda:1", max_running_requests=4, extra_args=["--x"], log_dir=tmp_path,
                            env={"A": "1"}, log=lines.append, dialect=load_dialect("sglang-dflash"))
    assert isinstance(backend, LocalBackend)
    assert (backend.base_url, backend.device, backend.max_running_requests) == ("http://127.0.0.2:30123", "cuda:1", 4)
    assert backend.extra_args == ["--x"] and backend.env == {"A": "1"} and backend.dialect.name == "sglang-dflash"
    backend.log("hello")
    assert lines == ["hello"]


def test_sglang_defaults_to_its_own_dialect() -> None:
    assert build_backend("sglang", model_path="m", port=30123).dialect.name == "sglang-ddtree"


@pytest.mark.parametrize(("kind", "missing"), [
    pytest.param("url", "url", id="url"),
    pytest.param("systemd", "unit", id="systemd"),
    pytest.param("local", "model_path", id="local"),
    pytest.param("sglang", "model_path", id="sglang"),
])
def test_a_missing_argument_is_named(kind: str, missing: str) -> None:
    with pytest.raises(MissingBackendArgument, match=f"the {kind} backend needs {missing}") as info:
        build_backend(kind)
    assert (info.value.kind, info.value.argument) == (kind, missing)


def test_an_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'ssh' is not one of local, sglang"):
        build_backend("ssh")
