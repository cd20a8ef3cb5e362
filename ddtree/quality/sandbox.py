"""Run one untrusted Python program in a child process and say whether it ran to its end.

`check_program(program)` -> Outcome(status, detail), status one of:

    passed    the program ran to its last line and exited 0
    failed    it raised (an AssertionError from a test, any other exception), exited early
              (sys.exit / os._exit / SystemExit, whatever the status), or was killed for memory
              or output size
    timeout   it hit the wall-clock limit (or the CPU-time limit) and was killed
    error     it could not be run: a SyntaxError, or the runner itself failed

How "ran to its end" is proven. The parent draws a random nonce and hands it to the child over
stdin; a bootstrap (given with `-c`, so nothing on disk) reads it before any user code runs,
points stdin at /dev/null, then executes the program in `__main__`, and only after the last line
returns writes a marker line carrying the nonce to fd 1. The nonce is never in a file, argv or the
environment, so the program cannot copy it from there, and a program that prints a look-alike
marker, or exits with status 0 before its end, does not pass.

Isolation. By default the program runs inside new user, mount, PID, network, IPC and UTS
namespaces made by bubblewrap (ddtree/quality/namespaces.py says why bubblewrap and exactly what the
program sees): the base Python installation and the system folders read-only; an empty, private,
writable working directory, /tmp and /dev/shm; a loopback-only network with nothing listening; no
$HOME, /root, project checkout, results folder or socket of the user's; uid 65534 with no
capabilities. The rlimits below apply inside too. When the program's main process exits, or the
wall clock runs out and the sandbox's init is killed, the kernel kills every process left in its
PID namespace; `check_program` returns only after that.

What the boundary relies on: the kernel's namespaces and its user-namespace permission checks,
bubblewrap's setup, and unprivileged user namespaces being allowed. What it does not cover: kernel
bugs reachable from inside a user namespace (there is no seccomp filter), the machine-wide facts
/proc shows (CPU, memory, uptime, kernel version), denial of service within the limits (CPU time,
memory, 64 MiB per writable folder, the wall clock) and side channels. What the base installation
holds, its site-packages included, the program can read and import.

Where namespaces cannot be made (no bubblewrap, user namespaces disabled), `check_program` raises
SandboxUnavailable, saying how to enable them, and runs nothing. With `unsafe_exec=True` it runs
the program with best-effort isolation instead and says so in Outcome.isolation: `python -I` in a
fresh temporary directory (removed afterwards), in its own session, with the same rlimits, an
environment empty but for a tag, and a preamble that makes socket creation and name lookup raise
PermissionError; afterwards the process group and every process still carrying the tag are
SIGKILLed. That guards against code that goes wrong by accident, not code written to escape: the
program can undo the preamble, read and write the user's files, reach the network, signal the
user's processes and leave a process behind that left the group and cleared its environment.

Limits, both ways: address space (memory_mb), CPU time, file size (OUTPUT_LIMIT_BYTES, which caps
stdout/stderr too), core dumps and, for non-root users, process count.
"""

from __future__ import annotations

import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import IO, Literal

import psutil

from ddtree.errors import ConfigError, SandboxUnavailable
from ddtree.quality.namespaces import Namespaces, end_namespace, namespaces, read_status

__all__ = ["Isolation", "Outcome", "Status", "check_program", "sandbox_isolation"]

Status = Literal["passed", "failed", "timeout", "error"]
Isolation = Literal["namespaces", "best-effort"]

