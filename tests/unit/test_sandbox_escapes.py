"""Programs written to escape check_program, run as this user (root in CI) and as an ordinary user.

Each program asserts that it escaped, so check_program says "passed" exactly when it got out; every
test also looks from the outside: the file is absent, the listener saw no connection, the victim
lives, no process is left. Every target is the test's own (its listener, its file, its sleeping
victim), so a sandbox that fails breaks nothing else on the machine.

The ordinary user is created for the module (useradd, removed afterwards with its home); a fresh
interpreter imports the checker as root, drops to that user and runs check_program, as that user
running the suite would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from ddtree.quality import Outcome, check_program
from ddtree.quality.namespaces import PYTHON_ENV

REPO = Path(__file__).resolve().parents[2]
# Imports the checker while still root, then becomes the user (job: uid, gid, home, env, program).
AS_USER = r"""
import dataclasses, json, os, sys
from ddtree.quality import check_program
job = json.loads(sys.stdin.read())
os.setgroups([])
os.setgid(job["gid"])
os.setuid(job["uid"])
os.environ.clear()
os.environ.update(job["env"])
os.chdir(job["home"])
try:
    print(json.dumps(dataclasses.asdict(check_program(job["program"]))))
except Exception as err:
    print(json.dumps({"raised": f"{type(err).__name__}: {err}"}))
