"""Where namespaces cannot be made, check_program and the gate refuse and say how to enable them;
unsafe_exec falls back to best-effort isolation, which keeps its old guarantees and says it ran."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from ddtree.errors import SandboxUnavailable
from ddtree.quality import check_program, load_problems, run_gate, sandbox_isolation
from ddtree.quality.namespaces import PYTHON_ENV

# what bwrap says on a kernel that forbids unprivileged user namespaces
NO_USERNS = ("bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
             "non-privileged user namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.")


@pytest.fixture
def no_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH leads first to a bwrap that fails the way the real one does without user namespaces."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "bwrap"
    fake.write_text(f"#!/bin/sh\necho \"{NO_USERNS}\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return fake


def writes(path: Path) -> str:
    """A program that leaves a mark on the host if it runs at all (outside namespaces)."""
    return f"open({str(path)!r}, 'w').write('ran')\n"


def test_namespaces_that_cannot_be_made_are_refused_saying_how_to_enable_them(no_namespaces: Path, tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable) as caught:
        check_program(writes(mark))
    message = str(caught.value)
    assert message.startswith("cannot run model-written code in namespaces:")
    assert "No permissions to creating new namespace" in message  # bwrap's own words
    for how in ("sysctl -w user.max_user_namespaces=", "kernel.unprivileged_userns_clone=1",
                "kernel.apparmor_restrict_unprivileged_userns=0", "apt-get install bubblewrap",
                "unsafe_exec=True", "--unsafe-exec"):
        assert how in message, how
    assert not mark.exists(), "the program ran although the sandbox was refused"
    with pytest.raises(SandboxUnavailable):
        sandbox_isolation()


def test_missing_bubblewrap_is_refused_saying_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    mark = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(bwrap\) is not on PATH.*apt-get install bubblewrap"):
        check_program(writes(mark))
    assert not mark.exists()


@pytest.mark.parametrize("python", ["/nonexistent/bin/python3", "python3"], ids=["missing", "relative"])
def test_an_interpreter_that_cannot_run_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, python: str) -> None:
    monkeypatch.setenv(PYTHON_ENV, python)
    with pytest.raises(SandboxUnavailable, match=rf"{python}.*set {PYTHON_ENV} to the absolute path of a Python 3"):
        check_program("pass\n")


def test_an_interpreter_installed_in_a_folder_holding_the_home_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a python at ~/bin/python3 has ~ for its installation folder: binding it would show all of $HOME
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python3"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(PYTHON_ENV, str(python))
    with pytest.raises(SandboxUnavailable, match="which holds your home folder"):
        check_program("pass\n")


def test_unsafe_exec_runs_with_best_effort_isolation_and_says_so(no_namespaces: Path, tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    outcome = check_program(writes(mark), unsafe_exec=True)
    assert (outcome.status, outcome.isolation) == ("passed", "best-effort"), outcome
    assert mark.read_text() == "ran"  # it really ran outside namespaces: this is what the flag accepts
    assert sandbox_isolation(unsafe_exec=True) == "best-effort"


def test_unsafe_exec_keeps_namespaces_where_they_can_be_made(tmp_path: Path) -> None:
    outcome = check_program("import os\nassert os.getcwd() == '/sandbox'\n", unsafe_exec=True)
    assert (outcome.status, outcome.isolation) == ("passed", "namespaces"), outcome
    assert sandbox_isolation(unsafe_exec=True) == "namespaces"


def test_the_gate_refuses_before_asking_the_model(no_namespaces: Path) -> None:
    asked: list[str] = []
    problem = load_problems()["HumanEval/2"]

    def complete(prompt: str, n: int) -> list[str]:
        asked.append(prompt)
        return [problem.canonical_solution] * n

    with pytest.raises(SandboxUnavailable, match="cannot run model-written code in namespaces"):
        run_gate([problem], complete)
    assert asked == []


def test_the_gate_records_best_effort_isolation_under_unsafe_exec(no_namespaces: Path) -> None:
    problem = load_problems()["HumanEval/2"]
    report = run_gate([problem], lambda prompt, n: [problem.canonical_solution] * n, unsafe_exec=True)
    assert (report.pass_at_k, report.isolation, report.to_dict()["isolation"]) == (1.0, "best-effort", "best-effort")


def test_the_gate_records_namespaces_by_default() -> None:
    problem = load_problems()["HumanEval/2"]
    report = run_gate([problem], lambda prompt, n: [problem.canonical_solution] * n)
    assert (report.pass_at_k, report.to_dict()["isolation"]) == (1.0, "namespaces")


# --- best-effort isolation keeps what it guaranteed before ------------------------------------------


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


def test_best_effort_infinite_loop_times_out_and_leaves_nothing(no_namespaces: Path, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    program = f"import os\nopen({str(pids)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass\n"
    outcome = check_program(program, timeout_s=1.0, unsafe_exec=True)
    assert (outcome.status, outcome.isolation) == ("timeout", "best-effort"), outcome
    for pid in read_pids(pids):
        assert_gone(pid)


def test_best_effort_kills_children_in_and_out_of_the_process_group(no_namespaces: Path, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    program = (
        "import os, subprocess, sys\n"
        "same = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{same.pid}} {{other.pid}}')\n"
        "while True:\n"
        "    pass\n"
    )
    outcome = check_program(program, timeout_s=3.0, unsafe_exec=True)
    assert outcome.status == "timeout", outcome
    found = read_pids(pids)
    assert len(found) == 2
    for pid in found:
        assert_gone(pid)


def test_best_effort_runs_in_a_fresh_directory_that_is_removed(no_namespaces: Path, tmp_path: Path) -> None:
    cwd_file = tmp_path / "cwd"
    program = (
        "import os\n"
        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "os.mkdir('sub')\n"
        "os.chmod('sub', 0o500)\n"
        f"open({str(cwd_file)!r}, 'w').write(os.getcwd())\n"
    )
    outcome = check_program(program, unsafe_exec=True)
    assert outcome.passed, outcome
    workdir = cwd_file.read_text()
    assert workdir and not os.path.exists(workdir), f"{workdir} still exists"


@pytest.mark.parametrize("program", [
    pytest.param("import socket\nsocket.socket()\n", id="socket"),
    pytest.param("x = bytearray(4 * 1024 ** 3)\n", id="memory"),
    pytest.param("import os\nos._exit(0)\n", id="early-exit"),
])
def test_best_effort_keeps_the_outcomes_of_accidental_faults(no_namespaces: Path, program: str) -> None:
    outcome = check_program(program, memory_mb=256, unsafe_exec=True)
    assert (outcome.status, outcome.isolation) == ("failed", "best-effort"), outcome