MAX_TIMEOUT_S = 3600.0
MIN_MEMORY_MB = 64  # the interpreter itself needs ~20 MB of address space before any user code
MAX_MEMORY_MB = 1 << 20
OUTPUT_LIMIT_BYTES = 16 << 20  # RLIMIT_FSIZE: covers stdout/stderr files too, so a print loop dies
NPROC_HEADROOM = 64  # extra processes a non-root program may start on top of what the user runs
TAIL_BYTES = 64 << 10  # how much of stdout/stderr is read back
DETAIL_LINES = 20
TAG_VAR = "DDTREE_SANDBOX_TAG"
MARKER_PREFIX = "__ddtree_sandbox"
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Runs as `python -I -c BOOTSTRAP cpu_s mem_bytes fsize_bytes nproc`. Nothing here is secret:
# the nonce arrives on stdin. The setup function returns a C-level callable (any over map over
# partials) that execs the program and then writes the marker; C calls add no Python frames, so
# from the program `sys._getframe(1)` is the -c module frame, whose namespace is the program's own,
# and no frame anywhere has the marker in its locals.
_BOOTSTRAP = r"""
def _ddtree_sandbox_setup():
    import functools, operator, os, resource, socket, sys, traceback
    import _socket

    def limit(res, value):
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))

    cpu_s, mem, fsize, nproc = (int(a) for a in sys.argv[1:5])
    # SIGXCPU at the soft limit, SIGKILL a second later if the program ignores it
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    if cpu_hard != resource.RLIM_INFINITY:
        cpu_s = min(cpu_s, cpu_hard - 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    limit(resource.RLIMIT_AS, mem)
    limit(resource.RLIMIT_FSIZE, fsize)
    limit(resource.RLIMIT_CORE, 0)
    if nproc > 0:
        limit(resource.RLIMIT_NPROC, nproc)

    nonce = sys.stdin.buffer.read().strip().decode("ascii")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    done = ("\n%s_done_%s__\n" % (PREFIX, nonce)).encode()
    bad_syntax = ("\n%s_syntax_%s__\n" % (PREFIX, nonce)).encode()
    del nonce

    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in the ddtree sandbox")

    for mod in (socket, _socket):
        for name in ("socket", "SocketType", "socketpair", "fromfd", "create_connection",
                     "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
                     "gethostbyaddr"):
            if hasattr(mod, name):
                setattr(mod, name, no_network)

    path = os.path.abspath("program.py")
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        traceback.print_exc(limit=0)
        sys.stderr.flush()
        os.write(1, bad_syntax)
        os._exit(2)

    main = sys.modules["__main__"].__dict__
    builtins = main["__builtins__"]
    main.clear()
    main.update(__name__="__main__", __file__=path, __builtins__=builtins, __doc__=None)
    sys.argv = [path]

    def flush():
        for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
            try:
                stream.flush()
            except Exception:
                pass

    # exec returns None, so any() goes on to flush (None) and the write (> 0) only after the
    # program's last line; an exception or SystemExit propagates and the marker is never written
    steps = [functools.partial(exec, code, main), flush, functools.partial(os.write, 1, done)]
    return functools.partial(any, map(operator.call, steps))


_ddtree_sandbox_setup()()
""".replace("PREFIX", repr(MARKER_PREFIX))


