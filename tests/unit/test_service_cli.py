"""The `ddtree` command: usage errors exit 2 naming the field; service actions against the fake server."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ddtree import cli
from ddtree.config import SpecConfig
from ddtree.service.fake import FakeBackend
from ddtree.service.readiness import wait_ready


@pytest.fixture
def running(tmp_path) -> Iterator[FakeBackend]:
    backend = FakeBackend(log_dir=tmp_path, stop_timeout_s=2)
    backend.start(SpecConfig())
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    yield backend
    backend.stop()


@pytest.mark.parametrize(("argv", "message"), [
    pytest.param(["service", "reconfigure", "--config", "b8-k4-w2048-bs8", "--budget", "4",
                  "--backend", "url", "--url", "http://x:1"], "cannot be combined with --budget",
                 id="config-and-field"),
    pytest.param(["service", "verify", "--budget", "0", "--backend", "url", "--url", "http://x:1"],
                 "budget: 0 is out of range (allowed 1..512)", id="budget-zero"),
    pytest.param(["service", "verify", "--window", "4", "--backend", "url", "--url", "http://x:1"],
                 "draft_window: 4 is out of range", id="window-below-block"),
    pytest.param(["service", "verify", "--config", "b8-k4", "--backend", "url", "--url", "http://x:1"],
                 "config id 'b8-k4' is not one of", id="bad-id"),
    pytest.param(["service", "verify", "--backend", "url"], "--url is required", id="url-without-url"),
    pytest.param(["service", "reconfigure", "--backend", "systemd"], "--unit is required", id="systemd-no-unit"),
    pytest.param(["service", "reconfigure", "--backend", "local"], "--model-path is required", id="local-no-model"),
    pytest.param(["service", "verify", "--backend", "k8s"], "invalid choice: 'k8s'", id="unknown-backend"),
    pytest.param(["service"], "the following arguments are required", id="no-action"),
    pytest.param(["service", "verify", "--algorithm", "EAGLE"], "invalid choice", id="bad-algorithm"),
    pytest.param([], "the following arguments are required", id="no-command"),
    pytest.param(["service", "verify", "--backend", "url", "--url", "http://x:1", "--server-dialect", "vllm"],
                 "server dialect 'vllm': not a built-in", id="unknown-dialect"),
])
def test_usage_errors_exit_2_with_a_message(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_fields_fill_in_from_the_default() -> None:
    args = cli.build_parser().parse_args(["service", "verify", "--budget", "16", "--window", "none"])
    assert cli.spec_from_args(args) == SpecConfig(budget=16, draft_window=None)


def test_budget_auto_and_its_cap() -> None:
    args = cli.build_parser().parse_args(["service", "verify", "--budget", "auto", "--max-budget", "16"])
    assert cli.spec_from_args(args) == SpecConfig(budget="auto", max_budget=16)
    assert cli.spec_from_args(args).id == "bauto16-k4-w2048-bs8"


def test_verify_prints_each_check_and_exits_0(running: FakeBackend, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["service", "verify", "--config", "b8-k4-w2048-bs8", "--backend", "url",
                     "--url", running.base_url])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "settings (server_info): ok" in out and "generation: ok" in out and "OK: b8-k4-w2048-bs8" in out


def test_verify_through_a_dialect_reads_its_server_info_keys(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddtree.service.dialects import load_dialect

    fork = FakeBackend(log_dir=tmp_path, stop_timeout_s=2, dialect=load_dialect("sglang-ddtree"))
    fork.start(SpecConfig(budget=12))
    try:
        wait_ready(fork, timeout_s=20, poll_s=0.05)
        argv = ["service", "verify", "--budget", "12", "--backend", "url", "--url", fork.base_url]
        assert cli.main([*argv, "--server-dialect", "sglang-ddtree"]) == 0, capsys.readouterr().out
        assert "budget 12 == 12" in capsys.readouterr().out
        assert cli.main(argv) == 1  # read as ddtree's server: no speculative_ddtree_topk in /server_info
        assert "topk 4 != '<missing>'" in capsys.readouterr().out
    finally:
        fork.stop()


def test_verify_mismatch_exits_1(running: FakeBackend, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["service", "verify", "--topk", "2", "--backend", "url", "--url", running.base_url])
    captured = capsys.readouterr()
    assert code == 1
    assert "topk 2 != 4" in captured.out and "FAILED" in captured.err


def test_url_reconfigure_is_refused_with_exit_1(running: FakeBackend, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["service", "reconfigure", "--budget", "16", "--backend", "url", "--url", running.base_url])
    assert code == 1
    assert "cannot reconfigure" in capsys.readouterr().err


def test_restore_default_checks_a_running_default(running: FakeBackend, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["service", "restore-default", "--backend", "url", "--url", running.base_url])
    assert code == 0 and "OK: b8-k4-w2048-bs8 verified" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "module"), [
    pytest.param(["sweep-report", "results/"], "ddtree.bench.report", id="sweep-report"),
    pytest.param(["serve", "--port", "1"], "ddtree.server", id="serve"),
    pytest.param(["train", "target"], "ddtree.train.cli", id="train"),
])
def test_lazy_commands_explain_a_failed_import(argv: list[str], module: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    assert cli.main(argv) == 1
    assert f"cannot import {module}" in capsys.readouterr().err


def test_lazy_commands_pass_their_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    class Module:
        @staticmethod
        def main(argv: list[str]) -> int:
            seen.append(argv)
            return 3

    monkeypatch.setitem(sys.modules, "ddtree.bench.report", Module)
    monkeypatch.setitem(sys.modules, "ddtree.server", Module)
    assert cli.main(["sweep-report", "out/run1"]) == 3
    assert cli.main(["serve", "--model-path", "m", "--port", "9"]) == 3
    assert seen == [["out/run1"], ["--model-path", "m", "--port", "9"]]
