"""Server dialects: each built-in against the fake service speaking it, files, and refusals.

The fake's three personalities (ddtree/service/fake.py) are written from each server's own flags
and log lines, not from the dialect files, so a dialect that names a wrong flag, variable,
/server_info key or init line fails here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError, ServiceStartError
from ddtree.service.dialects import DIALECTS_DIR, builtin_dialects, load_dialect
from ddtree.service.fake import FakeBackend
from ddtree.service.readiness import wait_ready
from ddtree.service.verify import verify

TREE = SpecConfig(budget=12, topk=3, block_size=8, draft_window=2048)
CHAIN = SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None)
AR = SpecConfig(Algorithm.NONE)
SUPPORTED = {"ddtree": [TREE, CHAIN, AR, SpecConfig(budget="auto", max_budget=12)],
             "sglang-dflash": [CHAIN, SpecConfig(Algorithm.DFLASH, draft_window=1024), AR],
             "sglang-ddtree": [TREE, SpecConfig(budget=4, topk=6, draft_window=None), CHAIN, AR]}


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[FakeBackend]]:
    made: list[FakeBackend] = []
    yield made
    for backend in made:
        backend.stop()


def _start(made: list[FakeBackend], tmp_path: Path, dialect: str, spec: SpecConfig, **env: str) -> FakeBackend:
    backend = FakeBackend(log_dir=tmp_path, dialect=load_dialect(dialect), env=env, stop_timeout_s=2)
    made.append(backend)
    backend.start(spec)
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    return backend


def test_the_three_built_ins_are_there() -> None:
    assert builtin_dialects() == ["ddtree", "sglang-ddtree", "sglang-dflash"]


@pytest.mark.parametrize(("dialect", "spec"), [pytest.param(d, s, id=f"{d}-{s.id}")
                                               for d, specs in SUPPORTED.items() for s in specs])
def test_each_built_in_deploys_and_verifies_against_the_fake_speaking_it(
        started: list[FakeBackend], tmp_path: Path, dialect: str, spec: SpecConfig) -> None:
    backend = _start(started, tmp_path, dialect, spec)
    report = verify(backend, spec)
    assert report.ok, report.lines()
    assert report.details["dialect"] == dialect
    if spec.speculative:  # a speculative start is checked on its init line(s), not only the settings
        assert report.details["log_values"], report.lines()


def test_sglang_ddtree_top_k_travels_in_the_environment_and_is_checked_there(
        started: list[FakeBackend], tmp_path: Path) -> None:
    backend = _start(started, tmp_path, "sglang-ddtree", TREE)
    assert "--speculative-ddtree-topk" not in backend.command(TREE)
    report = verify(backend, TREE, generate=False)
    topk = report.details["settings"]["topk"]
    assert topk == {"key": "environment variable SGLANG_DDTREE_MAX_TOPK", "expected": 3, "reported": 3, "ok": True}
    assert report.details["not_in_server_info"] == ["topk (environment variable SGLANG_DDTREE_MAX_TOPK)"]
    assert "Initialized DDTree worker. block_size=8, tree_budget=12, max_tree_nodes=13" in report.details["init_line"]
    wrong = verify(backend, SpecConfig(budget=12, topk=5), generate=False)  # another top-k than deployed
    assert not wrong.settings_ok and wrong.details["settings"]["topk"]["reported"] == 3
    assert wrong.log_ok, "the fork's init lines carry no top-k: only the environment tells"


def test_a_knob_only_the_environment_carries_is_reported_unchecked_where_it_cannot_be_read(
        started: list[FakeBackend], tmp_path: Path) -> None:
    from ddtree.service.url import UrlBackend

    backend = _start(started, tmp_path, "sglang-ddtree", TREE)
    report = verify(UrlBackend(backend.base_url, dialect=load_dialect("sglang-ddtree")), TREE, generate=False)
    assert report.ok and "topk" not in report.details["settings"]
    assert "not checked (the server does not report them): topk (environment variable SGLANG_DDTREE_MAX_TOPK)" \
        in report.lines()


def test_a_budget_the_fork_logs_differently_fails_the_init_line(started: list[FakeBackend], tmp_path: Path) -> None:
    backend = _start(started, tmp_path, "sglang-ddtree", TREE)
    report = verify(backend, SpecConfig(budget=8, topk=3), generate=False)
    assert report.log_ok is False and report.details["log_values"]["tree_budget"]["reported"] == 12


def test_stock_sglang_refuses_tree_flags_so_the_ddtree_dialect_cannot_drive_it(
        started: list[FakeBackend], tmp_path: Path) -> None:
    with pytest.raises(ServiceStartError, match="died while starting") as info:
        _start(started, tmp_path, "ddtree", TREE, DDTREE_FAKE_DIALECT="sglang-dflash")
    assert "unrecognized arguments: --speculative-ddtree-budget 12 --speculative-ddtree-topk 3" in info.value.log_tail


def test_stock_sglang_logs_no_ar_line_and_a_stray_speculative_line_fails_ar(
        started: list[FakeBackend], tmp_path: Path) -> None:
    backend = _start(started, tmp_path, "sglang-dflash", CHAIN)
    report = verify(backend, AR, generate=False)
    assert not report.settings_ok and report.log_ok is False
    assert "speculative init line for an AR deployment" in report.details["log_error"]


@pytest.mark.parametrize(("dialect", "spec", "message"), [
    ("sglang-dflash", TREE, "knob algorithm DDTREE: dialect sglang-dflash does not support it (supported: NONE, DFLASH)"),
    ("sglang-ddtree", SpecConfig(budget="auto"), "knob budget ('auto'): dialect sglang-ddtree takes a fixed budget only"),
    ("sglang-ddtree", SpecConfig(budget="auto", max_budget=12), "knob max_budget (12): dialect sglang-ddtree cannot set it"),
])
def test_a_knob_the_dialect_cannot_set_names_knob_and_dialect(dialect: str, spec: SpecConfig, message: str) -> None:
    assert message in "; ".join(load_dialect(dialect).problems(spec))
    with pytest.raises(ConfigError, match="cannot|does not|fixed budget"):
        load_dialect(dialect).launch(spec)


def test_a_users_dialect_file_maps_knobs_to_its_own_flags_and_variables(tmp_path: Path) -> None:
    data = yaml.safe_load((DIALECTS_DIR / "sglang-ddtree.yaml").read_text())
    data["name"] = "my-fork"
    data["knobs"]["topk"] = {"env": "MY_FORK_TOPK"}
    data["knobs"]["budget"] = {"flag": "--tree-budget", "server_info": "tree_budget"}
    path = tmp_path / "my-fork.yaml"
    path.write_text(yaml.safe_dump(data))
    mine = load_dialect(str(path))
    assert mine.name == "my-fork" and mine.path == path
    args, env = mine.launch(TREE)
    assert args[-2:] == ["--tree-budget", "12"] and env == {"MY_FORK_TOPK": "3"}
    assert mine.managed_env() == {"MY_FORK_TOPK": "topk"}


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["knobs"].pop("topk"), "knobs: missing ['topk'] (write 'unsupported' for a knob the server lacks)"),
    (lambda d: d["knobs"].update(topk={"flag": "--a", "env": "B"}), "knobs.topk: give exactly one of flag"),
    (lambda d: d["knobs"].update(colour={"flag": "--c"}), "knobs: unknown knob(s) ['colour']"),
    (lambda d: d["knobs"].update(topk={"env": "not a name"}), "knobs.topk.env: 'not a name' is not an environment"),
    (lambda d: d.update(algorithms=["EAGLE"]), "algorithms: algorithm: unknown value 'EAGLE'"),
    (lambda d: d["init_lines"][0]["keys"].update(x="colour"), "init_lines[0].keys: values must be knobs"),
], ids=["missing-knob", "flag-and-env", "unknown-knob", "bad-env", "bad-algorithm", "bad-line-key"])
def test_a_bad_dialect_file_names_the_file_and_the_key(tmp_path: Path, edit: object, message: str) -> None:
    data = yaml.safe_load((DIALECTS_DIR / "sglang-ddtree.yaml").read_text())
    edit(data)  # type: ignore[operator]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_dialect(str(path))
    assert str(path) in str(info.value) and message in str(info.value)


def test_an_unknown_dialect_name_lists_the_built_ins() -> None:
    with pytest.raises(ConfigError, match=r"'vllm': not a built-in \(ddtree, sglang-ddtree, sglang-dflash\)"):
        load_dialect("vllm")
