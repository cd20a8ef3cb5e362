"""A model folder's chat template, rendered the way transformers' `apply_chat_template` renders it.

    load_chat_template(model_dir) -> ChatTemplate | None      # tokenizer_config.json's chat_template, or chat_template.jinja
    template.render(messages, add_generation_prompt=True, **kwargs) -> str

Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension,
a `tojson` filter that keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`, as
transformers sets them up; the special tokens' text (bos_token, eos_token, ...) comes from
tokenizer_config.json. A template that raises (e.g. a role it does not know) is the caller's 400.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ddtree.errors import ModelLoadError

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused the messages (its own raise_exception, or a Jinja error while rendering)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, path: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ModelLoadError(f"chat template{f' in {path}' if path else ''}: {err}") from err
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.path = path

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        variables = {**self.special_tokens, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as err:
            raise TemplateError(str(err)) from err


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialised AddedToken
        return value["content"]
    return None


def load_chat_template(model_dir: str | Path | None) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none (chat is then a 400)."""
    if model_dir is None:
        return None
    folder = Path(model_dir)
    config: dict[str, Any] = {}
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text())
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"tokenizer config: cannot read {config_path}: {err}") from err
        config = loaded if isinstance(loaded, dict) else {}
    source = config.get("chat_template")
    path = str(config_path)
    if isinstance(source, list):  # named templates: transformers uses the one called "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) and (folder / TEMPLATE_FILE).is_file():
        source, path = (folder / TEMPLATE_FILE).read_text(), str(folder / TEMPLATE_FILE)
    if not isinstance(source, str) or not source:
        return None
    special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    return ChatTemplate(source, special, path)
