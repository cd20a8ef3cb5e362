r"""The HTTP server against the engine in process, on the same prompts: `python -m ddtree.profiling.http_vs_engine`.

    python -m ddtree.profiling.http_vs_engine --device cuda --configs ar dflash-w2048-bs8 b4-k4-w2048-bs8 \
        --contexts 60 1024 4096 --concurrency 1 8 32 --repeats 3 --out http_vs_engine.json
    python -m ddtree.profiling.http_vs_engine --engine emulated --round-ms 1.0    # no GPU: the server's own cost

Per config one server is started (ddtree.server, as the suite's local backend starts it). Per cell (context x
concurrency) it is timed three ways, on the same prompts: the server's batch driven directly (a closed loop
of `concurrency` requests on a thread of its own, as the server's scheduler runs it, with no HTTP, hand-over
or text in between), a streaming client and a non-streaming client (the sweep's load generator,
ddtree.bench.loadgen). Each prints output tok/s, TTFT, TPOT and E2E (median and p90) and the ratio HTTP / in
process of the medians.

Where the in-process side runs (`--in-process`): "same" (the default) in the server's own engine process, on
the very batch it serves, each repeat when the bench asks for it, on the scheduler's thread while nothing is
served (Scheduler.run_idle; ddtree.profiling.in_process says why: a round's time moves by up to ~8% between
process starts); "separate" in a batch this process opens the way the server opens its own. Either way the modes' repeats take turns.

Warm-up: the in-process batch first runs the cell once untimed (the engine at its best, as
`ddtree.profiling.paired` measures it); the server gets what the sweep gives it (`--warmup` requests at the
cell's concurrency), so what a server does not warm before serving shows up in its numbers.

`--engine emulated` replaces the model with a batch whose round waits `--round-ms` without the GIL (a
device sync's wait) and then does its rows' host work: the HTTP path's own cost on a machine without
a GPU, in the same table. Outputs at T = 0 must be the same both ways; the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from ddtree.bench.loadgen import RequestRecord, client_pool, run_client, run_requests, tls_verify
from ddtree.bench.metrics import percentile, records_duration_s
from ddtree.bench.results import git_commit
from ddtree.config import SpecConfig
from ddtree.errors import ConfigError
from ddtree.profiling.emulated import EmulatedEngine
from ddtree.profiling.flags import (
    add_concurrency,
    add_configs,
    add_contexts,
    add_device,
    add_dtype,
    add_max_new_tokens,
    add_models,
    add_out,
    add_repeats,
    parse_configs,
    resolve_device,
    tool_parser,
    torch_dtype,
)
from ddtree.profiling.fresh_runs import drive
from ddtree.profiling.in_process import (
    EngineChannel,
    measure_cell,
    measuring,
    write_plan,
)
from ddtree.service.local import LocalBackend

MODES = ("engine", "stream", "plain")  # in process, streaming client, non-streaming client


# -- numbers --------------------------------------------------------------------------------------------


def summarize(records: Sequence[RequestRecord], duration_s: float, round_ms: float | None = None) -> dict[str, Any]:
    """tok/s over the repeat's span (records_duration_s); TTFT, TPOT, E2E median and p90 in ms; failures counted; the server's
    own TTFT (meta_info, from queueing on) and the mean decode round (`round_ms`) where known."""
    done = [r for r in records if r.ok]

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else 1000.0 * v

    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    server_ttft = [r.server_ttft_s for r in done if r.server_ttft_s is not None]
    return {"tok_per_s": sum(r.completion_tokens for r in done) / duration_s, "duration_s": duration_s,
            "server_ttft_ms": ms(server_ttft, 50), "round_ms": round_ms,
            "failed": len(records) - len(done), "ttft_ms": ms(ttft, 50), "p90_ttft_ms": ms(ttft, 90),
            "tpot_ms": ms(tpot, 50), "p90_tpot_ms": ms(tpot, 90), "e2e_ms": ms(e2e, 50), "p90_e2e_ms": ms(e2e, 90)}


def _median(values: list[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def cell_row(config_id: str, context: int, concurrency: int, repeats: dict[str, list[dict[str, Any]]],
             mismatched: dict[str, int]) -> dict[str, Any]:
    """Medians over the repeats per mode (failed: the sum), and HTTP / in process of the medians' tok/s."""
    row: dict[str, Any] = {"config": config_id, "context": context, "concurrency": concurrency}
    for mode, reps in repeats.items():
        row[mode] = {key: _median([r[key] for r in reps]) for key in reps[0]} | {
            "tok_per_s_repeats": [r["tok_per_s"] for r in reps], "failed": sum(r["failed"] for r in reps)}
    engine_tps = row["engine"]["tok_per_s"]
    for mode in ("stream", "plain"):
        if mode in row and engine_tps:
            row[mode]["ratio"] = row[mode]["tok_per_s"] / engine_tps
            e2e, p90 = row[mode]["e2e_ms"], row[mode]["p90_e2e_ms"]
            row[mode]["p90_over_median_e2e"] = p90 / e2e if e2e and p90 else None
    row["mismatched"] = mismatched
    return row


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (f"{'config':20} {'ctx':>5} {'C':>3} {'mode':6} {'tok/s':>9} {'ratio':>6} {'TTFT ms':>8} {'p90':>7} "
            f"{'srv TTFT':>8} {'TPOT ms':>8} {'round ms':>8} {'E2E ms':>8} {'p90/med':>7}")
    lines = [head]
    for r in rows:
        for mode in MODES:
            m = r.get(mode)
            if m is None:
                continue
            lines.append(f"{r['config']:20} {r['context']:5} {r['concurrency']:3} {mode:6} {_f(m['tok_per_s']):>9} "
                         f"{_f(m.get('ratio'), 3) if mode != 'engine' else '':>6} {_f(m['ttft_ms'], 2):>8} "
                         f"{_f(m['p90_ttft_ms'], 2):>7} {_f(m.get('server_ttft_ms'), 2):>8} {_f(m['tpot_ms'], 3):>8} "
                         f"{_f(m.get('round_ms'), 3):>8} {_f(m['e2e_ms']):>8} "
                         f"{_f(m.get('p90_over_median_e2e'), 2) if mode != 'engine' else '':>7}")
    return "\n".join(lines)


