"""SGLang 0.5.23's and OpenAI's wire formats on ddtree.server, in process against the fake engine.

What SGLang's GenerateReqInput/SamplingParams and the OpenAI requests may carry: implemented fields
do what they say (defaults, sampling_seed and its alias seed, n, batches and rid, stop strings),
no-op-only fields pass at their defaults and are a 400 naming them otherwise, and the extra routes
(/tokenize, /detokenize, /v1/models, /model_info, /v1/chat/completions with the folder's template).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddtree.engine import Request
from ddtree.serving.chat import ChatTemplate, TemplateError, load_chat_template
from ddtree.serving.stops import find_stop, held_back
from tests.unit.server_fakes import FakeEngine, expected_output, fake_logprob
from tests.unit.test_server_api import gen, make_app, parse_sse, run, word_codec

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'system' %}# {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
)


def recorded(engine: FakeEngine) -> list[Request]:
    """The Requests of clients that reach the batch, in order (not the server's warm-up and health probes)."""
    batch, seen = engine.batches[0], []
    add = batch.add

    def record(request: Request) -> Any:
        if not request.request_id.startswith(("warmup-", "health-")):
            seen.append(request)
        return add(request)

    batch.add = record  # type: ignore[method-assign]
    return seen


def chat_folder(tmp_path: Path, template: str | None = TEMPLATE) -> str:
    config: dict[str, Any] = {"eos_token": "<eos>"}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


# -- /generate: SGLang's request ----------------------------------------------------------------------
def test_sglang_bench_client_payload_is_accepted() -> None:
    """The body SGLang 0.5.23's bench client (backend sglang) sends on every request."""
    app, engine = make_app(codec=word_codec())

    async def body(c: httpx.AsyncClient) -> None:
        payload = {"text": "the cat sat", "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
                   "stream": False, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
                   "logprob_start_len": -1}
        r = await c.post("/generate", json=payload)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 6

    run(app, body)


def test_defaults_are_sglangs() -> None:
    app, engine = make_app()
    seen = recorded(engine)

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": [3, 4]})
        assert r.status_code == 200, r.text
        r = await c.post("/generate", json=gen([3, 4], temperature=None, max_new_tokens=None, top_k=None))  # null = default
        assert r.status_code == 200, r.text

    run(app, body)
    assert (seen[0].max_new_tokens, seen[0].temperature) == (128, 1.0)
    assert seen[1].temperature == 1.0 and seen[1].max_new_tokens == 256 - 2  # null: what the context leaves


def test_sampling_seed_and_its_alias_seed() -> None:
    app, engine = make_app()
    seen = recorded(engine)

    async def body(c: httpx.AsyncClient) -> None:
        a = (await c.post("/generate", json=gen([7, 8], temperature=0.7, sampling_seed=11, max_new_tokens=12, ignore_eos=True))).json()
        b = (await c.post("/generate", json=gen([7, 8], temperature=0.7, seed=11, max_new_tokens=12, ignore_eos=True))).json()
        other = (await c.post("/generate", json=gen([7, 8], temperature=0.7, seed=12, max_new_tokens=12, ignore_eos=True))).json()
        assert a["output_ids"] == b["output_ids"] != other["output_ids"]

    run(app, body)
    assert [r.seed for r in seen] == [11, 11, 12]


NOOP_REFUSED = [
    pytest.param({"lora_path": "adapter"}, "lora_path", id="lora"),
    pytest.param({"image_data": "http://x/cat.png"}, "image_data", id="image"),
    pytest.param({"return_hidden_states": True}, "return_hidden_states", id="hidden-states"),
    pytest.param({"logprob_start_len": 0}, "logprob_start_len", id="prompt-logprobs"),
    pytest.param({"top_logprobs_num": 3}, "top_logprobs_num", id="top-logprobs"),
    pytest.param({"return_routed_experts": True}, "return_routed_experts", id="routed-experts"),
    pytest.param({"sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty", id="frequency-penalty"),
    pytest.param({"sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty", id="repetition-penalty"),
    pytest.param({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema", id="json-schema"),
    pytest.param({"sampling_params": {"regex": "a+"}}, "sampling_params.regex", id="regex"),
    pytest.param({"sampling_params": {"ebnf": "root ::= 'a'"}}, "sampling_params.ebnf", id="ebnf"),
    pytest.param({"sampling_params": {"logit_bias": {"3": 2.0}}}, "sampling_params.logit_bias", id="logit-bias"),
    pytest.param({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width", id="beam"),
]


@pytest.mark.parametrize(("extra", "field"), NOOP_REFUSED)
def test_unsupported_option_set_is_a_400_naming_it(extra: dict[str, Any], field: str) -> None:
    app, engine = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": [3], **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == field and err["message"].startswith(field + ":")
        assert "not supported" in err["message"]
        assert engine.batches[0].added == [a for a in engine.batches[0].added if a.startswith(("warmup", "health"))]
        ok = await c.post("/generate", json=gen([1, 2], max_new_tokens=3, ignore_eos=True))
        assert ok.status_code == 200

    run(app, body)


def test_unsupported_options_at_their_defaults_pass() -> None:
    app, _ = make_app()
    defaults = {"lora_path": None, "image_data": None, "return_hidden_states": False, "logprob_start_len": -1,
                "top_logprobs_num": 0, "custom_logit_processor": None, "bootstrap_host": None, "log_metrics": True,
                "custom_labels": {"team": "x"}, "routing_key": "k", "return_text_in_logprobs": False,
                "sampling_params": {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                    "json_schema": None, "regex": None, "logit_bias": None, "skip_special_tokens": True,
                                    "spaces_between_special_tokens": True, "stream_interval": 4, "max_new_tokens": 3}}

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": [3], **defaults})
        assert r.status_code == 200, r.text

    run(app, body)


def test_n_samples_one_prompt_with_consecutive_seeds() -> None:
    app, engine = make_app()
    seen = recorded(engine)

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=dict(gen([4, 5], n=3, temperature=0.9, sampling_seed=40, max_new_tokens=10,
                                                    ignore_eos=True), rid="job"))
        out = r.json()
        assert isinstance(out, list) and len(out) == 3
        for i, item in enumerate(out):
            assert item["meta_info"]["id"] == f"job-{i}"
            want, _ = expected_output(Request("x", [4, 5], 10, 0.9, 40 + i, (), True), engine.vocab_size, engine.eos_token_id)
            assert item["output_ids"] == want
        assert len({tuple(item["output_ids"]) for item in out}) == 3

    run(app, body)
    assert sorted(r.seed for r in seen) == [40, 41, 42]


def test_batch_with_a_string_rid_uses_it_as_a_prefix_and_per_prompt_params() -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"input_ids": [[1, 2], [3]], "rid": "b",
                                            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                                                {"max_new_tokens": 5, "ignore_eos": True}]})
        out = r.json()
        assert [o["meta_info"]["id"] for o in out] == ["b-0", "b-1"]
        assert [len(o["output_ids"]) for o in out] == [2, 5]
        r = await c.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2}]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params"

    run(app, body)


def test_a_batch_streams_its_prompts_interleaved_with_their_index() -> None:
    engine = FakeEngine()
    engine.step_delay = 0.002
    app, _ = make_app(engine)

    async def body(c: httpx.AsyncClient) -> None:
        payload = {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True, "n": 2,
                                                                      "temperature": 0.5, "sampling_seed": 9}}
        whole = (await c.post("/generate", json=payload)).json()
        chunks = parse_sse((await c.post("/generate", json=dict(payload, stream=True))).text)
        last = {ch["index"]: ch for ch in chunks}
        assert sorted(last) == [0, 1, 2, 3]
        assert [last[i]["output_ids"] for i in range(4)] == [w["output_ids"] for w in whole]
        assert sum(ch["meta_info"]["finish_reason"] is not None for ch in chunks) == 4  # each ends once

    run(app, body)


