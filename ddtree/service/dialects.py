"""Server dialects: how one kind of server spells each SpecConfig knob, and where it reports it.

A dialect is a YAML file (built-ins in ddtree/service/dialect_files/, or a user's own path):

    name: sglang-ddtree
    module: sglang.launch_server          # what the sglang backend runs (python -m MODULE)
    algorithms: [NONE, DFLASH, DDTREE]    # what --speculative-algorithm accepts
    knobs:                                # algorithm, budget, topk, block_size, draft_window, max_budget
      block_size:   {flag: --speculative-num-draft-tokens, aliases: [--speculative-dflash-block-size],
                     server_info: speculative_num_draft_tokens}
      draft_window: {flag: --speculative-draft-window-size, unlimited: omit, server_info: ...}
      topk:         {env: SGLANG_DDTREE_MAX_TOPK}
      max_budget:   unsupported
    init_lines:                           # where the log of one start carries the settings
      - {prefix: "Initialized DDTree worker.", algorithms: [DDTREE],
         keys: {block_size: block_size, tree_budget: budget, max_tree_nodes: max_tree_nodes}}
    ar_line: "Initialized AR worker."     # optional: the line of a NONE start

A knob is a launch flag (`flag`, with `aliases` that must agree), an environment variable (`env`:
the launched process's environment, or an `Environment=` line of a systemd unit), or
`unsupported`; `server_info` names its /server_info key when the server reports it. `unlimited`
says how an unlimited draft window is written: a value (ddtree: "0") or `omit` (no flag). Init
line keys map a `key=value` of the line to a knob, or to `compact_cache` (window set) or
`max_tree_nodes` (budget + 1). A config whose algorithm or a knob it uses is not supported is
rejected before anything starts, naming the knob and the dialect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from ddtree.config import DEFAULT_MAX_BUDGET, Algorithm, SpecConfig
from ddtree.errors import ConfigError

DIALECTS_DIR = Path(__file__).resolve().parent / "dialect_files"
DEFAULT_DIALECT = "ddtree"
KNOBS = ("algorithm", "budget", "topk", "block_size", "draft_window", "max_budget")
DERIVED = ("compact_cache", "max_tree_nodes")  # init-line values computed from the knobs
UNSUPPORTED = "unsupported"
OMIT = "omit"
_KNOB_KEYS = ("flag", "aliases", "env", "server_info", "unlimited", "auto", "note")
_TOP_KEYS = ("name", "description", "module", "algorithms", "knobs", "init_lines", "ar_line")
_LINE_KEYS = ("prefix", "algorithms", "keys")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Knob:
    """How one SpecConfig field reaches the server; all None/False when unsupported."""

    name: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    env: str | None = None
    server_info: str | None = None
    unlimited: str | None = None  # draft_window only: the value for "no window", or OMIT
    auto: bool = False  # budget only: the server takes "auto"
    note: str = ""

    @property
    def supported(self) -> bool:
        return self.flag is not None or self.env is not None

    @property
    def where(self) -> str:
        return f"flag {self.flag}" if self.flag else f"environment variable {self.env}" if self.env else UNSUPPORTED


@dataclass(frozen=True)
class InitLine:
    prefix: str
    algorithms: tuple[Algorithm, ...]
    keys: dict[str, str]  # log key -> knob or derived name


@dataclass(frozen=True)
class Dialect:
    name: str
    knobs: dict[str, Knob]
    algorithms: tuple[Algorithm, ...]
    init_lines: tuple[InitLine, ...]
    module: str = "sglang.launch_server"
    ar_line: str | None = None
    description: str = ""
    path: Path | None = None

    # -- what a config uses ------------------------------------------------------------------
    @staticmethod
    def used_knobs(spec: SpecConfig) -> list[str]:
        """The knobs `spec` sets: none beyond the algorithm for NONE; the chain's two for DFLASH."""
        if spec.algorithm is Algorithm.NONE:
            return ["algorithm"]
        used = ["algorithm", "block_size", "draft_window"]
        if spec.algorithm is Algorithm.DDTREE:
            used += ["budget", "topk"]
            if spec.auto_budget and spec.max_budget != DEFAULT_MAX_BUDGET:
                used.append("max_budget")
        return used

    def problems(self, spec: SpecConfig) -> list[str]:
        """Why this dialect cannot run `spec` (empty when it can)."""
        if spec.algorithm not in self.algorithms:
            allowed = ", ".join(a.value for a in self.algorithms)
            return [f"knob algorithm {spec.algorithm.value}: dialect {self.name} does not support it "
                    f"(supported: {allowed})"]
        out = []
        for name in self.used_knobs(spec):
            knob = self.knobs[name]
            if not knob.supported:
                why = f" ({knob.note})" if knob.note else ""
                out.append(f"knob {name} ({self.value_of(spec, name)!r}): dialect {self.name} cannot set it{why}")
            elif name == "budget" and spec.auto_budget and not knob.auto:
                out.append(f"knob budget ('auto'): dialect {self.name} takes a fixed budget only")
        return out

    def check(self, spec: SpecConfig, where: str = "config") -> None:
        problems = self.problems(spec)
        if problems:
            raise ConfigError(f"{where} {spec.id}: " + "; ".join(problems))

    @staticmethod
    def value_of(spec: SpecConfig, name: str) -> Any:
        if name == "algorithm":
            return spec.algorithm.value
        if name == "compact_cache":
            return spec.draft_window is not None
        if name == "max_tree_nodes":
            return spec.max_nodes
        return getattr(spec, name)

    # -- launching ---------------------------------------------------------------------------
    def _text(self, name: str, spec: SpecConfig) -> str | None:
        """The flag/env text of knob `name` for `spec`; None = leave the flag out."""
        value = self.value_of(spec, name)
        if name == "draft_window" and value is None:
            unlimited = self.knobs[name].unlimited or OMIT
            return None if unlimited == OMIT else unlimited
        return str(value)

    def launch(self, spec: SpecConfig) -> tuple[list[str], dict[str, str]]:
        """(flags, environment) that start the server with `spec`; every managed env var the
        config does not use is absent from the dict (see managed_env)."""
        self.check(spec)
        args: list[str] = []
        env: dict[str, str] = {}
        for name in self.used_knobs(spec):
            knob, text = self.knobs[name], self._text(name, spec)
            if text is None:
                continue
            if knob.flag:
                args += [knob.flag, text]
            else:
                env[str(knob.env)] = text
        return args, env

    def managed_flags(self) -> dict[str, str]:
        """{flag or alias: knob} for every flag a reconfiguration may set or remove."""
        out = {}
        for knob in self.knobs.values():
            for flag in ((knob.flag,) if knob.flag else ()) + knob.aliases:
                out[flag] = knob.name
        return out

    def managed_env(self) -> dict[str, str]:
        """{variable: knob} for every environment variable a reconfiguration may set or remove."""
        return {str(k.env): k.name for k in self.knobs.values() if k.env}

    # -- verification ------------------------------------------------------------------------
    def expected(self, spec: SpecConfig) -> dict[str, Any]:
        """{knob: value} of every knob `spec` uses (the values a service must show)."""
        return {name: self.value_of(spec, name) for name in self.used_knobs(spec)}

    def lines_for(self, spec: SpecConfig) -> list[InitLine]:
        return [line for line in self.init_lines if spec.algorithm in line.algorithms]


