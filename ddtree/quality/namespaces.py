"""The kernel boundary of the program checker: bubblewrap starts the interpreter in new user, mount,
PID, network, IPC and UTS namespaces (and a cgroup namespace where the kernel has one).

Why bubblewrap (`bwrap`, Debian's package bubblewrap). It is built for exactly this, running an
untrusted process as an ordinary user through unprivileged user namespaces, and it is small and
widely used (Flatpak's sandbox). It sets up the whole view in one exec: a tmpfs root it pivots into,
read-only binds, a fresh /proc for the new PID namespace, a minimal /dev, size-capped tmpfs folders,
a file copied in from a descriptor, every capability dropped, no nested user namespaces, and
SIGKILL for the sandbox when its parent dies. util-linux `unshare` only creates the namespaces; the
mounts and pivot_root would be a script of our own inside them. Direct syscalls (ctypes around
unshare/mount/pivot_root) would be that script again, in Python, with its own bugs. bwrap also
behaves the same as root and as an ordinary user once --unshare-user is given (as root it would
otherwise keep root's capabilities), so one command line serves both.

What the program sees: the system folders (/usr and the /bin, /lib... links or folders) and the
dynamic linker's cache, read-only; the interpreter's own installation, read-only, at its own path
(for pyenv that path lies under a home folder, and only that folder is shown); an empty, writable
/sandbox holding program.py (its working directory), /tmp and /dev/shm, each a tmpfs of
TMPFS_BYTES; /proc of its own PID namespace; /dev with null, zero, full, random, urandom, tty. It
runs as uid/gid 65534 with no capabilities, in a network namespace with only a loopback interface
on which nothing listens, so no host, no listener on this machine and no abstract or filesystem
socket is reachable. $HOME, /root, /home, /etc (but for the linker cache), /run, /var, the
project checkout and the results folder are simply not there.

The interpreter is the base installation of the running Python, not its venv (a venv usually lives
in the project checkout): programs get the standard library and that installation's
site-packages. DDTREE_SANDBOX_PYTHON names another one, e.g. when the base is in a folder the user
cannot read.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ddtree.errors import SandboxUnavailable

__all__ = ["PYTHON_ENV", "WORKDIR", "Namespaces", "end_namespace", "namespaces", "read_status", "sandbox_python"]

BWRAP = "bwrap"
PYTHON_ENV = "DDTREE_SANDBOX_PYTHON"
WORKDIR = "/sandbox"
PROGRAM_NAME = "program.py"
SANDBOX_ID = 65534  # uid and gid inside: nobody
TMPFS_BYTES = 64 << 20  # each writable folder is memory, so it is capped
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)  # without it the linker can miss multiarch library folders
PROBE_TIMEOUT_S = 30.0
KILL_WAIT_S = 5.0
REPO_DIR = Path(__file__).resolve().parents[2]

ENABLE_HINT = (
    "Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) and allow "
    "unprivileged user namespaces: sysctl -w user.max_user_namespaces=15000 where it is 0; "
    "sysctl -w kernel.unprivileged_userns_clone=1 on kernels that have that switch; "
    "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10 and later; in a container, "
    "start it with user namespaces allowed (docker: --security-opt seccomp=unconfined --security-opt apparmor=unconfined)."
)
UNSAFE_HINT = (
    "Or accept best-effort isolation, under which model code can read your files, reach your network and "
    "signal your processes: check_program(..., unsafe_exec=True), in the suite pytest --unsafe-exec."
)


@dataclass(frozen=True)
class Namespaces:
    """A bubblewrap command line that was seen to work for this interpreter and this user."""

    bwrap: str
    python: str
    mounts: tuple[str, ...]

    def command(self, program_fd: int | None = None, status_fd: int | None = None) -> list[str]:
        """bwrap's arguments up to and including the interpreter; the caller appends the interpreter's.
        program_fd: copied into WORKDIR/program.py; status_fd: bwrap's JSON status lines (read_status)."""
        size = str(TMPFS_BYTES)
        argv = [
            self.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try",
            "--disable-userns",  # no nested user namespace, so no capability anywhere inside
            "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--hostname", "sandbox",
            "--cap-drop", "ALL",  # bwrap started by root would otherwise keep them
            "--die-with-parent",  # SIGKILL the sandbox's init when bwrap or its parent dies
            "--new-session",  # no controlling terminal to push input into
            *self.mounts,
            "--proc", "/proc", "--dev", "/dev",
            "--size", size, "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",  # the /dev tmpfs itself has no size cap
            "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", WORKDIR,
        ]
        if program_fd is not None:
            argv += ["--file", str(program_fd), f"{WORKDIR}/{PROGRAM_NAME}"]
        argv += ["--remount-ro", "/", "--chdir", WORKDIR]
        if status_fd is not None:
            argv += ["--json-status-fd", str(status_fd)]
        return argv + ["--", self.python]


