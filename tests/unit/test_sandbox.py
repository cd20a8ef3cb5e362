"""check_program in namespaces (the default): the four statuses, the completion nonce, limits, the
sandbox's view, and that no process outlives the check. Escape attempts are in test_sandbox_escapes.py,
the refusal without namespaces and the best-effort fallback in test_sandbox_unavailable.py."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import time
from pathlib import Path

import psutil
import pytest

from ddtree.errors import ConfigError
from ddtree.quality import Outcome, check_program
from ddtree.quality.sandbox import MARKER_PREFIX, OUTPUT_LIMIT_BYTES


def alive_with(token: str) -> list[psutil.Process]:
    """Processes on this machine, zombies aside, whose command line has `token` as an argument."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if token in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def sleeper(token: str) -> str:
    """Source of an argv list for a Python that sleeps a minute, findable from outside by `token`."""
    return f"[sys.executable, '-c', 'import time; time.sleep(60)', {token!r}]"


# --- the four statuses ---------------------------------------------------------------------------


def test_program_that_runs_to_its_end_passes() -> None:
    outcome = check_program("def f(x):\n    return x + 1\n\nassert f(1) == 2\nprint('ok', end='')\n")
    assert outcome == Outcome("passed", "", outcome.elapsed_s)
    assert outcome.passed


def test_assertion_failure_fails_with_the_traceback_tail() -> None:
    outcome = check_program("def f(x):\n    return x\n\nassert f(1) == 2, 'wrong answer'\n")
    assert outcome.status == "failed"
    assert "AssertionError: wrong answer" in outcome.detail
    assert "exited with status 1" in outcome.detail


def test_exception_at_run_time_fails() -> None:
    outcome = check_program("{}['missing']\n")
    assert outcome.status == "failed" and "KeyError" in outcome.detail


@pytest.mark.parametrize(
    "program",
    [
        pytest.param("def f(:\n    pass\n", id="bad-def"),
        pytest.param("x = 1\n  y = 2\n", id="bad-indent"),
        pytest.param("x = 1\0\n", id="null-byte"),
    ],
)
def test_program_that_does_not_compile_is_an_error(program: str) -> None:
    outcome = check_program(program)
    assert outcome.status == "error", outcome
    assert "Error" in outcome.detail


def test_infinite_loop_times_out_within_the_limit_and_leaves_nothing() -> None:
    token = secrets.token_hex(8)
    program = f"import subprocess, sys\nsubprocess.Popen({sleeper(token)})\nwhile True:\n    pass\n"
    start = time.monotonic()
    outcome = check_program(program, timeout_s=1.0)
    took = time.monotonic() - start
    assert outcome.status == "timeout", outcome
    assert took < 1.0 + 2.0, f"returned after {took:.2f}s, limit 1s + 2s slack"
    assert "1s" in outcome.detail
    assert alive_with(token) == []  # gone when check_program returns, not some time later


def test_sleeping_program_is_killed_by_the_wall_clock() -> None:
    # no CPU used, so only the wall-clock limit can stop it
    start = time.monotonic()
    outcome = check_program("import time\ntime.sleep(60)\n", timeout_s=0.5)
    assert outcome.status == "timeout"
    assert time.monotonic() - start < 2.5


# --- "passed" means it ran to its end ------------------------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        pytest.param("import sys\nsys.exit(0)\nassert False\n", id="sys-exit-early"),
        pytest.param("import os\nos._exit(0)\nassert False\n", id="os-exit-early"),
        pytest.param("def f():\n    raise SystemExit(0)\n\nf()\nassert False\n", id="systemexit-in-the-middle"),
        pytest.param("import sys\nassert True\nsys.exit()\n", id="sys-exit-as-last-line"),
        pytest.param("import threading, os\nthreading.Thread(target=os._exit, args=(0,)).start()\nimport time\ntime.sleep(5)\n",
                     id="os-exit-from-a-thread"),
    ],
)
def test_exiting_with_status_zero_before_the_end_is_not_passed(program: str) -> None:
    outcome = check_program(program)
    assert outcome.status == "failed", outcome
    assert "before reaching the end" in outcome.detail


def test_printing_a_fake_marker_does_not_pass() -> None:
    fakes = [f"{MARKER_PREFIX}_done_{'0' * 32}__", f"{MARKER_PREFIX}_done___", f"{MARKER_PREFIX}_done_{{nonce}}__"]
    program = "import os\n" + "".join(f"print({fake!r}, flush=True)\n" for fake in fakes) + "os._exit(0)\n"
    assert check_program(program).status == "failed"