# -- stop strings ---------------------------------------------------------------------------------------
def test_stop_helpers() -> None:
    assert find_stop("a cat sat", ["sat", "cat"]) == (2, "cat")
    assert find_stop("a cat sat", ["dog"]) is None
    assert held_back("the ca", ["cat", "x"]) == 2
    assert held_back("the c", ["dog"]) == 0


def _greedy_words(engine: FakeEngine, prompt: list[int], n: int) -> tuple[list[int], list[str]]:
    want, _ = expected_output(Request("x", prompt, n, 0.0, None, (), True), engine.vocab_size, engine.eos_token_id)
    return want, word_codec().decode(want).split(" ")


@pytest.mark.parametrize("no_trim", [False, True])
def test_stop_string_cuts_text_and_tokens_and_ends_the_request(no_trim: bool) -> None:
    codec = word_codec()
    engine = FakeEngine()
    engine.step_delay = 0.002
    app, _ = make_app(engine, codec=codec)
    prompt = [2, 3]
    ids, words = _greedy_words(engine, prompt, 120)
    k = next(i for i in range(3, len(words)) if words[i] not in words[:i])  # first occurrence at word k
    stop = words[k]

    async def body(c: httpx.AsyncClient) -> None:
        params = dict(max_new_tokens=120, temperature=0, ignore_eos=True, stop=[stop, "never-there"], no_stop_trim=no_trim)
        r = await c.post("/generate", json=dict(gen(prompt, **params), rid="s"))
        out = r.json()
        kept = " ".join(words[: k + 1])
        assert out["text"] == (kept if no_trim else kept[: -len(stop)])
        assert out["output_ids"] == ids[: k + 1]
        assert out["meta_info"]["completion_tokens"] == k + 1
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        for _ in range(200):  # the scheduler applies a cancel between rounds
            if "s" in engine.batches[0].cancelled:
                break
            await asyncio.sleep(0.005)
        assert "s" in engine.batches[0].cancelled, "the engine request kept running after its stop string"
        r = await c.post("/generate", json=dict(gen(prompt, **params), stream=True))
        chunks = parse_sse(r.text)
        assert chunks[-1]["text"] == out["text"] and chunks[-1]["output_ids"] == out["output_ids"]
        assert all(stop not in ch["text"] or no_trim for ch in chunks)
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                                                  "stop": stop, "no_stop_trim": no_trim, "stream": True})
        chunks = parse_sse(r.text)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == out["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["matched_stop"] == stop

    run(app, body)


@pytest.mark.parametrize("no_trim", [False, True])
def test_a_stop_token_stays_in_output_ids_and_leaves_the_text(no_trim: bool) -> None:
    codec = word_codec()
    app, engine = make_app(codec=codec)
    ids, words = _greedy_words(engine, [2, 3], 60)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and ids[i] != engine.eos_token_id)

    async def body(c: httpx.AsyncClient) -> None:
        out = (await c.post("/generate", json=gen([2, 3], max_new_tokens=60, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[ids[k]], no_stop_trim=no_trim))).json()
        assert out["output_ids"] == ids[: k + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
        assert out["text"] == " ".join(words[: k + 1] if no_trim else words[:k])

    run(app, body)


def test_stop_strings_need_a_tokenizer() -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen([1], stop="x"))
        assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.stop"

    run(app, body)


