"""The suite's fixtures: the session `service`, the per-cell `deployed`, prompts and floors.

`service` builds the backend named by --service (through ddtree.service.factory), wraps it in a
ServiceManager and yields it. Its teardown always restores the grid's default and verifies it (settings and the init line of
the new start), also after failed cells, a crashed service or Ctrl-C: pytest tears session
fixtures down in pytest_sessionfinish, which runs on KeyboardInterrupt too. The outcome goes
into the run state, from which the plugin writes the sweep summary.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddtree.bench.answer import answer_progress
from ddtree.bench.results import PACE_DIR
from ddtree.config import SpecConfig
from ddtree.grid import Cell
from ddtree.service.base import ServiceBackend
from ddtree.service.factory import build_backend
from ddtree.service.manager import ServiceManager, SweepAborted
from ddtree.suite.cells import CELL_ARG, item_spec
from ddtree.suite.options import SuiteOptions, worker_index
from ddtree.suite.pace import PaceLog, PaceProbe, local_argv, standalone_argv
from ddtree.suite.state import suite_options, suite_state

BUILD_HINT = ("build the fixture pair first with `ddtree train corpus ...` then `ddtree train all ...` "
              "(see `ddtree train --help` and the README)")


def _log_to_terminal(config: pytest.Config) -> Callable[[str], None]:
    """Service progress lines go to the terminal even while output is captured."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")

    def log(message: str) -> None:
        if reporter is None or capman is None:  # an xdist worker has no terminal
            print(message, file=sys.__stderr__, flush=True)
            return
        with capman.global_and_fixture_disabled():
            reporter.write_line(message)

    return log


def _gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def require_models(options: SuiteOptions) -> None:
    """Fail (never skip) with how to build the fixture models when a model folder is missing."""
    for role, path in (("target", options.model_path), ("drafter", options.draft_model_path)):
        if not (path / "config.json").is_file():
            pytest.fail(f"{role} model folder {path} is missing or has no config.json; {BUILD_HINT}, "
                        f"or pass --model-path / --draft-model-path, or --service fake for a model-free run",
                        pytrace=False)


def suite_backend(options: SuiteOptions) -> ServiceBackend:
    """The backend named by --service (ddtree.service.factory), per xdist worker: own port, own GPU, own host."""
    index = worker_index()
    host = options.service_hosts[index % len(options.service_hosts)] if options.service_hosts else None
    env: dict[str, str] = {}
    if os.environ.get("PYTEST_XDIST_WORKER") and _gpu_visible() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    url = options.service_url
    if options.service == "url" and host:
        url = host if host.startswith("http") else f"http://{host}:{(url or '').rsplit(':', 1)[-1].strip('/')}"
    if options.service in ("local", "sglang"):
        require_models(options)
    return build_backend(options.service, model_path=options.model_path, draft_model_path=options.draft_model_path,
                         url=url, ssh_host=host or options.ssh_host, unit=options.systemd_unit,
                         ssh_config=options.ssh_config, host=host or "127.0.0.1", device=options.device,
                         log_dir=options.results_dir / "service-logs", env=env, dialect=options.dialect)


def cell_progress(config: pytest.Config, cell: Cell, metrics: dict[str, Any], pace: float | None = None) -> None:
    """One line per measured cell: position, id, throughput, pace, TPOT, acceptance, request counts."""
    state = suite_state(config)
    state.measured += 1
    accept = metrics.get("accept_length")
    speedup = metrics.get("speedup_vs_ar")
    line = (
        f"[{state.measured}/{len(state.expansion.kept)}] {cell.id}: "
        f"{metrics.get('output_throughput') or 0:.1f} tok/s (MAD {metrics.get('output_throughput_mad') or 0:.1f}), "
        f"pace {'-' if pace is None else f'{pace:.3f}'}"
        f"{'' if speedup is None else f', {speedup:.2f}x AR'}, "
        f"TPOT {metrics.get('median_tpot_ms') or 0:.1f} ms, "
        f"accept {'-' if accept is None else f'{accept:.2f}'}, "
        f"{metrics.get('completed', 0)} ok / {metrics.get('failed', 0)} failed"
        + answer_progress(metrics)
    )
    _log_to_terminal(config)(line)


def restore_record(manager: ServiceManager) -> dict[str, Any]:
    """The restore outcome in the shape the sweep summary reads."""
    default = manager.default_spec.id
    if manager.restore_report is not None:
        report = manager.restore_report
        return {"ok": report.ok, "config_id": default, "checks": report.lines(), "error": None}
    error = manager.restore_error or "no restore was attempted"
    return {"ok": False, "config_id": default, "checks": [], "error": str(error)}


@pytest.fixture(scope="session")
def service(request: pytest.FixtureRequest) -> Iterator[ServiceManager]:
    """The one service of this session (per xdist worker); teardown restores and verifies the default."""
    config = request.config
    options, state = suite_options(config), suite_state(config)
    log = _log_to_terminal(config)
    backend = suite_backend(options)
    state.service_used = True
    manager = ServiceManager(backend, options.grid.default, startup_timeout_s=options.startup_timeout_s, log=log,
                             start_retries=options.start_retries)
    try:
        with manager:
            try:
                yield manager
            finally:  # the sweep's deploys, before the restore adds its own
                state.deploys += [spec.id for spec in manager.deploy_history]
    finally:
        state.restore = restore_record(manager)
        state.deploy_timings += [t.to_dict() for t in manager.deploy_timings]
        log(f"[{backend.name}] deploys this session: {manager.deploy_count}; {manager.restore_outcome}")


