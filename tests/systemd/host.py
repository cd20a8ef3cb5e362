"""A real systemd host for the systemd backend's test: systemd booted as PID 1 of its own namespaces.

    with SystemdHost(workdir, units=...) as host:   # boots, waits for sshd
        host.ssh_config                            # ssh -F this; Host `host.ssh_alias` is root@127.0.0.1
        subprocess.run(host.in_net([...]))         # argv run here, in the booted system's network namespace

The booted system gets new pid, mount, uts, net and cgroup namespaces (util-linux `unshare`) and
a private root built by boot.sh: /usr and the interpreter and repository read-only, /etc and /var
overlays whose writes stay in a tmpfs, and tmpfs /tmp, /var/tmp, /run, /root and /home, so
systemd-tmpfiles (masked anyway) could not reach the machine's shared /tmp. Its cgroups are a
child cgroup of ours, seen as the root through the cgroup namespace. Its default target starts
only journald, an sshd on 127.0.0.1 of its own network namespace, and whatever the test adds; every
other unit of the image and every generator is masked. close() powers it off, kills what is left
by its cgroup and checks that no process of its pid namespace remains.

Written here, not taken from a library: systemd-nspawn (which does this) is not installed on the
machines the tests run on, and nothing on PyPI boots a systemd into namespaces.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BOOT_SH = Path(__file__).with_name("boot.sh")
SYSTEMD = Path("/lib/systemd/systemd")
UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"), Path("/etc/systemd/system"))
GENERATOR_DIRS = (Path("/usr/lib/systemd/system-generators"), Path("/lib/systemd/system-generators"),
                  Path("/usr/lib/systemd/system-environment-generators"))
# The only units of the image the booted system may start: the journal (journalctl is tested).
KEEP_UNITS = {"systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket"}
MASKED_SUFFIXES = (".service", ".socket", ".timer", ".path", ".mount", ".automount", ".swap")
TOOLS = {"unshare": "util-linux", "nsenter": "util-linux", "pivot_root": "util-linux", "mount": "mount",
         "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "useradd": "passwd"}
TARGET = "ddtree-test.target"
CGROUP_PREFIX = "ddtree-systemd-test-"
PR_SET_PDEATHSIG = 1
SSHD_UNIT = "ddtree-sshd.service"


class HostError(RuntimeError):
    """The systemd host could not be booted or torn down."""


def missing_prerequisites() -> list[str]:
    """Why this machine cannot boot the test's systemd host ([] when it can)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("not root (namespaces, mounts and cgroups need root)")
    if not SYSTEMD.exists():
        missing.append(f"{SYSTEMD} is not installed")
    for tool, package in TOOLS.items():
        if find_tool(tool) is None:
            missing.append(f"`{tool}` not found (Debian package {package})")
    if cgroup2_mount() is None:
        missing.append("no cgroup2 hierarchy is mounted")
    return missing


