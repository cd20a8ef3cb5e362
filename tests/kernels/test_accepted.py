"""gather_accepted: the torch reference against a row-by-row loop, the Triton kernel against the reference.

Everything it does is a copy or an integer add, so results must match bit for bit. On machines without
CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 set at import, before triton is).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ddtree.kernels.accepted import (
    gather_accepted,
    gather_accepted_reference,
    gather_accepted_triton,
    ring_slots_reference,
)
from tests.kernels.kernel_asserts import interpreter_off_but_installed, run_triton_cases_in_child, triton_runtime

pytestmark = pytest.mark.kernels

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_OK, TRITON_WHY = triton_runtime()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_WHY)

# (bs, width, nodes, features, taps dtype)
CASES = [(1, 5, 5, 512, torch.float32), (3, 8, 17, 96, torch.bfloat16), (4, 2, 9, 2048 + 5, torch.float32),
         (2, 1, 1, 16, torch.float16)]


def make_inputs(bs: int, width: int, nodes: int, features: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """A random path per row (root first, distinct nodes, -1 past its length) and the tensors around it."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (bs,), generator=gen)
    accepted = torch.full((bs, width), -1, dtype=torch.long)
    for b in range(bs):
        rest = torch.randperm(nodes - 1, generator=gen)[: int(lens[b]) - 1] + 1
        accepted[b, : int(lens[b])] = torch.cat([torch.zeros(1, dtype=torch.long), rest])
    tokens = torch.randint(0, 50000, (bs, nodes), generator=gen)
    bonus = torch.randint(0, 50000, (bs,), generator=gen)
    taps = torch.randn(bs, nodes, features, generator=gen).to(dtype)
    starts = torch.randint(0, 4000, (bs,), generator=gen)
    return tuple(t.to(DEVICE) for t in (accepted, lens, tokens, bonus, taps, starts))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c}")
def test_reference_follows_each_path(case: tuple) -> None:
    accepted, lens, tokens, bonus, taps, starts = make_inputs(*case)
    bonus_out = torch.zeros_like(bonus)
    host, path_taps, positions, slots = gather_accepted_reference(accepted, lens, tokens, bonus, taps, starts, bonus_out)
    assert slots is None  # no ring given
    width = accepted.shape[1]
    assert torch.equal(bonus_out, bonus)
    for b in range(accepted.shape[0]):
        k = int(lens[b])
        path = accepted[b, :k]
        assert host[b, :k].tolist() == tokens[b, path].tolist()
        assert host[b, width].item() == bonus[b].item() and host[b, width + 1].item() == k
        assert torch.equal(path_taps[b, :k], taps[b, path])
        assert positions[b, :k].tolist() == list(range(int(starts[b]), int(starts[b]) + k))


@pytest.mark.parametrize(("capacity", "total"), [(16, [0, 14, 30]), (3, [5, 0, 7])], ids=["wraps", "short-ring"])
def test_ring_slots_follow_the_ring(capacity: int, total: list[int]) -> None:
    """Path row j of row b goes to (total + j) % capacity; rows past the length, and all but the last
    `capacity` rows of a path longer than the ring, go to the sink slot `capacity`."""
    lens = torch.tensor([0, 5, 2])
    slots = ring_slots_reference(lens, torch.tensor(total), capacity, width=6)
    for b in range(3):
        k = int(lens[b])
        for j in range(6):
            kept = j < k and j >= k - capacity
            want = (total[b] + j) % capacity if kept else capacity
            assert int(slots[b, j]) == want, f"row {b}, path row {j}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c}")
def test_triton_equals_reference(case: tuple) -> None:
    accepted, lens, tokens, bonus, taps, starts = make_inputs(*case, seed=1)
    want_bonus, got_bonus = torch.zeros_like(bonus), torch.zeros_like(bonus)
    total = torch.arange(accepted.shape[0], device=DEVICE) * 7 + 3
    ring = (total, 4)  # a ring shorter than some paths: its sink slot is used too
    want = gather_accepted_reference(accepted, lens, tokens, bonus, taps, starts, want_bonus, ring=ring)
    got = gather_accepted_triton(accepted, lens, tokens, bonus, taps, starts, got_bonus, ring=ring)
    width = accepted.shape[1]
    live = torch.arange(width, device=DEVICE)[None] < lens[:, None]  # entries past a length are don't-cares
    assert torch.equal(got.host[:, :width][live], want.host[:, :width][live]), "path tokens"
    assert torch.equal(got.host[:, width:], want.host[:, width:]), "bonus and length columns"
    assert torch.equal(got.taps[live], want.taps[live]), "path taps"
    assert torch.equal(got.positions[live], want.positions[live]), "positions"
    assert got.slots is not None and torch.equal(got.slots, want.slots), "ring slots (every entry: the sink too)"
    assert torch.equal(got_bonus, bonus)
    assert gather_accepted_triton(accepted, lens, tokens, bonus, taps, starts).slots is None


@needs_triton
def test_triton_dispatch_and_strided_taps() -> None:
    """auto picks the kernel on CUDA; taps may be a strided view (a slice of a wider buffer)."""
    accepted, lens, tokens, bonus, taps, starts = make_inputs(2, 4, 9, 64, torch.float32, seed=2)
    wide = torch.cat([taps, taps], dim=-1)[..., 64:]  # the same values, row stride 128
    host, path_taps, _, _ = gather_accepted(accepted, lens, tokens, bonus, wide, starts, backend="triton")
    ref_host, ref_taps, _, _ = gather_accepted_reference(accepted, lens, tokens, bonus, taps, starts)
    live = torch.arange(4, device=DEVICE)[None] < lens[:, None]
    assert torch.equal(path_taps[live], ref_taps[live]) and torch.equal(host[:, 4:], ref_host[:, 4:])


def test_rejects_bad_shapes_before_any_work() -> None:
    accepted, lens, tokens, bonus, taps, starts = make_inputs(2, 4, 9, 64, torch.float32)
    with pytest.raises(ValueError, match="taps must be"):
        gather_accepted(accepted, lens, tokens, bonus, taps[:, :3], starts)
    with pytest.raises(ValueError, match="longer than the tree"):
        gather_accepted(torch.zeros(2, 10, dtype=torch.long, device=DEVICE), lens, tokens, bonus, taps, starts)
    with pytest.raises(ValueError, match="starts must be"):
        gather_accepted(accepted, lens, tokens, bonus, taps, starts.float())
    with pytest.raises(ValueError, match="backend"):
        gather_accepted(accepted, lens, tokens, bonus, taps, starts, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        gather_accepted(accepted, lens, tokens, bonus, taps, starts, ring=(starts, 0))
    with pytest.raises(ValueError, match="ring total must be"):
        gather_accepted(accepted, lens, tokens, bonus, taps, starts, ring=(starts[:1], 8))


@pytest.mark.skipif(not interpreter_off_but_installed(),
                    reason="the Triton cases ran in this process (CUDA, or the interpreter was on at import), "
                           "or triton is not installed")
def test_triton_cases_in_interpreter_child() -> None:
    run_triton_cases_in_child(__file__, "triton")
