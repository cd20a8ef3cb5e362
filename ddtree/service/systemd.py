"""SystemdBackend: reconfigure a systemd unit's ExecStart flags and Environment= lines over ssh, restart it.

start(spec) issues, in order:

    systemctl cat UNIT                          which file holds the effective ExecStart
    cat PATH                                    that file's exact bytes
    sh -c 'tmp=...; cat > $tmp; sudo mv $tmp PATH'   the file with only the dialect's flags and
                                                Environment= variables changed (skipped when
                                                nothing changes)
    sudo systemctl daemon-reload
    sudo journalctl -u UNIT -n 0 --show-cursor  the journal cursor before the restart
    sudo systemctl restart UNIT

so log_since_start() is `journalctl --after-cursor CURSOR`: only this start's lines. `sudo -n`
is left out when the ssh user is root (probed once with `id -u`); a user who is not root and has
no passwordless sudo gets a ServiceError before anything changes. `ssh -F CONFIG` carries the
port, identity and known hosts. Every command goes through `runner`, which tests replace with a
simulated host.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError, ServiceError, ServiceStartError
from ddtree.service.base import Deployment
from ddtree.service.dialects import Dialect, default_dialect
from ddtree.service.local import fetch_server_info


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""


Runner = Callable[[list[str], "str | None"], CommandResult]


def subprocess_runner(argv: list[str], stdin: str | None = None, timeout_s: float = 120.0) -> CommandResult:
    """Run argv locally (ssh included in argv when remote) and capture its output."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServiceError(f"command {shlex.join(argv)!r} failed to run: {err}") from err
    return CommandResult(done.returncode, done.stdout, done.stderr)


# -- ExecStart and Environment= editing (pure text; unit-tested without a host) ----------------------
# Which flags and variables carry the knobs comes from the dialect (ddtree/service/dialects.py);
# a flag's aliases (e.g. --speculative-dflash-block-size) are set to the same value when present.
_EXEC_RE = re.compile(r"^[ \t]*ExecStart[ \t]*=", re.M)
_ENV_RE = re.compile(r"^[ \t]*Environment[ \t]*=(.*)$", re.M)


@dataclass(frozen=True)
class Token:
    text: str  # unquoted
    start: int
    end: int


def tokenize(value: str) -> list[Token]:
    """Split an ExecStart value into words with their spans; backslash-newline is whitespace."""
    tokens, i, n = [], 0, len(value)
    while i < n:
        if value[i].isspace():
            i += 1
            continue
        if value.startswith("\\\n", i):
            i += 2
            continue
        start, buf = i, []
        while i < n and not value[i].isspace() and not value.startswith("\\\n", i):
            c = value[i]
            if c in "\"'":
                close = value.find(c, i + 1)
                close = n - 1 if close < 0 else close
                buf.append(value[i + 1:close])
                i = close + 1
            elif c == "\\" and i + 1 < n:
                buf.append(value[i + 1])
                i += 2
            else:
                buf.append(c)
                i += 1
        tokens.append(Token("".join(buf), start, i))
    return tokens


def find_exec_start(unit_text: str) -> tuple[int, int] | None:
    """Span of the value of the last non-empty ExecStart= in `unit_text` (continuations included)."""
    found = None
    for m in _EXEC_RE.finditer(unit_text):
        start = end = m.end()
        while True:
            newline = unit_text.find("\n", end)
            line_end = len(unit_text) if newline < 0 else newline
            end = line_end
            if newline < 0 or not unit_text[:line_end].endswith("\\"):
                break
            end = line_end + 1  # continue onto the next line
        if unit_text[start:end].strip():
            found = (start, end)
    return found


