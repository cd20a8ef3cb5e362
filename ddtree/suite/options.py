"""The suite's command-line options and ini keys, parsed once into a validated SuiteOptions.

Every option lives in one `getgroup("ddtree")`; one help constant serves the flag and its ini
key. Bad values raise pytest.UsageError naming the option and the accepted format, before
anything is collected or started.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.baseline import check_tolerance
from ddtree.errors import ConfigError
from ddtree.grid import Grid, load_grid, with_repeats
from ddtree.service.dialects import Dialect, default_dialect, load_dialect
from ddtree.service.factory import BACKENDS
from ddtree.suite.floors import NO_FLOORS, Floors, load_floors

REPO_DIR = Path(__file__).resolve().parents[2]
FIXTURE_TARGET = REPO_DIR / "fixtures" / "models" / "target"
FIXTURE_DRAFTER = REPO_DIR / "fixtures" / "models" / "drafter"
DEFAULT_GRID = "smoke"
DEFAULT_FLOORS = {"cpu": "cpu-fixture", "cuda": "h200-fixture"}  # by device kind: a GPU run is never judged by CPU floors
DEFAULT_STARTUP_TIMEOUT_S = 600.0

HELP = {
    "config_grid": "grid to sweep: a name in fixtures/grids (smoke, default, full) or a path to a YAML file",
    "service": f"service backend, one of {'|'.join(BACKENDS)} (default local: python -m ddtree.server)",
    "service_url": "base URL of an already running service (--service url), e.g. http://host:30000",
    "ssh_host": "ssh host of the systemd unit (--service systemd)",
    "systemd_unit": "systemd unit name (--service systemd), e.g. sglang.service",
    "model_path": "target model folder (default: fixtures/models/target)",
    "draft_model_path": "DFlash drafter folder (default: fixtures/models/drafter)",
    "device": "device of the local/sglang service: cpu or cuda[:N] (default: cuda if available, else cpu)",
    "results_dir": "where cell files and summaries go (default: results/<timestamp> under the rootdir)",
    "floors": "floors profile in fixtures/floors, a path to a floors YAML, or none (default: the fixture pair's on "
              "the local or fake service, cpu-fixture with --device cpu, h200-fixture with cuda; else none)",
    "floor_tolerance": "fraction one cell's pace-normalised tok/s may fall below its floor, in [0, 1) (default: the "
                       "floors file's `tolerance`, else 0.15; a config's median has its own, config_tolerance)",
    "update_floors": "record this run's medians (tok/s with the pace they were measured at, acceptance, speed-up over "
                     "AR) as the floors of the profile (written at session end)",
    "require_floors": "fail every cell that has no floor in the floors file (the summary lists them either way)",
    "repeats": "repeats per cell, an integer >= 1 (default: the grid's, else 3)",
    "startup_timeout": "seconds to wait for the service to become ready (default 600)",
    "resume": "skip cells whose result file already exists in --results-dir",
    "service_hosts": "comma-separated hosts, one per xdist worker (worker i takes host i)",
    "max_context": "model context length used to drop impossible cells (default: the target's config.json)",
    "server_dialect": "kind of server: a built-in dialect (ddtree, sglang-dflash, sglang-ddtree) or a path to a dialect "
                      "YAML file; maps each SpecConfig knob to a flag or an environment variable (default: ddtree)",
    "tokenize": "how prompt tokens are counted: local (the target's tokenizer.json), service (the service's /tokenize) "
                "or auto (local when --model-path has a tokenizer.json, else service; the default)",
    "ssh_config": "ssh config file for --ssh-host (ssh -F PATH: port, identity, known hosts)",
    "client_processes": "HTTP client processes that share each cell's concurrency (default 1; one asyncio client "
                        "sends a wave's requests one after another, so at high concurrency it can set the pace)",
    "start_retries": "extra start attempts for a config whose start failed, 0 or 1 (default 0: one start per config)",
    "unsafe_exec": "where namespaces cannot be made (no bubblewrap, user namespaces disabled), run the coding gate's "
                   "model-written programs with best-effort isolation instead of refusing; the gate's record and the "
                   "summary say so (model code can then read your files, reach the network and signal your processes)",
}
SUITE_INI = "ddtree_suite"
SUITE_INI_HELP = "true: this project runs the ddtree suite (its hooks act even without a ddtree option)"
TOKENIZE_MODES = ("auto", "local", "service")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddtree", "ddtree sweep: grid, service backend, results and floors")

    def opt(name: str, ini: bool = True, **kwargs: Any) -> None:
        dest = name.replace("-", "_")
        group.addoption(f"--{name}", dest=f"ddtree_{dest}", help=HELP[dest], **kwargs)
        if ini:
            parser.addini(f"ddtree_{dest}", HELP[dest], default=None)

    opt("config-grid", metavar="NAME|PATH")
    opt("service", metavar="|".join(BACKENDS))
    opt("service-url", metavar="URL")
    opt("ssh-host", metavar="HOST")
    opt("systemd-unit", metavar="UNIT")
    opt("model-path", metavar="DIR")
    opt("draft-model-path", metavar="DIR")
    opt("device", metavar="cpu|cuda")
    opt("results-dir", metavar="DIR")
    opt("floors", metavar="PATH|PROFILE")
    opt("floor-tolerance", metavar="FRACTION")
    opt("update-floors", ini=False, action="store_true", default=False)
    opt("require-floors", ini=False, action="store_true", default=False)
    opt("repeats", ini=False, metavar="N")
    opt("startup-timeout", metavar="SECONDS")
    opt("resume", ini=False, action="store_true", default=False)
    opt("service-hosts", metavar="H1,H2,...")
    opt("max-context", ini=False, metavar="TOKENS")
    opt("server-dialect", metavar="NAME|PATH")
    opt("tokenize", metavar="|".join(TOKENIZE_MODES))
    opt("ssh-config", metavar="PATH")
    opt("start-retries", metavar="N")
    opt("client-processes", metavar="N")
    opt("unsafe-exec", ini=False, action="store_true", default=False)
    parser.addini(SUITE_INI, SUITE_INI_HELP, type="bool", default=False)


def option_flags(parser: pytest.Parser) -> list[str]:
    """Every long flag of the ddtree group (the rootdir repair looks for them)."""
    group = parser.getgroup("ddtree")
    return [name for option in group.options for name in option.names() if name.startswith("--")]


def suite_requested(config: pytest.Config) -> bool:
    """True when this run is the suite's: the ini says so, or a ddtree flag or ini key was given.

    Otherwise (another project's run with ddtree installed) every hook of the plugin stays inert.
    """
    if config.getini(SUITE_INI):
        return True
    for name, value in vars(config.option).items():
        if name.startswith("ddtree_") and value not in (None, False):
            return True
    for key in HELP:
        try:
            if config.getini(f"ddtree_{key}"):
                return True
        except ValueError:  # flags without an ini key
            continue
    return False

@dataclass
class SuiteOptions:
    """Every ddtree option, validated; `grid_explicit` says --config-grid was given."""

    grid: Grid
    grid_explicit: bool
    service: str
    service_url: str | None
    ssh_host: str | None
    systemd_unit: str | None
    model_path: Path
    draft_model_path: Path
    device: str
    results_dir: Path
    floors: Floors
    tolerance: float
    update_floors: bool
    repeats: int
    startup_timeout_s: float
    resume: bool
    service_hosts: list[str] = field(default_factory=list)
    max_context: int | None = None
    model_path_given: bool = False  # --model-path was passed (auto tokenization may read it)
    unsafe_exec: bool = False  # the coding gate may fall back to best-effort isolation
    dialect: Dialect = field(default_factory=default_dialect)
    tokenize: str = "auto"
    ssh_config: str | None = None
    start_retries: int = 0
    client_processes: int = 1
    require_floors: bool = False


def raw_option(config: pytest.Config, dest: str) -> tuple[Any, str]:
    """(value, where it came from) for option `dest`: the flag first, then the ini key."""
    value = config.getoption(f"ddtree_{dest}")
    if value is not None:
        return value, "--" + dest.replace("_", "-")
    try:
        ini = config.getini(f"ddtree_{dest}")
    except ValueError:  # flags without an ini key
        return None, "--" + dest.replace("_", "-")
    return (ini or None), f"ini key ddtree_{dest}"


def _usage(where: str, value: Any, accepted: str, err: Exception | None = None) -> pytest.UsageError:
    detail = f" ({err})" if err else ""
    return pytest.UsageError(f"{where}: {value!r} is not valid; expected {accepted}{detail}")


def _positive_number(config: pytest.Config, dest: str, default: float, integer: bool) -> float:
    value, where = raw_option(config, dest)
    if value is None:
        return default
    kind = "an integer >= 1" if integer else "a number of seconds > 0"
    try:
        number = int(value) if integer else float(value)
    except (TypeError, ValueError) as err:
        raise _usage(where, value, kind) from err
    if number <= 0 or (integer and number < 1):
        raise _usage(where, value, kind)
    return number


def default_device() -> str:
    """cuda when torch sees a GPU, else cpu (torch is imported only when the flag is absent)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_max_context(model_path: Path) -> int | None:
    """The target's max_position_embeddings, or None when the folder or its config.json is not there (yet).

    Read here with json: ddtree.models would load torch and the Triton kernels into the pytest process.
    """
    try:
        data = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, unreadable or not JSON: as if unknown
        return None
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_options(config: pytest.Config, results_dir: Path | None = None) -> SuiteOptions:
    """Read and validate every option; `results_dir` overrides (xdist workers get the controller's)."""
    grid_arg, grid_where = raw_option(config, "config_grid")
    try:
        grid = load_grid(grid_arg or DEFAULT_GRID)
    except ConfigError as err:
        raise pytest.UsageError(f"{grid_where}: {err}") from err
    repeats = _positive_number(config, "repeats", grid.repeats, integer=True)
    grid = with_repeats(grid, int(repeats))

    service, where = raw_option(config, "service")
    service = (service or "local").lower()
    if service not in BACKENDS:
        raise _usage(where, service, f"one of {', '.join(BACKENDS)}")
    service_url, where = raw_option(config, "service_url")
    if service == "url" and not service_url:
        raise pytest.UsageError("--service url needs --service-url http://HOST:PORT")
    if service_url and not str(service_url).startswith(("http://", "https://")):
        raise _usage(where, service_url, "an http:// or https:// URL")
    dialect = _dialect(config, service, grid)
    tokenize, where = raw_option(config, "tokenize")
    tokenize = str(tokenize or "auto").lower()
    if tokenize not in TOKENIZE_MODES:
        raise _usage(where, tokenize, f"one of {', '.join(TOKENIZE_MODES)}")
    retries, where = raw_option(config, "start_retries")
    if retries is not None and str(retries) not in ("0", "1"):
        raise _usage(where, retries, "0 or 1 (extra start attempts per config)")
    ssh_config, where = raw_option(config, "ssh_config")
    if ssh_config and not Path(ssh_config).expanduser().is_file():
        raise _usage(where, ssh_config, "an existing ssh config file")
    ssh_host, _ = raw_option(config, "ssh_host")
    systemd_unit, _ = raw_option(config, "systemd_unit")
    if service == "systemd" and not (ssh_host and systemd_unit):
        raise pytest.UsageError("--service systemd needs --ssh-host HOST and --systemd-unit UNIT")

    device, where = raw_option(config, "device")
    device = device or default_device()
    if device != "cpu" and not str(device).startswith("cuda"):
        raise _usage(where, device, "cpu, cuda or cuda:N")

    kind = "cuda" if str(device).startswith("cuda") else "cpu"  # the pace probe's kind (ddtree.bench.pace)
    model_raw, _ = raw_option(config, "model_path")
    floors_arg, where = raw_option(config, "floors")
    # the fixture profiles hold the fixture pair's numbers on our server: another model or server has none yet
    fixture_pair = service in ("local", "fake") and not model_raw
    try:
        floors = load_floors(floors_arg or (DEFAULT_FLOORS[kind] if fixture_pair else NO_FLOORS))
    except ConfigError as err:
        raise pytest.UsageError(f"{where}: {err}") from err
    if config.getoption("ddtree_update_floors") and floors.none:
        raise pytest.UsageError(f"--update-floors needs --floors PROFILE|PATH to record into (the default for "
                                f"--service {service}{' with --model-path' if model_raw else ''} is none)")
    floors_kind = (floors.probe or "").partition("-v")[0]
    if floors.table and floors_kind and floors_kind != kind and not config.getoption("ddtree_update_floors"):
        # such floors pass or fail every cell whatever the code does: a GPU is far above CPU floors
        raise pytest.UsageError(
            f"{where}: floors {floors.profile} were measured on {floors_kind} (probe {floors.probe}), this run is "
            f"on {kind} (--device {device}); pass --floors {DEFAULT_FLOORS[kind]} or a floors file recorded on "
            f"{kind} (--update-floors records one)")
    tol_value, where = raw_option(config, "floor_tolerance")
    tolerance = floors.tolerance  # the file's, which defaults to DEFAULT_TOLERANCE
    if tol_value is not None:
        try:
            tolerance = check_tolerance(float(tol_value), where)
        except ValueError as err:  # float() or check_tolerance's ConfigError
            raise _usage(where, tol_value, "a fraction in [0, 1), e.g. 0.15") from err

    if results_dir is None:
        raw_dir, _ = raw_option(config, "results_dir")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        results_dir = Path(raw_dir) if raw_dir else config.rootpath / "results" / stamp
        if not results_dir.is_absolute():
            results_dir = config.rootpath / results_dir

    draft_raw, _ = raw_option(config, "draft_model_path")
    model_path = Path(model_raw) if model_raw else FIXTURE_TARGET
    hosts_raw, where = raw_option(config, "service_hosts")
    hosts = [h.strip() for h in str(hosts_raw or "").split(",") if h.strip()]
    if hosts_raw and not hosts:
        raise _usage(where, hosts_raw, "a comma-separated list of hosts, e.g. gpu1,gpu2")
    max_context_flag, _ = raw_option(config, "max_context")
    max_context = (
        int(_positive_number(config, "max_context", 1, integer=True))
        if max_context_flag is not None
        else model_max_context(model_path) if service in ("local", "sglang") else None
    )
    return SuiteOptions(
        grid=grid,
        grid_explicit=grid_arg is not None,
        service=service,
        service_url=service_url,
        ssh_host=ssh_host,
        systemd_unit=systemd_unit,
        model_path=model_path,
        draft_model_path=Path(draft_raw) if draft_raw else FIXTURE_DRAFTER,
        device=str(device),
        results_dir=results_dir,
        floors=floors,
        tolerance=tolerance,
        update_floors=bool(config.getoption("ddtree_update_floors")),
        repeats=int(repeats),
        startup_timeout_s=_positive_number(config, "startup_timeout", DEFAULT_STARTUP_TIMEOUT_S, integer=False),
        resume=bool(config.getoption("ddtree_resume")),
        service_hosts=hosts,
        max_context=max_context,
        model_path_given=model_raw is not None,
        unsafe_exec=bool(config.getoption("ddtree_unsafe_exec")),
        dialect=dialect,
        tokenize=tokenize,
        ssh_config=str(Path(ssh_config).expanduser()) if ssh_config else None,
        start_retries=0 if retries is None else int(retries),
        client_processes=int(_positive_number(config, "client_processes", 1, integer=True)),
        require_floors=bool(config.getoption("ddtree_require_floors")),
    )


def _dialect(config: pytest.Config, service: str, grid: Grid) -> Dialect:
    """The --server-dialect (sglang-ddtree for --service sglang, else ddtree), with every config of
    the grid checked against it: a knob it cannot set is a usage error naming knob and dialect."""
    value, where = raw_option(config, "server_dialect")
    try:
        dialect = load_dialect(value or ("sglang-ddtree" if service == "sglang" else "ddtree"))
    except ConfigError as err:
        raise pytest.UsageError(f"{where}: {err}") from err
    problems = [f"{'default' if spec is grid.default else 'config'} {spec.id}: {'; '.join(p)}"
                for spec in dict.fromkeys((grid.default, *grid.configs)) if (p := dialect.problems(spec))]
    if problems:
        raise pytest.UsageError(f"--config-grid {grid.name} ({grid.path}) cannot run on dialect {dialect.name} "
                                f"({where if value else 'the default for --service ' + service}): " + " | ".join(problems))
    return dialect


def worker_index() -> int:
    """This xdist worker's index (gw3 -> 3), 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker[2:].isdigit() else 0
