"""A model-free stand-in for the server, and FakeBackend that launches it like LocalBackend.

`python -m ddtree.service.fake` takes ddtree.server's flags, prints the same log lines and speaks
/health_generate, /server_info, /generate, /tokenize and /v1/chat/completions, so the whole lifecycle (start, readiness, verify,
restore) runs in a second without models. Standard library only, so it starts fast.
Failure modes come from the environment (FakeBackend.env):

    DDTREE_FAKE_LOAD_S        seconds before the port is bound (connections are refused)
    DDTREE_FAKE_WARMUP_S      seconds of 503 from /health_generate after binding
    DDTREE_FAKE_CRASH_AFTER_S exit with code 3 this many seconds after launch
    DDTREE_FAKE_NO_INIT_LINE  "1": print no init line
    DDTREE_FAKE_REPORT        JSON object merged into /server_info (a mismatched setting)
    DDTREE_FAKE_VERIFY_CT     spec_verify_ct to report instead of the computed one
    DDTREE_FAKE_IGNORE_SIGTERM "1": survive SIGTERM (tests SIGKILL escalation)
    DDTREE_FAKE_DIALECT       the server it pretends to be (overrides --fake-dialect)
    DDTREE_FAKE_CHAT_WRONG    "1": chat replies hold code that fails the tests
    DDTREE_FAKE_START_ERROR   "WORDS::MESSAGE": when WORDS occur in the command line, print MESSAGE
                              and exit 1 at once (a start that fails, e.g. a missing module)

It speaks one of three servers (`--fake-dialect`), each written from that server's own flags and
log lines, not from the dialect files, so a sweep against it tests the dialects too:

    ddtree         this project's server: every knob a flag, all reported, one init line
    sglang-dflash  stock SGLang 0.5.23: no tree flags (argparse rejects them), DDTREE unknown,
                   "Initialized DFLASH draft runner. ..." only for DFLASH
    sglang-ddtree  the PR 29907 fork: --speculative-ddtree-budget (default block_size - 1), top-k
                   from SGLANG_DDTREE_MAX_TOPK (default 6, not in /server_info), the DFLASH line
                   then "Initialized DDTree worker. block_size=.., tree_budget=.., max_tree_nodes=.."
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ddtree.service.local import LocalBackend

PERSONALITIES = ("ddtree", "sglang-dflash", "sglang-ddtree")
SGLANG_DEFAULT_MAX_TOPK = 6  # PR 29907's default for SGLANG_DDTREE_MAX_TOPK


class FakeBackend(LocalBackend):
    """LocalBackend running the fake server; `env` sets its failure modes, the dialect its personality."""

    name = "fake"
    module = "ddtree.service.fake"

    def __init__(self, model_path: str = "fake-model", draft_model_path: str | None = "fake-draft",
                 **kwargs: Any) -> None:
        super().__init__(model_path, draft_model_path, **kwargs)
        if self.dialect.name in PERSONALITIES:  # a user's dialect file: DDTREE_FAKE_DIALECT says which
            self.extra_args += ["--fake-dialect", self.dialect.name]


def init_lines(args: argparse.Namespace, dialect: str) -> list[str]:
    """The server's init lines for these flags, as the server `dialect` prints them."""
    algorithm = (args.speculative_algorithm or "NONE").upper()
    block = args.speculative_num_draft_tokens
    window = args.speculative_draft_window_size or None
    if dialect != "ddtree":
        if algorithm == "NONE":
            return []  # SGLang prints no worker line without speculation
        lines = [f"Initialized DFLASH draft runner. attention_backend=triton, model=DFlashDraftModel, "
                 f"block_size={block}, draft_window_size={window}, compact_cache={window is not None}"]
        if algorithm == "DDTREE":
            budget = args.speculative_ddtree_budget
            lines.append(f"Initialized DDTree worker. block_size={block}, tree_budget={budget}, "
                         f"max_tree_nodes={budget + 1}")
        return lines
    if algorithm == "NONE":
        return ["Initialized AR worker."]
    budget, topk = (block - 1, 1) if algorithm == "DFLASH" else (
        args.speculative_ddtree_budget, args.speculative_ddtree_topk)
    return [f"Initialized DDTree worker. block_size={block}, tree_budget={budget}, topk={topk}, "
            f"draft_window_size={window}, compact_cache={window is not None}"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--fake-dialect", choices=PERSONALITIES, default="ddtree")
    known, _ = pre.parse_known_args(argv)
    dialect = os.environ.get("DDTREE_FAKE_DIALECT") or known.fake_dialect
    p = argparse.ArgumentParser(prog=f"python -m ddtree.service.fake ({dialect})")
    p.add_argument("--fake-dialect", choices=PERSONALITIES, default="ddtree")
    p.add_argument("--model-path", required=True)
    p.add_argument("--speculative-algorithm", default="NONE")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-draft-tokens", "--speculative-dflash-block-size", type=int, default=8)
    if dialect == "ddtree":
        p.add_argument("--speculative-ddtree-budget", type=lambda v: v if v == "auto" else int(v), default=8)
        p.add_argument("--speculative-ddtree-max-budget", type=int, default=32)
        p.add_argument("--speculative-ddtree-topk", type=int, default=4)
        p.add_argument("--speculative-draft-window-size", type=int, default=0)
    else:
        p.add_argument("--speculative-draft-window-size", type=int, default=None)
        if dialect == "sglang-ddtree":
            p.add_argument("--speculative-ddtree-budget", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=8)
    args = p.parse_args(argv)
    args.fake_dialect = dialect
    algorithm = args.speculative_algorithm.upper()
    allowed = ("NONE", "DFLASH") if dialect == "sglang-dflash" else ("NONE", "DFLASH", "DDTREE")
    if algorithm not in allowed:  # SGLang's from_string
        print(f"ValueError: Unknown speculative algorithm name: {args.speculative_algorithm}", flush=True)
        sys.exit(1)
    if dialect == "sglang-ddtree":
        if args.speculative_ddtree_budget is None:
            args.speculative_ddtree_budget = args.speculative_num_draft_tokens - 1
            print(f"Inferred speculative_ddtree_budget={args.speculative_ddtree_budget} from "
                  f"speculative_num_draft_tokens={args.speculative_num_draft_tokens} for DDTREE.", flush=True)
        args.speculative_ddtree_topk = int(os.environ.get("SGLANG_DDTREE_MAX_TOPK") or SGLANG_DEFAULT_MAX_TOPK)
    return args


def _server_info(args: argparse.Namespace) -> dict[str, Any]:
    algorithm = args.speculative_algorithm.upper()
    speculative = algorithm != "NONE"
    if args.fake_dialect != "ddtree":  # SGLang: the resolved ServerArgs; no top-k (an env knob)
        info = {"model_path": args.model_path, "speculative_algorithm": algorithm if speculative else None,
                "speculative_draft_model_path": args.speculative_draft_model_path,
                "speculative_num_draft_tokens": args.speculative_num_draft_tokens if speculative else None,
                "speculative_draft_window_size": args.speculative_draft_window_size if speculative else None,
                "device": args.device, "max_running_requests": args.max_running_requests,
                "internal_states": [{"avg_spec_accept_length": 3.0 if speculative else 1.0}],
                "version": "0.5.23"}
        if args.fake_dialect == "sglang-ddtree":
            info["speculative_ddtree_budget"] = args.speculative_ddtree_budget if algorithm == "DDTREE" else None
        info.update(json.loads(os.environ.get("DDTREE_FAKE_REPORT") or "{}"))
        return info
    info: dict[str, Any] = {
        "model_path": args.model_path,
        "speculative_algorithm": algorithm if speculative else None,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "speculative_ddtree_budget": args.speculative_ddtree_budget if speculative else None,
        "speculative_ddtree_topk": args.speculative_ddtree_topk if speculative else None,
        "speculative_ddtree_max_budget": args.speculative_ddtree_max_budget,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens if speculative else None,
        "speculative_draft_window_size": (args.speculative_draft_window_size or None)
        if speculative else None,
        "device": args.device,
        "max_running_requests": args.max_running_requests,
        "internal_states": [{"avg_spec_accept_length": 3.0 if speculative else 1.0}],
    }
    if algorithm == "DFLASH":
        info["speculative_ddtree_budget"] = args.speculative_num_draft_tokens - 1
        info["speculative_ddtree_topk"] = 1
    info.update(json.loads(os.environ.get("DDTREE_FAKE_REPORT") or "{}"))
    return info


# -- /tokenize and /v1/chat/completions ----------------------------------------------------------------
# The fake's tokenizer is deliberately none that ddtree.text can load (no tokenizer.json exists for
# it): words, runs of spaces and single symbols, each hashed into a 50k vocabulary, the way a
# tiktoken-style model looks from outside. Only the service can count its tokens.
_PIECES = re.compile(r"\w+|\s+|[^\w\s]")
FAKE_VOCAB = 50_000


def fake_tokens(text: str) -> list[int]:
    return [100 + zlib.crc32(piece.encode()) % FAKE_VOCAB for piece in _PIECES.findall(text)]


def tokenize_response(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's TokenizeResponse for a TokenizeRequest ({"prompt": str | [str], ...})."""
    prompt = body["prompt"]
    if isinstance(prompt, list):
        tokens = [fake_tokens(str(p)) for p in prompt]
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": 1 << 20}
    tokens = fake_tokens(str(prompt))
    return {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}


def chat_response(body: dict[str, Any], speculative: bool) -> dict[str, Any]:
    """An OpenAI chat completion whose reply solves the HumanEval problem found in the last user
    message (its canonical solution, in a fenced python block amid prose, the way chat models
    answer); DDTREE_FAKE_CHAT_WRONG=1 answers `return None` instead, so a gate can fail."""
    from ddtree.quality.humaneval import load_problems

    question = str(body["messages"][-1]["content"])
    problem = next((p for p in load_problems().values() if p.prompt.strip() in question), None)
    if problem is None:
        code = "print('no problem found')"
    elif os.environ.get("DDTREE_FAKE_CHAT_WRONG") == "1":
        code = problem.prompt + "    return None\n"
    else:
        code = problem.prompt + problem.canonical_solution
    content = ("Here is a solution that passes the tests:\n\n```python\n" + code.rstrip() + "\n```\n\n"
               "It handles the edge cases.\n\n```python\nprint('not this block')\n```\n")
    completion = len(fake_tokens(content))
    usage = {"prompt_tokens": len(fake_tokens(question)), "completion_tokens": completion,
             "total_tokens": len(fake_tokens(question)) + completion}
    extra = {"spec_tokens_details": {"spec_verify_ct": math.ceil(completion / 3)}} if speculative else {}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model", "fake-model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}], "usage": usage, "sglext": extra}


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    if fail := env("DDTREE_FAKE_START_ERROR"):
        words, _, message = fail.partition("::")
        if words in " ".join(sys.argv[1:] if argv is None else argv):
            print(f"Traceback (most recent call last):\n  ...\n{message}", flush=True)
            sys.exit(1)
    args = _parse(argv)
    launched = time.monotonic()
    if env("DDTREE_FAKE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if (crash := env("DDTREE_FAKE_CRASH_AFTER_S")) is not None:
        def crash_now() -> None:
            print("RuntimeError: simulated crash (DDTREE_FAKE_CRASH_AFTER_S)", flush=True)
            os._exit(3)
        threading.Timer(float(crash), crash_now).start()

    print(f"server_args: {vars(args)}", flush=True)
    time.sleep(float(env("DDTREE_FAKE_LOAD_S") or 0))  # "loading weights": the port refuses
    if env("DDTREE_FAKE_NO_INIT_LINE") != "1":
        for line in init_lines(args, args.fake_dialect):
            print(line, flush=True)
    info = _server_info(args)
    speculative = info["speculative_algorithm"] is not None
    warm_at = time.monotonic() + float(env("DDTREE_FAKE_WARMUP_S") or 0)
    announced = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.startswith("/health"):
                if time.monotonic() < warm_at:
                    return self._send(503, {"error": "warming up"})
                if not announced.is_set():
                    announced.set()
                    print("The server is fired up and ready to roll!", flush=True)
                return self._send(200, {})
            if self.path == "/server_info":
                return self._send(200, info)
            self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ("/generate", "/tokenize", "/v1/tokenize", "/v1/chat/completions"):
                return self._send(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path.endswith("/tokenize"):
                    return self._send(200, tokenize_response(body))
                if self.path == "/v1/chat/completions":
                    return self._send(200, chat_response(body, speculative))
                n = int(body.get("sampling_params", {}).get("max_new_tokens", 128))
                prompt = body.get("input_ids") or list(str(body["text"]).encode())
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                return self._send(400, {"error": f"bad request: {err}"})
            meta: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": n,
                                    "finish_reason": {"type": "length", "length": n}}
            if speculative:
                meta["spec_verify_ct"] = int(env("DDTREE_FAKE_VERIFY_CT") or math.ceil(n / 3))
            self._send(200, {"text": "x" * n, "output_ids": [7] * n, "meta_info": meta})

        def log_message(self, format: str, *a: Any) -> None:  # noqa: A002 - keep the log clean
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake server listening on {args.host}:{args.port} after "
          f"{time.monotonic() - launched:.2f} s", flush=True)
    server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main(sys.argv[1:])
