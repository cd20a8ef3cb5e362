"""The server's command line (SGLang's flag names) and the resolved arguments it reports.

Everything that can be checked without loading a model is checked here, so an impossible
configuration exits with status 2 before any weight is read.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ddtree.config import AUTO, DEFAULT_MAX_BUDGET, Algorithm, SpecConfig
from ddtree.errors import ConfigError

DEFAULT_BLOCK_SIZE = 8  # when the drafter's config.json does not name its trained block size
DEFAULT_DRAFT_WINDOW = 2048
MAX_RUNNING_LIMIT = 4096
DTYPES = ("auto", "float32", "float16", "bfloat16")
FLAG_OF = {  # SpecConfig field -> the flag that sets it, so errors name what the user typed
    "budget": "--speculative-ddtree-budget",
    "max_budget": "--speculative-ddtree-max-budget",
    "topk": "--speculative-ddtree-topk",
    "block_size": "--speculative-num-draft-tokens",
    "draft_window": "--speculative-draft-window-size",
    "algorithm": "--speculative-algorithm",
}


@dataclass(frozen=True)
class ServerArgs:
    """Every resolved setting; /server_info reports these fields as they are."""

    model_path: str
    speculative_algorithm: str
    speculative_draft_model_path: str | None
    speculative_ddtree_budget: int | str  # "auto": chosen per round (ddtree.budget)
    speculative_ddtree_topk: int
    speculative_num_draft_tokens: int
    speculative_draft_window_size: int  # 0 = no window
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    max_running_requests: int = 32
    context_length: int | None = None  # None until resolved against the loaded engine
    log_level: str = "info"
    drain_timeout: float = 30.0
    served_model_name: str | None = None
    launch_command: str = ""
    speculative_ddtree_max_budget: int = DEFAULT_MAX_BUDGET  # the cap of an auto budget
    speculative_ddtree_cost_profile: str | None = None  # a measured round cost profile (JSON) for auto
    attention_backend: str = "auto"  # verify attention: auto | sdpa | triton (ddtree.engine.resolve_attention)
    disable_cuda_graph: bool = False  # run rounds eagerly on CUDA (graphs are on by default there)
    sleep_on_idle: bool = False  # block instead of polling between requests (ddtree.serving.polling)
    disable_overlap_schedule: bool = False  # never launch a round before the one before it is read

    @property
    def spec(self) -> SpecConfig:
        return spec_from_args(self)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["spec_config_id"] = self.spec.id
        return data


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ddtree.server",
        description="DDTree speculative decoding behind SGLang's HTTP API.",
    )
    p.add_argument("--model-path", required=True, help="target model folder (Hugging Face layout)")
    p.add_argument(
        "--speculative-algorithm",
        default="NONE",
        type=str.upper,
        choices=[a.value for a in Algorithm],
        help="NONE (plain decoding), DFLASH (drafter chain) or DDTREE (drafter tree)",
    )
    p.add_argument("--speculative-draft-model-path", default=None, help="DFlash drafter folder")
    p.add_argument("--speculative-ddtree-budget", type=_budget, default=8,
                   help="tree nodes per round, or 'auto': chosen each round by a verify cost model")
    p.add_argument("--speculative-ddtree-max-budget", type=int, default=DEFAULT_MAX_BUDGET,
                   help=f"the most nodes an auto budget may choose (1..63, default {DEFAULT_MAX_BUDGET})")
    p.add_argument("--speculative-ddtree-cost-profile", default=None,
                   help="JSON cost profile for an auto budget (default: measured at start-up)")
    p.add_argument("--speculative-ddtree-topk", type=int, default=4, help="candidates per depth")
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="drafter block size (default: the drafter config's block_size, else 8)",
    )
    p.add_argument(
        "--speculative-draft-window-size",
        type=int,
        default=DEFAULT_DRAFT_WINDOW,
        help="drafter attends to the last W positions; 0 = unlimited (default 2048)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--max-running-requests", type=int, default=32, help="requests decoded together")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "triton"],
                   help="verify attention: auto = the Triton tree-attention kernel on CUDA, SDPA on CPU")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode rounds eagerly (CUDA graphs are captured by default on CUDA)")
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens (default: the target's max_position_embeddings)",
    )
    p.add_argument(
        "--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"]
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM",
    )
    p.add_argument("--served-model-name", default=None, help="model name in /v1 responses")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="launch each decode round only after the one before it is read (by default, on CUDA, "
                        "the next round is launched first, so the device does not wait on the host)")
    p.add_argument("--sleep-on-idle", action="store_true",
                   help="never poll: both server processes block between events (by default they poll while "
                        "requests run and briefly after, on machines with 8 or more CPUs)")
    return p


def _budget(text: str) -> int | str:
    """--speculative-ddtree-budget: an integer or 'auto'."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'auto'") from err


def read_config(folder: str | None) -> dict[str, Any]:
    """A model folder's config.json, or {} when there is none (the loader reports real problems)."""
    if folder is None:
        return {}
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def drafter_block_size(draft_path: str | None) -> int:
    cfg = read_config(draft_path)
    for source in (cfg, cfg.get("dflash_config") or {}):
        value = source.get("block_size") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return DEFAULT_BLOCK_SIZE


