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

Isolation, best effort -- NOT a security boundary. The child runs `python -I` in a fresh temporary
directory (removed afterwards), in its own session, with rlimits on address space (memory_mb),
CPU time, file size, core dumps and, for non-root users, process count; its environment is empty
but for a tag, so no proxy settings leak in; a preamble makes socket creation and name lookup raise
PermissionError. Code in the same interpreter can undo any of that (reach the real socket type via
`__subclasses__`, dig the nonce out of memory with gc, or spawn a process with network access):
this guards against generated code that goes wrong by accident, not against code written to
escape. When `check_program` returns, the child's process group has been SIGKILLed, and so has
every process still carrying the tag in its environment (children that left the group with
setsid); a process that both leaves the group and clears its environment can escape.
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
from dataclasses import dataclass
from typing import IO, Literal

import psutil

from ddtree.errors import ConfigError

__all__ = ["Outcome", "Status", "check_program"]

Status = Literal["passed", "failed", "timeout", "error"]

MAX_TIMEOUT_S = 3600.0
MIN_MEMORY_MB = 64  # the interpreter itself needs ~20 MB of address space before any user code
MAX_MEMORY_MB = 1 << 20
OUTPUT_LIMIT_BYTES = 16 << 20  # RLIMIT_FSIZE: covers stdout/stderr files too, so a print loop dies
NPROC_HEADROOM = 64  # extra processes a non-root program may start on top of what the user runs
TAIL_BYTES = 64 << 10  # how much of stdout/stderr is read back
DETAIL_LINES = 20
TAG_VAR = "DDTREE_SANDBOX_TAG"
MARKER_PREFIX = "__ddtree_sandbox"

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


def _kill_everything(proc: subprocess.Popen[bytes], tag: str) -> None:
    """SIGKILL the child's process group, then any process that left the group but still carries the tag."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
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


def check_program(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> Outcome:
    """Run `program` with `python -I` in a throwaway directory; see the module docstring."""
    if not isinstance(program, str):
        raise ConfigError(f"program: expected source text (str), got {type(program).__name__}")
    _validate(timeout_s, memory_mb)
    nonce = secrets.token_hex(16)
    tag = secrets.token_hex(8)
    done = f"{MARKER_PREFIX}_done_{nonce}__"
    bad_syntax = f"{MARKER_PREFIX}_syntax_{nonce}__"
    limits = [
        str(math.ceil(timeout_s) + 1),  # CPU seconds: the wall clock normally fires first
        str(memory_mb << 20),
        str(OUTPUT_LIMIT_BYTES),
        str(_nproc_limit()),
    ]
    env = {TAG_VAR: tag, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    workdir = tempfile.mkdtemp(prefix="ddtree-sandbox-")
    start = time.monotonic()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _BOOTSTRAP, *limits],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                return Outcome("error", f"could not start the interpreter: {exc}", time.monotonic() - start)
            try:
                assert proc.stdin is not None
                try:
                    proc.stdin.write(nonce.encode() + b"\n")
                    proc.stdin.close()
                except BrokenPipeError:
                    pass  # the child died before reading; its exit status tells why
                exited = _wait_exited(proc, timeout_s)
            finally:
                _kill_everything(proc, tag)
            elapsed = time.monotonic() - start
            stdout, stderr = _tail(out), _tail(err)
        return _classify(proc.returncode, exited, stdout, stderr, done, bad_syntax, timeout_s, elapsed)
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
