"""ddtree.request.emit, what every round hands each request: cut at the first stop token or at max_new_tokens,
against the plain reading of that rule (a token at a time), on random rounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.request import Request, Row, emit


def reference(output: list[int], stop_ids: frozenset[int], max_new: int,
              tokens: list[int]) -> tuple[list[int], str | None]:
    kept: list[int] = []
    for tok in tokens:
        if len(output) + len(kept) >= max_new:
            break
        kept.append(tok)
        if tok in stop_ids:
            return kept, "stop"
    return kept, "length" if len(output) + len(kept) >= max_new else None


@settings(max_examples=300, deadline=None)
@given(max_new=st.integers(1, 12), stops=st.frozensets(st.integers(0, 6), max_size=3),
       rounds=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=8), min_size=1, max_size=8),
       with_logprobs=st.booleans())
def test_emit_cuts_each_round_as_a_token_at_a_time_would(max_new: int, stops: frozenset[int],
                                                        rounds: list[list[int]], with_logprobs: bool) -> None:
    row = Row(Request("r", [1], max_new), committed=1, stop_ids=stops)
    seen: list[int] = []
    for i, tokens in enumerate(rounds):
        want, reason = reference(seen, stops, max_new, tokens)
        logprobs = [-0.5 * j for j in range(len(tokens))] if with_logprobs else None
        out = emit(row, list(tokens), accept=len(tokens), logprobs=logprobs, budgets=[i])
        assert out.new_token_ids == want and out.finish_reason == reason and out.finished == (reason is not None)
        assert out.logprobs == (logprobs[: len(want)] if logprobs else [])
        assert out.accept_lengths == [len(tokens)] and out.budgets == [i] and out.request_id == "r"
        seen += want
        assert row.output == seen and row.accept_lengths[-1] == len(tokens)
        if out.finished:
            break


def test_emit_without_accept_or_budgets() -> None:
    row = Row(Request("r", [1], 3), committed=1, stop_ids=frozenset({7}))
    out = emit(row, [4], accept=None)
    assert (out.new_token_ids, out.accept_lengths, out.budgets, out.logprobs, out.finished) == ([4], [], [], [], False)
    out = emit(row, [7], accept=None)
    assert out.finish_reason == "stop" and row.accept_lengths == [] and row.output == [4, 7]
