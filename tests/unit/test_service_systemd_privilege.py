"""SystemdBackend's privilege probe and ssh config against a simulated host: root runs systemctl and
journalctl without sudo, a user with passwordless sudo gets `sudo -n`, anyone else a clear error
before the unit is touched. (The real host is in tests/systemd.)"""

from __future__ import annotations

import shlex

import pytest

from ddtree.config import SpecConfig
from ddtree.errors import ServiceError
from ddtree.service.systemd import CommandResult, SystemdBackend

UNIT_PATH = "/etc/systemd/system/ddtree.service"
UNIT = ("[Service]\nExecStart=/usr/bin/python -m ddtree.server --model-path /m "
        "--speculative-draft-model-path /d --speculative-algorithm DFLASH --port 30000\n")


class Host:
    """Answers the backend's commands; `uid` and `sudo` ("ok", "missing", "password") set who we are."""

    def __init__(self, uid: int, sudo: str = "ok") -> None:
        self.uid, self.sudo = uid, sudo
        self.argvs: list[list[str]] = []
        self.remote: list[str] = []  # the remote command lines, as sent

    def __call__(self, argv: list[str], stdin: str | None) -> CommandResult:
        self.argvs.append(argv)
        line = argv[-1]
        self.remote.append(line)
        cmd = shlex.split(line)
        if cmd[:2] == ["sudo", "-n"]:
            if self.sudo == "missing":
                return CommandResult(127, "", "sh: 1: sudo: not found\n")
            if self.sudo == "password":
                return CommandResult(1, "", "sudo: a password is required\n")
            cmd = cmd[2:]
        elif cmd[:1] in (["systemctl"], ["journalctl"]) and cmd[1] not in ("cat", "is-active") and self.uid:
            return CommandResult(1, "", "Access denied\n")  # root's commands, run as a user
        match cmd:
            case ["id", "-u"]:
                return CommandResult(0, f"{self.uid}\n")
            case ["true"]:
                return CommandResult(0, "")
            case ["systemctl", "cat", _]:
                return CommandResult(0, f"# {UNIT_PATH}\n{UNIT}")
            case ["cat", _]:
                return CommandResult(0, UNIT)
            case ["journalctl", *_]:
                return CommandResult(0, "-- cursor: s=1;i=1\n")
            case ["sh", "-c", _] | ["systemctl", _, _] | ["systemctl", "daemon-reload"]:
                return CommandResult(0, "")
        raise AssertionError(f"unexpected command {cmd}")


def backend(host: Host, **kwargs: object) -> SystemdBackend:
    return SystemdBackend("admin@gpu1", "ddtree.service", runner=host, query_server_info=False,
                          **kwargs)  # type: ignore[arg-type]


def test_root_runs_everything_without_sudo() -> None:
    host = Host(uid=0)
    backend(host).start(SpecConfig())
    assert host.remote.count("id -u") == 1  # probed once, before the first root command
    assert host.remote.index("id -u") < min(i for i, line in enumerate(host.remote) if line.startswith("sh -c"))
    assert not [line for line in host.remote if "sudo" in line], host.remote
    assert "systemctl restart ddtree.service" in host.remote


def test_a_user_with_passwordless_sudo_gets_sudo_n_for_root_commands_only() -> None:
    host = Host(uid=1000)
    backend(host).start(SpecConfig())
    assert "sudo -n true" in host.remote
    assert "sudo -n systemctl daemon-reload" in host.remote
    assert "sudo -n systemctl restart ddtree.service" in host.remote
    assert "systemctl cat ddtree.service" in host.remote  # reading needs no root
    write = next(line for line in host.remote if line.startswith("sh -c"))
    assert "sudo -n chown" in write and "sudo -n mv" in write


@pytest.mark.parametrize(("sudo", "why"), [
    ("missing", "is not root and sudo is not installed there"),
    ("password", "is not root and `sudo -n true` failed: sudo: a password is required"),
])
def test_a_user_without_usable_sudo_gets_a_clear_error_before_the_unit_changes(sudo: str, why: str) -> None:
    host = Host(uid=1000, sudo=sudo)
    with pytest.raises(ServiceError) as info:
        backend(host).start(SpecConfig())
    message = str(info.value)
    assert f"systemd ddtree.service on admin@gpu1: the ssh user (uid 1000) {why}" in message
    assert "connect as root (--ssh-host root@HOST)" in message and "NOPASSWD" in message
    assert not [line for line in host.remote if line.startswith(("sh -c", "systemctl daemon-reload",
                                                                 "systemctl restart"))], host.remote


def test_forced_sudo_setting_skips_the_probe_and_ssh_config_is_passed_with_f() -> None:
    host = Host(uid=1000)
    backend(host, sudo=True, ssh_config="/home/me/.ssh/gpu.conf").start(SpecConfig())
    assert "id -u" not in host.remote
    assert all(argv[:5] == ["ssh", "-o", "BatchMode=yes", "-F", "/home/me/.ssh/gpu.conf"] for argv in host.argvs)
    host = Host(uid=0)
    backend(host, sudo=False).start(SpecConfig())
    assert "id -u" not in host.remote and host.argvs[0][:4] == ["ssh", "-o", "BatchMode=yes", "admin@gpu1"]
