"""SystemdBackend against a simulated host: exact commands, ExecStart rewriting, journal since restart."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError, ServiceStartError
from ddtree.service.dialects import load_dialect
from ddtree.service.fake import init_lines
from ddtree.service.systemd import (
    CommandResult,
    SystemdBackend,
    environment,
    flag_values,
    knobs_from_unit,
    rewrite_exec_start,
    rewrite_unit,
)
from ddtree.service.verify import verify

DEFAULT = SpecConfig()
UNIT_PATH = "/etc/systemd/system/sglang.service"
UNIT = """\
[Unit]
Description=SGLang with DDTree   # comments and spacing stay as they are
After=network-online.target

[Service]
Environment=CUDA_VISIBLE_DEVICES=0,1
ExecStart=/opt/venv/bin/python -m sglang.launch_server --model-path /models/qwen3-8b \\
    --speculative-algorithm DFLASH --speculative-draft-model-path /models/qwen3-8b-dflash \\
    --speculative-num-draft-tokens 16 --tp 2 \\
    --host 0.0.0.0 --port 30000
Restart=on-failure

[Install]
WantedBy=multi-user.target
"""
REWRITTEN_EXEC = """/opt/venv/bin/python -m sglang.launch_server --model-path /models/qwen3-8b \\
    --speculative-algorithm DDTREE --speculative-draft-model-path /models/qwen3-8b-dflash \\
    --speculative-num-draft-tokens 8 --tp 2 \\
    --host 0.0.0.0 --port 30000 --speculative-draft-window-size 2048 --speculative-ddtree-budget 8 \
