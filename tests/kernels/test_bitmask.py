"""Packed ancestor bitmasks: pack/unpack round trips, the causal chain, ancestor masks from parents."""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels.bitmask import (
    ancestor_mask,
    as_words,
    causal_bitmask,
    pack_mask,
    unpack_bitmask,
)

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 130])
def test_pack_unpack_round_trip(n: int) -> None:
    mask = torch.rand(3, n, n, generator=torch.Generator().manual_seed(n)) < 0.4
    packed = pack_mask(mask)
    assert packed.dtype == torch.int64
    assert packed.shape == ((3, n) if n <= 64 else (3, n, (n + 63) // 64))
    assert torch.equal(unpack_bitmask(packed, n), mask)


def test_bit_layout_matches_tree_compile() -> None:
    """Bit j of row i is mask[i, j]; bit 63 is the sign bit."""
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[0, 0] = mask[5, 3] = mask[63, 63] = True
    packed = pack_mask(mask)
    assert int(packed[0]) == 1 and int(packed[5]) == 1 << 3 and int(packed[63]) == -(1 << 63)


def test_causal_bitmask() -> None:
    assert causal_bitmask(4).tolist() == [1, 3, 7, 15]
    assert int(causal_bitmask(64)[63]) == -1  # all 64 bits
    assert torch.equal(unpack_bitmask(causal_bitmask(70), 70), torch.ones(70, 70, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="n must be >= 1"):
        causal_bitmask(0)


def test_ancestor_mask_from_parents() -> None:
    parents = torch.tensor([[0, 0, 1, 1, 0, 4]])  # root 0; 1,4 under root; 2,3 under 1; 5 under 4
    mask = ancestor_mask(parents)[0]
    rows = [set(torch.nonzero(mask[i]).flatten().tolist()) for i in range(6)]
    assert rows == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 4}, {0, 4, 5}]


def test_as_words_names_the_expected_shape() -> None:
    assert as_words(torch.zeros(2, 5, dtype=torch.long), 5).shape == (2, 5, 1)
    assert as_words(torch.zeros(2, 70, 2, dtype=torch.long), 70).shape == (2, 70, 2)
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 70, 2\]"):
        as_words(torch.zeros(2, 70, dtype=torch.long), 70)
