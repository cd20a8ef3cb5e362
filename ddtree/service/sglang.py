"""SGLangBackend: `python -m sglang.launch_server` with the same flags as ddtree's server.

SGLang's CLI spells the speculative flags the way SpecConfig.server_args() writes them, so this
is LocalBackend with another module; its init line differs ("Initialized DFLASH draft runner.
... block_size=8, draft_window_size=2048, compact_cache=True") and verify.py accepts both shapes.
"""

from __future__ import annotations

from ddtree.service.local import LocalBackend


class SGLangBackend(LocalBackend):
    name = "sglang"
    module = "sglang.launch_server"
    default_device = "cuda"  # DFLASH (and DDTree on top of it) cannot run on SGLang's CPU engine
