"""KV compaction: the torch reference against a naive slot-by-slot loop, the Triton kernel against the reference.

Moves are exact copies, so results must match bit for bit. On machines without CUDA the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is; see test_tree_attention.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.kv_compact import (
    compact_kv,
    compact_kv_reference,
    compact_kv_triton,
)
from tests.kernels.kernel_asserts import (
    interpreter_off_but_installed,
    run_triton_cases_in_child,
    triton_runtime,
)

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)


@dataclass(frozen=True)
class Case:
    layers: int
    bs: int
    hkv: int
    prefix: int  # the largest committed length; rows get lengths in [0, prefix]
    n: int  # tree window written after the prefix (nodes incl. root)
    m: int  # src columns (longest accepted path + padding)
    d: int
    dtype: torch.dtype
    seed: int = 0

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"l{self.layers}-b{self.bs}-h{self.hkv}-p{self.prefix}-n{self.n}-m{self.m}-d{self.d}-{dtype}"


CPU_CASES = [
    Case(1, 1, 1, 0, 4, 4, 16, torch.float32),
    Case(2, 4, 2, 30, 17, 8, 64, torch.bfloat16, seed=1),
    Case(3, 6, 2, 100, 65, 16, 128, torch.float32, seed=2),
    Case(2, 5, 1, 12, 9, 9, 96, torch.float16, seed=3),
]
GPU_CASES = [
    Case(28, 32, 8, 4096, 65, 16, 128, torch.bfloat16, seed=10),
    Case(28, 1, 8, 1024, 9, 9, 128, torch.bfloat16, seed=11),
    Case(4, 32, 4, 512, 33, 33, 64, torch.float32, seed=12),
    Case(2, 7, 2, 300, 64, 64, 128, torch.float16, seed=13),
]


def accepted_paths(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """src[bs, m] (increasing node indices starting at 0, then garbage past counts) and counts[bs] in [1, m].

    Row kinds: random paths, an already contiguous path, the root only, and a one-step shift (every
    destination is another move's source: the overlap case).
    """
    src = torch.randint(0, case.n, (case.bs, case.m), generator=gen)  # garbage beyond counts
    counts = torch.randint(1, min(case.m, case.n) + 1, (case.bs,), generator=gen)
    for b in range(case.bs):
        c = int(counts[b])
        kind = b % 4
        if kind == 0 or c == 1:
            path = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(case.n - 1, generator=gen)[:c - 1].sort()
                              .values + 1])
        elif kind == 1:
            path = torch.arange(c)  # contiguous: nothing may move
        elif kind == 2:
            counts[b], path = 1, torch.zeros(1, dtype=torch.long)
        else:
            c = min(c, case.n - 1)
            counts[b], path = c, torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(2, c + 1)])
        src[b, :len(path)] = path
    return src, counts


def make_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(case.seed)
    big = torch.Generator(device=device).manual_seed(case.seed)  # full-size caches are drawn on the device
    max_len = case.prefix + case.n + 3
    shape = (case.layers, case.bs, case.hkv, max_len, case.d)
    k = torch.randn(*shape, generator=big, device=device, dtype=case.dtype)
    v = torch.randn(*shape, generator=big, device=device, dtype=case.dtype)
    lengths = torch.randint(0, case.prefix + 1, (case.bs,), generator=gen)
    lengths[0] = case.prefix
    src, counts = accepted_paths(case, gen)
    return k, v, lengths.to(device), src.to(device), counts.to(device)


def naive_compact(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor,
                  counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, one slot at a time, reading only from the untouched input."""
    k_out, v_out = k.clone(), v.clone()
    for b in range(k.shape[1]):
        base = int(lengths[b])
        for j in range(int(counts[b])):
            k_out[:, b, :, base + j] = k[:, b, :, base + int(src[b, j])]
            v_out[:, b, :, base + j] = v[:, b, :, base + int(src[b, j])]
    return k_out, v_out


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs()
        wrong = diff.ne(0) | actual.isnan()
        first = tuple(int(i) for i in wrong.nonzero()[0]) if wrong.any() else None
        raise AssertionError(f"{what}: {int(wrong.sum())}/{actual.numel()} elements differ "
                             f"(dims layer, b, head, slot, d; first at {first}); max abs diff {float(diff.max()):.3g}")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES[:3]])