def flag_values(value: str) -> dict[str, str | None]:
    """{flag: value} for every `--flag value` / `--flag=value` in an ExecStart value (last wins)."""
    tokens = tokenize(value)
    out: dict[str, str | None] = {}
    for k, tok in enumerate(tokens):
        if not tok.text.startswith("--"):
            continue
        if "=" in tok.text:
            flag, val = tok.text.split("=", 1)
            out[flag] = val
        else:
            nxt = tokens[k + 1].text if k + 1 < len(tokens) else None
            out[tok.text] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def rewrite_exec_start(value: str, spec: SpecConfig, dialect: Dialect | None = None) -> str:
    """`value` with the dialect's flags set for `spec`: replaced in place, missing ones added at
    the end, ones `spec` does not use removed; every other byte is kept."""
    dialect = dialect or default_dialect()
    args = dialect.launch(spec)[0]
    wanted = dict(zip(args[::2], args[1::2], strict=True))
    managed = dialect.managed_flags()
    for knob in dialect.knobs.values():
        if knob.flag in wanted:
            wanted |= {alias: wanted[knob.flag] for alias in knob.aliases}
    tokens = tokenize(value)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), non-overlapping
    seen: set[str] = set()
    k = 0
    while k < len(tokens):
        tok = tokens[k]
        flag, _, inline = tok.text.partition("=")
        if flag not in managed:
            k += 1
            continue
        seen.add(flag)
        has_value = not inline and k + 1 < len(tokens) and not tokens[k + 1].text.startswith("--")
        last = tokens[k + 1] if has_value else tok
        new = wanted.get(flag)
        if new is None:  # not used by this spec: drop the flag, its value and the space before it
            edits.append((tokens[k - 1].end if k else tok.start, last.end, ""))
        elif inline:
            edits.append((tok.start, tok.end, f"{flag}={new}"))
        elif has_value:
            edits.append((last.start, last.end, new))
        else:
            edits.append((tok.end, tok.end, f" {new}"))
        k += 2 if has_value else 1
    missing = [f for f in args[::2] if f not in seen]
    if missing:
        tail = tokens[-1].end if tokens else len(value)
        edits.append((tail, tail, "".join(f" {f} {wanted[f]}" for f in missing)))
    for start, end, text in sorted(edits, reverse=True):
        value = value[:start] + text + value[end:]
    return value


def rewrite_unit(unit_text: str, spec: SpecConfig, where: str = "unit", dialect: Dialect | None = None) -> str:
    """The unit file with its effective ExecStart and its Environment= lines set for `spec`."""
    dialect = dialect or default_dialect()
    dialect.check(spec, where=f"{where}: dialect {dialect.name}:")
    span = find_exec_start(unit_text)
    if span is None:
        raise ServiceError(f"{where}: no non-empty ExecStart= line to reconfigure")
    start, end = span
    value = unit_text[start:end]
    if spec.speculative and "--speculative-draft-model-path" not in flag_values(value) \
            and "--speculative-draft-model" not in flag_values(value):
        raise ConfigError(f"{where}: ExecStart has no --speculative-draft-model-path, so "
                          f"{spec.id} cannot run; add the drafter path to the unit first")
    text = unit_text[:start] + rewrite_exec_start(value, spec, dialect) + unit_text[end:]
    return rewrite_environment(text, dialect.launch(spec)[1], set(dialect.managed_env()))


def environment(unit_text: str) -> dict[str, str]:
    """{variable: value} of the Environment= lines of one unit file (a later assignment wins)."""
    out: dict[str, str] = {}
    for m in _ENV_RE.finditer(unit_text):
        out |= _assignments(m.group(1))
    return out


def _assignments(value: str) -> dict[str, str]:
    # systemd splits Environment= like a shell word list with its own quotes; shlex is that close
    try:
        words = shlex.split(value, comments=False)
    except ValueError:
        words = value.split()
    return dict(w.split("=", 1) for w in words if "=" in w)