def spec_from_args(args: ServerArgs) -> SpecConfig:
    return SpecConfig(
        algorithm=Algorithm.parse(args.speculative_algorithm),
        budget=args.speculative_ddtree_budget,
        topk=args.speculative_ddtree_topk,
        block_size=args.speculative_num_draft_tokens,
        draft_window=args.speculative_draft_window_size or None,
        max_budget=args.speculative_ddtree_max_budget,
    )


def _default_device() -> str:
    import torch  # imported late: parsing --help should not pay for torch

    # Asked through NVML: torch's default answer initializes CUDA in this process, and the server forks its
    # engine process afterwards (CUDA does not survive a fork).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and check the command line; raises ConfigError naming the flag and its allowed range."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    if not Path(ns.model_path).is_dir():
        raise ConfigError(f"--model-path: {ns.model_path!r} is not a directory")
    algorithm = Algorithm.parse(ns.speculative_algorithm)
    draft = ns.speculative_draft_model_path
    if algorithm is not Algorithm.NONE:
        if draft is None:
            raise ConfigError(f"--speculative-draft-model-path: required with --speculative-algorithm {algorithm.value}")
        if not Path(draft).is_dir():
            raise ConfigError(f"--speculative-draft-model-path: {draft!r} is not a directory")
    else:
        draft = None  # NONE never loads a drafter; reporting one would mislead verification
    if ns.speculative_draft_window_size < 0:
        raise ConfigError(f"--speculative-draft-window-size: {ns.speculative_draft_window_size} < 0 (0 = none)")
    if not 1 <= ns.max_running_requests <= MAX_RUNNING_LIMIT:
        raise ConfigError(f"--max-running-requests: {ns.max_running_requests} is out of range (allowed 1..{MAX_RUNNING_LIMIT})")
    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port: {ns.port} is out of range (allowed 0..65535)")
    if ns.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout: {ns.drain_timeout} < 0")
    max_positions = read_config(ns.model_path).get("max_position_embeddings")
    if ns.context_length is not None:
        if ns.context_length < 2:
            raise ConfigError(f"--context-length: {ns.context_length} is out of range (allowed >= 2)")
        if isinstance(max_positions, int) and ns.context_length > max_positions:
            raise ConfigError(
                f"--context-length: {ns.context_length} exceeds the target's max_position_embeddings {max_positions}"
            )
    block = ns.speculative_num_draft_tokens
    if block is None:
        block = drafter_block_size(draft) if algorithm is not Algorithm.NONE else DEFAULT_BLOCK_SIZE
    args = ServerArgs(
        model_path=ns.model_path,
        speculative_algorithm=algorithm.value,
        speculative_draft_model_path=draft,
        speculative_ddtree_budget=ns.speculative_ddtree_budget,
        speculative_ddtree_topk=ns.speculative_ddtree_topk,
        speculative_num_draft_tokens=block,
        speculative_draft_window_size=ns.speculative_draft_window_size,
        host=ns.host,
        port=ns.port,
        device=ns.device or _default_device(),
        dtype=ns.dtype,
        max_running_requests=ns.max_running_requests,
        context_length=ns.context_length,
        log_level=ns.log_level,
        drain_timeout=ns.drain_timeout,
        served_model_name=ns.served_model_name,
        launch_command=shlex.join([sys.executable, "-m", "ddtree.server", *argv]),
        speculative_ddtree_max_budget=ns.speculative_ddtree_max_budget,
        speculative_ddtree_cost_profile=ns.speculative_ddtree_cost_profile,
        attention_backend=ns.attention_backend,
        disable_cuda_graph=ns.disable_cuda_graph,
        sleep_on_idle=ns.sleep_on_idle,
        disable_overlap_schedule=ns.disable_overlap_schedule,
    )
    if args.attention_backend == "triton" and args.device != "cuda":
        raise ConfigError(f"--attention-backend: 'triton' needs --device cuda (got {args.device}); use auto or sdpa")
    profile = ns.speculative_ddtree_cost_profile
    if profile is not None and not Path(profile).is_file():
        raise ConfigError(f"--speculative-ddtree-cost-profile: {profile!r} is not a file")
    try:
        spec = spec_from_args(args)
    except ConfigError as err:
        field = str(err).split(":", 1)[0]
        raise ConfigError(f"{FLAG_OF.get(field, field)}: {str(err).split(':', 1)[-1].strip()}") from err
    # report the normalised values (DFLASH: budget = block - 1, topk = 1; NONE: zeros)
    return _with_spec(args, spec)


def _with_spec(args: ServerArgs, spec: SpecConfig) -> ServerArgs:
    return replace(
        args,
        speculative_ddtree_budget=spec.budget,
        speculative_ddtree_topk=spec.topk,
        speculative_num_draft_tokens=spec.block_size,
        speculative_draft_window_size=spec.draft_window or 0,
        speculative_ddtree_max_budget=spec.max_budget,
    )
