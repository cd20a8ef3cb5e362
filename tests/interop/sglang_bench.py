"""Run SGLang's benchmark client (`sglang.benchmark.serving`, SGLang 0.5.23) with its own command line.

    python tests/interop/sglang_bench.py --backend sglang --base-url URL ...   # the same flags as sglang's

The client module imports `sglang.srt.disaggregation.utils` for one constant (FAKE_BOOTSTRAP_HOST, used only
with --fake-prefill); that module pulls in SGLang's model configs, torchvision and GPU kernels, which a CPU
machine with `pip install --no-deps sglang` does not have. So this stands in a module holding that constant
(its value as SGLang defines it) and then runs the client unchanged: every request it sends and every
response it parses is SGLang's own code.
"""

from __future__ import annotations

import sys
import types


def main() -> None:
    stand_in = types.ModuleType("sglang.srt.disaggregation.utils")
    stand_in.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]
    sys.modules.setdefault("sglang.srt.disaggregation.utils", stand_in)
    from sglang.benchmark.serving import cli_main

    cli_main()


if __name__ == "__main__":
    main()