def cgroup2_mount() -> Path | None:
    """Where this machine mounts the cgroup2 (unified) hierarchy."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            return Path(left.split()[4])
    return None


def own_cgroup2_path() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise HostError("/proc/self/cgroup has no cgroup2 (0::) line")


def find_tool(tool: str) -> str | None:
    """`tool` on PATH, else in /usr/sbin (sshd and pivot_root live there; a user's PATH may lack it)."""
    return shutil.which(tool) or (str(Path("/usr/sbin", tool)) if Path("/usr/sbin", tool).exists() else None)


def which(tool: str) -> str:
    found = find_tool(tool)
    if found is None:
        raise HostError(f"`{tool}` not found")
    return found


def ns_id(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def pids_in_namespace(ident: str, kind: str = "pid") -> list[int]:
    """Host pids of every process whose `kind` namespace is `ident` (e.g. 'pid:[4026532]')."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / kind) == ident:
                    found.append(int(entry.name))
            except OSError:  # gone, or a kernel thread
                continue
    return found


def running_in_namespace(ident: str) -> list[int]:
    """pids_in_namespace(ident) without the processes that have exited (zombies)."""
    return [pid for pid in pids_in_namespace(ident) if not is_zombie(pid)]


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True  # gone


def describe(pid: int) -> str:
    """pid, state, parent and command line of a process, for an error message."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"
    return (f"{pid} (inside: {status.get('NSpid', '?').split()[-1]}) {status.get('State', '?')} "
            f"ppid {status.get('PPid', '?')}: {cmdline.strip()[:200]}")


def remove_cgroup_tree(top: Path) -> bool:
    """Kill every process in the cgroup tree `top`, rmdir it bottom-up; True when it is gone."""
    kill = top / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "populated 1" in (top / "cgroup.events").read_text():
        time.sleep(0.1)
    for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        try:
            path.rmdir()
        except OSError:
            pass
    try:
        top.rmdir()
    except OSError:
        pass
    return not top.exists()


def remove_stale_cgroups(parent: Path) -> None:
    """Remove the cgroups a killed earlier run left (their test process is gone)."""
    for path in parent.glob(f"{CGROUP_PREFIX}*"):
        owner = path.name[len(CGROUP_PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            remove_cgroup_tree(path)


class SystemdHost:
    """One booted systemd; see the module docstring."""

    ssh_alias = "ddtree-test"

    def __init__(self, workdir: Path, *, units: dict[str, str] | None = None, ssh_port: int = 2222,
                 ro_paths: list[str] | None = None, boot_timeout_s: float = 60.0) -> None:
        self.workdir = workdir
        self.units = units or {}
        self.ssh_port = ssh_port
        self.ro_paths = sorted(set(ro_paths or []))
        self.boot_timeout_s = boot_timeout_s
        self.root = workdir / "root"
        self.payload = workdir / "payload"
        self.client = workdir / "client"
        self.console_log = workdir / "console.log"
        self.ssh_config = self.client / "ssh_config"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None  # systemd's pid on this machine
        self.pid_ns: str | None = None
        self.cgroup: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> SystemdHost:
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def boot(self) -> None:
        for d in (self.root, self.payload, self.client):
            d.mkdir(parents=True)
        self._write_payload()
        base = cgroup2_mount()
        if base is None:
            raise HostError("no cgroup2 hierarchy is mounted")
        parent = base / own_cgroup2_path().lstrip("/")
        remove_stale_cgroups(parent)
        self.cgroup = parent / f"{CGROUP_PREFIX}{os.getpid()}-{time.time_ns()}"
        self.cgroup.mkdir()
        procs = self.cgroup / "cgroup.procs"

        def in_cgroup_dying_with_us() -> None:  # runs in the child before it execs unshare
            procs.write_text(str(os.getpid()))
            # If this test process dies, unshare gets SIGKILL, and --kill-child passes it to systemd.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        argv = [which("unshare"), "--pid", "--fork", "--mount", "--uts", "--net", "--cgroup",
                "--propagation", "private", "--kill-child=SIGKILL",
                "/bin/sh", str(BOOT_SH), str(self.root), str(self.payload), *self.ro_paths]
        with self.console_log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=in_cgroup_dying_with_us,
                                         start_new_session=True)
        self.pid = self._child_pid()
        self.pid_ns = ns_id(self.pid, "pid")
        deadline = time.monotonic() + self.boot_timeout_s
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HostError(f"the booted system exited with {self.proc.returncode}:\n{self.console_tail()}")
            state = self.inside(["systemctl", "is-active", SSHD_UNIT], check=False).stdout.strip()
            if state == "active" and self.ssh(["true"], check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise HostError(f"{SSHD_UNIT} not reachable after {self.boot_timeout_s:.0f} s (is-active: {state!r}):\n"
                        f"{self.console_tail()}")

    def _child_pid(self) -> int:
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        for _ in range(200):
            try:
                text = children.read_text().split()
            except OSError:
                text = []
            if text:
                return int(text[0])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise HostError(f"unshare started no child:\n{self.console_tail()}")

    def close(self) -> None:
        """Power off, kill what is left, remove the cgroup; raise if anything survived."""
        if self.proc is not None and self.proc.poll() is None:
            if self.pid is not None:
                try:
                    os.kill(self.pid, signal.SIGRTMIN + 4)  # systemd: poweroff (exits in a container)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # PID 1 of a pid namespace dies: the kernel kills the rest (unshare's SIGKILL
                # reaches systemd through --kill-child when its pid is not known yet).
                for pid in (self.pid, self.proc.pid):
                    if pid is None:
                        continue
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait(timeout=30)
        left = self._remove_cgroup()
        survivors = self.running_processes(wait_s=10)  # SIGKILLed ones may take a moment to go
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if survivors or left:
            raise HostError(f"teardown left processes {[describe(p) for p in survivors]} / cgroups {left}")

    def running_processes(self, wait_s: float = 0.0) -> list[int]:
        """Host pids of the booted system's processes that have not exited, after up to `wait_s`.

        Exited ones count as gone: a process that entered by nsenter and was reparented out of
        the namespace can stay a zombie of this machine's init until that init reaps it.
        """
        deadline = time.monotonic() + wait_s
        while True:
            alive = running_in_namespace(self.pid_ns) if self.pid_ns else []
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    def _remove_cgroup(self) -> list[str]:
        """Kill anything still in the cgroup tree and remove it; the paths that remain."""
        if self.cgroup is None or not self.cgroup.exists():
            return []
        return [] if remove_cgroup_tree(self.cgroup) else [str(self.cgroup)]

    # -- running things ----------------------------------------------------------------------------
    def inside(self, argv: list[str], *, check: bool = True, timeout: float = 60,
               stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run argv inside the booted system (all its namespaces, its root)."""
        assert self.pid is not None
        full = [which("nsenter"), "-t", str(self.pid), "-m", "-u", "-n", "-p", "-C", "-r", "-w",
                "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", *argv]
        return subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=timeout, check=check)

    def in_net(self, argv: list[str]) -> list[str]:
        """argv run on this machine but in the booted system's network namespace (its loopback)."""
        assert self.pid is not None
        return [which("nsenter"), f"--net=/proc/{self.pid}/ns/net", *argv]

    def ssh(self, argv: list[str], *, user: str | None = None, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
        host = f"{user}@{self.ssh_alias}" if user else self.ssh_alias
        return subprocess.run(self.in_net(["ssh", "-F", str(self.ssh_config), host, shlex.join(argv)]),
                              capture_output=True, text=True, timeout=timeout, check=check)

    def console_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.console_log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- the image -----------------------------------------------------------------------------------
    def _write_payload(self) -> None:
        etc = self.payload / "etc"
        units, generators = etc / "systemd" / "system", etc / "systemd" / "system-generators"
        units.mkdir(parents=True)
        generators.mkdir(parents=True)
        for d in UNIT_DIRS:  # mask the image's units: nothing but the journal starts
            for f in d.glob("*") if d.is_dir() else []:
                if f.name.endswith(MASKED_SUFFIXES) and f.name not in KEEP_UNITS and not (units / f.name).exists():
                    (units / f.name).symlink_to("/dev/null")
        for d in GENERATOR_DIRS:
            for f in d.glob("*") if d.is_dir() else []:
                if not (generators / f.name).exists():
                    (generators / f.name).symlink_to("/dev/null")
        (units / TARGET).write_text(
            "[Unit]\nDescription=ddtree test host: journald, sshd and the test's units only\n"
            f"Requires={SSHD_UNIT}\nAfter={SSHD_UNIT}\nAllowIsolate=yes\n"
            "Wants=systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket\n"
            "After=systemd-journald.service\n")  # a unit's stdout is only After= the journal
        ssh_dir = etc / "ddtree-test"
        (ssh_dir / "authorized_keys").mkdir(parents=True)
        subprocess.run([which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "ddtree-test-host",
                        "-f", str(ssh_dir / "ssh_host_ed25519_key")], check=True)
        key = self.client / "id_ed25519"
        subprocess.run([which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "ddtree-test-client",
                        "-f", str(key)], check=True)
        public = (self.client / "id_ed25519.pub").read_text()
        for user in ("root", "ddtree"):
            (ssh_dir / "authorized_keys" / user).write_text(public)
        (ssh_dir / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1:{self.ssh_port}\n"
            "HostKey /etc/ddtree-test/ssh_host_ed25519_key\n"
            "AuthorizedKeysFile /etc/ddtree-test/authorized_keys/%u\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nPidFile none\nPrintMotd no\n")
        (units / SSHD_UNIT).write_text(
            f"[Unit]\nDescription=sshd on 127.0.0.1:{self.ssh_port} for the ddtree systemd test\n"
            "DefaultDependencies=no\n\n[Service]\nRuntimeDirectory=sshd\nRuntimeDirectoryMode=0755\n"
            "ExecStart=/usr/sbin/sshd -D -e -f /etc/ddtree-test/sshd_config\n")
        for name, text in self.units.items():
            (units / name).write_text(text)
        host_key = (ssh_dir / "ssh_host_ed25519_key.pub").read_text().split()
        (self.client / "known_hosts").write_text(f"[127.0.0.1]:{self.ssh_port} {host_key[0]} {host_key[1]}\n")
        self.ssh_config.write_text(
            f"Host {self.ssh_alias}\n  HostName 127.0.0.1\n  Port {self.ssh_port}\n  User root\n"
            f"  IdentityFile {key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.client / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
            "  ConnectTimeout 10\n  LogLevel ERROR\n")


def default_ro_paths(repo: Path) -> list[str]:
    """The interpreter's prefixes and the repository: what a unit running our server needs."""
    paths = {str(repo)}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        if not p.startswith("/usr/") and p != "/usr":
            paths.add(p)
    # a path inside another is bound with it
    return sorted(p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths))
