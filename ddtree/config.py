"""SpecConfig: one speculative-decoding configuration, validated, with a short stable id.

The id is what pytest shows and `-k` matches, what result files are keyed by and what floors
files use:

    DDTREE   b{budget}-k{topk}-w{window|none}-bs{block_size}     e.g. b8-k4-w2048-bs8
             bauto[{max_budget}]-k{topk}-...                      e.g. bauto-k4-w2048-bs8 (max 32)
    DFLASH   dflash-w{window|none}-bs{block_size}                e.g. dflash-w2048-bs8
    NONE     ar

`SpecConfig.from_id(cfg.id) == cfg` for every valid config. DFLASH is DDTree's special case
"topk 1, budget block_size - 1" (a chain), so its budget and topk are normalised to that;
NONE ignores every speculative field, so they are normalised to zero. `budget="auto"` lets the
engine choose the tree size every round (ddtree.budget) up to `max_budget`, which only an auto
config uses (a fixed budget normalises it to the default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from ddtree.errors import ConfigError

MAX_BUDGET = 512  # the heap and the verify width stay sane; bitmask kernels need <= 63
MAX_TOPK = 1024
MIN_BLOCK_SIZE = 2  # the bonus token plus at least one drafted position
MAX_BLOCK_SIZE = 64
MAX_DRAFT_WINDOW = 1 << 20
AUTO = "auto"  # budget chosen per round by the engine's cost model (ddtree.budget)
DEFAULT_MAX_BUDGET = 32
MAX_AUTO_BUDGET = 63  # auto trees stay within one int64 bitmask word (root + 63 nodes)


class Algorithm(str, Enum):
    NONE = "NONE"
    DFLASH = "DFLASH"
    DDTREE = "DDTREE"

    @classmethod
    def parse(cls, value: str | Algorithm) -> Algorithm:
        if isinstance(value, Algorithm):
            return value
        try:
            return cls(str(value).upper())
        except ValueError as err:
            allowed = ", ".join(a.value for a in cls)
            raise ConfigError(f"algorithm: unknown value {value!r}; allowed: {allowed}") from err


def parse_window(value: Any) -> int | None:
    """A draft window from a flag, a YAML value or an id part: an int >= 1, or none/null/0 = unlimited."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"draft_window: {value!r} is not a window; use an integer or 'none'")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("none", "null", "", "0", "unlimited"):
            return None
        try:
            value = int(text)
        except ValueError as err:
            raise ConfigError(f"draft_window: {value!r} is not an integer or 'none'") from err
    if not isinstance(value, int):
        raise ConfigError(f"draft_window: {value!r} is not an integer or 'none'")
    return None if value == 0 else value


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: {value!r} is not an integer (allowed range {low}..{high})")
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is out of range (allowed {low}..{high})")


