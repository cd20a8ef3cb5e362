"""A Request through pickle (the server's submit to the engine process): every field back as it was, the prompt a
list of ints whether it travelled packed (ids that fit a C int) or as the list itself."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.engine import Request

ids = st.lists(st.integers(-2**40, 2**40) | st.integers(0, 200_000), max_size=64)


@settings(max_examples=80, deadline=None)
@given(ids, st.floats(0, 2), st.none() | st.integers(0, 2**63 - 1), st.booleans())
def test_a_request_comes_back_from_pickle_as_it_was(prompt: list[int], temperature: float, seed: int | None,
                                                   flag: bool) -> None:
    request = Request("r-1", list(prompt), 17, temperature, seed, (3, 4), flag, 0.5, 7, 0.05, 2, not flag)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(request, protocol))
        assert back == request
        assert type(back.prompt_ids) is list and all(type(t) is int for t in back.prompt_ids)


def test_a_long_prompt_travels_as_packed_ints() -> None:
    request = Request("r", list(range(100_000, 101_024)), 8)
    data = pickle.dumps(request, pickle.HIGHEST_PROTOCOL)
    assert len(data) < 4 * 1024 + 200  # 4 bytes an id; a pickled list of these ids takes 5 an id (BININT)
    assert pickle.loads(data).prompt_ids == request.prompt_ids
    wide = Request("w", [2**40, 1], 8)  # past a C int: sent as the list
    assert pickle.loads(pickle.dumps(wide)).prompt_ids == [2**40, 1]
