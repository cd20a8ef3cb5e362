"""Launch `python -m ddtree.server` on small random models for process-level tests (not a test module).

`save_tiny_pair(folder)` writes a random Qwen3-style target and a DFlash drafter (block 8) that
fits it; `launched(...)` starts the server on a free port in its own process group, waits for
/health_generate, and always kills it on the way out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

VOCAB = 128
EOS = 1
MAX_POSITIONS = 512
READY_TIMEOUT_S = 120.0


def save_tiny_pair(folder: Path) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of a small random pair; the drafter taps target layers 1 and 2."""
    import torch

    from ddtree.models import DrafterConfig, TargetConfig, init_drafter, init_target, save_drafter, save_target

    cfg = TargetConfig(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS,
        eos_token_id=EOS,
    )
    target = init_target(cfg, seed=0)
    with torch.no_grad():  # larger embeddings: logits far from uniform, so outputs are not all ties
        target.model.embed_tokens.weight.mul_(30)
    drafter_cfg = DrafterConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": VOCAB - 1}, "num_target_layers": 4,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS,
    })
    drafter = init_drafter(drafter_cfg, target, seed=1)
    save_target(target, folder / "target")
    save_drafter(drafter, folder / "drafter")
    return folder / "target", folder / "drafter"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_ready(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + "/health_generate", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()[-3000:]}")


@contextmanager
def launched(args: list[str], log_path: Path, wait: bool = True) -> Iterator[RunningServer]:
    port = free_port()
    cmd = [sys.executable, "-m", "ddtree.server", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])
    server = RunningServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        if wait:
            _wait_ready(server, READY_TIMEOUT_S)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
