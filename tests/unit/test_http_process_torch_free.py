"""The HTTP process imports no torch: only the engine process, after it is forked, loads it.

Two checks: the real server (`python -m ddtree.server` on the committed CPU fixture models) has no libtorch
mapped in its HTTP process while its engine process does; and importing ddtree.server and building the app
(routes, validation, replies, state, the engine client) leaves torch out of sys.modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.unit.tiny_server import RunningServer, launched

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "models"


def mapped_torch(pid: int) -> list[str]:
    """The torch libraries mapped into process `pid`."""
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libtorch" in line})


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    args = ["--model-path", str(FIXTURES / "target"), "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(FIXTURES / "drafter"), "--max-running-requests", "2"]
    with launched(args, tmp_path_factory.mktemp("log") / "server.log") as running:
        yield running


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_served_http_process_maps_no_torch_and_its_engine_process_does(server: RunningServer) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200  # both processes served
    engines = children(server.proc.pid)
    assert any(mapped_torch(pid) for pid in engines), "the engine process has torch (the check would see it)"
    assert mapped_torch(server.proc.pid) == [], "the HTTP process has torch mapped"


BUILD_THE_APP = textwrap.dedent(f"""
    import sys
    from types import SimpleNamespace

    from ddtree.server import create_app
    from ddtree.serving.args import resolve_args
    from ddtree.serving.metrics import ServerMetrics
    from ddtree.serving.wire import EngineInfo
    from ddtree.text import load_tokenizer

    args = resolve_args(["--model-path", {str(FIXTURES / "target")!r}, "--device", "cpu"])
    info = EngineInfo(eos_token_id=1, max_context=512, vocab_size=128, context_length=512, device="cpu",
                      attention="sdpa", cuda_graphs=False)
    engine = SimpleNamespace(metrics=ServerMetrics(), on_death=None)  # what ServerState needs of EngineProcess
    create_app(info, args.spec, args, load_tokenizer(args.model_path), scheduler=engine)
    print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
""")


def test_building_the_served_app_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD_THE_APP], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"torch imported by the HTTP side: {out.stdout.strip()[:300]}"
