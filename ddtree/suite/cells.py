"""Cells as pytest parameters: expansion of the grid, impossible-cell removal, ids and xdist groups.

Perf tests take a `cell` argument (config x context x load); quality tests take a
`config_cell` argument (one per server config). Both are parametrized here from the session's
grid, with the config id as the xdist group so that, under `--dist loadgroup`, every cell of a
config runs on the same worker and the config is deployed once there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ddtree.config import SpecConfig
from ddtree.grid import Cell, Grid, cells, ordered_configs

CELL_ARG = "cell"  # perf: one Cell per (config, context, concurrency or request rate)
CONFIG_ARG = "config_cell"  # quality: one SpecConfig per server config


@dataclass
class Expansion:
    """The grid expanded once per session: kept cells, removed ones with reasons, deploy order."""

    kept: list[Cell]
    removed: list[tuple[Cell, str]]
    configs: list[SpecConfig]
    order: dict[str, int] = field(default_factory=dict)  # config id -> deploy position

    @classmethod
    def of(cls, grid: Grid, max_context: int | None, max_block_size: int | None = None) -> Expansion:
        kept, removed = cells(grid, max_context, max_block_size)
        configs = ordered_configs(grid)
        return cls(kept, removed, configs, {c.id: i for i, c in enumerate(configs)})


def cell_param(cell: Cell) -> object:
    return pytest.param(cell, id=cell.id, marks=pytest.mark.xdist_group(cell.config_id))


def config_param(spec: SpecConfig) -> object:
    return pytest.param(spec, id=spec.id, marks=pytest.mark.xdist_group(spec.id))


def parametrize(metafunc: pytest.Metafunc, expansion: Expansion) -> None:
    if CELL_ARG in metafunc.fixturenames:
        metafunc.parametrize(CELL_ARG, [cell_param(c) for c in expansion.kept])
    if CONFIG_ARG in metafunc.fixturenames:
        metafunc.parametrize(CONFIG_ARG, [config_param(s) for s in expansion.configs])


def item_spec(item: pytest.Item) -> SpecConfig | None:
    """The server config an item needs deployed, or None for an item that needs no service config."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    value = callspec.params.get(CELL_ARG, callspec.params.get(CONFIG_ARG))
    if isinstance(value, Cell):
        return value.spec
    return value if isinstance(value, SpecConfig) else None


def sort_items(items: list[pytest.Item], expansion: Expansion) -> None:
    """Reorder in place: items without a config keep their order and come first; config items
    follow grouped by config in deploy order, then by test function (in collection order), then
    context and load (concurrency levels, then request rates), so each server config is deployed once."""
    first_seen: dict[str, int] = {}
    keys = []
    for index, item in enumerate(items):
        spec = item_spec(item)
        if spec is None:
            keys.append((0, 0, 0, 0, (False, 0, 0.0), index))
            continue
        func = item.nodeid.split("[")[0]
        kind = first_seen.setdefault(func, len(first_seen))
        cell = item.callspec.params.get(CELL_ARG)  # type: ignore[attr-defined]
        context, load = ((cell.context, (cell.request_rate is not None, cell.concurrency, cell.request_rate or 0.0))
                         if isinstance(cell, Cell) else (0, (False, 0, 0.0)))
        order = expansion.order.get(spec.id, len(expansion.order))
        keys.append((1, order, kind, context, load, index))
    ranked = sorted(range(len(items)), key=keys.__getitem__)
    items[:] = [items[i] for i in ranked]
