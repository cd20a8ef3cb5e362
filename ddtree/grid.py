"""Grid files: a default server config, the server configs to sweep, and the client axes.

This module owns the YAML format of `fixtures/grids/*.yaml` and the expansion of a grid into
cells (config x context x load). It knows nothing about pytest or about services.

    default: {budget: 8, topk: 4, draft_window: 2048, block_size: 8}
    configs:                      # server-scoped: each entry is one deploy (restart)
      - {algorithm: NONE}
      - {algorithm: DFLASH, block_size: 8, draft_window: 2048}
      - {budget: 4, topk: 4, draft_window: 2048, block_size: 8}
    client: {contexts: [60, 1024], concurrency: [1, 32], max_new_tokens: 128,
             requests_per_cell: 32, repeats: 3, warmup_requests: 2}      # never restarts
    # client may also hold request_rates: [0.5, 2] (req/s, Poisson arrivals, open loop) and arrival_seed: 0
    slo: {ttft_p99_ms: 2000, tpot_p90_ms: 50, attainment_target: 0.99}  # the answer's criterion (bench/slo.py)
    quality: {problems: 5, k: 1, n: 1, threshold: 0.8, temperature: 0.0, max_new_tokens: 192,
              accept_floor: 1.5, mode: completion}   # mode chat: /v1/chat/completions, for chat models

A load is a concurrency level (closed loop) or a request rate (open loop); a grid may have either axis
or both (concurrency defaults to [1] only when there are no request_rates).

Config entries take SpecConfig's keys (algorithm, budget, topk, block_size, draft_window); keys
a config entry leaves out come from `default`, so `{budget: 4}` is the default with budget 4.
Errors name the file and the key, and are raised while parsing (before any restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ddtree.bench.arrivals import check_rate, load_label
from ddtree.bench.slo import SloSpec, parse_slo
from ddtree.config import SpecConfig
from ddtree.errors import ConfigError

GRIDS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "grids"

SERVER_KEYS = ("algorithm", "budget", "topk", "block_size", "draft_window")  # a change restarts
TOP_KEYS = ("name", "description", "default", "configs", "client", "quality", "slo")
QUALITY_MODES = ("completion", "chat")


@dataclass(frozen=True)
class QualitySpec:
    """The coding gate and acceptance floor run per config (client-scoped: no restart)."""

    problems: int = 5  # the first N of quality.gate_problems()
    k: int = 1
    n: int = 1  # samples per problem; pass@k needs n >= k
    threshold: float = 0.8  # pass@k must reach this
    temperature: float = 0.0
    max_new_tokens: int = 192
    accept_floor: float = 1.5  # token-weighted accept length floor for DFLASH/DDTREE configs
    mode: str = "completion"  # completion: raw continuation (base models); chat: /v1/chat/completions
    chat_template_kwargs: dict[str, Any] | None = None  # chat mode: sent as is, e.g. {enable_thinking: false}


@dataclass(frozen=True)
class Grid:
    """A parsed grid file. `configs` keeps the file's order with duplicates removed."""

    name: str
    default: SpecConfig
    configs: tuple[SpecConfig, ...]
    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    max_new_tokens: int = 128
    requests_per_cell: int = 32
    repeats: int = 3
    warmup_requests: int = 2
    quality: QualitySpec = field(default_factory=QualitySpec)
    path: Path | None = None
    request_rates: tuple[float, ...] = ()  # req/s, open loop
    arrival_seed: int = 0  # repeat i of a rate cell draws its arrivals from seed + i
    slo: SloSpec | None = None


@dataclass(frozen=True)
class Cell:
    """One measurement: a server config at one context length and one load.

    The load is `concurrency` requests in flight (closed loop), or, for a rate cell, `request_rate`
    requests per second sent at Poisson arrival times whatever is in flight (open loop; concurrency 0).
    """

    spec: SpecConfig
    context: int
    concurrency: int
    request_rate: float | None = None

    @property
    def load(self) -> str:
        return load_label(self.concurrency, self.request_rate)

    @property
    def config_id(self) -> str:
        return self.spec.id

    @property
    def key(self) -> str:
        """The floors-file key under the config id."""
        return f"ctx{self.context}-{self.load}"

    @property
    def id(self) -> str:
        return f"{self.spec.id}-{self.key}"