def sandbox_python() -> str:
    """The interpreter programs run with: $DDTREE_SANDBOX_PYTHON, else the running Python's base
    installation (not its venv), symlinks resolved."""
    chosen = os.environ.get(PYTHON_ENV)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    path = chosen or os.path.join(sys.base_exec_prefix, "bin", version)
    real = os.path.realpath(path)
    if not os.path.isabs(path) or not os.path.isfile(real) or not os.access(real, os.X_OK):
        where = f"${PYTHON_ENV}" if chosen else "the running Python's base installation"
        raise SandboxUnavailable(
            f"the sandbox's interpreter {path} (from {where}) is not an executable file for uid {os.getuid()}; "
            f"set {PYTHON_ENV} to the absolute path of a Python 3 this user can run, e.g. /usr/bin/python3"
        )
    return real


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _mounts(python: str) -> tuple[str, ...]:
    """Read-only system folders (links stay links) and the interpreter's installation folder."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        if os.path.isfile(path):
            args += ["--ro-bind", path, path]
    prefix = os.path.dirname(os.path.dirname(python))  # <prefix>/bin/pythonX.Y
    if any(_is_within(python, os.path.realpath(d)) for d in SYSTEM_DIRS if os.path.isdir(d)):
        return tuple(args)
    guarded = {"your home folder": str(Path.home()), "the working folder": os.getcwd(), "the project checkout": str(REPO_DIR)}
    for what, folder in guarded.items():
        if _is_within(os.path.realpath(folder), prefix):
            raise SandboxUnavailable(
                f"the sandbox's interpreter {python} lives in {prefix}, which holds {what} ({folder}); showing it "
                f"to the program would show that too. Set {PYTHON_ENV} to a Python 3 installed in its own folder "
                f"(e.g. /usr/bin/python3)"
            )
    return (*args, "--ro-bind", prefix, prefix)


def namespaces() -> Namespaces:
    """The bubblewrap launcher for this user and interpreter, checked once per process by running
    the interpreter through it; raises SandboxUnavailable, saying how to enable it, when it cannot run."""
    bwrap = shutil.which(BWRAP)
    if bwrap is None:
        raise SandboxUnavailable(
            f"cannot run model-written code in namespaces: bubblewrap ({BWRAP}) is not on PATH. {ENABLE_HINT} {UNSAFE_HINT}"
        )
    python = sandbox_python()
    launcher = Namespaces(bwrap, python, _mounts(python))
    problem = _probe(launcher, os.getuid())
    if problem:
        raise SandboxUnavailable(f"cannot run model-written code in namespaces: {problem}. {ENABLE_HINT} {UNSAFE_HINT}")
    return launcher


@lru_cache(maxsize=8)
def _probe(launcher: Namespaces, uid: int) -> str:
    """'' when a trivial program runs through the launcher, else what went wrong (uid: part of the cache key)."""
    with tempfile.TemporaryFile() as program:
        program.write(b"pass\n")
        program.flush()
        program.seek(0)
        argv = launcher.command(program.fileno()) + ["-I", "-c", "import os; print(sorted(os.listdir()))"]
        try:
            done = subprocess.run(argv, pass_fds=(program.fileno(),), capture_output=True, text=True,
                                  env={}, cwd="/", timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{launcher.bwrap} did not run ({err})"
    if done.returncode == 0 and done.stdout.strip() == repr([PROGRAM_NAME]):
        return ""
    said = (done.stderr.strip() or done.stdout.strip() or "no output")[-600:]
    return f"{launcher.bwrap} exited with status {done.returncode} running {launcher.python} ({said})"


def read_status(fd: int) -> dict[str, Any]:
    """What bwrap has written to its --json-status-fd so far, merged: child-pid and pid-namespace
    once the sandbox's init exists, exit-code once the command it started has exited (absent when
    the setup or the exec failed). fd is set non-blocking, so this returns at once while bwrap runs."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    status: dict[str, Any] = {}
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            status.update(record)
    return status


def end_namespace(status: dict[str, Any]) -> None:
    """SIGKILL the sandbox's init and wait until it has exited: the kernel kills every other process
    of a PID namespace when its init dies, and init's exit completes only after they are gone.
    Nothing to do when init has already exited (the program's end ends it)."""
    pid, namespace = status.get("child-pid"), status.get("pid-namespace")
    if not isinstance(pid, int) or not isinstance(namespace, int):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # already exited and reaped
    try:
        try:
            same = os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace
        except OSError:
            same = False
        if not same:
            return  # the pid was reused by an unrelated process: init is gone
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], KILL_WAIT_S)
    finally:
        os.close(pidfd)
