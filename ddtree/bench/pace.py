"""The pace probe: a short fixed workload that says how fast this machine runs right now.

A sweep's tok/s depends on the code and on the machine's pace at that moment (a shared VM's pace
moves by up to half within an hour; a GPU's clocks and neighbours move too). The suite measures this
probe around every cell and judges pace-normalised throughput, tok/s / pace, against floors that
recorded the pace they were measured at (docs/results.md, "How a verdict is computed").

The probe is built from torch and the standard library only, never from ddtree's model, engine or
server code: if it ran that code, a slower engine would slow the probe as much and hide itself. It
stands alone for the same reason a second way: `python3 -c "$(cat pace.py)" --serve` runs it on a
remote service host (the systemd backend sends it over ssh), where ddtree is not installed.

Components, each a fixed amount of work timed in `CHUNKS` chunks (the median chunk counts, so a
one-off stall inside the probe is not the machine's pace):

    cpu   interpreter  a pure-Python loop (dicts, lists, calls): the server's per-request and
                       per-round host code runs on the interpreter
          dispatch     tiny torch ops on a [4, 256] tensor: the fixture models' rounds are
                       hundreds of small ops, so the dispatcher's cost per op sets their pace
          gemm         [8, 256] x [256, 4096] and [8, 256] x [256, 768] products at the served
                       shapes (one thread: small products run on one in the engine, and a
                       two-thread team on a 2-core VM beside other work measures OpenMP's
                       spinning, 10-100x off, not the machine)
          pipeline     a served token's shape: a byte passed round three processes through pipes,
                       a millisecond of tiny torch ops at the engine-like hop and a little Python at
                       the others (engine -> HTTP process -> client). Processes that block and wake
                       are scheduled unlike a CPU hog: beside a busy neighbour the hog-like parts
                       above slow by up to twice as much as serving does, this part about as much
          pipeline_loaded  the same with three bytes in flight, every process busy: concurrent
                       requests. A busy neighbour on a 2-core VM speeds a lone request up (the
                       vCPUs stay awake, waking a process costs less) and slows concurrent ones
                       (they need the cores it takes): each kind of cell gets the pipeline it is
    cuda  interpreter  as on the CPU (the host drives every launch)
          launch       1000 launches of a one-element kernel, then a sync: launch latency
          gemm         bf16 [64, 4096] x [4096, 4096] products: small-batch GEMMs
          hbm          device-to-device copies of a 256 MiB buffer: memory bandwidth

The pace score is the weighted geometric mean over components of REFERENCE_MS / measured ms: 1.0
on the reference machine (the 2-core CI VM on a quiet hour; an H200 for cuda), 0.5 when everything
takes twice as long. On the CPU the pipeline weighs 0.7 and the three hog-like parts 0.1 each: they
track the host's own speed (a slow hour slows every part alike), the pipeline also how the host
treats the server's processes beside other work; `score` takes the plain pipeline (cells at
concurrency 1), `score_loaded` the loaded one (the others); on CUDA the four parts weigh alike. Only ratios of
scores measured by the same probe (`probe` id) mean anything.

    python -m ddtree.bench.pace [--device cpu|cuda] [--json]     # one reading
    python -m ddtree.bench.pace --serve                          # a reading per "probe" line on stdin
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch

PROBE_VERSION = {"cpu": 4, "cuda": 2}  # bumped when a kind's workload or weights change: old paces stop comparing
CHUNKS = 3
# ms per chunk of each component on the reference machines (quiet 2-core CI VM; H200), so a score of 1.0 is
# that machine at its usual pace
REFERENCE_MS = {
    "cpu": {"interpreter": 14.0, "dispatch": 15.0, "gemm": 15.0, "pipeline": 20.0, "pipeline_loaded": 45.0},
    "cuda": {"interpreter": 14.0, "launch": 5.0, "gemm": 1.5, "hbm": 2.5},
}
WEIGHTS = {
    "cpu": {"interpreter": 0.1, "dispatch": 0.1, "gemm": 0.1, "pipeline": 0.7},
    "cuda": {"interpreter": 1 / 4, "launch": 1 / 4, "gemm": 1 / 4, "hbm": 1 / 4},
}


def probe_id(device: str) -> str:
    """What a score is comparable with: the device kind and the probe's version."""
    kind = device_kind(device)
    return f"{kind}-v{PROBE_VERSION[kind]}"


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


# -- workloads (each runs one chunk) -------------------------------------------------------------

