r"""Where a request's time goes on its way through the server: `python -m ddtree.profiling.timeline`.

    python -m ddtree.profiling.timeline --device cuda --configs ar b4-k4-w2048-bs8 --context 1024 --requests 50
    python -m ddtree.profiling.timeline --engine emulated --round-ms 0.25 --prefill-ms 1    # no GPU

Per config one server is started with DDTREE_TIMELINE set (ddtree.serving.stamps: the HTTP process and the
engine process stamp each request's stages) and sent `--requests` requests one at a time (the closed loop of
concurrency 1, after `--warmup` untimed ones), streamed and plain; the client stamps its own. All stamps are
CLOCK_MONOTONIC, one clock for every process of the machine, joined by the request's id (meta_info's). Printed
per stage: the median time since the client's send, and the median step from the stage before.

The stages, in the order a streamed request meets them (a plain one has h_answer instead of the chunks):

    c_send         client: the request leaves (the pool's post begins: ddtree.bench.http_client)
    h_in           HTTP process: its first bytes read by uvicorn's protocol
    h_asgi         the /generate route begins
    h_body         the body read
    h_parsed       parsed and validated (orjson, the 1024 ids' range check), the Request built
    h_submit       the submit about to be pickled onto the requests pipe
    e_read         engine process: the submit read from the pipe and unpickled
    e_admit        the prefill begins (the scheduler thread has taken it)
    e_prefilled    the prefill returned the first token
    e_first_out    the first token handed to the relay (pickled onto the events pipe)
    h_first_event  HTTP process: the first token's event read from the pipe
    h_first_chunk  the first SSE chunk built, about to be written
    c_first        client: the first chunk with tokens read
    e_last         engine process: the round that finished the request returned
    e_last_out     its event handed to the relay
    h_last_event   HTTP process: the finish read from the pipe
    h_last_chunk   the last SSE chunk built (h_answer: the plain answer built)
    c_last         client: the last chunk with tokens read
    h_done         `data: [DONE]` about to be written
    c_done         client: `[DONE]` read (plain: the body read)
    h_closed       HTTP process: the response has ended (its cancel hook ran)
    c_end          client: the request's record complete
    next_send      client: the next request leaves (the closed loop's gap)

Exit status 1 when a request failed or a stage is missing or out of order.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ddtree.bench.loadgen import RequestRecord, run_client, run_requests
from ddtree.errors import ConfigError
from ddtree.profiling import http_vs_engine
from ddtree.profiling.flags import (
    add_configs,
    add_context,
    add_max_new_tokens,
    add_models,
    parse_configs,
    resolve_device,
    tool_parser,
)
from ddtree.serving import stamps

STREAM_STAGES = ("c_send", "h_in", "h_asgi", "h_body", "h_parsed", "h_submit", "e_read", "e_admit", "e_prefilled",
                 "e_first_out", "h_first_event", "h_first_chunk", "c_first", "e_last", "e_last_out", "h_last_event",
                 "h_last_chunk", "c_last", "h_done", "c_done", "h_closed", "c_end", "next_send")
PLAIN_STAGES = ("c_send", "h_in", "h_asgi", "h_body", "h_parsed", "h_submit", "e_read", "e_admit", "e_prefilled",
                "e_first_out", "h_first_event", "e_last", "e_last_out", "h_last_event", "h_answer", "c_done",
                "c_end", "next_send")
# Each chain is causal (a stage cannot happen before the one it follows), so a request's stamps must keep its
# order; the printed order (the *_STAGES) also puts side by side stages that race (c_last and h_done, ...)
_FIRST_TOKEN = ("c_send", "h_in", "h_asgi", "h_body", "h_parsed", "h_submit", "e_read", "e_admit", "e_prefilled",
                "e_first_out", "h_first_event")
CHAINS = {
    "stream": (_FIRST_TOKEN + ("h_first_chunk", "c_first"),
               ("e_prefilled", "e_last", "e_last_out", "h_last_event", "h_last_chunk", "c_last", "c_done", "c_end",
                "next_send"),
               ("h_first_chunk", "h_last_chunk", "h_done", "c_done"),
               ("h_done", "h_closed")),
    "plain": (_FIRST_TOKEN,
              ("e_prefilled", "e_last", "e_last_out", "h_last_event", "h_answer", "c_done", "c_end", "next_send")),
}
STAGES = {"stream": STREAM_STAGES, "plain": PLAIN_STAGES}
# the stage a step is measured from, where it is not the one printed above (that one races it)
AFTER = {"stream": {"h_done": "h_last_chunk", "c_done": "h_done", "h_closed": "h_done", "c_end": "c_done",
                    "next_send": "c_end"},
         "plain": {}}


def join(records: Sequence[RequestRecord], server: dict[str, dict[str, int]]) -> list[dict[str, int]]:
    """Each request's stamps, the client's and the server's processes' together (in the order sent), with
    next_send: when the client sent the request after it (the last request has none)."""
    rows = []
    for record in sorted(records, key=lambda r: r.stamps.get("c_send", 0)):
        row = dict(server.get(record.rid or "", {}))
        row.update(record.stamps)
        rows.append(row)
    for row, after in zip(rows, rows[1:]):
        if "c_send" in after:
            row["next_send"] = after["c_send"]
    return rows


def check(rows: Sequence[dict[str, int]], mode: str) -> list[str]:
    """What is wrong with the requests' stamps: a stage missing (next_send only where another request followed)
    or one earlier than the stage before it in a chain."""
    problems = []
    for i, row in enumerate(rows):
        last = i == len(rows) - 1
        missing = [s for s in STAGES[mode] if s not in row and not (s == "next_send" and last)]
        if missing:
            problems.append(f"request {i}: no {', '.join(missing)}")
            continue
        for chain in CHAINS[mode]:
            for before, after in zip(chain, chain[1:]):
                if after in row and row[after] < row[before]:
                    problems.append(f"request {i}: {after} {(row[before] - row[after]) / 1e3:.0f} us before {before}")
    return problems


def medians(rows: Sequence[dict[str, int]], mode: str) -> list[dict[str, Any]]:
    """Per stage (printed order): the median ms since c_send and the median ms since the stage before (AFTER's)."""
    out = []
    stages = STAGES[mode]
    for k, stage in enumerate(stages):
        since = [(r[stage] - r["c_send"]) / 1e6 for r in rows if stage in r and "c_send" in r]
        prev = AFTER[mode].get(stage, stages[k - 1] if k else None)
        step = [(r[stage] - r[prev]) / 1e6 for r in rows if prev and stage in r and prev in r]
        out.append({"stage": stage, "ms": statistics.median(since) if since else None,
                    "step_ms": statistics.median(step) if step else None, "n": len(since)})
    return out


def format_table(config: str, mode: str, table: list[dict[str, Any]]) -> str:
    lines = [f"{config} {mode}: median ms since c_send | median ms since the stage above, or the one named (n requests)"]
    for entry in table:
        ms = "-" if entry["ms"] is None else f"{entry['ms']:8.3f}"
        step = "" if entry["step_ms"] is None else f"{entry['step_ms']:+8.3f}"
        after = AFTER[mode].get(entry["stage"])
        lines.append(f"  {entry['stage']:14} {ms:>8} {step:>9}   ({entry['n']}){f'  after {after}' if after else ''}")
    return "\n".join(lines)


# -- the run --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__name__, __doc__)
    p.add_argument("--engine", choices=("model", "emulated"), default="model",
                   help="model: the target/drafter pair; emulated: a batch of fixed round time (no GPU needed)")
    add_models(p)
    add_configs(p, ["ar"])
    add_context(p)
    p.add_argument("--requests", type=int, default=40, help="timed requests per mode, one at a time")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per mode first")
    p.add_argument("--modes", nargs="+", choices=("stream", "plain"), default=["stream", "plain"])
    add_max_new_tokens(p)
    p.add_argument("--max-running-requests", type=int, default=32)
    http_vs_engine.add_server_args(p, round_ms=0.25, prefill_ms=1.0)
    p.add_argument("--out", type=Path, help="folder: timeline.json (tables and every request's stamps), server logs")
    return p


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--context", args.context), ("--requests", args.requests),
                        ("--max-new-tokens", args.max_new_tokens), ("--tokens-per-round", args.tokens_per_round),
                        ("--max-running-requests", args.max_running_requests)):
        if value < 1:
            raise ConfigError(f"{flag}: {value} out of range (allowed >= 1)")
    if args.warmup < 0 or args.round_ms < 0 or args.prefill_ms < 0:
        raise ConfigError("--warmup/--round-ms/--prefill-ms: out of range (allowed >= 0)")
    if not (args.target / "tokenizer.json").is_file():
        raise ConfigError(f"--target: {args.target} has no tokenizer.json (the prompts are tokenized with it)")


