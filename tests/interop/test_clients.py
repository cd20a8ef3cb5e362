"""Clients nobody here wrote, against `python -m ddtree.server` on the fixture pair (DDTREE, CPU).

- the official `openai` package: completions, streaming (with stream_options.include_usage), chat
  (the fixture target's chat template), chat streaming, /v1/models, and a 400 that names the field;
- SGLang 0.5.23's benchmark client (`sglang.benchmark.serving`) through its native backend (`sglang`,
  /generate) and its OpenAI backends (`sglang-oai`, `sglang-oai-chat`): 16 prompts at concurrency 4,
  every request successful.
They need the `interop` extra (pip install -e '.[interop]' and `pip install --no-deps sglang==0.5.23`,
as .ci/run does). Without it they skip, except in CI (CI=true), where a missing client is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.tiny_server import RunningServer, launched

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "fixtures" / "models" / "target"
DRAFTER = ROOT / "fixtures" / "models" / "drafter"
PROMPT = "def fibonacci(n):\n"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")


def need(module: str) -> Any:
    """The client package, or a skip outside CI (in CI a missing client fails the test)."""
    if IN_CI:
        return __import__(module)
    return pytest.importorskip(module, reason=f"the interop extra is not installed ({module})")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    args = ["--model-path", str(TARGET), "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(DRAFTER),
            "--max-running-requests", "8", "--served-model-name", "ddtree-fixture"]
    with launched(args, tmp_path_factory.mktemp("log") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Any:
    openai = need("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def native_text(server: RunningServer, text: str, max_new_tokens: int) -> str:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    return httpx.post(server.url + "/generate", json=body, timeout=120).json()["text"]


def test_openai_models(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["ddtree-fixture"]


def test_openai_completions_equal_generate(client: Any, server: RunningServer) -> None:
    out = client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == native_text(server, PROMPT, 24) and out.choices[0].text.strip()
    assert out.usage.completion_tokens <= 24 and out.usage.prompt_tokens == len(
        httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    two = client.completions.create(model="ddtree-fixture", prompt=[PROMPT, "import os\n"], n=2, max_tokens=8, temperature=0.8,
                                    seed=5)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]


def test_openai_completions_stream(client: Any) -> None:
    whole = client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_openai_chat_and_chat_stream(client: Any, server: RunningServer) -> None:
    messages = [{"role": "system", "content": "Python 3."}, {"role": "user", "content": "def is_even(n):"}]
    out = client.chat.completions.create(model="ddtree-fixture", messages=messages, max_tokens=24, temperature=0, stop=["\n\n"])
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    # the fixture's template: "# <system>\n<user>\n", continued as a completion
    assert message.content == client.completions.create(model="ddtree-fixture", prompt="# Python 3.\ndef is_even(n):\n",
                                                         max_tokens=24, temperature=0, stop=["\n\n"]).choices[0].text
    assert "\n\n" not in message.content
    stream = client.chat.completions.create(model="ddtree-fixture", messages=messages, max_tokens=24, temperature=0,
                                            stop=["\n\n"], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_openai_logprobs_are_the_targets(client: Any, server: RunningServer) -> None:
    body = {"text": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    native = httpx.post(server.url + "/generate", json=body, timeout=120).json()["meta_info"]["output_token_logprobs"]
    want = [entry[0] for entry in native]
    out = client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(v <= 0 for v in want) and len(want) == 12
    chat = client.chat.completions.create(model="ddtree-fixture", messages=[{"role": "user", "content": PROMPT.rstrip()}],
                                          max_tokens=12, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert [t.logprob for t in chat.choices[0].logprobs.content] == pytest.approx(want, abs=1e-5)  # the same prompt


def test_openai_bad_input_names_the_field_and_the_server_keeps_serving(client: Any) -> None:
    openai = need("openai")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=4, frequency_penalty=0.5)
    assert caught.value.body["field"] == "frequency_penalty" and "not supported" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="ddtree-fixture", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert caught.value.body["field"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=10**9)
    assert caught.value.body["field"] == "max_tokens"
    assert client.completions.create(model="ddtree-fixture", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_client(backend: str, server: RunningServer, tmp_path: Path) -> None:
    need("sglang.benchmark")  # the client module itself is imported by sglang_bench.py, after its stand-in
    result = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(ROOT / "tests" / "interop" / "sglang_bench.py"), "--backend", backend, "--base-url", server.url,
           "--dataset-name", "random-ids", "--num-prompts", "16", "--max-concurrency", "4", "--random-input-len", "48",
           "--random-output-len", "12", "--random-range-ratio", "1", "--tokenizer", str(TARGET), "--output-file", str(result),
           "--disable-tqdm", "--seed", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(result.read_text().splitlines()[-1])
    assert summary["completed"] == 16, run.stdout[-3000:]
    assert summary["total_output_tokens"] == 16 * 12  # the client sends ignore_eos: every request ran to its length
    assert summary["accept_length"] > 1.0 or backend != "sglang"  # the native backend reads spec_accept_length
    assert "Successful requests:                     16" in run.stdout
