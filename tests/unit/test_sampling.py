"""The counter-based sampler: exact in distribution, and a pure function of (seed, position, vocab id)."""

from __future__ import annotations

import torch

from ddtree.sampling import choose_tokens_no_sync, gumbel_noise


def test_noise_depends_only_on_seed_position_and_vocab_id() -> None:
    seeds = torch.tensor([7, 7, 8])
    positions = torch.tensor([[10, 11], [11, 10], [10, 11]])
    noise = gumbel_noise(seeds, positions, 50)
    assert torch.equal(noise[0, 0], noise[1, 1])  # same (seed, position) in another row and column
    assert torch.equal(noise[0, 1], noise[1, 0])
    assert not torch.equal(noise[0, 0], noise[2, 0])  # another seed
    assert not torch.equal(noise[0, 0], noise[0, 1])  # another position
    assert torch.isfinite(noise).all()


def test_gumbel_max_matches_softmax_distribution() -> None:
    """Empirical frequencies over 40k positions vs softmax(logits / T).

    With 40k draws the standard error of a frequency near 0.3 is ~0.0023; a tolerance of 0.012
    (5 sigma) makes a false failure vanishingly unlikely, while a sampler that ignored T (or the
    logits) would be off by > 0.05 for these logits.
    """
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    temperature = 0.8
    n = 40_000
    positions = torch.arange(n)[None]  # one row, n positions
    tokens = choose_tokens_no_sync(
        logits.expand(1, n, 4).contiguous(), torch.tensor([temperature]), torch.tensor([1234]), positions, True
    )[0]
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = torch.softmax(logits / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=0.012), f"frequencies {freq.tolist()} vs softmax {expected.tolist()}"


def test_greedy_rows_are_argmax_even_beside_sampled_rows() -> None:
    logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).expand(2, 5)
    tokens = choose_tokens_no_sync(logits, torch.tensor([0.0, 1.0]), torch.tensor([1, 1]), positions, True)
    assert torch.equal(tokens[0], logits[0].argmax(-1))
    greedy_only = choose_tokens_no_sync(logits, torch.tensor([0.0, 0.0]), torch.tensor([1, 1]), positions, False)
    assert torch.equal(greedy_only, logits.argmax(-1))
