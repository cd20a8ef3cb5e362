"""Every request field SGLang 0.5.23 defines is known to ddtree's server: implemented, metadata, or no-op only.

The field lists are read from the installed sglang package's own source (its dataclasses and pydantic
models, by AST: importing them needs SGLang's GPU stack), so a field SGLang adds is caught here rather than
by a client's first 400.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from ddtree.serving import openai_api, validation
from tests.interop.test_clients import IN_CI

INTERNAL = {  # SamplingParams fields SGLang fills itself (normalize / __post_init__), not API-facing
    "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized", "ebnf_full_assistant",
}


def sglang_source(relative: str) -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        if IN_CI:
            raise AssertionError("sglang is not installed (the interop extra and pip install --no-deps sglang==0.5.23)")
        pytest.skip("sglang is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def fields_of(source: str, name: str) -> set[str]:
    """The annotated public fields of class `name` (dataclass, msgspec Struct or pydantic model)."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not s.target.id.startswith("_")}


def test_generate_request_fields() -> None:
    fields = fields_of(sglang_source("srt/managers/io_struct.py"), "GenerateReqInput")
    known = set(validation.GenerateBody.model_fields) | set(validation.GENERATE_NOOP) | set(validation.GENERATE_METADATA)
    assert len(fields) > 50 and fields <= known, f"unknown to ddtree: {sorted(fields - known)}"


def test_sampling_params_fields() -> None:
    fields = fields_of(sglang_source("srt/sampling/sampling_params.py"), "SamplingParams") - INTERNAL
    known = set(validation.SamplingParams.model_fields) | set(validation.SAMPLING_NOOP)
    assert len(fields) > 20 and fields <= known, f"unknown to ddtree: {sorted(fields - known)}"


@pytest.mark.parametrize(("name", "model", "noop", "metadata"), [
    ("CompletionRequest", openai_api.CompletionBody, openai_api.COMPLETION_NOOP, openai_api.COMMON_METADATA),
    ("ChatCompletionRequest", openai_api.ChatBody, openai_api.CHAT_NOOP, openai_api.CHAT_METADATA),
])
def test_openai_request_fields(name: str, model: type, noop: dict, metadata: tuple) -> None:
    fields = fields_of(sglang_source("srt/entrypoints/openai/protocol.py"), name)
    known = set(model.model_fields) | set(noop) | set(metadata)
    assert len(fields) > 30 and fields <= known, f"unknown to ddtree: {sorted(fields - known)}"