# -- the server -----------------------------------------------------------------------------------------


def server_rounds(url: str) -> tuple[float, float] | None:
    """The server's (decode rounds, seconds in them) so far, from /metrics; None when it does not report them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10, trust_env=False, verify=tls_verify(url)).text
    except httpx.HTTPError:
        return None
    found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    rounds, seconds = found.get("ddtree_decode_rounds_total"), found.get("ddtree_decode_round_seconds_total")
    return None if rounds is None or seconds is None else (rounds, seconds)


def _mean_round_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1000.0 * (after[1] - before[1]) / (after[0] - before[0])


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-plan", type=Path, default=None,
                   help="cells the engine process measures in process on request (ddtree.profiling.in_process)")


def _serve(ns: argparse.Namespace, rest: list[str], load: Any) -> int:
    """The real server (routes, engine process, scheduler, text); with ns.engine_plan, its engine process first
    measures the batch it serves in process (ddtree.profiling.in_process.measuring)."""
    from ddtree.server import serve, setup_logging, start_engine
    from ddtree.serving.args import resolve_args
    from ddtree.serving.engine_worker import open_scheduler
    from ddtree.text import load_tokenizer

    args = resolve_args(rest)
    setup_logging(args.log_level)
    factory = None
    if ns.engine_plan is not None:
        factory = measuring(partial(open_scheduler, spec=args.spec, args=args), ns.engine_plan)
    engine = start_engine(partial(load, args), args, factory)
    return serve(engine, args, load_tokenizer(args.model_path))


def serve_model(argv: list[str]) -> int:
    """`python -m ddtree.profiling.http_vs_engine serve --engine-plan P <server flags>`: ddtree.server, whose engine
    process measures its batch in process when the bench asks."""
    from ddtree.server import load_engine

    p = argparse.ArgumentParser(prog="serve")
    _plan_flags(p)
    ns, rest = p.parse_known_args(argv)
    return _serve(ns, rest, load_engine)


def serve_emulated(argv: list[str]) -> int:
    """`python -m ddtree.profiling.http_vs_engine serve-emulated --round-ms X ... <server flags>`: the real
    server (routes, engine process, scheduler, text) in front of an EmulatedEngine."""
    p = argparse.ArgumentParser(prog="serve-emulated")
    p.add_argument("--round-ms", type=float, required=True)
    p.add_argument("--prefill-ms", type=float, required=True)
    p.add_argument("--tokens-per-round", type=int, required=True)
    p.add_argument("--prefill-token-us", type=float, default=0.0)
    _plan_flags(p)
    ns, rest = p.parse_known_args(argv)

    def load(args: Any) -> tuple[EmulatedEngine, int]:
        return _emulated_engine(args, ns.round_ms, ns.prefill_ms, ns.tokens_per_round, ns.prefill_token_us)

    return _serve(ns, rest, load)


def _emulated_engine(args: Any, round_ms: float, prefill_ms: float, tokens_per_round: int,
                     prefill_token_us: float = 0.0) -> tuple[EmulatedEngine, int]:
    from ddtree.text import load_tokenizer

    codec = load_tokenizer(args.model_path)
    vocab = codec.vocab_size if codec is not None else 32000
    engine = EmulatedEngine(vocab, 8192, round_ms / 1000, prefill_ms / 1000, tokens_per_round,
                            prefill_token_s=prefill_token_us / 1e6)
    return engine, args.context_length or engine.max_context


class BenchBackend(LocalBackend):
    """The suite's local backend, launching one of this module's serve commands instead of ddtree.server."""

    module = "ddtree.profiling.http_vs_engine"

    def __init__(self, serve_args: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.serve_args = serve_args  # the subcommand and its own flags

    def command(self, spec: SpecConfig) -> list[str]:
        cmd = super().command(spec)  # [python, -m, module, server flags...]
        return cmd[:3] + self.serve_args + cmd[3:]


def server_flags(args: argparse.Namespace) -> list[str]:
    """The server flags the bench's own options set (beyond what the backend passes for every config)."""
    flags = ["--dtype", args.dtype] if args.dtype != "auto" else []
    if args.sleep_on_idle:
        flags.append("--sleep-on-idle")
    if args.disable_overlap_schedule:
        flags.append("--disable-overlap-schedule")
    return flags