def _knob(name: str, raw: Any, where: str) -> Knob:
    if raw is None or raw == UNSUPPORTED:
        return Knob(name)
    if isinstance(raw, dict) and set(raw) <= {"unsupported", "note"} and raw.get("unsupported"):
        return Knob(name, note=str(raw.get("note", "")))
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with flag/env/server_info or '{UNSUPPORTED}', got {raw!r}")
    unknown = sorted(set(raw) - set(_KNOB_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(_KNOB_KEYS)}")
    flag, env = raw.get("flag"), raw.get("env")
    if bool(flag) == bool(env):
        raise ConfigError(f"{where}: give exactly one of flag (a --long-flag) or env (a variable name)")
    if flag and not str(flag).startswith("--"):
        raise ConfigError(f"{where}.flag: {flag!r} is not a --long-flag")
    if env and not _ENV_NAME.match(str(env)):
        raise ConfigError(f"{where}.env: {env!r} is not an environment variable name")
    aliases = raw.get("aliases") or []
    if not isinstance(aliases, list) or not all(str(a).startswith("--") for a in aliases):
        raise ConfigError(f"{where}.aliases: expected a list of --long-flags, got {aliases!r}")
    unlimited = raw.get("unlimited")
    if unlimited is not None and name != "draft_window":
        raise ConfigError(f"{where}.unlimited: only draft_window has an unlimited value")
    if raw.get("auto") and name != "budget":
        raise ConfigError(f"{where}.auto: only budget can be 'auto'")
    return Knob(name, str(flag) if flag else None, tuple(str(a) for a in aliases), str(env) if env else None,
                raw.get("server_info"), None if unlimited is None else str(unlimited), bool(raw.get("auto")),
                str(raw.get("note", "")))


def _algorithms(raw: Any, where: str) -> tuple[Algorithm, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: expected a non-empty list of NONE, DFLASH, DDTREE")
    try:
        return tuple(Algorithm.parse(a) for a in raw)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err


def parse_dialect(data: Any, where: str, path: Path | None = None) -> Dialect:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a dialect file must be a mapping with keys {list(_TOP_KEYS)}")
    unknown = sorted(str(k) for k in set(data) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(_TOP_KEYS)}")
    raw_knobs = data.get("knobs")
    if not isinstance(raw_knobs, dict):
        raise ConfigError(f"{where}: knobs must map each of {list(KNOBS)} to flag/env or '{UNSUPPORTED}'")
    extra = sorted(set(raw_knobs) - set(KNOBS))
    if extra:
        raise ConfigError(f"{where}: knobs: unknown knob(s) {extra}; allowed: {list(KNOBS)}")
    missing = [k for k in KNOBS if k not in raw_knobs and k != "max_budget"]
    if missing:
        raise ConfigError(f"{where}: knobs: missing {missing} (write '{UNSUPPORTED}' for a knob the server lacks)")
    knobs = {name: _knob(name, raw_knobs.get(name), f"{where}: knobs.{name}") for name in KNOBS}
    if not knobs["algorithm"].supported:
        raise ConfigError(f"{where}: knobs.algorithm must be a flag or an env variable")
    lines = []
    for i, raw in enumerate(data.get("init_lines") or []):
        spot = f"{where}: init_lines[{i}]"
        if not isinstance(raw, dict) or not raw.get("prefix"):
            raise ConfigError(f"{spot}: expected a mapping with prefix, algorithms and keys")
        bad = sorted(set(raw) - set(_LINE_KEYS))
        if bad:
            raise ConfigError(f"{spot}: unknown key(s) {bad}; allowed: {list(_LINE_KEYS)}")
        keys = raw.get("keys") or {}
        wrong = {k: v for k, v in keys.items() if v not in KNOBS + DERIVED}
        if not isinstance(keys, dict) or wrong:
            raise ConfigError(f"{spot}.keys: values must be knobs or {list(DERIVED)}, got {wrong or keys!r}")
        lines.append(InitLine(str(raw["prefix"]), _algorithms(raw.get("algorithms", ["DFLASH", "DDTREE"]), f"{spot}.algorithms"),
                              {str(k): str(v) for k, v in keys.items()}))
    name = str(data.get("name") or (path.stem if path else "dialect"))
    return Dialect(name=name, knobs=knobs, algorithms=_algorithms(data.get("algorithms"), f"{where}: algorithms"),
                   init_lines=tuple(lines), module=str(data.get("module") or "sglang.launch_server"),
                   ar_line=data.get("ar_line"), description=str(data.get("description") or ""), path=path)


def builtin_dialects() -> list[str]:
    return sorted(p.stem for p in DIALECTS_DIR.glob("*.yaml"))


def load_dialect(name_or_path: str | Path | None) -> Dialect:
    """A built-in dialect by name, or a user's YAML file by path; errors name the file and key."""
    text = str(name_or_path or DEFAULT_DIALECT)
    if "/" not in text and not text.endswith((".yaml", ".yml")):
        path = DIALECTS_DIR / f"{text}.yaml"
        if not path.is_file():
            raise ConfigError(f"server dialect {text!r}: not a built-in ({', '.join(builtin_dialects())}); "
                              "or give the path of a dialect YAML file")
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(f"server dialect {text!r}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    return parse_dialect(data, str(path), path)


@lru_cache(maxsize=1)
def default_dialect() -> Dialect:
    """The ddtree dialect (this project's server), what a backend without one speaks."""
    return load_dialect(DEFAULT_DIALECT)