@dataclass(frozen=True)
class Outcome:
    """What happened to one program; detail is the stderr tail or the reason."""

    status: Status
    detail: str = ""
    elapsed_s: float = 0.0
    isolation: Isolation = "namespaces"  # "best-effort": run with unsafe_exec where namespaces could not start

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _validate(timeout_s: float, memory_mb: int) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ConfigError(f"timeout_s: expected a number of seconds, got {timeout_s!r}")
    if not (0 < timeout_s <= MAX_TIMEOUT_S) or math.isnan(timeout_s):
        raise ConfigError(f"timeout_s: {timeout_s}; allowed: 0 < timeout_s <= {MAX_TIMEOUT_S:g}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int):
        raise ConfigError(f"memory_mb: expected an integer number of MiB, got {memory_mb!r}")
    if not MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB:
        raise ConfigError(f"memory_mb: {memory_mb}; allowed: {MIN_MEMORY_MB} <= memory_mb <= {MAX_MEMORY_MB}")


def _nproc_limit() -> int:
    """RLIMIT_NPROC counts every process of the user, so it is set relative to what runs now;
    root ignores the limit anyway, so none is set there (0)."""
    uid = os.getuid()
    if uid == 0:
        return 0
    mine = 0
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if uids is not None and uids.real == uid:
            mine += 1
    return mine + NPROC_HEADROOM


def _wait_exited(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait until the child exits, without reaping it, so its pid (= the group id) cannot be reused
    before the group is killed. True if it exited within the timeout."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        # no pidfd (old kernel): reaping is the only way to wait; the pid-reuse window is tiny
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (the child alone, under bwrap) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process that left the group but still carries the tag (best-effort runs)."""
    me = os.getpid()
    for other in psutil.process_iter():
        if other.pid == me:
            continue
        try:
            if other.environ().get(TAG_VAR) == tag:
                other.kill()
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or not ours to read


def _tail(stream: IO[bytes]) -> str:
    stream.seek(0, os.SEEK_END)
    size = stream.tell()
    stream.seek(max(0, size - TAIL_BYTES))
    return stream.read().decode("utf-8", errors="replace")


def _last_lines(text: str, n: int = DETAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _remove_tree(path: str) -> None:
    # the program may have made files read-only; make them writable and retry once
    def retry(func, p, _exc):  # type: ignore[no-untyped-def]
        try:
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)  # onerror is deprecated from 3.12
    else:
        shutil.rmtree(path, onerror=retry)


def sandbox_isolation(unsafe_exec: bool = False) -> Isolation:
    """The isolation check_program will use: "namespaces", or with unsafe_exec "best-effort" where
    namespaces cannot be made. Raises SandboxUnavailable, saying how to enable them, otherwise."""
    return "best-effort" if _launcher(unsafe_exec) is None else "namespaces"


def _launcher(unsafe_exec: bool) -> Namespaces | None:
    try:
        return namespaces()
    except SandboxUnavailable:
        if unsafe_exec:
            return None
        raise


def check_program(program: str, timeout_s: float = 10.0, memory_mb: int = 1024, *,
                  unsafe_exec: bool = False) -> Outcome:
    """Run `program` with `python -I` in namespaces (see the module docstring); unsafe_exec: where
    namespaces cannot be made, run it with best-effort isolation instead of raising SandboxUnavailable."""
    if not isinstance(program, str):
        raise ConfigError(f"program: expected source text (str), got {type(program).__name__}")
    _validate(timeout_s, memory_mb)
    launcher = _launcher(unsafe_exec)
    nonce = secrets.token_hex(16)
    done = f"{MARKER_PREFIX}_done_{nonce}__"
    bad_syntax = f"{MARKER_PREFIX}_syntax_{nonce}__"
    limits = [
        str(math.ceil(timeout_s) + 1),  # CPU seconds: the wall clock normally fires first
        str(memory_mb << 20),
        str(OUTPUT_LIMIT_BYTES),
        str(_nproc_limit()),
    ]
    isolation: Isolation = "best-effort" if launcher is None else "namespaces"
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if launcher is None:
            ran = _run_best_effort(program, limits, nonce, timeout_s, out, err)
        else:
            ran = _run_in_namespaces(launcher, program, limits, nonce, timeout_s, out, err)
        elapsed = time.monotonic() - start
        stdout, stderr = _tail(out), _tail(err)
    if ran.failed_to_start:
        detail = f"{ran.failed_to_start}: {_last_lines(stderr)}" if stderr.strip() else ran.failed_to_start
        return Outcome("error", detail, elapsed, isolation)
    outcome = _classify(ran.returncode, ran.exited, stdout, stderr, done, bad_syntax, timeout_s, elapsed)
    return replace(outcome, isolation=isolation)


@dataclass(frozen=True)
class _Ran:
    returncode: int
    exited: bool  # within the wall-clock limit
    failed_to_start: str = ""  # why the interpreter never ran; empty when it did


def _feed_nonce_and_wait(proc: subprocess.Popen[bytes], nonce: str, timeout_s: float) -> bool:
    assert proc.stdin is not None
    try:
        proc.stdin.write(nonce.encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child died before reading; its exit status tells why
    return _wait_exited(proc, timeout_s)


def _run_in_namespaces(launcher: Namespaces, program: str, limits: list[str], nonce: str, timeout_s: float,
                       out: IO[bytes], err: IO[bytes]) -> _Ran:
    """bwrap copies the program into the sandbox's working directory from a descriptor and reports
    its init's pid and PID namespace on a pipe, which is how a timed-out sandbox is ended."""
    status_read, status_write = os.pipe()
    try:
        with tempfile.TemporaryFile() as source:
            source.write(program.encode("utf-8"))
            source.flush()
            source.seek(0)
            try:
                proc = subprocess.Popen(
                    launcher.command(source.fileno(), status_write) + ["-I", "-c", _BOOTSTRAP, *limits],
                    stdin=subprocess.PIPE, stdout=out, stderr=err, cwd="/", env=THREAD_ENV,
                    start_new_session=True, pass_fds=(source.fileno(), status_write),
                )
            except OSError as exc:
                return _Ran(-1, True, f"could not start {launcher.bwrap}: {exc}")
            finally:
                os.close(status_write)
            try:
                exited = _feed_nonce_and_wait(proc, nonce, timeout_s)
            finally:
                status = read_status(status_read)
                end_namespace(status)
                _kill_group(proc)
    finally:
        os.close(status_read)
    if exited and "exit-code" not in status:  # bwrap reports one only once the interpreter has been started
        return _Ran(proc.returncode, exited, "the sandbox did not start")
    return _Ran(_shell_status_to_signal(proc.returncode), exited)


def _shell_status_to_signal(returncode: int) -> int:
    """bwrap reports a child killed by signal N as exit status 128 + N (the shell's convention);
    -N is how the rest of this module, like subprocess, says it. A program that itself exits with
    129..192 reads as killed: either way it did not pass."""
    if 128 < returncode <= 128 + signal.NSIG:
        return -(returncode - 128)
    return returncode


def _run_best_effort(program: str, limits: list[str], nonce: str, timeout_s: float,
                     out: IO[bytes], err: IO[bytes]) -> _Ran:
    tag = secrets.token_hex(8)
    workdir = tempfile.mkdtemp(prefix="ddtree-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, *limits],
                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, env={TAG_VAR: tag, **THREAD_ENV},
                start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            return _Ran(-1, True, f"could not start the interpreter: {exc}")
        try:
            exited = _feed_nonce_and_wait(proc, nonce, timeout_s)
        finally:
            _kill_group(proc)
            _kill_tagged(tag)
        return _Ran(proc.returncode, exited)
    finally:
        _remove_tree(workdir)


def _classify(
    returncode: int,
    exited: bool,
    stdout: str,
    stderr: str,
    done: str,
    bad_syntax: str,
    timeout_s: float,
    elapsed: float,
) -> Outcome:
    lines = stdout.splitlines()
    if not exited:
        return Outcome("timeout", f"killed after the {timeout_s:g}s wall-clock limit", elapsed)
    if returncode == -signal.SIGXCPU:
        return Outcome("timeout", "killed at the CPU-time limit", elapsed)
    if bad_syntax in lines:
        return Outcome("error", _last_lines(stderr) or "the program does not compile", elapsed)
    if done in lines and returncode == 0:
        return Outcome("passed", "", elapsed)
    if returncode == -signal.SIGXFSZ:
        return Outcome("failed", f"output exceeded {OUTPUT_LIMIT_BYTES >> 20} MiB (file size limit)", elapsed)
    if returncode < 0:
        try:
            reason = f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            reason = f"killed by signal {-returncode}"
    elif returncode == 0:
        reason = "exited with status 0 before reaching the end of the program"
    else:
        reason = f"exited with status {returncode}"
    tail = _last_lines(stderr)
    return Outcome("failed", f"{tail}\n({reason})" if tail else reason, elapsed)