def test_the_nonce_is_not_in_stdin_argv_environ_files_or_frames() -> None:
    # A forger: it gathers everything a program can read without digging through memory, prints
    # a marker line for every 32-hex-digit token it finds, then exits 0 early. If the nonce were
    # in any of these places, one of its lines would be the real marker and it would pass.
    program = (
        "import os, re, sys\n"
        "seen = [sys.stdin.read(), repr(sys.argv), repr(dict(os.environ))]\n"
        "for name in ('cmdline', 'environ'):\n"
        "    seen.append(open('/proc/self/' + name, 'rb').read().decode(errors='replace'))\n"
        "for name in os.listdir('.'):\n"
        "    seen.append(open(name).read())\n"
        "f = sys._getframe()\n"
        "while f is not None:\n"
        "    seen.extend(repr(v) for v in f.f_locals.values())\n"
        "    f = f.f_back\n"
        "tokens = set(re.findall('[0-9a-f]{32}', ' '.join(seen)))\n"
        f"prefix = {MARKER_PREFIX!r}\n"
        "for token in tokens:\n"
        "    print(f'{prefix}_done_{token}__')\n"
        "print(len(tokens), 'candidates', flush=True)\n"
        "os._exit(0)\n"
    )
    outcome = check_program(program)
    assert outcome.status == "failed", outcome


