"""verify: settings and the current start's init line are checked independently, plus one generation."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ServiceVerifyError
from ddtree.service.dialects import load_dialect
from ddtree.service.fake import FakeBackend
from ddtree.service.readiness import wait_ready
from ddtree.service.verify import compare_init_line, compare_settings, find_line, verify, verify_or_raise

DEFAULT = SpecConfig()
MakeBackend = Callable[..., FakeBackend]


@pytest.fixture
def make_backend(tmp_path) -> Iterator[MakeBackend]:
    made: list[FakeBackend] = []

    def make(spec: SpecConfig, **env: object) -> FakeBackend:
        backend = FakeBackend(log_dir=tmp_path, env={k: str(v) for k, v in env.items()}, stop_timeout_s=2)
        made.append(backend)
        backend.start(spec)
        wait_ready(backend, timeout_s=20, poll_s=0.05)
        return backend

    yield make
    for backend in made:
        backend.stop()


@pytest.mark.parametrize("spec", [
    pytest.param(DEFAULT, id=DEFAULT.id),
    pytest.param(SpecConfig(budget=16, topk=2, draft_window=None), id="b16-k2-wnone-bs8"),
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=16), id="dflash-w2048-bs16"),
    pytest.param(SpecConfig(Algorithm.NONE), id="ar"),
])
def test_matching_service_passes_all_checks(make_backend: MakeBackend, spec: SpecConfig) -> None:
    report = verify_or_raise(make_backend(spec), spec)
    assert (report.settings_ok, report.log_ok, report.generation_ok) == (True, True, True), report.lines()
    if spec.speculative:
        assert report.details["generation"]["spec_verify_ct"] > 0


def test_mismatched_setting_names_expected_and_reported(make_backend: MakeBackend) -> None:
    backend = make_backend(DEFAULT, DDTREE_FAKE_REPORT='{"speculative_ddtree_topk": 2}')
    report = verify(backend, DEFAULT)
    assert not report.settings_ok and report.log_ok and not report.ok
    with pytest.raises(ServiceVerifyError, match="topk expected 4, reported 2") as info:
        verify_or_raise(backend, DEFAULT)
    assert info.value.expected == {"topk": 4} and info.value.reported == {"topk": 2}


def test_wrong_config_fails_both_checks(make_backend: MakeBackend) -> None:
    backend = make_backend(SpecConfig(budget=16))
    report = verify(backend, DEFAULT, generate=False)
    assert not report.settings_ok and report.log_ok is False
    with pytest.raises(ServiceVerifyError) as info:
        verify_or_raise(backend, DEFAULT, generate=False)
    assert info.value.expected == {"budget": 8, "log.tree_budget": 8}
    assert info.value.reported == {"budget": 16, "log.tree_budget": 16}


def test_init_line_of_an_older_start_does_not_count(make_backend: MakeBackend) -> None:
    backend = make_backend(DEFAULT)  # this start logs a matching init line
    backend.stop()
    backend.env["DDTREE_FAKE_NO_INIT_LINE"] = "1"
    backend.start(DEFAULT)  # same log file, appended; this start logs no init line
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    assert backend.log_path.read_text().count("Initialized DDTree worker.") == 1  # only the old one
    report = verify(backend, DEFAULT)
    assert report.settings_ok and report.generation_ok
    assert report.log_ok is False and "no speculative init line" in report.details["log_error"]
    with pytest.raises(ServiceVerifyError, match="init log line"):
        verify_or_raise(backend, DEFAULT)


def test_only_the_current_start_is_read_after_a_restart(make_backend: MakeBackend) -> None:
    other = SpecConfig(budget=32, topk=8)
    backend = make_backend(other)
    backend.stop()
    backend.start(DEFAULT)
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    assert verify(backend, DEFAULT).ok
    assert verify(backend, other, generate=False).log_ok is False


def test_speculation_without_verify_steps_fails_generation(make_backend: MakeBackend) -> None:
    report = verify(make_backend(DEFAULT, DDTREE_FAKE_VERIFY_CT=0), DEFAULT)
    assert report.settings_ok and report.log_ok and not report.generation_ok
    with pytest.raises(ServiceVerifyError, match="spec_verify_ct is 0"):
        verify_or_raise(make_backend(DEFAULT, DDTREE_FAKE_VERIFY_CT=0), DEFAULT)


# -- pure parsing ---------------------------------------------------------------------------------
SGLANG_LINE = ("[2026-05-01 10:00:00 TP0] Initialized DFLASH draft runner. attention_backend=fa3, "
               "model=DFlashDraftModel, block_size=8, draft_window_size=2048, compact_cache=True")


def test_sglang_runner_line_is_parsed() -> None:
    line, values = find_line("loading...\n" + SGLANG_LINE + "\nready\n", "Initialized DFLASH draft runner.")  # type: ignore[misc]
    assert line == SGLANG_LINE
    assert values["block_size"] == "8" and values["draft_window_size"] == "2048"
    stock = load_dialect("sglang-dflash")
    checked, _, error = compare_init_line(SpecConfig(Algorithm.DFLASH), SGLANG_LINE, stock)
    assert error is None and all(v["ok"] for v in checked.values())
    checked, _, _ = compare_init_line(SpecConfig(Algorithm.DFLASH, draft_window=None), SGLANG_LINE, stock)
    assert not checked["draft_window_size"]["ok"] and not checked["compact_cache"]["ok"]


def test_last_init_line_wins() -> None:
    log = ("Initialized DDTree worker. block_size=8, tree_budget=4, topk=4, draft_window_size=None, "
           "compact_cache=False\nInitialized DDTree worker. block_size=8, tree_budget=8, topk=4, "
           "draft_window_size=2048, compact_cache=True\n")
    checked, _, error = compare_init_line(DEFAULT, log)
    assert error is None and all(v["ok"] for v in checked.values())


@pytest.mark.parametrize("window", [0, None, "none", "0"], ids=["zero", "null", "none-str", "zero-str"])
def test_reported_window_zero_or_none_means_no_window(window: object) -> None:
    reported = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": "8",
                "speculative_ddtree_topk": 4, "speculative_num_draft_tokens": 8,
                "speculative_draft_window_size": window}
    assert all(v["ok"] for v in compare_settings(SpecConfig(draft_window=None), reported).values())
    assert not compare_settings(DEFAULT, reported)["draft_window"]["ok"]


def test_missing_setting_is_a_mismatch() -> None:
    result = compare_settings(DEFAULT, {"speculative_algorithm": "ddtree"})
    assert result["algorithm"]["ok"] and result["budget"]["reported"] == "<missing>"
    assert not result["budget"]["ok"]


def test_auto_budget_deployment_verifies_from_settings_and_init_line() -> None:
    """budget auto: /server_info reports "auto" and the init line says tree_budget=auto; a fixed 8 is a mismatch."""
    from ddtree.server import init_line

    auto = SpecConfig(budget="auto")
    reported = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": "AUTO",
                "speculative_ddtree_topk": 4, "speculative_num_draft_tokens": 8,
                "speculative_draft_window_size": 2048}
    assert all(v["ok"] for v in compare_settings(auto, reported).values())
    assert not compare_settings(DEFAULT, reported)["budget"]["ok"]
    checked, line, error = compare_init_line(auto, "loading\n" + init_line(auto) + "\n")
    assert error is None and line is not None and "tree_budget=auto" in line
    assert all(v["ok"] for v in checked.values()) and checked["tree_budget"]["reported"] == "auto"
    checked, _, _ = compare_init_line(auto, init_line(DEFAULT))
    assert not checked["tree_budget"]["ok"]
    checked, _, _ = compare_init_line(DEFAULT, init_line(auto))
    assert not checked["tree_budget"]["ok"]