# -- /tokenize, /detokenize, /v1/models, /model_info ---------------------------------------------------
def test_tokenize_and_detokenize_shapes() -> None:
    app, _ = make_app(codec=word_codec(), context_length=200)

    async def body(c: httpx.AsyncClient) -> None:
        one = (await c.post("/tokenize", json={"prompt": "the cat sat"})).json()
        assert one == {"tokens": [2, 3, 4], "count": 3, "max_model_len": 200}
        many = (await c.post("/tokenize", json={"model": "m", "prompt": ["the", "cat sat"]})).json()
        assert many["tokens"] == [[2], [3, 4]] and many["count"] == [1, 2]
        assert (await c.post("/detokenize", json={"tokens": [2, 3]})).json() == {"text": "the cat"}
        assert (await c.post("/detokenize", json={"tokens": [[2], [3, 4]]})).json() == {"text": ["the", "cat sat"]}
        r = await c.post("/detokenize", json={"tokens": [2, 500]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "tokens"
        r = await c.post("/tokenize", json={"text": "x"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "text"

    run(app, body)


def test_models_and_model_info() -> None:
    app, _ = make_app(codec=word_codec(), served_model_name="tiny")

    async def body(c: httpx.AsyncClient) -> None:
        models = (await c.get("/v1/models")).json()
        card = models["data"][0]
        assert models["object"] == "list" and card["id"] == "tiny" and card["object"] == "model"
        assert card["max_model_len"] == 256 and card["root"] == "fake-target"
        info = (await c.get("/model_info")).json()
        for key in ("model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                    "weight_version", "has_image_understanding", "model_type", "architectures"):
            assert key in info, key
        assert info["tokenizer_path"] == "fake-target" and info["is_generation"] is True

    run(app, body)


# -- /v1/completions ---------------------------------------------------------------------------------------
def test_completions_n_and_prompt_lists() -> None:
    app, engine = make_app(codec=word_codec())

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": ["the cat", "a dog"], "n": 2, "max_tokens": 4, "temperature": 0.5,
                                                  "seed": 3, "ignore_eos": True, "best_of": 2, "user": "me"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
        assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}
        want, _ = expected_output(Request("x", [7, 8], 4, 0.5, 4, (), True), engine.vocab_size, engine.eos_token_id)
        assert out["choices"][3]["text"] == word_codec().decode(want)
        r = await c.post("/v1/completions", json={"prompt": ["the", "a"], "max_tokens": 2, "rid": "mine"})
        assert r.status_code == 200, r.text

    run(app, body)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        pytest.param({"best_of": 3}, "best_of", id="best-of"),
        pytest.param({"echo": True}, "echo", id="echo"),
        pytest.param({"logprobs": 5}, "logprobs", id="top-logprobs"),
        pytest.param({"suffix": "x"}, "suffix", id="suffix"),
        pytest.param({"presence_penalty": 1.0}, "presence_penalty", id="presence-penalty"),
        pytest.param({"stream_options": {"include_usage": True}}, "stream_options", id="stream-options-without-stream"),
        pytest.param({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", id="stream-options-unknown"),
    ],
)
def test_completions_unsupported_values_are_400s(payload: dict[str, Any], field: str) -> None:
    app, _ = make_app()

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, **payload})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field

    run(app, body)


def test_completions_stream_interleaves_n_choices_of_several_prompts() -> None:
    codec = word_codec()
    engine = FakeEngine()
    engine.step_delay = 0.002
    app, _ = make_app(engine, codec=codec)

    async def body(c: httpx.AsyncClient) -> None:
        payload = {"prompt": ["the cat", "a dog"], "n": 2, "max_tokens": 20, "temperature": 0.9, "seed": 4, "ignore_eos": True}
        whole = (await c.post("/v1/completions", json=payload)).json()
        r = await c.post("/v1/completions", json=dict(payload, stream=True, stream_options={"include_usage": True}))
        chunks = parse_sse(r.text)
        texts: dict[int, str] = {}
        finals = []
        for ch in chunks[:-1]:
            (choice,) = ch["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                finals.append(choice["index"])
        assert sorted(finals) == [0, 1, 2, 3], "each choice ends exactly once"
        assert texts == {ch["index"]: ch["text"] for ch in whole["choices"]}
        assert chunks[-1]["usage"] == whole["usage"]

    run(app, body)


def test_completions_stream_include_usage_ends_with_a_usage_chunk() -> None:
    app, _ = make_app(codec=word_codec())

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                  "stream": True, "stream_options": {"include_usage": True}})
        chunks = parse_sse(r.text)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        assert all(ch["usage"] is None for ch in chunks[:-2])

    run(app, body)


# -- chat ---------------------------------------------------------------------------------------------------
def test_chat_renders_the_folder_template(tmp_path: Path) -> None:
    codec = word_codec()
    app, engine = make_app(codec=codec, model_path=chat_folder(tmp_path))
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    flat = [messages[0], {"role": "user", "content": "the cat"}]
    prompt = codec.encode(load_chat_template(tmp_path).render(flat), add_special_tokens=False)  # type: ignore[union-attr]
    want, _ = expected_output(Request("x", prompt, 5, 0.0, None, (), True), engine.vocab_size, engine.eos_token_id)

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_completion_tokens": 5,
                                                       "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": codec.decode(want), "reasoning_content": None,
                                                "tool_calls": None}
        assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 5
        r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                       "stream": True, "stream_options": {"include_usage": True}})
        chunks = parse_sse(r.text)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1]) == codec.decode(want)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "messages" and "unknown role" in r.text
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "messages.0.content.0"
        r = await c.post("/v1/chat/completions", json={"messages": messages, "tools": [{"type": "function"}]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "tools"

    run(app, body)


def test_chat_without_a_template_is_a_clear_400(tmp_path: Path) -> None:
    app, _ = make_app(codec=word_codec(), model_path=chat_folder(tmp_path, template=None))

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the"}]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "messages" and "chat template" in r.text
        assert (await c.post("/generate", json=gen([1], max_new_tokens=2))).status_code == 200

    run(app, body)


def test_template_is_sandboxed() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_fixture_target_has_a_chat_template() -> None:
    template = load_chat_template(Path(__file__).parents[2] / "fixtures" / "models" / "target")
    assert template is not None
    text = template.render([{"role": "system", "content": "Python."}, {"role": "user", "content": "def f():"}])
    assert text == "# Python.\ndef f():\n"


# -- engine-side sampling options and log-probs ---------------------------------------------------------
def test_sampling_options_reach_the_engine() -> None:
    app, engine = make_app()
    seen = recorded(engine)

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=gen([3], temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, min_new_tokens=2,
                                               max_new_tokens=4))
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={"prompt": [3], "max_tokens": 4, "top_p": 0.5, "top_k": 2, "min_p": 0.2,
                                                  "min_tokens": 1})
        assert r.status_code == 200, r.text

    run(app, body)
    assert [(r.top_p, r.top_k, r.min_p, r.min_new_tokens) for r in seen] == [(0.9, 5, 0.1, 2), (0.5, 2, 0.2, 1)]


