"""Programmatic dependent launch against plain launches, as CUDA graphs: 300 tiny kernels in a chain (silu * up of
one 256-wide row), and 20 layers of the 1b shape's four skinny GEMMs at one row (q/k/v, o, gate/up + SwiGLU,
down), each with and without the weight prefetch. `python -m ddtree.bench.pdl_chain` (CUDA, sm_90+)."""
import os
import statistics
import torch
import triton
from triton.backends.nvidia.compiler import CUDAOptions
print("CUDAOptions has launch_pdl:", "launch_pdl" in CUDAOptions.__dataclass_fields__, flush=True)
from ddtree.kernels import pdl, skinny_gemm
from ddtree.kernels.residual_norm import silu_mul
from ddtree.kernels.skinny_gemm import skinny_linear

dev = torch.device("cuda")

def graph_ms(fn, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)

def tiny_chain():
    a = torch.randn(1, 256, device=dev, dtype=torch.bfloat16)
    b = torch.randn(1, 256, device=dev, dtype=torch.bfloat16)
    def run():
        x = a
        for _ in range(300):
            x = silu_mul(x, b)
    return run

def gemm_chain(layers=20, h=2048, inter=6144, qkv=4096):
    ws = [(torch.randn(qkv, h, device=dev, dtype=torch.bfloat16) * 0.02,
           torch.randn(h, h, device=dev, dtype=torch.bfloat16) * 0.02,
           torch.randn(2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02,
           torch.randn(h, inter, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
    x0 = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    def run():
        x = x0
        for wq, wo, wgu, wd in ws:
            q = skinny_linear(x, wq)
            x = skinny_linear(q[:, :h], wo, residual=x)
            y = skinny_linear(x, wgu, swiglu=True)
            x = skinny_linear(y, wd, residual=x)
    return run

for name, make in (("tiny chain x300", tiny_chain), ("1b gemms x20 layers", gemm_chain)):
    res = {}
    for mode, mb in (("0", 16), ("1", 0), ("1", 16), ("0", 16), ("1", 0), ("1", 16), ("1", 48)):
        os.environ["DDTREE_PDL"] = mode
        skinny_gemm.PREFETCH_BYTES = mb << 20
        ms = graph_ms(make())
        res.setdefault((mode, mb), []).append(ms)
        print(f"{name}: PDL={mode} prefetch={mb} MB: {ms:.4f} ms", flush=True)
