"""The systemd backend against a real systemd: a sweep over ssh reconfigures, restarts and restores a unit.

systemd boots as PID 1 of its own namespaces (host.py): sshd on 127.0.0.1 of its network
namespace with a key made here, and a unit whose ExecStart runs our server on the fixture pair.
A real sweep (`pytest -m perf --service systemd --ssh-host ...`, in a subprocess on that loopback)
then edits ExecStart over ssh, daemon-reloads, restarts, reads the journal since each restart,
restores the default and verifies it, as root and so without sudo. A user who is not root and
has no sudo gets the backend's clear error and leaves the unit as it was. Afterwards nothing of
the booted system is left: no process, no cgroup, and the machine's /tmp, /var/tmp and /etc as
they were (canary files, an old one among them, since systemd-tmpfiles ages files out).

Runs where we are root and systemd, util-linux and openssh-server are installed (.ci/run installs
openssh-server); skipped with the reason elsewhere, failed instead in CI (CI=true).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from ddtree.config import SpecConfig
from tests.systemd.host import (
    SystemdHost,
    cgroup2_mount,
    default_ro_paths,
    find_tool,
    missing_prerequisites,
    remove_cgroup_tree,
    running_in_namespace,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
UNIT = "ddtree-server.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
PORT = 30000
DEFAULT = {"algorithm": "DDTREE", "budget": 8, "topk": 4, "draft_window": 2048, "block_size": 8}
GRID = {  # two configs (the default is one: two restarts and the restore), one cell each
    "default": DEFAULT,
    "configs": [DEFAULT, {"budget": 4}],
    "client": {"contexts": [16], "concurrency": [1], "max_new_tokens": 8,
               "requests_per_cell": 2, "repeats": 1, "warmup_requests": 0},
}
SWEEP_TIMEOUT_S = 600
TMPFILES = ("systemd-tmpfiles-setup.service", "systemd-tmpfiles-clean.timer", "systemd-tmpfiles-clean.service")


@pytest.fixture(scope="module")
def prerequisites() -> None:
    missing = missing_prerequisites()
    if missing:
        reason = ("a booted systemd host needs: " + "; ".join(missing) + ". To run it: as root on a machine with "
                  "systemd and util-linux, `apt-get install openssh-server` (as .ci/run does)")
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI runs this test; .ci/run installs openssh-server)", pytrace=False)
        pytest.skip(reason)


def server_unit() -> str:
    """Our server on the fixture pair, started with the grid's default; the sweep rewrites it."""
    spec = SpecConfig(**DEFAULT)  # type: ignore[arg-type]
    fixtures = REPO / "fixtures" / "models"
    argv = [sys.executable, "-m", "ddtree.server", "--model-path", str(fixtures / "target"),
            "--speculative-draft-model-path", str(fixtures / "drafter"), *spec.server_args(),
            "--host", "127.0.0.1", "--port", str(PORT), "--device", "cpu"]
    return ("[Unit]\nDescription=ddtree server on the fixture pair (the sweep reconfigures it)\n"
            "DefaultDependencies=no\n\n"
            f"[Service]\nWorkingDirectory={REPO}\n"
            "Environment=HOME=/root PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1\n"
            f"ExecStart={shlex.join(argv)}\n")


def plant_canaries(tag: str) -> dict[Path, str]:
    """Files in the machine's /tmp and /var/tmp, one of them 60 days old (what tmpfiles removes)."""
    canaries: dict[Path, str] = {}
    for base in (Path("/tmp"), Path("/var/tmp")):
        for age_days in (0, 60):
            path = base / f"ddtree-systemd-canary-{tag}-{age_days}d"
            text = f"{tag} {age_days}\n"
            path.write_text(text)
            if age_days:
                old = time.time() - age_days * 86400
                os.utime(path, (old, old))
            canaries[path] = text
    return canaries


