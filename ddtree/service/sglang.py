"""SGLangBackend: `python -m sglang.launch_server` (the dialect's `module`), flags and environment
from the server dialect.

LocalBackend with another module: the dialect (sglang-ddtree unless told otherwise) says which
knob is a flag and which an environment variable of the launched process (the PR 29907 fork
reads top-k from SGLANG_DDTREE_MAX_TOPK), and where verification reads each one back.
"""

from __future__ import annotations

from typing import Any

from ddtree.service.dialects import load_dialect
from ddtree.service.local import LocalBackend


class SGLangBackend(LocalBackend):
    name = "sglang"
    module = "sglang.launch_server"
    default_device = "cuda"  # DFLASH (and DDTree on top of it) cannot run on SGLang's CPU engine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["dialect"] = kwargs.get("dialect") or load_dialect("sglang-ddtree")
        super().__init__(*args, **kwargs)
        self.module = self.dialect.module