def test_program_runs_as_main_in_a_clean_namespace() -> None:
    program = (
        "assert __name__ == '__main__'\n"
        "assert sorted(k for k in globals() if not k.startswith('__')) == [], sorted(globals())\n"
        "import sys\n"
        "assert sys.argv[0].endswith('program.py'), sys.argv\n"
        "assert sys.stdin.read() == ''\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome


# --- processes, files, limits --------------------------------------------------------------------


def test_forked_child_is_killed() -> None:
    token = secrets.token_hex(8)
    program = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        f"    argv = {sleeper(token)}\n"
        "    os.execv(argv[0], argv)\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome
    assert alive_with(token) == []


def test_children_that_left_the_group_or_cleared_the_environment_are_killed_on_timeout() -> None:
    token = secrets.token_hex(8)
    program = (
        "import subprocess, sys\n"
        f"subprocess.Popen({sleeper(token)})\n"
        f"subprocess.Popen({sleeper(token)}, start_new_session=True, env={{}})\n"
        "while True:\n"
        "    pass\n"
    )
    # 3 s: time for a loaded 2-core machine to start the program and both children before the limit cuts it
    outcome = check_program(program, timeout_s=3.0)
    assert outcome.status == "timeout", outcome
    assert alive_with(token) == []


def test_a_double_forked_orphan_of_a_passing_program_is_gone_when_the_check_returns() -> None:
    token = secrets.token_hex(8)
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        argv = {sleeper(token)}\n"
        "        os.execve(argv[0], argv, {})\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(0.3)  # the orphan has started\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome
    assert alive_with(token) == []


def test_each_run_gets_an_empty_private_working_directory_tmp_and_dev_shm() -> None:
    program = (
        "import os\n"
        "assert os.getcwd() == '/sandbox', os.getcwd()\n"
        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "assert os.listdir('/tmp') == [] and os.listdir('/dev/shm') == [], (os.listdir('/tmp'), os.listdir('/dev/shm'))\n"
        "for folder in ('.', '/tmp', '/dev/shm'):\n"
        "    open(os.path.join(folder, 'left-behind.txt'), 'w').write('x')\n"
        "os.mkdir('sub')\n"
        "os.chmod('sub', 0o500)\n"
    )
    first = check_program(program)
    assert first.passed, first
    second = check_program(program)  # would fail its listdir asserts if anything were shared between runs
    assert second.passed, second


def test_the_sandbox_view() -> None:
    # the documented view (ddtree/quality/namespaces.py): nobody without capabilities, its own
    # hostname, a root of system folders and private tmpfs folders, a loopback-only network
    program = (
        "import os, socket\n"
        "assert (os.getuid(), os.getgid()) == (65534, 65534), (os.getuid(), os.getgid())\n"
        "status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
        "assert all(int(status[k], 16) == 0 for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')), status\n"
        "assert socket.gethostname() == 'sandbox', socket.gethostname()\n"
        "top = set(os.listdir('/'))\n"
        "assert top <= {'usr', 'bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32', 'etc', 'proc', 'dev', 'tmp', 'sandbox',\n"
        "               'root', 'home', 'opt'}, top  # root/home/opt: only if the interpreter's installation is there\n"
        "assert not os.path.isdir('/etc') or os.listdir('/etc') == ['ld.so.cache'], os.listdir('/etc')\n"
        "assert sorted(os.listdir('/sys/class/net') if os.path.isdir('/sys/class/net') else\n"
        "              [line.split(':')[0].strip() for line in open('/proc/net/dev').read().splitlines()[2:]]) == ['lo']\n"
        "assert os.getppid() == 1 and sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()]\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome


def test_only_stdin_stdout_and_stderr_are_inherited() -> None:
    program = "import os\nfds = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))\nassert fds[:3] == [0, 1, 2] and len(fds) == 4, fds\n"
    outcome = check_program(program)  # the fourth is listdir's own
    assert outcome.passed, outcome


def test_memory_bomb_fails() -> None:
    outcome = check_program("x = bytearray(4 * 1024 ** 3)\n", memory_mb=256)
    assert outcome.status == "failed"
    assert "MemoryError" in outcome.detail


def test_memory_limit_is_what_stops_the_allocation() -> None:
    program = "x = bytearray(200 * 1024 ** 2)\n"
    assert check_program(program, memory_mb=1024).passed
    assert check_program(program, memory_mb=128).status == "failed"


def test_runaway_output_is_cut_off() -> None:
    start = time.monotonic()
    outcome = check_program("while True:\n    print('x' * 4096)\n", timeout_s=10.0)
    assert outcome.status == "failed", outcome
    # Python ignores SIGXFSZ, so the write past RLIMIT_FSIZE raises EFBIG instead of killing it
    assert "File too large" in outcome.detail or f"{OUTPUT_LIMIT_BYTES >> 20} MiB" in outcome.detail
    assert time.monotonic() - start < 8.0


@pytest.mark.parametrize(
    "call",
    [
        pytest.param("socket.socket(socket.AF_INET, socket.SOCK_STREAM)", id="socket"),
        pytest.param("socket.create_connection(('127.0.0.1', 9))", id="create-connection"),
        pytest.param("socket.getaddrinfo('localhost', 80)", id="getaddrinfo"),
        pytest.param("_socket.socket()", id="raw-socket-module"),
    ],
)
def test_socket_creation_is_blocked(call: str) -> None:
    program = (
        "import socket, _socket\n"
        "try:\n"
        f"    {call}\n"
        "except PermissionError as err:\n"
        "    assert 'network access is disabled' in str(err)\n"
        "else:\n"
        "    raise AssertionError('network call succeeded')\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome


def test_environment_is_empty_of_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    program = "import os\nassert not [k for k in os.environ if 'proxy' in k.lower()], dict(os.environ)\n"
    assert check_program(program).passed


def test_a_sandbox_that_fails_to_set_up_is_an_error_with_bwraps_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a bwrap that works for the start-up check but cannot mount a missing folder for real runs
    # (those, unlike the check, report on --json-status-fd)
    real = shutil.which("bwrap")
    assert real is not None
    wrapper = tmp_path / "bin" / "bwrap"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --json-status-fd "*) exec ' + real + ' --ro-bind /nonexistent-ddtree /x "$@" ;; esac\n'
        'exec ' + real + ' "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    outcome = check_program("pass\n")
    assert outcome.status == "error", outcome
    assert outcome.detail.startswith("the sandbox did not start: bwrap: Can't find source path /nonexistent-ddtree")


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"timeout_s": 0}, "timeout_s", id="timeout-zero"),
        pytest.param({"timeout_s": -1.0}, "timeout_s", id="timeout-negative"),
        pytest.param({"timeout_s": math.nan}, "timeout_s", id="timeout-nan"),
        pytest.param({"timeout_s": "5"}, "timeout_s", id="timeout-str"),
        pytest.param({"memory_mb": 8}, "memory_mb", id="memory-too-small"),
        pytest.param({"memory_mb": 512.0}, "memory_mb", id="memory-float"),
    ],
)
def test_bad_limits_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        check_program("pass\n", **kwargs)  # type: ignore[arg-type]


def test_program_must_be_text() -> None:
    with pytest.raises(ConfigError, match="^program:"):
        check_program(b"pass\n")  # type: ignore[arg-type]


def test_process_limit_is_relative_to_what_the_user_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtree.quality import sandbox

    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert sandbox._nproc_limit() == 0  # root ignores RLIMIT_NPROC, so none is set
    me = psutil.Process().uids().real
    monkeypatch.setattr(os, "getuid", lambda: me if me != 0 else 987654)
    expected_min = sandbox.NPROC_HEADROOM + (1 if me != 0 else 0)
    assert sandbox._nproc_limit() >= expected_min