def tree_digest(root: Path) -> str:
    """Names, link targets and contents of every file under `root` (a change anywhere shows)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path).encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def sweep(host: SystemdHost, tmp: Path, ssh_host: str, results: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "perf", "tests/perf/test_sweep.py",
            "--config-grid", str(tmp / "grid.yaml"), "--results-dir", str(results),
            "--service", "systemd", "--ssh-host", ssh_host, "--ssh-config", str(host.ssh_config),
            "--systemd-unit", UNIT, "--service-url", f"http://127.0.0.1:{PORT}", "--device", "cpu",
            "--startup-timeout", "300"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DDTREE_"))}
    return subprocess.run(host.in_net(argv), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SWEEP_TIMEOUT_S)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-3000:]}"


def test_a_sweep_reconfigures_restarts_and_restores_a_real_systemd_unit(
        prerequisites: None, tmp_path: Path) -> None:
    canaries = plant_canaries(f"{os.getpid()}-{uuid.uuid4().hex[:12]}")  # unique: runs may overlap
    etc_before = {d: tree_digest(d) for d in (Path("/etc/systemd"), Path("/etc/ssh"))}
    hostname = socket.gethostname()
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(GRID))
    host = SystemdHost(tmp_path / "host", units={UNIT: server_unit()}, ro_paths=default_ro_paths(REPO))
    try:
        with host:
            original = host.inside(["cat", UNIT_PATH]).stdout
            # The booted system has its own /tmp and /var/tmp (no canary there), and tmpfiles cannot run.
            seen = host.inside(["sh", "-c", 'for p; do [ ! -e "$p" ] || echo "$p"; done', "-", *map(str, canaries)])
            assert seen.stdout.split() == []
            assert host.inside(["stat", "-f", "-c", "%T", "/tmp", "/var/tmp"]).stdout.split() == ["tmpfs", "tmpfs"]
            masked = host.inside(["systemctl", "show", "-p", "LoadState", "--value", *TMPFILES]).stdout.split()
            assert masked == ["masked"] * len(TMPFILES)
            assert host.ssh(["id", "-u"]).stdout.strip() == "0"
            running = host.inside(["systemctl", "list-units", "--type=service", "--state=running", "--no-legend",
                                   "--plain"]).stdout.split("\n")
            assert sorted(line.split()[0] for line in running if line.strip()) == [
                "ddtree-sshd.service", "systemd-journald.service"]
            # Its cgroups live under the one child cgroup made for it (its cgroup namespace's root).
            assert host.cgroup is not None and host.pid is not None
            mine = Path(f"/proc/{host.pid}/cgroup").read_text().split("0::", 1)[1].split()[0]
            assert (cgroup2_mount() / mine.lstrip("/")).is_relative_to(host.cgroup), (mine, host.cgroup)

            result = sweep(host, tmp_path, host.ssh_alias, tmp_path / "results")
            assert result.returncode == 0, output(result)
            cells = sorted(p.name for p in (tmp_path / "results").rglob("*.json") if "ctx16" in p.name)
            assert len(cells) == 2, (cells, output(result))

            restore = json.loads((tmp_path / "results" / "restore.json").read_text())
            assert restore["ok"] and restore["deploy_order"] == ["b8-k4-w2048-bs8", "b4-k4-w2048-bs8"], restore
            init_check = next(line for line in restore["checks"] if line.startswith("init log line of this start"))
            assert ": ok [" in init_check and "tree_budget=8" in init_check, restore["checks"]

            # ExecStart was edited for b4 and put back byte for byte; systemd loaded the restored file.
            assert host.inside(["cat", UNIT_PATH]).stdout == original
            shown = host.inside(["systemctl", "show", UNIT, "-p", "ExecStart", "--value"]).stdout
            assert "--speculative-ddtree-budget 8 " in shown and "budget 4" not in shown
            assert host.inside(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
            journal = host.inside(["journalctl", "-u", UNIT, "--no-pager", "-o", "cat"]).stdout
            starts = re.findall(r"Initialized DDTree worker\. .*tree_budget=(\d+)", journal)
            assert starts[-2:] == ["4", "8"] and starts.count("4") == 1, journal[-3000:]  # b4, then the restore
            info = subprocess.run(host.in_net([sys.executable, "-c", (
                "import httpx, json; print(json.dumps(httpx.get('http://127.0.0.1:%d/server_info', timeout=10)"
                ".json()))" % PORT)]), capture_output=True, text=True, timeout=60, check=True)
            served = json.loads(info.stdout)
            assert served.get("speculative_ddtree_budget") == 8, served

            # Not root, no sudo: the backend says so and the unit is untouched.
            host.inside(["useradd", "--create-home", "--password", "*", "--shell", "/bin/sh", "ddtree"])
            assert host.ssh(["id", "-u"], user="ddtree").stdout.strip() != "0"
            denied = sweep(host, tmp_path, f"ddtree@{host.ssh_alias}", tmp_path / "results-user")
            assert denied.returncode != 0, output(denied)
            why = "sudo is not installed there" if find_tool("sudo") is None else "`sudo -n true` failed"
            assert f"on ddtree@{host.ssh_alias}: the ssh user (uid" in denied.stdout, output(denied)
            assert f"is not root and {why}" in denied.stdout, output(denied)
            assert host.inside(["cat", UNIT_PATH]).stdout == original
        pid_ns = host.pid_ns
    finally:
        host_tmp_ok = {p: p.exists() and p.read_text() == text for p, text in canaries.items()}
        for path in canaries:
            path.unlink(missing_ok=True)

    # Nothing of the booted system is left, and the machine's /tmp, /var/tmp and /etc are as before.
    assert host_tmp_ok == dict.fromkeys(canaries, True)
    assert pid_ns and running_in_namespace(pid_ns) == []
    assert host.cgroup is not None and not host.cgroup.exists()
    assert list(host.root.iterdir()) == []  # the private root was a tmpfs of the booted system's mounts
    assert {d: tree_digest(d) for d in etc_before} == etc_before
    assert socket.gethostname() == hostname
    assert not [line for line in Path("/etc/passwd").read_text().splitlines() if line.startswith("ddtree:")]


def test_a_killed_test_process_takes_the_booted_system_down(prerequisites: None, tmp_path: Path) -> None:
    """SIGKILL leaves no time to power off: the kernel must end systemd and its namespace at once."""
    boot = ("import json, sys, time; from pathlib import Path; from tests.systemd.host import SystemdHost, "
            "default_ro_paths; host = SystemdHost(Path(sys.argv[1]), ro_paths=default_ro_paths(Path.cwd())); "
            "host.boot(); print(json.dumps([host.pid_ns, str(host.cgroup)]), flush=True); time.sleep(600)")
    with subprocess.Popen([sys.executable, "-c", boot, str(tmp_path / "host")], cwd=REPO,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            pid_ns, cgroup = json.loads(child.stdout.readline())  # type: ignore[union-attr]
            assert running_in_namespace(pid_ns), "the booted system has no process"
        finally:
            child.kill()
    deadline = time.monotonic() + 20
    while running_in_namespace(pid_ns) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_in_namespace(pid_ns) == []
    assert remove_cgroup_tree(Path(cgroup))  # left empty; the next boot would remove it too