def test_reference_matches_naive_loop(case: Case) -> None:
    k, v, lengths, src, counts = make_inputs(case, torch.device("cpu"))
    k_exp, v_exp = naive_compact(k, v, lengths, src, counts)
    compact_kv_reference(k, v, lengths, src, counts)
    assert_equal(k, k_exp, f"reference K, {case.id}")
    assert_equal(v, v_exp, f"reference V, {case.id}")


def _check_kernel(case: Case) -> None:
    k, v, lengths, src, counts = make_inputs(case, DEVICE)
    k_exp, v_exp = k.clone(), v.clone()
    compact_kv_reference(k_exp, v_exp, lengths, src, counts)
    lengths_before = lengths.clone()
    compact_kv_triton(k, v, lengths, src, counts)
    assert torch.equal(lengths, lengths_before), "compact_kv must not change lengths"
    assert_equal(k, k_exp, f"triton K, {case.id}")
    assert_equal(v, v_exp, f"triton V, {case.id}")


@needs_triton
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_triton_matches_reference(case: Case) -> None:
    _check_kernel(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: full-size caches are too slow for the Triton interpreter")
@pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_triton_matches_reference_gpu(case: Case) -> None:
    _check_kernel(case)


@needs_triton
def test_triton_contiguous_row_stays_put() -> None:
    """A contiguous row (src[b, j] == j) is left as it is: a NaN in one of its slots stays there, spreads nowhere."""
    case = Case(2, 3, 2, 10, 9, 5, 32, torch.float32, seed=30)
    k, v, lengths, src, counts = make_inputs(case, DEVICE)
    src[1, :5], counts[1] = torch.arange(5), 5  # row 1 contiguous
    slot = int(lengths[1]) + 2
    k[:, 1, :, slot] = float("nan")  # an identity move's slot
    k_exp, v_exp = k.clone(), v.clone()
    compact_kv_triton(k, v, lengths, src, counts)
    compact_kv_reference(k_exp, v_exp, lengths, src, counts)
    assert k[:, 1, :, slot].isnan().all(), "the contiguous row's slot changed"
    assert torch.equal(k.nan_to_num(7.0), k_exp.nan_to_num(7.0)) and torch.equal(v, v_exp)


@needs_triton
def test_dispatcher_picks_triton_by_device() -> None:
    case = CPU_CASES[1]
    k, v, lengths, src, counts = make_inputs(case, DEVICE)
    k_exp, v_exp = k.clone(), v.clone()
    compact_kv_reference(k_exp, v_exp, lengths, src, counts)
    compact_kv(k, v, lengths, src, counts)  # auto: Triton on CUDA, the reference on CPU
    assert_equal(k, k_exp, "auto K")
    assert_equal(v, v_exp, "auto V")


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")


@pytest.mark.parametrize(("field", "value", "message"), [
    pytest.param("k", torch.zeros(2, 3, 4), "k and v must both be", id="k-rank"),
    pytest.param("src", torch.zeros(3, 4), "src must be", id="src-float"),
    pytest.param("lengths", torch.zeros(5, dtype=torch.long), "lengths must be", id="lengths-shape"),
    pytest.param("counts", torch.zeros(2, dtype=torch.long), "counts must be", id="counts-shape"),
])
def test_bad_input_names_the_field(field: str, value: torch.Tensor, message: str) -> None:
    args = dict(zip(("k", "v", "lengths", "src", "counts"), make_inputs(CPU_CASES[1], torch.device("cpu"))))
    args[field] = value
    with pytest.raises(ValueError, match=message):
        compact_kv_reference(**args)
    with pytest.raises(ValueError, match="backend must be"):
        compact_kv(*make_inputs(CPU_CASES[0], torch.device("cpu")), backend="gpu")  # type: ignore[arg-type]
