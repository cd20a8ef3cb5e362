"""The counter-based sampler: exact in distribution, and a pure function of (seed, position, vocab id)."""

from __future__ import annotations

import torch

from ddtree.sampling import Filters, ban_tokens, choose_tokens_no_sync, filter_logits, gumbel_noise, token_logprobs


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


def _draw(logits: torch.Tensor, temperature: float, n: int, filters: Filters | None, seed: int = 99) -> torch.Tensor:
    positions = torch.arange(n)[None]
    return choose_tokens_no_sync(logits.expand(1, n, logits.shape[-1]).contiguous(), torch.tensor([temperature]),
                                 torch.tensor([seed]), positions, True, filters)[0]


def _filters(top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> Filters:
    return Filters(torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))


def test_truncated_sampling_matches_the_renormalised_kept_set() -> None:
    """top_k 2, top_p 0.7 and min_p 0.3 each keep tokens {0, 1} of softmax([2, 1, 0.5, -1]) = [.61, .22, .14, .03];
    draws follow the kept probabilities renormalised, [.73, .27]. 30k draws: standard error ~0.0026, tolerance
    0.013 (5 sigma); a sampler that ignored the filter would put ~0.17 on tokens 2 and 3."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    kept = torch.softmax(logits, 0)[:2] / torch.softmax(logits, 0)[:2].sum()
    for filters in (_filters(top_k=2), _filters(top_p=0.7), _filters(min_p=0.3)):
        freq = torch.bincount(_draw(logits, 1.0, 30_000, filters), minlength=4).float() / 30_000
        assert freq[2:].sum() == 0, filters
        assert torch.allclose(freq[:2], kept, atol=0.013), (filters, freq.tolist())


def test_filters_off_change_nothing_and_keep_the_coupling() -> None:
    logits = torch.randn(3, 6, 40, generator=torch.Generator().manual_seed(1))
    temps, seeds = torch.tensor([0.9, 0.0, 1.3]), torch.tensor([5, 5, 6])
    positions = torch.arange(6).expand(3, 6) + 20
    off = Filters(torch.tensor([-1, 0, 40]), torch.ones(3), torch.zeros(3))
    plain = choose_tokens_no_sync(logits, temps, seeds, positions, True)
    assert torch.equal(choose_tokens_no_sync(logits, temps, seeds, positions, True, off), plain)
    # a row's draw depends on (seed, position, its logits) only: the same row alone, with other columns, agrees
    on = Filters(torch.tensor([3, 3, 3]), torch.tensor([0.8, 0.8, 0.8]), torch.tensor([0.05, 0.05, 0.05]))
    full = choose_tokens_no_sync(logits, temps, seeds, positions, True, on)
    alone = choose_tokens_no_sync(logits[2:, 2:4], temps[2:], seeds[2:], positions[2:, 2:4], True,
                                  Filters(on.top_k[2:], on.top_p[2:], on.min_p[2:]))
    assert torch.equal(alone[0], full[2, 2:4])
    assert torch.equal(full[1], logits[1].argmax(-1))  # greedy rows are unaffected
    ranks = logits.argsort(-1, descending=True).argsort(-1)
    assert (ranks.gather(-1, full[..., None]) < 3).all()


def test_ban_tokens_before_the_minimum_length() -> None:
    logits = torch.zeros(2, 3, 5)
    logits[..., 4] = 10.0  # token 4 (a stop token) would always win
    banned = torch.zeros(2, 5, dtype=torch.bool)
    banned[:, 4] = True
    positions = torch.tensor([[8, 9, 10], [8, 9, 10]])
    out = ban_tokens(logits, banned, torch.tensor([10, 0]), positions)
    assert torch.equal(out.argmax(-1)[0, :2] == 4, torch.tensor([False, False])) and out.argmax(-1)[0, 2] == 4
    assert (out.argmax(-1)[1] == 4).all()


def test_token_logprobs_are_the_log_softmax_of_the_chosen_token() -> None:
    logits = torch.randn(2, 4, 30, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 30, (2, 4), generator=torch.Generator().manual_seed(3))
    want = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, tokens), want, atol=1e-6)


def test_rows_without_filters_are_untouched_by_a_filtered_neighbour() -> None:
    """A row whose options are off keeps every token beside a truncating row, even where the float32 cumulative
    sum rounds past 1 before the smallest probabilities (top_p = 1 must not cut them)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(4096, generator=g) * 3  # here the float32 cumulative sum ends at 1 + 2e-7
    sorted_probs = logits.sort(descending=True)[0].softmax(-1)
    assert (sorted_probs.cumsum(-1) - sorted_probs >= 1).any(), "the case this test is about did not arise"
    rows = logits.expand(2, 1, 4096).contiguous()
    out = filter_logits(rows, Filters(torch.tensor([-1, 2]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.1])))
    assert torch.equal(out[0], rows[0])
    assert torch.isfinite(out[1]).sum() <= 2