def test_logprobs_on_every_route() -> None:
    N = 40
    codec = word_codec()
    engine = FakeEngine()
    engine.step_delay = 0.01  # several rounds, so a stream has several chunks
    app, _ = make_app(engine, codec=codec)
    ids, _ = _greedy_words(engine, [2, 3], N)
    want = [fake_logprob(t) for t in ids]

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=dict(gen([2, 3], temperature=0, max_new_tokens=N, ignore_eos=True), return_logprob=True,
                                                return_text_in_logprobs=True))
        entries = r.json()["meta_info"]["output_token_logprobs"]
        assert entries == [[lp, t, codec.decode([t])] for lp, t in zip(want, ids)]
        plain = (await c.post("/generate", json=gen([2, 3], temperature=0, max_new_tokens=N, ignore_eos=True))).json()
        assert "output_token_logprobs" not in plain["meta_info"]
        r = await c.post("/v1/completions", json={"prompt": [2, 3], "max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                  "logprobs": 0})
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == want and lp["tokens"] == [codec.decode([t]) for t in ids]
        r = await c.post("/v1/completions", json={"prompt": [2, 3], "max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                  "logprobs": 0, "stream": True})
        chunks = parse_sse(r.text)
        assert len(chunks) > 1
        assert [v for ch in chunks for v in ch["choices"][0]["logprobs"]["token_logprobs"]] == want  # each token once

    run(app, body)