def run_config(args: argparse.Namespace, spec: Any, prompts: list[list[int]], folder: Path,
               log: Any = print) -> dict[str, Any]:
    """One server for `spec`, stamping into `folder`: {mode: {"table", "problems", "rows"}} and the server's facts."""
    from ddtree.service.readiness import wait_ready

    stamp_dir = folder / f"stamps-{spec.id}"
    stamp_dir.mkdir(parents=True, exist_ok=True)
    for old in stamp_dir.glob("*.tsv"):
        old.unlink()
    backend = http_vs_engine.server_backend(args, folder)  # the server started as the HTTP bench starts it
    backend.env[stamps.ENV] = str(stamp_dir)
    warm, timed = prompts[:args.warmup], prompts[args.warmup:]
    records: dict[str, list[RequestRecord]] = {}
    backend.start(spec)
    try:
        wait_ready(backend, timeout_s=args.startup_timeout)
        for mode in args.modes:
            stream = mode == "stream"
            if warm:
                run_client(run_requests(backend.base_url, warm, 1, args.max_new_tokens, stream=stream))
            records[mode] = run_client(run_requests(backend.base_url, timed, 1, args.max_new_tokens, stream=stream,
                                                     timeline=True))
    finally:
        backend.stop()  # SIGTERM: both server processes write their stamps as they stop
    server, facts = stamps.read_folder(stamp_dir)
    out: dict[str, Any] = {"facts": facts}
    for mode, recs in records.items():
        rows = join(recs, server)
        failed = [r.error for r in recs if not r.ok]
        problems = [f"{len(failed)} request(s) failed: {failed[0]}"] if failed else []
        problems += check(rows, mode)
        out[mode] = {"table": medians(rows, mode), "problems": problems, "rows": rows}
        log(format_table(spec.id, mode, out[mode]["table"]), flush=True)
        for problem in problems[:5]:
            log(f"  problem: {problem}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from ddtree.bench.prompts import code_prompts
    from ddtree.text import load_tokenizer

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "auto":  # an emulated engine never touches a device
        args.device = "cpu" if args.engine == "emulated" else resolve_device(args.device)
    try:
        _check(args)
        specs = parse_configs(args.configs)
    except ConfigError as err:
        return parser.fail(err)
    folder = args.out or Path(tempfile.mkdtemp(prefix="ddtree-timeline-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"stamps and server logs: {folder}", flush=True)
    codec = load_tokenizer(args.target)
    prompts = code_prompts(codec, args.context, args.warmup + args.requests)
    result: dict[str, Any] = {"meta": {
        "command": shlex.join(["python", "-m", "ddtree.profiling.timeline", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "engine": args.engine, "device": args.device,
        "cpus": os.cpu_count()}, "configs": {}}
    bad = False
    for spec in specs:
        found = run_config(args, spec, prompts, folder)
        result["configs"][spec.id] = found
        bad = bad or any(found[m]["problems"] for m in args.modes)
        (folder / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