def server_backend(args: argparse.Namespace, log_dir: Path, plan: Path | None = None) -> LocalBackend:
    """The server the bench measures; with a plan, its engine process measures in process on request."""
    common: dict[str, Any] = dict(model_path=args.target, draft_model_path=args.drafter,
                                  device=resolve_device(args.device),
                                  max_running_requests=args.max_running_requests, log_dir=log_dir,
                                  extra_args=server_flags(args))
    measured = [] if plan is None else ["--engine-plan", str(plan)]
    if args.engine == "emulated":
        emulation = ["--round-ms", str(args.round_ms), "--prefill-ms", str(args.prefill_ms),
                     "--tokens-per-round", str(args.tokens_per_round), "--prefill-token-us", str(args.prefill_token_us)]
        return BenchBackend(["serve-emulated", *emulation, *measured], **common)
    return BenchBackend(["serve", *measured], **common) if measured else LocalBackend(**common)


# -- the run --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: --runs hands the rest of the command line to each run, less its own --runs and --out
    p = tool_parser(__name__, __doc__, allow_abbrev=False)
    p.add_argument("--engine", choices=("model", "emulated"), default="model",
                   help="model: the target/drafter pair; emulated: a batch of fixed round time (no GPU needed)")
    add_models(p)
    add_configs(p, ["ar", "dflash-w2048-bs8", "b4-k4-w2048-bs8"])
    add_contexts(p, [1024])
    add_concurrency(p, [1, 8, 32])
    p.add_argument("--modes", nargs="+", choices=MODES[1:], default=list(MODES[1:]),
                   help="HTTP clients: stream (SSE, SGLang's cumulative chunks), plain (one JSON answer)")
    p.add_argument("--requests", type=int, default=0, help="requests per repeat (0: max(waves x concurrency, 8))")
    p.add_argument("--waves", type=int, default=1,
                   help="without --requests: waves of `concurrency` requests a repeat (a C = 32 repeat of one wave "
                        "is 0.1-0.25 s on the H200 fixture; more waves steady it, C = 1 keeps its 8)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="HTTP client processes sharing each cell's concurrency (ddtree.bench.loadgen.client_pool)")
    add_repeats(p)
    p.add_argument("--runs", type=int, default=1,
                   help="the whole bench this many times, each in a fresh process with fresh servers; then each cell's "
                        "median ratio over the runs (ddtree.profiling.fresh_runs)")
    p.add_argument("--in-process", choices=("same", "separate"), default="same",
                   help="where the in-process side runs: same: in the server's own engine process, on the batch it "
                        "serves, each repeat between the HTTP ones, on the scheduler's thread while nothing is served; separate: an engine "
                        "loaded in this process")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests sent to the server first (the sweep's)")
    add_max_new_tokens(p)
    p.add_argument("--max-running-requests", type=int, default=32, help="the server's, and the in-process batch's rows")
    add_server_args(p, round_ms=1.0, prefill_ms=2.0)
    add_out(p, "JSON file of every row and repeat")
    return p


def add_server_args(p: argparse.ArgumentParser, round_ms: float, prefill_ms: float) -> None:
    """The flags `server_backend` starts a server from (this bench's and ddtree.profiling.timeline's)."""
    add_device(p)
    add_dtype(p)
    p.add_argument("--sleep-on-idle", action="store_true", help="the server's: block instead of polling")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="the server's (and the in-process batch's): no round launched before the one before it is read")
    p.add_argument("--round-ms", type=float, default=round_ms, help="emulated: a round's GIL-free wait")
    p.add_argument("--prefill-ms", type=float, default=prefill_ms, help="emulated: a prefill's GIL-free wait")
    p.add_argument("--prefill-token-us", type=float, default=0.0,
                   help="emulated: a prefill's wait per padded token; then --prefill-ms is per forward, cut as DecodeBatch cuts")
    p.add_argument("--tokens-per-round", type=int, default=1, help="emulated: tokens each row commits per round")
    p.add_argument("--startup-timeout", type=float, default=600.0)


def _check(args: argparse.Namespace) -> None:
    for flag, values in (("--contexts", args.contexts), ("--concurrency", args.concurrency),
                         ("--repeats", [args.repeats]), ("--runs", [args.runs]), ("--waves", [args.waves]),
                         ("--max-new-tokens", [args.max_new_tokens]),
                         ("--max-running-requests", [args.max_running_requests]),
                         ("--tokens-per-round", [args.tokens_per_round])):
        bad = [v for v in values if v < 1]
        if bad:
            raise ConfigError(f"{flag}: {bad} out of range (allowed >= 1)")
    if args.client_processes < 1:
        raise ConfigError(f"--client-processes: {args.client_processes} out of range (allowed >= 1)")
    if args.requests < 0 or args.warmup < 0:
        raise ConfigError("--requests/--warmup: out of range (allowed >= 0)")
    if max(args.concurrency) > args.max_running_requests:
        raise ConfigError(f"--concurrency: {max(args.concurrency)} exceeds --max-running-requests "
                          f"{args.max_running_requests}")
    if args.round_ms < 0 or args.prefill_ms < 0 or args.prefill_token_us < 0:
        raise ConfigError("--round-ms/--prefill-ms/--prefill-token-us: out of range (allowed >= 0)")
    if not (args.target / "tokenizer.json").is_file():
        raise ConfigError(f"--target: {args.target} has no tokenizer.json (the prompts are tokenized with it)")


def _load_engine(args: argparse.Namespace) -> Any:
    if args.engine == "emulated":
        from ddtree.text import load_tokenizer

        codec = load_tokenizer(args.target)
        assert codec is not None  # _check
        return EmulatedEngine(codec.vocab_size, 8192, args.round_ms / 1000, args.prefill_ms / 1000,
                              args.tokens_per_round, prefill_token_s=getattr(args, "prefill_token_us", 0.0) / 1e6)

    from ddtree.engine import Engine

    return Engine.from_pretrained(args.target, args.drafter, device=resolve_device(args.device),
                                  dtype=torch_dtype(args.dtype))


def requests_per_repeat(args: argparse.Namespace, conc: int) -> int:
    return args.requests or max(args.waves * conc, 8)


def _timed(args: argparse.Namespace, prompts: list[list[int]], conc: int) -> list[list[int]]:
    return prompts[args.warmup:args.warmup + requests_per_repeat(args, conc)]


def run(args: argparse.Namespace, log: Any = print, on_row: Any = None) -> list[dict[str, Any]]:
    """Every cell's row; on_row(rows so far) after each (main writes --out there, so a run cut short keeps them)."""
    from ddtree.bench.prompts import code_prompts
    from ddtree.service.readiness import wait_ready
    from ddtree.text import load_tokenizer

    specs = parse_configs(args.configs)
    if args.client_processes > 1:
        client_pool(args.client_processes)  # started before anything is timed (and before CUDA: spawned anyway)
    same = args.in_process == "same"
    engine = None if same else _load_engine(args)
    codec = load_tokenizer(args.target)
    n_max = max(requests_per_repeat(args, c) for c in args.concurrency)
    prompts = {ctx: code_prompts(codec, ctx, n_max + args.warmup) for ctx in args.contexts}
    # the servers' logs (local-PORT.log): beside --out, else in a folder of their own (never the cwd)
    log_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="ddtree-http-vs-engine-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"server logs: {log_dir}", flush=True)
    cells = [(ctx, conc) for ctx in args.contexts for conc in args.concurrency]
    plan_path = log_dir / "engine-plan.json"
    rows = []
    for spec in specs:
        channel = None
        if same:  # a new address and key per server
            address, key = write_plan(plan_path, [(ctx, conc, _timed(args, prompts[ctx], conc)) for ctx, conc in cells],
                                      args.max_new_tokens)
        backend = server_backend(args, log_dir, plan_path if same else None)
        if same:
            log(f"[{spec.id}] in process: in the server's engine process, between the HTTP repeats", flush=True)
        backend.start(spec)
        try:
            wait_ready(backend, timeout_s=args.startup_timeout)
            batch = None
            if same:
                channel = EngineChannel(address, key)
            else:
                context_length = backend.reported_settings().get("context_length") or engine.max_context
                batch = engine.open_batch(spec, args.max_running_requests, context_length + spec.max_nodes,
                                          run_ahead=not args.disable_overlap_schedule)
            for i, (ctx, conc) in enumerate(cells):
                in_process = None if channel is None else partial(channel.measure, i)
                rows.append(_cell(args, engine, batch, backend.base_url, spec, prompts[ctx], ctx, conc, in_process))
                if on_row is not None:
                    on_row(rows)
                log(format_rows(rows[-1:]).split("\n", 1)[1], flush=True)
            del batch
        finally:
            if channel is not None:
                channel.close()
            backend.stop()
    return rows


def _cell(args: argparse.Namespace, engine: Any, batch: Any, url: str, spec: SpecConfig, prompts: list[list[int]],
          ctx: int, conc: int, in_process: Any = None) -> dict[str, Any]:
    """One cell's row, the modes' repeats interleaved. in_process() -> one in-process repeat, measured in the server's
    engine process (--in-process same); without it the batch here runs them."""
    warm, timed = prompts[:args.warmup], _timed(args, prompts, conc)
    if in_process is None:
        measure_cell(engine, batch, timed, conc, args.max_new_tokens, 0)  # untimed: captures made
    if warm:
        for stream in (True, False):
            run_client(run_requests(url, warm, conc, args.max_new_tokens, stream=stream,
                                     processes=args.client_processes))
    repeats: dict[str, list[dict[str, Any]]] = {m: [] for m in ("engine", *args.modes)}
    reference: list[list[int]] | None = None
    mismatched = {m: 0 for m in repeats}
    for _ in range(args.repeats):
        for mode in repeats:  # interleaved: a drifting machine moves every mode alike
            if mode == "engine":
                rep = in_process() if in_process else measure_cell(engine, batch, timed, conc, args.max_new_tokens,
                                                                   1, warm=False)[0]
                records, round_ms = rep["records"], rep["round_ms"]
            else:
                before = server_rounds(url)  # a /metrics scrape: 20-40 ms, outside every timed span
                records = run_client(run_requests(url, timed, conc, args.max_new_tokens, stream=mode == "stream",
                                                   processes=args.client_processes))
                round_ms = _mean_round_ms(before, server_rounds(url))
            # the requests' own span (first start to last end), as the sweep measures a repeat: not a clock around
            # the run, which would count what only one side pays outside its requests (a client's event loop,
            # session and process hand-off; a /metrics scrape)
            span = records_duration_s(records)
            outputs = [r.output_ids for r in records]
            reference = outputs if reference is None else reference
            mismatched[mode] = max(mismatched[mode], sum(1 for a, b in zip(outputs, reference) if a != b))
            repeats[mode].append(summarize(records, span, round_ms))
    return cell_row(spec.id, ctx, conc, repeats, mismatched)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve-emulated"]:
        return serve_emulated(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_model(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    try:
        _check(args)
    except ConfigError as err:
        return parser.fail(err)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    meta = {"command": shlex.join(["python", "-m", "ddtree.profiling.http_vs_engine", *argv]), "date": started,
            "engine": args.engine, "in_process": args.in_process, "device": args.device,
            "client_processes": args.client_processes,
            "commit": git_commit()}
    if args.runs > 1:
        return drive("ddtree.profiling.http_vs_engine", argv, args.runs, args.out,
                     Path(tempfile.mkdtemp(prefix="ddtree-http-vs-engine-runs-")), meta)

    def write(rows: list[dict[str, Any]]) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")

    rows = run(args, on_row=write)
    print(format_rows(rows))
    write(rows)
    bad = [f"{r['config']} ctx{r['context']} c{r['concurrency']}" for r in rows if any(r["mismatched"].values())]
    if bad:
        print(f"outputs differ between the engine and HTTP at T=0: {', '.join(bad)}", file=sys.stderr)
    failed = [f"{r['config']} ctx{r['context']} c{r['concurrency']} {m}" for r in rows for m in MODES
              if m in r and r[m]["failed"]]
    if failed:
        print(f"requests failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
