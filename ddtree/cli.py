"""The `ddtree` command: serve, service reconfigure/verify/restore-default, sweep-report, train.

    ddtree serve ARGS...                          python -m ddtree.server ARGS...
    ddtree service reconfigure --config b8-k4-w2048-bs8 --backend systemd --ssh-host gpu1 --unit sglang
    ddtree service verify      --budget 16 --backend url --url http://gpu1:30000
    ddtree service restore-default --backend systemd --ssh-host gpu1 --unit sglang
    ddtree sweep-report RESULTS_DIR
    ddtree sweep-report --compare OLD NEW          exit 1 when NEW regressed against OLD
    ddtree sweep-report --trend DIR... --out DIR   tok/s and acceptance across runs, by date
    ddtree train ...

Exit status: 0 success, 1 the service failed (start, readiness or verification), 2 bad usage.
serve, sweep-report and train import their modules only when called.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ddtree.config import DEFAULT_SPEC, Algorithm, SpecConfig, parse_window
from ddtree.errors import ConfigError, ServiceError


def _lazy_main(module: str, what: str, argv: list[str]) -> int:
    """Call module.main(argv), or say clearly why it cannot be imported."""
    try:
        entry: Callable[[list[str]], int | None] = importlib.import_module(module).main
    except ImportError as err:
        print(f"ddtree: {what} is unavailable: cannot import {module} ({err})", file=sys.stderr)
        return 1
    except AttributeError:
        print(f"ddtree: {what} is unavailable: {module} has no main()", file=sys.stderr)
        return 1
    return int(entry(argv) or 0)


# -- the parser ------------------------------------------------------------------------------------
def _add_spec_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("config (an id, or fields; unset fields take the default b8-k4-w2048-bs8)")
    g.add_argument("--config", metavar="ID", help="config id, e.g. b8-k4-w2048-bs8, dflash-w2048-bs8, ar")
    g.add_argument("--algorithm", choices=[a.value for a in Algorithm], type=str.upper)
    g.add_argument("--budget", type=lambda v: v if v == "auto" else int(v),
                   help="tree budget (non-root nodes verified per round), or auto")
    g.add_argument("--max-budget", type=int, help="with --budget auto: the largest tree (default 32)")
    g.add_argument("--topk", type=int, help="candidates kept per depth")
    g.add_argument("--block-size", type=int, help="drafter block size (--speculative-num-draft-tokens)")
    g.add_argument("--window", help="draft window: an integer >= block size, or none")


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    from ddtree.service.factory import BACKENDS  # the service package loads for service actions only

    g = p.add_argument_group("backend")
    g.add_argument("--backend", choices=BACKENDS, default="local")
    g.add_argument("--server-dialect", metavar="NAME|PATH",
                   help="how the server spells the knobs: ddtree, sglang-dflash, sglang-ddtree or a dialect YAML "
                        "(default: sglang-ddtree for --backend sglang, else ddtree; see docs/deployments.md)")
    g.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for readiness (default 900; a large model needs minutes)")
    g.add_argument("--no-generate", action="store_true", help="skip the tiny /generate check")
    g.add_argument("--model-path", help="local/sglang: target model folder")
    g.add_argument("--draft-model-path", help="local/sglang: drafter folder")
    g.add_argument("--host", default="127.0.0.1", help="local/sglang: bind host")
    g.add_argument("--port", type=int, default=30000, help="local/sglang: port (default 30000)")
    g.add_argument("--device", help="local/sglang: cpu or cuda (default: cpu for local, cuda for sglang)")
    g.add_argument("--max-running-requests", type=int)
    g.add_argument("--log-dir", help="local/sglang: where the service log goes")
    g.add_argument("--extra-arg", action="append", default=[], metavar="ARG",
                   help="local/sglang: one more server argument (repeatable)")
    g.add_argument("--ssh-host", help="systemd: host to ssh to (omit for this machine)")
    g.add_argument("--unit", help="systemd: unit name, e.g. sglang.service")
    g.add_argument("--url", help="url (and systemd, optional): base url of the running service")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="run the server: ddtree serve --model-path DIR ... (flags of ddtree.server)")
    sub.add_parser("train", help="train the fixture models (flags of ddtree.train.cli)")
    # sweep-report, like serve and train, passes its arguments to its own parser (main() above)
    sub.add_parser("sweep-report", help="rebuild summary, CSV and plots of a results folder; "
                   "--compare OLD NEW; --trend DIR...")
    service = sub.add_parser("service", help="reconfigure, verify or restore a serving config")
    actions = service.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (("reconfigure", "deploy a config (restart), wait until ready, verify it"),
                       ("verify", "check the running service against a config (no restart)"),
                       ("restore-default", "deploy the default when needed and verify it")):
        p = actions.add_parser(name, help=text, description=text)
        p.set_defaults(action_parser=p)  # so usage errors found later print this parser's usage
        if name != "restore-default":
            _add_spec_options(p)
        else:
            p.add_argument("--default", metavar="ID", default=DEFAULT_SPEC.id,
                           help=f"the default to restore (default {DEFAULT_SPEC.id})")
        _add_backend_options(p)
    return parser


# -- turning arguments into objects (usage errors exit 2) ---------------------------------------------
def spec_from_args(args: argparse.Namespace) -> SpecConfig:
    """The SpecConfig the flags name; ConfigError names the bad field."""
    if args.action == "restore-default":
        return SpecConfig.from_id(args.default)
    fields = {"algorithm": args.algorithm, "budget": args.budget, "topk": args.topk,
              "block_size": args.block_size, "draft_window": args.window, "max_budget": args.max_budget}
    given = {k: v for k, v in fields.items() if v is not None}
    if args.config is not None:
        if given:
            raise ConfigError(f"--config {args.config} cannot be combined with "
                              f"{', '.join('--' + k.replace('_', '-') for k in given)}")
        return SpecConfig.from_id(args.config)
    if "draft_window" in given:
        given["draft_window"] = parse_window(given["draft_window"])
    return SpecConfig(**(DEFAULT_SPEC.to_dict() | given))


FLAGS = {"url": "--url", "unit": "--unit", "model_path": "--model-path"}  # factory argument -> its flag here


def backend_from_args(args: argparse.Namespace, log: Callable[[str], None]) -> Any:
    """The backend the flags describe (ddtree.service.factory); ConfigError naming the missing flag."""
    from ddtree.service.dialects import load_dialect
    from ddtree.service.factory import MissingBackendArgument, build_backend

    dialect = load_dialect(args.server_dialect) if args.server_dialect else None
    try:
        return build_backend(args.backend, model_path=args.model_path, draft_model_path=args.draft_model_path,
                             url=args.url, ssh_host=args.ssh_host, unit=args.unit, host=args.host, port=args.port,
                             device=args.device, max_running_requests=args.max_running_requests,
                             extra_args=args.extra_arg, log_dir=args.log_dir, log=log, dialect=dialect)
    except MissingBackendArgument as err:
        raise ConfigError(f"{FLAGS[err.argument]} is required with --backend {err.kind}") from err


# -- service actions -------------------------------------------------------------------------------
def _service(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ddtree.service.factory import LAUNCHED
    from ddtree.service.manager import ServiceManager
    from ddtree.service.verify import verify

    def log(message: str) -> None:
        print(message, flush=True)

    try:
        spec = spec_from_args(args)
        backend = backend_from_args(args, log)
        manager = ServiceManager(backend, spec, startup_timeout_s=args.startup_timeout, log=log,
                                 verify_generation=not args.no_generate)
    except ConfigError as err:
        parser.error(str(err))  # exits 2 with the usage line
    if args.action in ("verify", "restore-default") and backend.name in LAUNCHED:
        # A service started by an earlier command is not our child; observe it over HTTP.
        from ddtree.service.url import UrlBackend

        observed = UrlBackend(backend.base_url)
    else:
        observed = backend
    log(f"[{backend.name}] {args.action} {spec.id} at {observed.base_url}")
    try:
        if args.action == "verify":
            report = verify(observed, spec, generate=not args.no_generate)
        elif args.action == "restore-default" and observed is not backend:
            alive, _ = observed.is_alive()
            if alive:  # running: it must already be the default (we cannot stop what we did not start)
                report = verify(observed, spec, generate=not args.no_generate)
                if not report.settings_ok:
                    log(f"[{backend.name}] the service at {observed.base_url} runs another config and was "
                        "not started by this command; stop it, then run restore-default again")
            else:
                report = manager.deploy(spec)
                log(f"[{backend.name}] pid {backend.pid} keeps running; log {backend.log_path}")
        elif args.action == "restore-default":
            report = manager.restore_default()
        else:
            report = manager.deploy(spec)
            if observed is not backend:
                log(f"[{backend.name}] pid {backend.pid} keeps running; log {backend.log_path}")
    except ServiceError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    for line in report.lines():
        log(f"  {line}")
    if not report.ok:
        print(f"FAILED: the service does not run {spec.id}", file=sys.stderr)
        return 1
    log(f"OK: {spec.id} verified")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # serve and train pass every argument through untouched (their own parsers own them).
    if argv[:1] == ["serve"]:
        return _lazy_main("ddtree.server", "`ddtree serve`", argv[1:])
    if argv[:1] == ["train"]:
        return _lazy_main("ddtree.train.cli", "`ddtree train`", argv[1:])
    if argv[:1] == ["sweep-report"]:
        return _lazy_main("ddtree.bench.report", "`ddtree sweep-report`", argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return _service(args, args.action_parser)


if __name__ == "__main__":
    sys.exit(main())
