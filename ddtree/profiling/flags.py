"""The flags the profiling tools share, each defined once with one default, and the parser they hang on.

Every tool builds its parser with `tool_parser(__name__, __doc__)` and adds the common flags it takes with
the helpers below, then its own. One default each:

    --device          auto: cuda when this machine has one, else cpu. A tool measures the engine where it
                      would serve; on a machine without a GPU it still runs (the tests run every tool on the
                      CPU). "auto" is resolved by `resolve_device`, so a tool whose engine never touches a
                      device (an emulated one) can keep it off the GPU.
    --dtype           auto: the model folder's own dtype on a GPU, float32 on the CPU (what Engine.from_pretrained
                      and the server do with no --dtype): the tools time what the server would run.
    --target, --drafter   the fixture pair in fixtures/models/, by absolute path (any working folder).
    --max-new-tokens  128: the sweep's default output length.
    --repeats         3: medians of three runs.
    --configs         config ids (SpecConfig.from_id); the list is the tool's own workload.
    --context, --contexts, --concurrency   prompt tokens and requests in flight; the grid is the tool's own.
    --out             where the JSON report goes (no default: nothing is written unless asked).

Checks that need no model (`parse_configs`, `check_positive`) run before anything is loaded, and a tool reports
a bad value as `<prog>: error: <message>` with exit status 2 (`ToolParser.fail`), as argparse does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddtree.config import SpecConfig
from ddtree.errors import ConfigError

if TYPE_CHECKING:
    import torch

REPO_DIR = Path(__file__).resolve().parents[2]
FIXTURE_TARGET = REPO_DIR / "fixtures" / "models" / "target"
FIXTURE_DRAFTER = REPO_DIR / "fixtures" / "models" / "drafter"
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
MAX_NEW_TOKENS = 128
REPEATS = 3


class ToolParser(argparse.ArgumentParser):
    """An ArgumentParser whose prog is the tool's command line (`python -m ddtree.profiling.<tool>`)."""

    def fail(self, message: object) -> int:
        """Report a bad value found after parsing (a config id, a range) as argparse would; the exit status."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        return 2


def tool_parser(module: str, doc: str | None, **kwargs: object) -> ToolParser:
    """The parser of the tool `module` (its __name__), described by its docstring's first line."""
    if module == "__main__":  # run with -m: the module's own name is its spec's
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    description = doc.strip().splitlines()[0] if doc and doc.strip() else None
    return ToolParser(prog=f"python -m {module}", description=description, **kwargs)  # type: ignore[arg-type]


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when available, else cpu)")


def resolve_device(name: str) -> str:
    """--device's value with "auto" made concrete (torch is imported only for that)."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="auto: the model's dtype on GPU, float32 on CPU")


def torch_dtype(name: str) -> torch.dtype | None:
    """--dtype's value as a torch dtype; None for auto (the loader decides)."""
    if name == "auto":
        return None
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def add_models(p: argparse.ArgumentParser, help_suffix: str = "") -> None:
    p.add_argument("--target", type=Path, default=FIXTURE_TARGET, help=f"target folder{help_suffix}")
    p.add_argument("--drafter", type=Path, default=FIXTURE_DRAFTER, help=f"drafter folder{help_suffix}")


def add_configs(p: argparse.ArgumentParser, default: list[str], help: str | None = None) -> None:
    p.add_argument("--configs", nargs="+", default=default, metavar="ID", help=help)


def add_context(p: argparse.ArgumentParser, default: int = 1024) -> None:
    p.add_argument("--context", type=int, default=default, help="prompt tokens")


def add_contexts(p: argparse.ArgumentParser, default: list[int]) -> None:
    p.add_argument("--contexts", nargs="+", type=int, default=default, metavar="TOKENS", help="prompt tokens")


def add_concurrency(p: argparse.ArgumentParser, default: list[int]) -> None:
    p.add_argument("--concurrency", nargs="+", type=int, default=default, metavar="N", help="requests in flight")


def add_max_new_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)


def add_repeats(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--repeats", type=int, default=REPEATS, help=help)


def add_out(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--out", type=Path, help=help)


def parse_configs(ids: list[str]) -> list[SpecConfig]:
    """SpecConfigs for the ids, AR first (the baseline every row is compared with), duplicates dropped.

    Raises ConfigError naming every id that does not parse, before anything is loaded.
    """
    specs: list[SpecConfig] = []
    bad: list[str] = []
    for config_id in ids:
        try:
            specs.append(SpecConfig.from_id(config_id))
        except ConfigError:
            bad.append(config_id)
    if bad:
        raise ConfigError(f"--configs: unknown config id(s) {bad}; allowed forms: 'ar', "
                          "'dflash-w<window|none>-bs<block>', 'b<budget|auto>-k<topk>-w<window|none>-bs<block>'")
    specs.insert(0, SpecConfig.from_id("ar"))
    unique = {s.id: s for s in specs}
    return list(unique.values())


def check_positive(flag: str, values: list[int]) -> None:
    for v in values:
        if v < 1:
            raise ConfigError(f"{flag}: {v} is out of range (allowed >= 1)")
