"""Prompts of exactly N tokens of the served model when this project cannot read its tokenizer:
counted by the service's /tokenize (SGLang's TokenizeRequest/Response), in the suite and alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree.bench.prompts import code_prompts, service_encoder
from ddtree.config import SpecConfig
from ddtree.errors import ModelLoadError, ServiceError
from ddtree.service.fake import FakeBackend, fake_tokens
from ddtree.service.readiness import wait_ready
from ddtree.text import load_tokenizer
from tests.unit.test_suite_plugin import run, suite_dir  # noqa: F401 - suite_dir is a fixture


def kimi_like(folder: Path) -> Path:
    """A model folder as Kimi ships it: a tiktoken model file, no tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "max_position_embeddings": 4096}))
    return folder


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeBackend]:
    backend = FakeBackend(log_dir=tmp_path, stop_timeout_s=2)
    backend.start(SpecConfig())
    wait_ready(backend, timeout_s=20, poll_s=0.05)
    yield backend
    backend.stop()


def test_the_local_loader_cannot_read_these_tokenizers(tmp_path: Path) -> None:
    assert load_tokenizer(kimi_like(tmp_path / "kimi")) is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": {"type": "TikToken"}}')
    with pytest.raises(ModelLoadError):
        load_tokenizer(tmp_path / "broken")


def test_prompts_are_cut_by_the_services_counts(fake: FakeBackend) -> None:
    encode = service_encoder(fake.base_url)
    text = "def f(x):\n    return x + 1  # one\n"
    assert encode(text) == fake_tokens(text)
    prompts = code_prompts(encode, 300, 3)
    assert [len(p) for p in prompts] == [300, 300, 300] and len({tuple(p) for p in prompts}) == 3
    vocabulary = set(range(100, 100 + 50_000))
    assert all(set(p) <= vocabulary for p in prompts)  # the service's own ids, sent as input_ids


def test_a_service_without_tokenize_is_a_clear_error(fake: FakeBackend) -> None:
    with pytest.raises(ServiceError, match=r"/nope/tokenize answered 404.*cannot count tokens.*--tokenize local"):
        service_encoder(fake.base_url + "/nope")("x = 1")


@pytest.mark.parametrize("tokenize", ["service", "auto"])
def test_a_sweep_counts_prompt_tokens_through_the_service(suite_dir: pytest.Pytester, tokenize: str) -> None:  # noqa: F811
    model = kimi_like(suite_dir.path / "kimi")
    result = run(suite_dir, "-m", "perf", "--tokenize", tokenize, "--model-path", str(model), "-k", "ctx8-c2")
    result.assert_outcomes(passed=2, deselected=2)
    if tokenize == "auto":
        result.stdout.fnmatch_lines(["*kimi has no tokenizer.json: counting tokens with the service's /tokenize"])
    for cell in (suite_dir.path / "results" / "cells").iterdir():
        repeat = json.loads(cell.read_text())["per_repeat"][0]
        assert repeat["total_input_tokens"] == 8 * 2, cell.name  # what the service counted: 2 prompts of 8


def test_local_tokenization_without_a_readable_tokenizer_says_what_to_do(suite_dir: pytest.Pytester) -> None:  # noqa: F811
    model = kimi_like(suite_dir.path / "kimi")
    result = run(suite_dir, "-m", "perf", "--tokenize", "local", "--model-path", str(model), "-k", "ar-ctx8-c1")
    result.assert_outcomes(errors=1, deselected=3)
    result.stdout.fnmatch_lines(["*--tokenize local: *kimi has no tokenizer.json; use --tokenize service*"])