def interpreter_chunk() -> None:
    table: dict[int, int] = {}
    items: list[int] = []
    for i in range(120_000):
        table[i & 1023] = table.get(i & 1023, 0) + i
        items.append(abs(i - 512))
        if len(items) > 256:
            items = items[128:]
    sorted(table.items(), key=lambda kv: kv[1])


def make_dispatch(device: torch.device) -> Callable[[], None]:
    x = torch.randn(4, 256, device=device)
    w = torch.randn(256, device=device)

    def chunk() -> None:
        y = x
        for _ in range(500):
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w).tanh()
    return chunk


def spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


class Pipeline:
    """A served token's shape in three processes: a ring of pipes through an engine-like hop (a
    millisecond of tiny torch ops and a product at the served shapes), an HTTP-like hop and this
    process (a little Python each), as a streamed token goes engine -> HTTP process -> client.
    A busy neighbour or a slow host shows here as it shows in serving: in the bursts' own speed and
    in how soon a process that blocked on a pipe runs again. The hops exit when their input closes,
    so they never outlive the probe."""

    PYTHON_WORK = 2000  # loop iterations at the HTTP-like hop and here (~25 us)
    ENGINE_STEPS = 30  # tiny-op steps at the engine-like hop (~1 ms in all)
    TRIPS = 20
    LOADED = 3  # bytes in flight for the loaded pipeline: one per process
    LOADED_WORK = 30  # the Python hops' work per loaded byte, in PYTHON_WORKs (~0.8 ms, near the engine hop's)

    def __init__(self) -> None:
        pipes = [os.pipe() for _ in range(3)]  # 0: here -> engine, 1: engine -> http, 2: http -> here
        self.pids = []
        for hop, work in ((1, self._engine_work), (2, self._python_work)):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the forked hop
                keep = (pipes[hop - 1][0], pipes[hop][1])
                for fd in {fd for pair in pipes for fd in pair} - set(keep):
                    os.close(fd)
                self._hop(*keep, work())
            self.pids.append(pid)
        self.send, self.receive = pipes[0][1], pipes[2][0]
        for fd in (pipes[0][0], pipes[1][0], pipes[1][1], pipes[2][1]):
            os.close(fd)

    @classmethod
    def _python_work(cls) -> Callable[[bytes], None]:
        def work(data: bytes) -> None:
            spin(cls.PYTHON_WORK * (cls.LOADED_WORK if data == b"L" else 1))
        return work

    @classmethod
    def _engine_work(cls) -> Callable[[bytes], None]:
        x, w = torch.randn(4, 256), torch.randn(256)
        head = torch.randn(256, 4096)

        def work(data: bytes) -> None:
            y = x
            for _ in range(cls.ENGINE_STEPS):
                y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w).tanh()
            torch.mm(y, head).argmax(-1)
        return work

    @staticmethod
    def _hop(read_fd: int, write_fd: int, work: Callable[[bytes], None]) -> None:
        while True:
            data = os.read(read_fd, 1)  # one byte, one token's work
            if not data:
                os._exit(0)
            work(data)
            os.write(write_fd, data)

    def chunk(self, in_flight: int = 1) -> None:
        """TRIPS bytes round the ring, `in_flight` of them at a time: 1 is a lone request's token, each hop
        waking the next; LOADED bytes ("L": the Python hops do LOADED_WORK times their work, as the HTTP
        process and the client do for concurrent streams) keep every process busy."""
        token, work = (b"L", self.PYTHON_WORK * self.LOADED_WORK) if in_flight > 1 else (b"x", self.PYTHON_WORK)
        for _ in range(in_flight):
            os.write(self.send, token)
        for _ in range(self.TRIPS - in_flight):
            os.read(self.receive, 1)
            spin(work)
            os.write(self.send, token)
        for _ in range(in_flight):
            os.read(self.receive, 1)

    def loaded_chunk(self) -> None:
        self.chunk(self.LOADED)

    def close(self) -> None:
        os.close(self.send)  # the engine hop reads EOF and exits, which closes the next hop's input
        os.close(self.receive)
        for pid in self.pids:
            os.waitpid(pid, 0)
        self.pids = []


def make_cpu_gemm() -> Callable[[], None]:
    a = torch.randn(8, 256)  # a b8 tree's rows
    head, up = torch.randn(256, 4096), torch.randn(256, 768)

    def chunk() -> None:
        for _ in range(75):
            torch.mm(a, head)
            torch.mm(a, up)
    return chunk