--speculative-ddtree-topk 4"""


class FakeHost:
    """A host reached over ssh: unit files, systemd's loaded copy, a journal, the unit's state."""

    def __init__(self, files: dict[str, str], unit: str = "sglang.service", ssh_host: str = "gpu1",
                 personality: str = "ddtree") -> None:
        self.ssh_host = ssh_host
        self.personality = personality  # which server's init lines a restart logs (ddtree.service.fake)
        self.files = dict(files)
        self.loaded = dict(files)  # what systemd uses until daemon-reload
        self.unit = unit
        self.journal = ["old start: Initialized DDTree worker. block_size=8, tree_budget=8, topk=4, "
                        "draft_window_size=2048, compact_cache=True"]
        self.state = "active"
        self.print_init_line = True
        self.main_exit = "ExecMainCode=0\nExecMainStatus=0\n"  # systemctl show's, for a dead unit
        self.commands: list[list[str]] = []

    def __call__(self, argv: list[str], stdin: str | None) -> CommandResult:
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", self.ssh_host], argv
        cmd = shlex.split(argv[4])
        if cmd[:2] == ["sudo", "-n"]:
            cmd = cmd[2:]
        if cmd in (["id", "-u"], ["true"]):  # the backend's privilege probe: a user with sudo
            return CommandResult(0, "1000\n" if cmd[0] == "id" else "")
        self.commands.append(cmd)
        match cmd:
            case ["systemctl", "cat", unit]:
                assert unit == self.unit
                return CommandResult(0, "\n".join(f"# {p}\n{t}" for p, t in self.files.items()))
            case ["cat", path]:
                return CommandResult(0, self.files[path])
            case ["sh", "-c", script]:
                path = shlex.split(re.search(r'mv "\$tmp" (.+)$', script).group(1))[0]  # type: ignore[union-attr]
                self.files[path] = stdin or ""
                return CommandResult(0, "")
            case ["systemctl", "daemon-reload"]:
                self.loaded = dict(self.files)
                return CommandResult(0, "")
            case ["journalctl", "-u", _, "-n", "0", "--show-cursor", "--no-pager"]:
                return CommandResult(0, f"-- cursor: s=abc;i={len(self.journal)}\n")
            case ["systemctl", "restart", _]:
                self._restart()
                return CommandResult(0 if self.state == "active" else 1, "")
            case ["systemctl", "is-active", _]:
                return CommandResult(0 if self.state == "active" else 3, self.state + "\n")
            case ["systemctl", "show", _, "-p", "ExecMainCode", "-p", "ExecMainStatus"]:
                return CommandResult(0, self.main_exit)
            case ["journalctl", "-u", _, "--no-pager", "-o", "short-iso", *rest]:
                start = int(rest[1].split("i=")[1]) if rest[:1] == ["--after-cursor"] else 0
                return CommandResult(0, "".join(line + "\n" for line in self.journal[start:]))
        raise AssertionError(f"unexpected command {cmd}")

    def _restart(self) -> None:
        text = list(self.loaded.values())[-1]
        exec_line = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", text, re.M).group(1)  # type: ignore[union-attr]
        flags = flag_values(exec_line)
        args = argparse.Namespace(
            speculative_algorithm=flags.get("--speculative-algorithm") or "NONE",
            speculative_num_draft_tokens=int(flags.get("--speculative-num-draft-tokens") or 8),
            speculative_draft_window_size=int(flags.get("--speculative-draft-window-size") or 0),
            speculative_ddtree_budget=int(flags.get("--speculative-ddtree-budget") or 8),
            speculative_ddtree_topk=int(flags.get("--speculative-ddtree-topk") or environment(text).get(
                "SGLANG_DDTREE_MAX_TOPK") or 4))
        if self.personality != "ddtree":  # SGLang: an unset window is None
            args.speculative_draft_window_size = args.speculative_draft_window_size or None
        self.journal.append("Stopped sglang.service.")
        if self.print_init_line:
            self.journal += [f"gpu1 python[123]: {line}" for line in init_lines(args, self.personality)]
        self.journal.append("gpu1 python[123]: The server is fired up and ready to roll!")


def _backend(host: FakeHost) -> SystemdBackend:
    return SystemdBackend("gpu1", "sglang.service", runner=host, query_server_info=False)


# -- ExecStart text ------------------------------------------------------------------------------
def test_rewrite_replaces_adds_and_keeps_every_other_byte() -> None:
    rewritten = rewrite_unit(UNIT, DEFAULT)
    head, tail = UNIT.split("ExecStart=")[0], UNIT.split("--port 30000")[1]
    assert rewritten == head + "ExecStart=" + REWRITTEN_EXEC + tail


def test_rewrite_is_idempotent_and_round_trips_through_the_flags() -> None:
    once = rewrite_unit(UNIT, DEFAULT)
    assert rewrite_unit(once, DEFAULT) == once
    assert knobs_from_unit(once) == {"algorithm": "DDTREE", "block_size": "8", "draft_window": "2048",
                                     "budget": "8", "topk": "4"}


def test_inline_values_and_the_block_size_alias_are_rewritten() -> None:
    value = "/usr/bin/x --speculative-algorithm=DDTREE --speculative-dflash-block-size=16 --tp 8"
    spec = SpecConfig(budget=12, topk=3, block_size=4, draft_window=None)
    assert rewrite_exec_start(value, spec) == (
        "/usr/bin/x --speculative-algorithm=DDTREE --speculative-dflash-block-size=4 --tp 8"
        " --speculative-num-draft-tokens 4 --speculative-draft-window-size 0"
        " --speculative-ddtree-budget 12 --speculative-ddtree-topk 3")


@pytest.mark.parametrize(("spec", "expected"), [
    pytest.param(SpecConfig(Algorithm.DFLASH), "x --speculative-algorithm DFLASH --speculative-num-draft-tokens 8 "
                 "--speculative-draft-window-size 2048 --speculative-draft-model-path /d --port 1",
                 id="to-dflash-drops-tree-flags"),
    pytest.param(SpecConfig(Algorithm.NONE), "x --speculative-algorithm NONE "
                 "--speculative-draft-model-path /d --port 1", id="to-ar-drops-all-but-the-draft-path"),
])
def test_flags_the_spec_does_not_use_are_removed(spec: SpecConfig, expected: str) -> None:
    value = ("x --speculative-algorithm DDTREE --speculative-num-draft-tokens 8 "
             "--speculative-draft-window-size 2048 --speculative-ddtree-budget 8 "
             "--speculative-draft-model-path /d --speculative-ddtree-topk 4 --port 1")
    assert rewrite_exec_start(value, spec) == expected


def test_the_effective_drop_in_is_rewritten_not_the_reset_line() -> None:
    drop_in = ("[Service]\nExecStart=\n"
               "ExecStart=/bin/srv --speculative-draft-model-path /d --speculative-ddtree-topk 2\n")
    rewritten = rewrite_unit(drop_in, DEFAULT)
    assert rewritten.startswith("[Service]\nExecStart=\nExecStart=/bin/srv --speculative-draft-model-path /d "
                                "--speculative-ddtree-topk 4 --speculative-algorithm DDTREE")


def test_speculation_without_a_draft_model_is_refused_before_any_change() -> None:
    host = FakeHost({UNIT_PATH: UNIT.replace("--speculative-draft-model-path /models/qwen3-8b-dflash ", "")})
    with pytest.raises(ConfigError, match="no --speculative-draft-model-path"):
        _backend(host).start(DEFAULT)
    assert [c[0:2] for c in host.commands] == [["systemctl", "cat"], ["cat", UNIT_PATH]]


# -- the backend against the simulated host ----------------------------------------------------------
def test_start_issues_cat_write_reload_cursor_restart_in_order() -> None:
    host = FakeHost({UNIT_PATH: UNIT})
    deployment = _backend(host).start(DEFAULT)
    assert host.commands[0] == ["systemctl", "cat", "sglang.service"]
    assert host.commands[1] == ["cat", UNIT_PATH]
    assert host.commands[2][:2] == ["sh", "-c"] and host.commands[2][2].endswith(f'mv "$tmp" {UNIT_PATH}')
    assert host.commands[3:] == [
        ["systemctl", "daemon-reload"],
        ["journalctl", "-u", "sglang.service", "-n", "0", "--show-cursor", "--no-pager"],
        ["systemctl", "restart", "sglang.service"],
    ]
    assert host.files[UNIT_PATH] == rewrite_unit(UNIT, DEFAULT)
    assert deployment.marker == "s=abc;i=1" and deployment.spec == DEFAULT


def test_unchanged_unit_is_restarted_without_a_write() -> None:
    host = FakeHost({UNIT_PATH: rewrite_unit(UNIT, DEFAULT)})
    _backend(host).start(DEFAULT)
    assert [c[1] for c in host.commands] == ["cat", UNIT_PATH, "-u", "restart"]


def test_verify_reads_the_unit_and_only_this_restarts_journal() -> None:
    host = FakeHost({UNIT_PATH: UNIT})
    backend = _backend(host)
    spec = SpecConfig(budget=32, topk=8)
    backend.start(spec)
    report = verify(backend, spec, generate=False)
    assert report.ok and report.settings_ok and report.log_ok, report.lines()
    assert report.details["settings_source"] == "unit file"
    assert "tree_budget=32" in report.details["init_line"]


def test_older_journal_line_does_not_pass_verification() -> None:
    host = FakeHost({UNIT_PATH: UNIT})
    host.print_init_line = False  # this restart logs no init line; the journal holds an older one
    backend = _backend(host)
    backend.start(DEFAULT)
    assert "Initialized DDTree worker" in "\n".join(host.journal)
    report = verify(backend, DEFAULT, generate=False)
    assert report.settings_ok and report.log_ok is False


def test_failed_unit_is_dead_with_a_reason_and_restart_failure_carries_the_journal() -> None:
    host = FakeHost({UNIT_PATH: UNIT})
    backend = _backend(host)
    host.state = "failed"
    assert backend.is_alive() == (False, "systemctl is-active sglang.service: failed")
    host.main_exit = "ExecMainCode=2\nExecMainStatus=9\n"  # CLD_KILLED by signal 9
    assert backend.is_alive() == (False, "systemctl is-active sglang.service: failed (main process killed by SIGKILL)")
    host.main_exit = "ExecMainCode=1\nExecMainStatus=3\n"
    assert backend.is_alive()[1].endswith("(main process exited with code 3)")
    with pytest.raises(ServiceStartError, match="systemctl restart sglang.service exited with 1") as info:
        backend.start(DEFAULT)
    assert "The server is fired up" in info.value.log_tail


def test_base_url_comes_from_the_unit_and_the_ssh_host() -> None:
    host = FakeHost({UNIT_PATH: UNIT}, ssh_host="admin@gpu1")
    backend = SystemdBackend("admin@gpu1", "sglang.service", runner=host)
    assert backend.base_url == "http://gpu1:30000"


# -- dialects: flags and Environment= lines ------------------------------------------------------------
FORK = load_dialect("sglang-ddtree")


def test_the_fork_gets_top_k_as_an_environment_line_and_loses_it_for_a_chain() -> None:
    tree = SpecConfig(budget=12, topk=3)
    once = rewrite_unit(UNIT, tree, dialect=FORK)
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1\n" in once  # other variables keep every byte
    assert "Environment=SGLANG_DDTREE_MAX_TOPK=3\nExecStart=" in once
    assert "--speculative-ddtree-topk" not in once and "--speculative-ddtree-budget 12" in once
    assert knobs_from_unit(once, FORK) == {"algorithm": "DDTREE", "block_size": "8", "draft_window": "2048",
                                           "budget": "12", "topk": "3"}
    assert rewrite_unit(once, tree, dialect=FORK) == once
    chain = rewrite_unit(once, SpecConfig(Algorithm.DFLASH, draft_window=None), dialect=FORK)
    assert "SGLANG_DDTREE_MAX_TOPK" not in chain and "--speculative-ddtree-budget" not in chain
    assert "--speculative-draft-window-size" not in chain  # SGLang: no flag = no window
    assert knobs_from_unit(chain, FORK) == {"algorithm": "DFLASH", "block_size": "8", "draft_window": None}


def test_a_shared_environment_line_keeps_its_other_assignments() -> None:
    unit = UNIT.replace("Environment=CUDA_VISIBLE_DEVICES=0,1",
                        'Environment=A=1 SGLANG_DDTREE_MAX_TOPK=9 "B=x y"')
    rewritten = rewrite_unit(unit, SpecConfig(budget=8, topk=2), dialect=FORK)
    assert 'Environment=A=1 "B=x y"\n' in rewritten
    assert environment(rewritten) == {"A": "1", "B": "x y", "SGLANG_DDTREE_MAX_TOPK": "2"}


def test_a_knob_the_dialect_cannot_set_is_refused_before_any_change() -> None:
    host = FakeHost({UNIT_PATH: UNIT})
    backend = SystemdBackend("gpu1", "sglang.service", runner=host, query_server_info=False,
                             dialect=load_dialect("sglang-dflash"))
    with pytest.raises(ConfigError, match="knob algorithm DDTREE: dialect sglang-dflash does not support it"):
        backend.start(DEFAULT)
    assert [c[0] for c in host.commands] == ["systemctl", "cat"]


def test_the_fork_on_a_host_deploys_and_verifies_from_unit_and_journal() -> None:
    host = FakeHost({UNIT_PATH: UNIT}, personality="sglang-ddtree")
    backend = SystemdBackend("gpu1", "sglang.service", runner=host, query_server_info=False, dialect=FORK)
    spec = SpecConfig(budget=12, topk=3)
    backend.start(spec)
    report = verify(backend, spec, generate=False)
    assert report.ok, report.lines()
    assert report.details["settings"]["topk"] == {"key": "environment variable SGLANG_DDTREE_MAX_TOPK",
                                                  "expected": 3, "reported": 3, "ok": True}
    assert "Initialized DDTree worker. block_size=8, tree_budget=12, max_tree_nodes=13" in report.details["init_line"]
    assert not verify(backend, SpecConfig(budget=12, topk=4), generate=False).settings_ok