@dataclass(frozen=True)
class SpecConfig:
    """What the target verifies each round and how the drafter proposes it.

    budget       non-root tree nodes verified per round (DDTREE); the chain uses block_size - 1;
                 "auto": chosen per round (1..max_budget) to maximise expected tokens per second
    topk         candidate tokens kept per depth (K = min(topk, vocab))
    block_size   drafter block: the bonus token plus block_size - 1 drafted positions (max depth)
    draft_window the drafter attends to the last W committed positions; None = unlimited.
                 Changes speed and acceptance, never the output.
    """

    algorithm: Algorithm = Algorithm.DDTREE
    budget: int | str = 8
    topk: int = 4
    block_size: int = 8
    draft_window: int | None = 2048
    max_budget: int = DEFAULT_MAX_BUDGET  # the cap of an auto budget (1..63); unused otherwise

    def __post_init__(self) -> None:
        algorithm = Algorithm.parse(self.algorithm)
        object.__setattr__(self, "algorithm", algorithm)
        if algorithm is Algorithm.NONE:
            for name in ("budget", "topk", "block_size"):
                object.__setattr__(self, name, 0)
            object.__setattr__(self, "draft_window", None)
            object.__setattr__(self, "max_budget", DEFAULT_MAX_BUDGET)
            return
        _check_int("block_size", self.block_size, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
        window = parse_window(self.draft_window)
        if window is not None:
            _check_int("draft_window", window, self.block_size, MAX_DRAFT_WINDOW)
        object.__setattr__(self, "draft_window", window)
        if algorithm is Algorithm.DFLASH:
            object.__setattr__(self, "budget", self.block_size - 1)
            object.__setattr__(self, "topk", 1)
            object.__setattr__(self, "max_budget", DEFAULT_MAX_BUDGET)
            return
        if isinstance(self.budget, str) and self.budget.strip().lower() == AUTO:
            object.__setattr__(self, "budget", AUTO)
            _check_int("max_budget", self.max_budget, 1, MAX_AUTO_BUDGET)
        else:
            if isinstance(self.budget, str):
                raise ConfigError(f"budget: {self.budget!r} is not an integer (allowed range 1..{MAX_BUDGET}) or 'auto'")
            _check_int("budget", self.budget, 1, MAX_BUDGET)
            object.__setattr__(self, "max_budget", DEFAULT_MAX_BUDGET)  # only an auto budget uses it
        _check_int("topk", self.topk, 1, MAX_TOPK)

    # -- derived -------------------------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return self.algorithm is not Algorithm.NONE

    @property
    def depth(self) -> int:
        """Drafted positions per round (L); 0 without speculation."""
        return max(self.block_size - 1, 0)

    @property
    def auto_budget(self) -> bool:
        """True when the engine chooses the budget every round (budget == "auto")."""
        return self.budget == AUTO

    @property
    def budget_cap(self) -> int:
        """The most non-root nodes a round may verify: the budget, or max_budget when auto."""
        return self.max_budget if self.budget == AUTO else int(self.budget)

    @property
    def max_nodes(self) -> int:
        """Tree nodes verified per round at most, root included (the widest verify)."""
        return self.budget_cap + 1 if self.speculative else 1

    @property
    def id(self) -> str:
        if self.algorithm is Algorithm.NONE:
            return "ar"
        window = "none" if self.draft_window is None else str(self.draft_window)
        if self.algorithm is Algorithm.DFLASH:
            return f"dflash-w{window}-bs{self.block_size}"
        budget = self.budget
        if budget == AUTO and self.max_budget != DEFAULT_MAX_BUDGET:
            budget = f"{AUTO}{self.max_budget}"
        return f"b{budget}-k{self.topk}-w{window}-bs{self.block_size}"

    def __str__(self) -> str:
        return self.id

    # -- parsing -------------------------------------------------------------------------------
    _ID_TREE = re.compile(r"^b(\d+|auto\d*)-k(\d+)-w(none|\d+)-bs(\d+)$")
    _ID_CHAIN = re.compile(r"^dflash-w(none|\d+)-bs(\d+)$")

    @classmethod
    def from_id(cls, config_id: str) -> SpecConfig:
        text = config_id.strip().lower()
        if text in ("ar", "none"):
            return cls(algorithm=Algorithm.NONE)
        if m := cls._ID_TREE.match(text):
            budget, topk, window, block = m.groups()
            if budget.startswith(AUTO):
                cap = int(budget[len(AUTO):] or DEFAULT_MAX_BUDGET)
                return cls(Algorithm.DDTREE, AUTO, int(topk), int(block), parse_window(window), max_budget=cap)
            return cls(Algorithm.DDTREE, int(budget), int(topk), int(block), parse_window(window))
        if m := cls._ID_CHAIN.match(text):
            window, block = m.groups()
            return cls(Algorithm.DFLASH, block_size=int(block), draft_window=parse_window(window))
        raise ConfigError(
            f"config id {config_id!r} is not one of 'b<budget|auto>-k<topk>-w<window|none>-bs<block>', "
            "'dflash-w<window|none>-bs<block>' or 'ar'"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config") -> SpecConfig:
        """Build from a grid entry; unknown keys are an error naming the key and `where`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        kwargs = dict(data)
        if "draft_window" in kwargs:
            kwargs["draft_window"] = parse_window(kwargs["draft_window"])
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "algorithm": self.algorithm.value,
            "budget": self.budget,
            "topk": self.topk,
            "block_size": self.block_size,
            "draft_window": self.draft_window,
        }
        if self.auto_budget:  # a fixed budget ignores max_budget: keep its dict as it always was
            data["max_budget"] = self.max_budget
        return data

    def server_args(self) -> list[str]:
        """The speculative flags of `python -m ddtree.server` / sglang for this config."""
        args = ["--speculative-algorithm", self.algorithm.value]
        if not self.speculative:
            return args
        args += ["--speculative-num-draft-tokens", str(self.block_size)]
        args += ["--speculative-draft-window-size", str(self.draft_window or 0)]
        if self.algorithm is Algorithm.DDTREE:
            args += ["--speculative-ddtree-budget", str(self.budget)]
            args += ["--speculative-ddtree-topk", str(self.topk)]
            if self.auto_budget and self.max_budget != DEFAULT_MAX_BUDGET:
                args += ["--speculative-ddtree-max-budget", str(self.max_budget)]
        return args


DEFAULT_SPEC = SpecConfig()  # the recommended serving default: b8-k4-w2048-bs8