def _quote_assignment(name: str, value: str) -> str:
    text = f"{name}={value}"
    if re.search(r"[\s\"'\\]", text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def rewrite_environment(unit_text: str, wanted: dict[str, str], managed: set[str]) -> str:
    """`unit_text` with every variable of `managed` removed from its Environment= lines (a line
    left empty goes) and one `Environment=VAR=value` line per entry of `wanted`, placed just before
    the effective ExecStart=; lines without a managed variable keep every byte."""
    if not managed:
        return unit_text
    out: list[str] = []
    for line in unit_text.splitlines(keepends=True):
        m = _ENV_RE.match(line.rstrip("\n"))
        if m and managed & set(_assignments(m.group(1))):
            kept = {k: v for k, v in _assignments(m.group(1)).items() if k not in managed}
            if kept:
                out.append("Environment=" + " ".join(_quote_assignment(k, v) for k, v in kept.items()) + "\n")
            continue
        out.append(line)
    text = "".join(out)
    if not wanted:
        return text
    span = find_exec_start(text)
    assert span is not None  # rewrite_unit found one before the environment was edited
    at = text.rfind("\n", 0, span[0]) + 1  # the start of the ExecStart= line
    block = "".join(f"Environment={_quote_assignment(k, v)}\n" for k, v in wanted.items())
    return text[:at] + block + text[at:]


def knobs_from_unit(unit_text: str, dialect: Dialect | None = None) -> dict[str, Any]:
    """{knob: value as written} that a unit file asks for: the dialect's flags in its effective
    ExecStart, its env knobs in Environment= lines. An absent algorithm is NONE, an absent window
    unlimited when the dialect omits the flag for that; other absent knobs are left out."""
    dialect = dialect or default_dialect()
    span = find_exec_start(unit_text)
    flags = flag_values(unit_text[span[0]:span[1]]) if span else {}
    env = environment(unit_text)
    out: dict[str, Any] = {"algorithm": None}
    if (dialect.knobs["draft_window"].unlimited or "omit") == "omit":
        out["draft_window"] = None
    for name, knob in dialect.knobs.items():
        for flag in ((knob.flag,) if knob.flag else ()) + knob.aliases:
            if flag in flags:
                out[name] = flags[flag]
                break
        if knob.env and knob.env in env:
            out[name] = env[knob.env]
    return out


def split_systemctl_cat(text: str) -> list[tuple[str, str]]:
    """[(path, content)] from `systemctl cat` output ("# /path" header before each file)."""
    files: list[tuple[str, str]] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("# /"):
            files.append((line[2:].strip(), ""))
        elif files:
            files[-1] = (files[-1][0], files[-1][1] + line)
    return files


# -- the backend -----------------------------------------------------------------------------------
class SystemdBackend:
    """A systemd unit on `ssh_host` (None = this machine); its ExecStart carries the flags."""

    name = "systemd"
    can_restart = True
    owns_process = False  # a production unit keeps running after the suite
    has_log = True
    settings_source = "unit file"

    def __init__(
        self,
        ssh_host: str | None,
        unit: str,
        *,
        runner: Runner | None = None,
        base_url: str | None = None,
        sudo: bool | None = None,
        ssh_config: str | None = None,
        query_server_info: bool = True,
        log: Callable[[str], None] = lambda _: None,
        dialect: Dialect | None = None,
    ) -> None:
        if not unit or any(c.isspace() for c in unit):
            raise ConfigError(f"unit: {unit!r} is not a systemd unit name")
        self.ssh_host = ssh_host
        self.unit = unit
        self.runner: Runner = runner or subprocess_runner
        self._base_url = base_url.rstrip("/") if base_url else None
        self.sudo = sudo  # None: probed on the first privileged command (root needs none)
        self.dialect = dialect or default_dialect()  # which ExecStart flags / Environment= lines carry the knobs
        self.ssh_config = ssh_config
        self.query_server_info = query_server_info
        self.log = log
        self.deployment: Deployment | None = None
        self.unit_path: str | None = None

    # -- commands --------------------------------------------------------------------------------
    def _argv(self, argv: Sequence[str], privileged: bool = False) -> list[str]:
        argv = (["sudo", "-n"] if privileged and self._privileged() else []) + list(argv)
        if self.ssh_host is None:
            return argv
        config = ["-F", str(self.ssh_config)] if self.ssh_config else []  # port, identity, known hosts
        return ["ssh", "-o", "BatchMode=yes", *config, self.ssh_host, shlex.join(argv)]

    def host_command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run on the unit's host as the ssh user (through ssh when the host is remote)."""
        return self._argv(argv)

    def _privileged(self) -> bool:
        """Whether root's commands need `sudo -n`: no for root, yes for anyone else whose sudo
        works without a password; otherwise a ServiceError before anything is changed."""
        if self.sudo is None:
            where = f"{self.name} {self.unit} on {self.ssh_host or 'localhost'}"
            uid = self._run(["id", "-u"]).stdout.strip()
            if uid == "0":
                self.sudo = False
            else:
                self.sudo = True
                probe = self.runner(self._argv(["true"], privileged=True), None)
                if probe.returncode != 0:
                    self.sudo = None
                    detail = (probe.stderr.strip() or probe.stdout.strip()).splitlines()[-1:] or [""]
                    missing = probe.returncode == 127 or "not found" in detail[0]
                    why = "sudo is not installed there" if missing else f"`sudo -n true` failed: {detail[0]}"
                    raise ServiceError(
                        f"{where}: the ssh user (uid {uid or '?'}) is not root and {why}; editing the unit, "
                        f"systemctl and journalctl need root: connect as root (--ssh-host root@HOST) or give "
                        f"this user passwordless sudo (a NOPASSWD sudoers rule)")
        return bool(self.sudo)

    def _run(self, argv: Sequence[str], *, privileged: bool = False, stdin: str | None = None,
             check: bool = True) -> CommandResult:
        full = self._argv(argv, privileged)
        result = self.runner(full, stdin)
        if check and result.returncode != 0:
            raise ServiceError(f"{self.name} {self.unit}: `{shlex.join(full)}` exited with "
                               f"{result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    def _effective_file(self) -> tuple[str, str]:
        """(path, text as printed by systemctl cat) of the file whose ExecStart is in effect."""
        files = split_systemctl_cat(self._run(["systemctl", "cat", self.unit]).stdout)
        for path, text in reversed(files):
            if find_exec_start(text) is not None:
                return path, text
        raise ServiceError(f"{self.name} {self.unit}: no file of the unit has a non-empty ExecStart=")

    # -- ServiceBackend --------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        if self._base_url is None:  # derive from the unit's --host/--port and the ssh host
            flags = flag_values(self._exec_start_value())
            host = flags.get("--host") or "127.0.0.1"
            if host in ("0.0.0.0", "::", "127.0.0.1", "localhost") and self.ssh_host:
                host = self.ssh_host.rpartition("@")[2]
            self._base_url = f"http://{host}:{flags.get('--port') or 30000}"
        return self._base_url

    def _exec_start_value(self) -> str:
        _, text = self._effective_file()
        span = find_exec_start(text)
        assert span is not None  # _effective_file only returns files that have one
        return text[span[0]:span[1]]

    def start(self, spec: SpecConfig) -> Deployment:
        self._privileged()  # who cannot become root learns it before anything is read or changed
        path, _ = self._effective_file()
        self.unit_path = path
        original = self._run(["cat", path]).stdout
        updated = rewrite_unit(original, spec, where=path, dialect=self.dialect)  # raises before anything changes
        if updated != original:
            self._write(path, updated)
            self._run(["systemctl", "daemon-reload"], privileged=True)
        cursor = self._cursor()
        self.log(f"[{self.name}] restarting {self.unit} on {self.ssh_host or 'localhost'} with {spec.id}")
        restart = self._run(["systemctl", "restart", self.unit], privileged=True, check=False)
        self.deployment = Deployment(spec, time.time(), self._argv(["systemctl", "restart", self.unit],
                                                                   True), marker=cursor)
        if restart.returncode != 0:
            raise ServiceStartError(f"{self.name}: systemctl restart {self.unit} exited with "
                                    f"{restart.returncode}: {restart.stderr.strip()}",
                                    log_tail=self.log_tail())
        return self.deployment

    def _write(self, path: str, text: str) -> None:
        # Write to a temp file as the ssh user, then move it into place as root in one step.
        sudo = "sudo -n " if self._privileged() else ""
        q = shlex.quote(path)
        script = (f'tmp=$(mktemp /tmp/ddtree-unit.XXXXXX) && cat > "$tmp" && chmod 0644 "$tmp" && '
                  f'{sudo}chown root:root "$tmp" && {sudo}mv "$tmp" {q}')
        self._run(["sh", "-c", script], stdin=text)

    def _cursor(self) -> str | None:
        # Some journalctl versions print no cursor for -n 0; the last entry's cursor is as good.
        for lines in ("0", "1"):
            out = self._run(["journalctl", "-u", self.unit, "-n", lines, "--show-cursor", "--no-pager"],
                            privileged=True, check=False).stdout
            if m := re.search(r"^-- cursor: (\S+)", out, re.M):
                return m.group(1)
        return None  # the unit has no journal entries yet: everything is this start's

    def stop(self) -> None:
        self._run(["systemctl", "stop", self.unit], privileged=True)

    def is_alive(self) -> tuple[bool, str]:
        state = self._run(["systemctl", "is-active", self.unit], check=False).stdout.strip()
        if state in ("active", "activating", "reloading"):
            return True, ""
        return False, f"systemctl is-active {self.unit}: {state or 'unknown'}{self._main_exit()}"

    def _main_exit(self) -> str:
        """How the unit's main process ended, from systemd's ExecMainCode/ExecMainStatus (waitid's
        CLD_EXITED=1: an exit code; CLD_KILLED=2, CLD_DUMPED=3: a signal); "" when unknown."""
        out = self._run(["systemctl", "show", self.unit, "-p", "ExecMainCode", "-p", "ExecMainStatus"],
                        check=False).stdout
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        code, status = values.get("ExecMainCode", ""), values.get("ExecMainStatus", "")
        if not status.isdigit() or code not in ("1", "2", "3"):
            return ""
        if code == "1":
            return f" (main process exited with code {status})"
        try:
            name = signal.Signals(int(status)).name
        except ValueError:
            name = f"signal {status}"
        return f" (main process killed by {name}{', core dumped' if code == '3' else ''})"

    def log_since_start(self) -> str:
        argv = ["journalctl", "-u", self.unit, "--no-pager", "-o", "short-iso"]
        if self.deployment is not None and self.deployment.marker:
            argv += ["--after-cursor", str(self.deployment.marker)]
        return self._run(argv, privileged=True, check=False).stdout

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_since_start().splitlines()[-n:])

    def reported_settings(self) -> dict[str, Any]:
        _, text = self._effective_file()
        settings: dict[str, Any] = {"unit_file": knobs_from_unit(text, self.dialect)}
        if self.query_server_info:  # the live service too, when this machine can reach it
            try:
                settings["server_info"] = fetch_server_info(self.base_url)
            except ServiceError as err:
                settings["server_info_error"] = str(err)
        return settings