# -- parsing -----------------------------------------------------------------------------------


def resolve_grid_path(name_or_path: str | Path) -> Path:
    """A grid name (`smoke`) resolves to fixtures/grids/smoke.yaml; anything else is a path."""
    text = str(name_or_path)
    if "/" not in text and not text.endswith((".yaml", ".yml")):
        path = GRIDS_DIR / f"{text}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))
            raise ConfigError(f"config grid {text!r}: no file {path}; known grids: {known}, or give a path")
        return path
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"config grid {text!r}: file not found")
    return path


def load_grid(name_or_path: str | Path) -> Grid:
    path = resolve_grid_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    return parse_grid(data, where=str(path), name=path.stem, path=path)


def parse_grid(data: Any, *, where: str = "grid", name: str = "grid", path: Path | None = None) -> Grid:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a grid file must be a mapping with keys {list(TOP_KEYS)}")
    _no_unknown(data, TOP_KEYS, where)
    default = SpecConfig.from_dict(_mapping(data.get("default", {}), f"{where}: default"), where=f"{where}: default")
    raw_configs = data.get("configs")
    if not isinstance(raw_configs, list) or not raw_configs:
        raise ConfigError(f"{where}: configs must be a non-empty list of config mappings")
    configs: list[SpecConfig] = []
    for i, entry in enumerate(raw_configs):
        spot = f"{where}: configs[{i}]"
        merged = {**default.to_dict(), **_mapping(entry, spot)} if isinstance(entry, dict) else entry
        spec = SpecConfig.from_dict(_mapping(merged, spot), where=spot)
        if spec not in configs:
            configs.append(spec)
    client = _mapping(data.get("client", {}), f"{where}: client")
    client_keys = ("contexts", "concurrency", "request_rates", "arrival_seed", "max_new_tokens", "requests_per_cell",
                   "repeats", "warmup_requests")
    _no_unknown(client, client_keys, f"{where}: client")
    rates = _rate_list(client.get("request_rates", []), f"{where}: client.request_rates")
    slo = parse_slo(_mapping(data["slo"], f"{where}: slo"), f"{where}: slo") if "slo" in data else None
    grid = Grid(
        name=str(data.get("name", name)),
        default=default,
        configs=tuple(configs),
        contexts=_int_list(client.get("contexts", [60]), f"{where}: client.contexts", 1, 1 << 20),
        concurrency=() if rates and "concurrency" not in client
        else _int_list(client.get("concurrency", [1]), f"{where}: client.concurrency", 1, 4096),
        max_new_tokens=_int(client.get("max_new_tokens", 128), f"{where}: client.max_new_tokens", 1, 1 << 16),
        requests_per_cell=_int(client.get("requests_per_cell", 32), f"{where}: client.requests_per_cell", 1, 1 << 16),
        repeats=_int(client.get("repeats", 3), f"{where}: client.repeats", 1, 100),
        warmup_requests=_int(client.get("warmup_requests", 2), f"{where}: client.warmup_requests", 0, 1024),
        quality=_parse_quality(_mapping(data.get("quality", {}), f"{where}: quality"), f"{where}: quality"),
        path=path,
        request_rates=rates,
        arrival_seed=_int(client.get("arrival_seed", 0), f"{where}: client.arrival_seed", 0, (1 << 31) - 1),
        slo=slo,
    )
    return grid