def pace_log(options: SuiteOptions, backend: Any) -> PaceLog:
    """The pace log of this session: a probe where the service runs (see ddtree.suite.pace)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = options.results_dir / PACE_DIR / f"{worker}.json"
    device = options.device
    if options.service == "systemd" and backend.ssh_host:
        return PaceLog(path, f"{backend.ssh_host} (over ssh)",
                       lambda: PaceProbe(backend.host_command(standalone_argv(device)), backend.ssh_host))
    where = "this machine (the client's: a URL's host is not reachable)" if options.service == "url" else "this machine"
    return PaceLog(path, where, lambda: PaceProbe(local_argv(device), "this machine"))


@pytest.fixture(scope="session")
def pace(request: pytest.FixtureRequest, service: ServiceManager) -> Iterator[PaceLog]:
    """The session's pace readings; a last reading at the end of the session goes into the log."""
    log = pace_log(suite_options(request.config), service.backend)
    try:
        yield log
    finally:
        if log.readings:
            log.read("end")
        log.close()


@pytest.fixture
def deployed(request: pytest.FixtureRequest, service: ServiceManager) -> ServiceManager:
    """The service running this item's config (a cell's or a config_cell's); deploys when it changes."""
    spec: SpecConfig | None = item_spec(request.node)
    if spec is None:
        raise pytest.UsageError(f"{request.node.nodeid}: `deployed` needs a `cell` or `config_cell` parameter")
    try:
        service.ensure(spec)
    except SweepAborted as err:  # stop after this item; the session teardown still restores the default
        request.session.shouldstop = str(err).splitlines()[0]
        raise
    return service


@pytest.fixture(scope="session")
def suite(request: pytest.FixtureRequest) -> SuiteOptions:
    """The validated ddtree options of this run (grid, floors, results dir, ...)."""
    return suite_options(request.config)


@pytest.fixture
def resume_skip(request: pytest.FixtureRequest, suite: SuiteOptions) -> None:
    """With --resume, skip a perf cell whose result file exists (before anything is deployed)."""
    from ddtree.bench.results import cell_exists

    cell = request.node.callspec.params.get(CELL_ARG)
    if suite.resume and isinstance(cell, Cell) and cell_exists(suite.results_dir, cell.config_id, cell.context,
                                                               cell.concurrency, cell.request_rate):
        suite_state(request.config).resumed.append(cell.id)
        pytest.skip(f"--resume: {cell.id} already has a result file in {suite.results_dir}")


@pytest.fixture(scope="session")
def prompt_maker(request: pytest.FixtureRequest, suite: SuiteOptions) -> Callable[[int, int], list[list[int]]]:
    """make(context, count) -> `count` prompts of exactly `context` tokens of the served model.

    Tokens are counted by the target's tokenizer.json when there is one this project can read
    (`--tokenize local`, or auto for a model we launch or a --model-path given), else by the
    service's /tokenize (`--tokenize service`, or auto: a remote service, a tiktoken-style model);
    the model-free fake service gets deterministic synthetic ids unless given --model-path or --tokenize.
    """
    from ddtree.bench.prompts import code_prompts, service_encoder

    mode = suite.tokenize
    if suite.service == "fake" and mode == "auto" and not suite.model_path_given:
        def synthetic(context: int, count: int) -> list[list[int]]:
            return [[(i * 7919 + j) % 1000 + 1 for j in range(context)] for i in range(count)]

        return synthetic
    log = _log_to_terminal(request.config)
    encode: Callable[[str], Any] | None = None
    if mode == "local" or (mode == "auto" and (suite.service in ("local", "sglang") or suite.model_path_given)):
        encode, why = _local_codec(suite)
        if encode is None and mode == "local":
            pytest.fail(f"--tokenize local: {why}; use --tokenize service to count tokens with the "
                        f"service's /tokenize", pytrace=False)
        if encode is None:
            log(f"[prompts] {why}: counting tokens with the service's /tokenize")
    if encode is None:
        manager: ServiceManager = request.getfixturevalue("service")
        encode = service_encoder(manager.backend.base_url)

    def make(context: int, count: int) -> list[list[int]]:
        return code_prompts(encode, context, count)

    return make


def _local_codec(suite: SuiteOptions) -> tuple[Any, str]:
    """(the target's TextCodec, "") or (None, why it cannot be used)."""
    from ddtree.errors import ModelLoadError
    from ddtree.text import load_tokenizer

    if suite.service in ("local", "sglang"):
        require_models(suite)
    try:
        codec = load_tokenizer(suite.model_path)
    except ModelLoadError as err:
        return None, f"{err}"
    if codec is None:
        return None, f"{suite.model_path} has no tokenizer.json"
    return codec, ""
