"""Stop strings, matched on the detokenized output as SGLang does (the engine stops on token ids only).

    find_stop(text, stops, start) -> (index, stop) | None     # the earliest match at or after `start`
    held_back(text, stops) -> int                             # trailing chars that may still become a stop

When a stop string appears, the output ends there: the text is cut before it (or just after it with
`no_stop_trim`) and the token ids are cut to the fewest that still spell that text, so
`completion_tokens` counts what was kept. A stream holds back a tail that could be the start of a
stop string, so the chunks a client joins always equal the final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def tokens_for(ids: Sequence[int], chars: int, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading tokens of `ids` whose text is at least `chars` long (bisection over prefixes)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(ids[:mid]))) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return hi