def make_cuda_parts(device: torch.device) -> dict[str, Callable[[], None]]:
    one = torch.zeros(1, device=device)
    a = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    src = torch.empty(256 * 2**20 // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)

    def launch() -> None:
        for _ in range(1000):
            one.add_(1.0)
        torch.cuda.synchronize(device)

    def gemm() -> None:
        for _ in range(100):
            torch.mm(a, w)
        torch.cuda.synchronize(device)

    def hbm() -> None:
        for _ in range(16):
            dst.copy_(src)
        torch.cuda.synchronize(device)

    return {"launch": launch, "gemm": gemm, "hbm": hbm}


def workloads(device: str, pipeline: Pipeline | None) -> dict[str, Callable[[], None]]:
    if device_kind(device) == "cuda":
        return {"interpreter": interpreter_chunk, **make_cuda_parts(torch.device(device))}
    assert pipeline is not None
    return {"interpreter": interpreter_chunk, "dispatch": make_dispatch(torch.device("cpu")), "gemm": make_cpu_gemm(),
            "pipeline": pipeline.chunk, "pipeline_loaded": pipeline.loaded_chunk}


# -- measuring ------------------------------------------------------------------------------------

def time_chunks(chunk: Callable[[], None], chunks: int = CHUNKS) -> float:
    """The median of `chunks` timed runs of `chunk`, in ms (callers sync the device inside the chunk)."""
    times = []
    for _ in range(chunks):
        start = time.perf_counter()
        chunk()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def score_of(kind: str, components_ms: dict[str, float], loaded: bool = False) -> float:
    """Weighted geometric mean of reference / measured over the components (1.0 = the reference machine);
    `loaded` weighs the loaded pipeline where the plain one would be (WEIGHTS)."""
    reference, weights = REFERENCE_MS[kind], WEIGHTS[kind]
    if loaded and "pipeline_loaded" in components_ms:
        weights = {("pipeline_loaded" if k == "pipeline" else k): w for k, w in weights.items()}
    parts = [(weights[name], math.log(reference[name] / ms)) for name, ms in components_ms.items()
             if ms > 0 and name in weights]
    return math.exp(sum(w * x for w, x in parts) / sum(w for w, _ in parts))


class Probe:
    """The workloads built once (buffers allocated, kernels loaded) and measured on demand."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.kind = device_kind(device)
        if self.kind == "cpu":
            torch.set_num_threads(1)  # see the gemm component
        self.pipeline = Pipeline() if self.kind == "cpu" else None
        self.parts = workloads(device, self.pipeline)
        for chunk in self.parts.values():  # warm-up: allocations, first-call dispatch, kernel loads
            chunk()

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    def measure(self) -> dict[str, Any]:
        """`score` for one request in flight, `score_loaded` for several (the cells at concurrency > 1 and
        the rate cells); on CUDA the two are one."""
        start = time.perf_counter()
        components = {name: round(time_chunks(chunk), 4) for name, chunk in self.parts.items()}
        return {"probe": probe_id(self.device), "score": round(score_of(self.kind, components), 4),
                "score_loaded": round(score_of(self.kind, components, loaded=True), 4),
                "components_ms": components, "seconds": round(time.perf_counter() - start, 3),
                "at": datetime.now(UTC).isoformat(timespec="seconds")}


def serve(device: str) -> int:
    """Answer each line "probe" on stdin with one JSON reading on stdout; "quit" or EOF ends.

    The first line out is {"ready": true, "probe": ...} once the warm-up is done, so a caller never
    times torch's import or the warm-up.
    """
    probe = Probe(device)
    print(json.dumps({"ready": True, "probe": probe_id(device)}), flush=True)
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "quit":
                break
            if command == "probe":
                print(json.dumps(probe.measure()), flush=True)
            elif command:
                print(json.dumps({"error": f"unknown command {command!r}; expected probe or quit"}), flush=True)
    finally:
        probe.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.bench.pace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--json", action="store_true", help="print the reading as JSON")
    parser.add_argument("--repeat", type=int, default=1, help="readings to take (default 1)")
    parser.add_argument("--serve", action="store_true", help="answer 'probe' lines on stdin with JSON readings")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device: {args.device!r} is not valid; expected cpu, cuda or cuda:N")
    if device_kind(args.device) == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} is not valid; expected an integer >= 1")
    if args.serve:
        return serve(args.device)
    probe = Probe(args.device)
    try:
        for _ in range(args.repeat):
            reading = probe.measure()
            if args.json:
                print(json.dumps(reading))
            else:
                parts = ", ".join(f"{k} {v:.2f} ms" for k, v in reading["components_ms"].items())
                print(f"pace {reading['score']:.3f} ({reading['probe']}; {parts}; {reading['seconds']:.2f} s)")
    finally:
        probe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
