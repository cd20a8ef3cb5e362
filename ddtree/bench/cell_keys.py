"""How two runs' cells are matched: a cell's key and how keys read and sort.

A closed-loop cell is (config, context, concurrency); a rate cell's concurrency is 0 and its rate tells it
from the other rate cells of its config and context.
"""

from __future__ import annotations

from ddtree.bench.arrivals import load_label
from ddtree.bench.results import CellResult

Key = tuple[str, int, int, float]  # (config id, context, concurrency, request rate or 0.0 for a closed loop)


def cell_key(cell: CellResult) -> Key:
    return (cell.config_id, cell.context, cell.concurrency, cell.request_rate or 0.0)


def key_load(key: Key) -> str:
    """`c<N>` or `r<R>`: the rate tells rate cells apart (their concurrency is 0)."""
    return load_label(key[2], key[3] or None)


def key_order(key: Key) -> tuple[int, float, int, str]:
    """Context, closed-loop cells before rate cells, load, config."""
    return (key[1], key[3], key[2], key[0])


def key_text(key: Key) -> str:
    return f"{key[0]} @ ctx{key[1]} {key_load(key)}"
