"""check_program: the four statuses, the completion nonce, limits, cleanup of processes and files."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import psutil
import pytest

from ddtree.errors import ConfigError
from ddtree.quality import Outcome, check_program
from ddtree.quality.sandbox import MARKER_PREFIX, OUTPUT_LIMIT_BYTES


def assert_gone(pid: int, within_s: float = 2.0) -> None:
    """The process is dead (a zombie waiting for init to reap it counts as dead)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return
        if status == psutil.STATUS_ZOMBIE:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} survived check_program (status {status})")
        time.sleep(0.05)


def read_pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


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


def test_infinite_loop_times_out_within_the_limit_and_leaves_nothing(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    program = f"import os\nopen({str(pids)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass\n"
    start = time.monotonic()
    outcome = check_program(program, timeout_s=1.0)
    took = time.monotonic() - start
    assert outcome.status == "timeout", outcome
    assert took < 1.0 + 2.0, f"returned after {took:.2f}s, limit 1s + 2s slack"
    assert "1s" in outcome.detail
    for pid in read_pids(pids):
        assert_gone(pid)


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


def test_forked_child_is_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    program = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{pid}}')\n"
    )
    outcome = check_program(program)
    assert outcome.passed, outcome
    found = read_pids(pids)
    assert len(found) == 2
    for pid in found:
        assert_gone(pid)


def test_child_that_left_the_process_group_is_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    program = (
        "import os, subprocess, sys\n"
        "same = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{same.pid}} {{other.pid}}')\n"
        "while True:\n"
        "    pass\n"
    )
    # 3 s: time for a loaded 2-core machine to start the program and both children before the limit cuts it
    outcome = check_program(program, timeout_s=3.0)
    assert outcome.status == "timeout", outcome
    found = read_pids(pids)
    assert len(found) == 2
    for pid in found:
        assert_gone(pid)


def test_runs_in_a_fresh_directory_that_is_removed(tmp_path: Path) -> None:
    cwd_file = tmp_path / "cwd"
    program = (
        "import os\n"
        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "open('left-behind.txt', 'w').write('x')\n"
        "os.mkdir('sub')\n"
        "os.chmod('sub', 0o500)\n"
        f"open({str(cwd_file)!r}, 'w').write(os.getcwd())\n"
    )
    first = check_program(program)
    assert first.passed, first
    first_dir = cwd_file.read_text()
    assert first_dir and not os.path.exists(first_dir), f"{first_dir} still exists"
    second = check_program(program)  # would fail its listdir assert if the directory were reused
    assert second.passed, second
    assert cwd_file.read_text() != first_dir


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