"""


@dataclasses.dataclass(frozen=True)
class Runner:
    """Who runs check_program: uid/gid, home, and the sandbox interpreter to use (None: the default)."""

    name: str
    uid: int
    gid: int
    home: Path
    python: str | None

    @property
    def is_me(self) -> bool:
        return self.uid == os.getuid()

    def check(self, program: str) -> Outcome:
        if self.is_me:
            return check_program(program)
        env = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "PATH": os.environ.get("PATH", "")}
        if self.python:
            env[PYTHON_ENV] = self.python
        job = {"uid": self.uid, "gid": self.gid, "home": str(self.home), "env": env, "program": program}
        done = subprocess.run([sys.executable, "-c", AS_USER], input=json.dumps(job), capture_output=True,
                              text=True, timeout=120, cwd="/")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert "raised" not in result, f"check_program as {self.name} raised {result['raised']}"
        return Outcome(**result)

    def own(self, path: Path) -> Path:
        os.chown(path, self.uid, self.gid)
        return path

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """A process of this user, outside any sandbox."""
        ids = {} if self.is_me else {"user": self.uid, "group": self.gid, "extra_groups": []}
        return subprocess.Popen(argv, start_new_session=True, cwd="/", **ids)  # type: ignore[call-overload]


def runs_for(user: str, python: str) -> bool:
    done = subprocess.run(["runuser", "-u", user, "--", python, "-I", "-c", "import encodings"],
                          capture_output=True, cwd="/", timeout=60)
    return done.returncode == 0


@pytest.fixture(scope="module")
def ordinary_user() -> Iterator[Runner]:
    if os.getuid() != 0:
        pytest.skip("creating a user needs root; run as an ordinary user, the 'self' cases are that user's")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.fail("useradd and runuser are needed to test as an ordinary user (Debian: passwd, util-linux)")
    name = f"ddtree-sbx-{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        base = os.path.join(sys.base_exec_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
        # the base installation may lie where the user cannot read (pyenv under /root): then a system Python
        usable = [p for p in (base, "/usr/bin/python3", "/usr/local/bin/python3") if os.path.isfile(p) and runs_for(name, p)]
        if not usable:
            pytest.fail(f"no Python that {name} can run: tried {base}, /usr/bin/python3, /usr/local/bin/python3")
        yield Runner(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), None if usable[0] == base else usable[0])
    finally:
        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] is not None and proc.info["uids"].real == pwd.getpwnam(name).pw_uid:
                proc.kill()
        subprocess.run(["userdel", "--remove", name], capture_output=True)
        try:
            pwd.getpwnam(name)
        except KeyError:
            pass
        else:
            raise AssertionError(f"userdel left user {name} behind")


@pytest.fixture(params=["self", "ordinary-user"])
def runner(request: pytest.FixtureRequest) -> Runner:
    if request.param == "ordinary-user":
        return request.getfixturevalue("ordinary_user")
    me = pwd.getpwuid(os.getuid())
    return Runner(me.pw_name, os.getuid(), os.getgid(), Path.home(), None)


@pytest.fixture
def outside(runner: Runner) -> Iterator[Path]:
    """A folder in the host's /tmp that the runner can write to outside the sandbox."""
    folder = Path(tempfile.mkdtemp(prefix="ddtree-sbx-outside-"))
    runner.own(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def assert_contained(outcome: Outcome) -> None:
    """Not passed, and failed rather than an error: the attempt ran and was stopped."""
    assert outcome.status != "passed", f"the program escaped: {outcome}"
    assert (outcome.status, outcome.isolation) == ("failed", "namespaces"), outcome


# --- reading the user's files ----------------------------------------------------------------------


@pytest.fixture
def planted(runner: Runner) -> Iterator[Callable[[Path], tuple[Path, str]]]:
    """plant(folder) -> (path, secret): a secret file the runner can read outside the sandbox."""
    paths: list[Path] = []

    def plant(folder: Path) -> tuple[Path, str]:
        secret = secrets.token_hex(16)
        path = folder / f".ddtree-sandbox-secret-{secrets.token_hex(4)}"
        path.write_text(secret)
        paths.append(path)
        path.chmod(0o644)  # readable by the runner: a checkout or home file it could read outside
        runner.own(path)
        return path, secret

    yield plant
    for path in paths:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("where", ["home", "checkout"])
@pytest.mark.parametrize("route", ["open", "child-cat", "proc-1-root"])
def test_reading_a_file_of_the_user_does_not_escape(runner: Runner, planted: Callable[[Path], tuple[Path, str]],
                                                    where: str, route: str) -> None:
    path, secret = planted(runner.home if where == "home" else REPO)
    read = {
        "open": f"open({str(path)!r}).read()",
        "child-cat": f"subprocess.run(['cat', {str(path)!r}], capture_output=True, text=True).stdout",
        "proc-1-root": f"open('/proc/1/root' + {str(path)!r}).read()",
    }[route]
    outcome = runner.check(f"import subprocess\nassert {read} == {secret!r}, 'not read'\n")
    assert_contained(outcome)


@pytest.mark.parametrize("where", ["home", "checkout"])
def test_listing_the_home_folder_or_the_checkout_does_not_escape(runner: Runner, planted: Callable[[Path], tuple[Path, str]],
                                                                 where: str) -> None:
    path, _ = planted(runner.home if where == "home" else REPO)
    program = f"import os\nassert {path.name!r} in os.listdir({str(path.parent)!r})\n"
    assert_contained(runner.check(program))


def test_reading_the_environment_of_a_process_outside_does_not_escape(runner: Runner) -> None:
    victim = runner.start(["sleep", "60"])
    try:
        outcome = runner.check(f"assert b'PATH=' in open('/proc/{victim.pid}/environ', 'rb').read()\n")
        assert_contained(outcome)
    finally:
        victim.kill()
        victim.wait()


# --- connecting to a listener on this machine ----------------------------------------------------------

CONNECT_ROUTES = {
    "_socket": (
        "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.connect(('127.0.0.1', PORT))\n"
    ),
    "subclasses": (
        "kinds = [c for c in object.__subclasses__() if c.__module__ == '_socket' and c.__name__ == 'socket']\n"
        "s = kinds[0](2, 1)  # AF_INET, SOCK_STREAM\n"
        "s.connect(('127.0.0.1', PORT))\n"
    ),
    "ctypes-connect": (
        "import ctypes, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(2, 1, 0)\n"
        "assert fd >= 0, ctypes.get_errno()\n"
        "addr = struct.pack('!HH4s8x', 2, PORT, bytes([127, 0, 0, 1]))\n"
        "addr = struct.pack('=H', 2) + addr[2:]  # sin_family is host order, the port network order\n"
        "rc = libc.connect(fd, ctypes.c_char_p(addr), len(addr))\n"
        "assert rc == 0, f'connect: errno {ctypes.get_errno()}'\n"
    ),
    "child-python-empty-env": (
        "import subprocess, sys\n"
        "code = 'import socket; socket.create_connection((\"127.0.0.1\", PORT), timeout=5)'\n"
        "done = subprocess.run([sys.executable, '-c', code], env={}, capture_output=True, text=True)\n"
        "assert done.returncode == 0, done.stderr\n"
    ),
    "child-bash-dev-tcp": (
        "import subprocess\n"
        "done = subprocess.run(['bash', '-c', 'exec 3<>/dev/tcp/127.0.0.1/PORT'], env={}, capture_output=True, text=True)\n"
        "assert done.returncode == 0, done.stderr\n"
    ),
    "localhost-by-name": (
        "import subprocess, sys\n"
        "code = 'import socket; socket.create_connection((\"localhost\", PORT), timeout=5)'\n"
        "done = subprocess.run([sys.executable, '-c', code], env={}, capture_output=True, text=True)\n"
        "assert done.returncode == 0, done.stderr\n"
    ),
}


@pytest.fixture
def tcp_listener() -> Iterator[socket.socket]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    listener.close()


def assert_no_connection(listener: socket.socket) -> None:
    """A connection that reached the listener waits in its backlog even if nobody accepted it."""
    try:
        peer = listener.accept()
    except BlockingIOError:
        return
    peer[0].close()
    raise AssertionError(f"the listener was reached from {peer[1]}")


@pytest.mark.parametrize("route", list(CONNECT_ROUTES))
def test_connecting_to_a_tcp_listener_on_this_machine_does_not_escape(runner: Runner, tcp_listener: socket.socket,
                                                                      route: str) -> None:
    port = tcp_listener.getsockname()[1]
    outcome = runner.check(CONNECT_ROUTES[route].replace("PORT", str(port)))
    assert_contained(outcome)
    assert_no_connection(tcp_listener)


@pytest.mark.parametrize("kind", ["abstract", "path-in-tmp"])
def test_connecting_to_a_unix_socket_does_not_escape(runner: Runner, kind: str) -> None:
    # an ssh agent listens on a path in /tmp; abstract sockets belong to the network namespace
    name = f"ddtree-sbx-{secrets.token_hex(4)}"
    address = "\0" + name if kind == "abstract" else f"/tmp/{name}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        if kind == "path-in-tmp":
            os.chmod(address, 0o777)
        listener.listen(8)
        listener.setblocking(False)
        program = (
            "kinds = [c for c in object.__subclasses__() if c.__module__ == '_socket' and c.__name__ == 'socket']\n"
            "s = kinds[0](1, 1)  # AF_UNIX, SOCK_STREAM\n"
            f"s.connect({address!r})\n"
        )
        assert_contained(runner.check(program))
        assert_no_connection(listener)
    finally:
        listener.close()
        if kind == "path-in-tmp":
            Path(address).unlink(missing_ok=True)


# --- writing outside the working directory ----------------------------------------------------------


def test_writing_into_a_folder_of_the_user_does_not_escape(runner: Runner, outside: Path) -> None:
    target = outside / "escaped"
    outcome = runner.check(f"open({str(target)!r}, 'w').write('out')\n")
    assert_contained(outcome)
    assert not target.exists()


@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm", "home"])
def test_writing_into_a_shared_folder_does_not_escape(runner: Runner, folder: str) -> None:
    # the program writes next to a probe file the test put there, and asserts it sees the probe:
    # both hold only if it writes into the host's folder, not the sandbox's own
    base = runner.home if folder == "home" else Path(folder)
    probe = base / f"ddtree-sbx-probe-{secrets.token_hex(4)}"
    target = base / f"ddtree-sbx-escaped-{secrets.token_hex(4)}"
    probe.write_text("probe")
    try:
        program = (
            f"open({str(target)!r}, 'w').write('out')\n"
            f"assert open({str(probe)!r}).read() == 'probe', 'a private folder'\n"
        )
        assert_contained(runner.check(program))
        assert not target.exists(), f"{target} was written"
        assert probe.read_text() == "probe"
    finally:
        probe.unlink(missing_ok=True)
        target.unlink(missing_ok=True)


# --- signalling a process outside ---------------------------------------------------------------------

KILL_ROUTES = {
    "kill": "os.kill(PID, signal.SIGKILL)\n",
    "killpg": "os.killpg(PID, signal.SIGKILL)\n",  # the victim leads its own group
    "pidfd": "fd = os.pidfd_open(PID)\nsignal.pidfd_send_signal(fd, signal.SIGKILL)\n",
    "child-shell-kill": "import subprocess\nassert subprocess.run(['sh', '-c', 'kill -9 PID'], env={}).returncode == 0\n",
}


@pytest.mark.parametrize("route", list(KILL_ROUTES))
def test_signalling_a_process_outside_does_not_escape(runner: Runner, route: str) -> None:
    victim = runner.start(["sleep", "60"])
    try:
        program = "import os, signal\n" + KILL_ROUTES[route].replace("PID", str(victim.pid))
        outcome = runner.check(program)
        time.sleep(0.2)  # a signal sent would have landed
        assert victim.poll() is None, f"the victim died: {victim.returncode}"
        assert_contained(outcome)
    finally:
        victim.kill()
        victim.wait()


# --- leaving a process behind -------------------------------------------------------------------------


def test_a_process_left_behind_dies_with_the_check(runner: Runner, outside: Path) -> None:
    # a double-forked orphan in its own session with an empty environment keeps appending to a file
    # outside; the program asserts the orphan got out (the file grows). From the outside: nothing
    # carries the token once check_program returns, and the file never appears.
    token = secrets.token_hex(8)
    trail = outside / "orphan-trail"
    orphan = (
        "import time\n"
        "while True:\n"
        "    for path in (TRAIL, '/tmp/trail'):\n"
        "        try:\n"
        "            open(path, 'a').write('x')\n"
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.05)\n"
    ).replace("TRAIL", repr(str(trail)))
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execve(sys.executable, [sys.executable, '-c', {orphan!r}, {token!r}], {{}})\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(0.5)\n"
        f"assert os.path.exists({str(trail)!r}), 'the orphan cannot write outside'\n"
    )
    outcome = runner.check(program)
    left = [p for p in psutil.process_iter(["cmdline", "status"])
            if token in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert left == [], f"left running after the check returned: {left}"
    time.sleep(0.3)
    assert not trail.exists(), "the orphan wrote outside"
    assert_contained(outcome)


# --- gaining privileges inside ------------------------------------------------------------------------


def test_making_a_nested_user_namespace_does_not_work(runner: Runner) -> None:
    # a new user namespace would hand the program every capability over its own mounts
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.unshare(0x10000000) == 0, f'unshare: errno {ctypes.get_errno()}'  # CLONE_NEWUSER\n"
    )
    assert_contained(runner.check(program))