def _parse_quality(data: dict[str, Any], where: str) -> QualitySpec:
    _no_unknown(data, tuple(f.name for f in fields(QualitySpec)), where)
    q = QualitySpec(
        problems=_int(data.get("problems", 5), f"{where}.problems", 1, 10_000),
        k=_int(data.get("k", 1), f"{where}.k", 1, 1000),
        n=_int(data.get("n", 1), f"{where}.n", 1, 1000),
        threshold=_float(data.get("threshold", 0.8), f"{where}.threshold", 0.0, 1.0),
        temperature=_float(data.get("temperature", 0.0), f"{where}.temperature", 0.0, 10.0),
        max_new_tokens=_int(data.get("max_new_tokens", 192), f"{where}.max_new_tokens", 1, 1 << 16),
        accept_floor=_float(data.get("accept_floor", 1.5), f"{where}.accept_floor", 1.0, 64.0),
        mode=str(data.get("mode", "completion")),
        chat_template_kwargs=data.get("chat_template_kwargs"),
    )
    if q.mode not in QUALITY_MODES:
        raise ConfigError(f"{where}.mode: {q.mode!r}; allowed: {', '.join(QUALITY_MODES)}")
    if q.chat_template_kwargs is not None and not isinstance(q.chat_template_kwargs, dict):
        raise ConfigError(f"{where}.chat_template_kwargs: expected a mapping, got {q.chat_template_kwargs!r}")
    if q.n < q.k:
        raise ConfigError(f"{where}.n: {q.n} samples cannot give pass@{q.k} (allowed n >= k)")
    return q


def _no_unknown(data: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return value


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {value!r} is not an integer (allowed range {low}..{high})")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {value} is out of range (allowed {low}..{high})")
    return value


def _float(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {value!r} is not a number (allowed range {low}..{high})")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {value} is out of range (allowed {low}..{high})")
    return float(value)


def _int_list(value: Any, where: str, low: int, high: int) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of integers in {low}..{high}, got {value!r}")
    out = tuple(_int(v, f"{where}[{i}]", low, high) for i, v in enumerate(value))
    return tuple(dict.fromkeys(out))  # keep order, drop repeats


def _rate_list(value: Any, where: str) -> tuple[float, ...]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of requests per second (numbers > 0), got {value!r}")
    out = tuple(check_rate(v, f"{where}[{i}]") for i, v in enumerate(value))
    return tuple(dict.fromkeys(out))


# -- cells -------------------------------------------------------------------------------------


def ordered_configs(grid: Grid) -> list[SpecConfig]:
    """Deploy order: the baseline (NONE) first, then the default, then the file's order.

    The baseline goes first because the lossless check and every speed ratio compare against it;
    the default goes next so that a sweep cut short still has the two numbers that matter most.
    Teardown then restores the default (one more start, verified from its own init line).
    """
    head = [c for c in grid.configs if not c.speculative] + [c for c in grid.configs if c == grid.default]
    return head + [c for c in grid.configs if c not in head]


def impossible_reason(
    cell: Cell, max_new_tokens: int, max_context: int | None, max_block_size: int | None = None
) -> str | None:
    """Why a cell cannot run on this model pair, or None when it can."""
    if max_context is not None and cell.context + max_new_tokens > max_context:
        return (
            f"context {cell.context} + max_new_tokens {max_new_tokens} = {cell.context + max_new_tokens} "
            f"exceeds the model's context {max_context}"
        )
    if max_block_size is not None and cell.spec.speculative and cell.spec.block_size > max_block_size:
        return f"block_size {cell.spec.block_size} is more than the drafter can run ({max_block_size})"
    return None


def cells(
    grid: Grid, max_context: int | None, max_block_size: int | None = None
) -> tuple[list[Cell], list[tuple[Cell, str]]]:
    """All cells in deploy order, split into (kept, [(removed, reason)]).

    Order: config (ordered_configs), then context, then concurrency, then request rate, so each config
    is deployed once.
    """
    kept: list[Cell] = []
    removed: list[tuple[Cell, str]] = []
    for spec in ordered_configs(grid):
        for context in sorted(grid.contexts):
            loads = [Cell(spec, context, conc) for conc in sorted(grid.concurrency)]
            loads += [Cell(spec, context, 0, rate) for rate in sorted(grid.request_rates)]
            for cell in loads:
                reason = impossible_reason(cell, grid.max_new_tokens, max_context, max_block_size)
                if reason is None:
                    kept.append(cell)
                else:
                    removed.append((cell, reason))
    return kept, removed


def with_repeats(grid: Grid, repeats: int | None) -> Grid:
    """The grid with its repeats overridden (--repeats)."""
    return grid if repeats is None else replace(grid, repeats=repeats)
