"""LocalBackend: `python -m ddtree.server ...` as a child process in its own process group.

The log of every start is appended to one file; a start's marker is the file offset at launch,
so log_since_start() never shows an older start's lines. stop() signals the whole process
group (the server's workers die with it): SIGTERM, wait, SIGKILL, wait.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ServiceError, ServiceStartError
from ddtree.service.base import Deployment, http_client
from ddtree.service.dialects import Dialect, default_dialect

Log = Callable[[str], None]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _quiet(_: str) -> None:
    pass


class LocalBackend:
    """A server we launch and own: ddtree's own server by default (`module` picks another)."""

    name = "local"
    module = "ddtree.server"
    default_device = "cpu"
    can_restart = True
    owns_process = True
    has_log = True

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        draft_model_path: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str | None = None,
        max_running_requests: int | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        stop_timeout_s: float = 10.0,
        log: Log = _quiet,
        dialect: Dialect | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"port: {port} is out of range (allowed 0..65535; 0 = pick a free port)")
        if max_running_requests is not None and max_running_requests < 1:
            raise ConfigError(f"max_running_requests: {max_running_requests} must be >= 1")
        self.model_path = str(model_path)
        self.draft_model_path = None if draft_model_path is None else str(draft_model_path)
        self.host = host
        self.port = port or free_port(host)  # fixed once, so base_url is stable across restarts
        self.device = device or self.default_device
        self.max_running_requests = max_running_requests
        self.extra_args = list(extra_args)
        self._log_dir = Path(log_dir) if log_dir else None  # a temporary one is made at the first use
        self.env = dict(env or {})  # added to os.environ at each start; tests change it between starts
        self.dialect = dialect or default_dialect()  # how this server spells the knobs (flags, env)
        self.python = python
        self.stop_timeout_s = stop_timeout_s
        self.log = log
        self.deployment: Deployment | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def log_dir(self) -> Path:
        """Where the server's log goes; without log_dir, a temporary folder made when first needed (so a
        backend that never starts leaves nothing behind)."""
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="ddtree-service-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.port}.log"

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self, spec: SpecConfig) -> list[str]:
        """The exact argv for `spec` (speculative flags from the dialect; see spec_env for the rest)."""
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path]
        cmd += self.dialect.launch(spec)[0]
        if spec.speculative and self.draft_model_path:
            cmd += ["--speculative-draft-model-path", self.draft_model_path]
        cmd += ["--host", self.host, "--port", str(self.port), "--device", self.device]
        if self.max_running_requests is not None:
            cmd += ["--max-running-requests", str(self.max_running_requests)]
        return cmd + self.extra_args

    def spec_env(self, spec: SpecConfig) -> dict[str, str]:
        """The environment of a start: os.environ, `env`, and the dialect's env knobs for `spec`
        (a knob's variable that `spec` does not use is removed, so an older start's value cannot stay)."""
        env = {**os.environ, **self.env}
        for var in self.dialect.managed_env():
            env.pop(var, None)
        return env | self.dialect.launch(spec)[1]

    def start(self, spec: SpecConfig) -> Deployment:
        self.stop()
        cmd = self.command(spec)
        knob_env = self.dialect.launch(spec)[1]
        self.log(f"[{self.name}] starting: {shlex.join(cmd)}")
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - held open for the child's life
        offset = self._log_file.tell()
        shown = " ".join(f"{k}={v}" for k, v in knob_env.items())
        self._log_file.write(f"=== ddtree service start {spec.id}: {shown + ' ' if shown else ''}{shlex.join(cmd)}\n".encode())
        self._log_file.flush()
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stop() reaches every worker
                env=self.spec_env(spec),
            )
        except OSError as err:
            self._close_log()
            raise ServiceStartError(f"{self.name}: cannot launch {cmd[0]!r}: {err}") from err
        self.deployment = Deployment(spec, time.time(), cmd, marker=offset)
        return self.deployment

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.log(f"[{self.name}] pid {proc.pid} ignored SIGTERM for "
                         f"{self.stop_timeout_s:.0f} s; sending SIGKILL")
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=self.stop_timeout_s)
            # Children that outlived the leader still hold the group; make sure they go too.
            self._signal_group(proc, signal.SIGKILL)
        self._close_log()

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
            os.killpg(proc.pid, sig)  # pgid == pid because of start_new_session

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def is_alive(self) -> tuple[bool, str]:
        if self._proc is None:
            return False, "not started" if self.deployment is None else "stopped"
        code = self._proc.poll()
        if code is None:
            return True, ""
        if code < 0:
            return False, f"pid {self._proc.pid} killed by {signal.Signals(-code).name}"
        return False, f"pid {self._proc.pid} exited with code {code}"

    def log_since_start(self) -> str:
        if self.deployment is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(int(self.deployment.marker))
            return f.read().decode("utf-8", errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_since_start().splitlines()[-n:])

    def reported_settings(self) -> dict[str, Any]:
        info = fetch_server_info(self.base_url)
        if self.dialect.managed_env() and self._proc is not None:  # knobs /server_info cannot show
            info["environment"] = process_environment(self._proc.pid, self.dialect.managed_env())
        return info


def process_environment(pid: int, names: Any) -> dict[str, str]:
    """The variables of `names` in the environment process `pid` was started with (Linux /proc)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError as err:
        raise ServiceError(f"cannot read the environment of pid {pid}: {err}") from err
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs if k in names}


def fetch_server_info(base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET /server_info as a dict; ServiceError naming the url when it cannot be read."""
    url = base_url.rstrip("/") + "/server_info"
    try:
        with http_client(timeout_s) as client:
            response = client.get(url)
            response.raise_for_status()
            info = response.json()
    except (httpx.HTTPError, ValueError) as err:
        raise ServiceError(f"cannot read {url}: {type(err).__name__}: {err}") from err
    if not isinstance(info, dict):
        raise ServiceError(f"{url} returned {type(info).__name__}, expected a JSON object")
    return info
