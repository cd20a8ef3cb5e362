"""ddtree.grid: parsing grid files, errors naming the file and key, cells and impossible-cell removal."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddtree.config import Algorithm, SpecConfig
from ddtree.errors import ConfigError
from ddtree.grid import GRIDS_DIR, Cell, cells, load_grid, ordered_configs, parse_grid

BASE = {
    "default": {"budget": 8, "topk": 4, "draft_window": 2048, "block_size": 8},
    "configs": [{"algorithm": "NONE"}, {"algorithm": "DFLASH", "block_size": 8}, {"budget": 4}],
    "client": {"contexts": [60, 1024], "concurrency": [1, 32], "max_new_tokens": 128,
               "requests_per_cell": 32, "repeats": 3, "warmup_requests": 2},
}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_parses_configs_with_the_default_filling_missing_keys(tmp_path: Path) -> None:
    grid = load_grid(write(tmp_path, BASE))
    assert [c.id for c in grid.configs] == ["ar", "dflash-w2048-bs8", "b4-k4-w2048-bs8"]
    assert grid.default == SpecConfig(Algorithm.DDTREE, 8, 4, 8, 2048)
    assert grid.contexts == (60, 1024) and grid.concurrency == (1, 32)
    assert (grid.max_new_tokens, grid.requests_per_cell, grid.repeats, grid.warmup_requests) == (128, 32, 3, 2)
    assert grid.name == "grid"


@pytest.mark.parametrize("name", ["smoke", "default", "full"])
def test_shipped_grids_parse_by_name(name: str) -> None:
    grid = load_grid(name)
    assert grid.path == GRIDS_DIR / f"{name}.yaml"
    assert grid.default.id == "b8-k4-w2048-bs8"
    assert {"ar", "dflash-w2048-bs8"} <= {c.id for c in grid.configs}


def test_full_grid_has_the_documented_configs() -> None:
    ids = {c.id for c in load_grid("full").configs}
    assert ids == {"b4-k4-w2048-bs8", "b8-k4-w2048-bs8", "b12-k6-w2048-bs8", "b16-k4-w2048-bs8",
                   "b8-k4-wnone-bs8", "b8-k4-w2048-bs16", "b16-k4-w2048-bs16", "dflash-w2048-bs8", "ar"}


def test_smoke_grid_is_small() -> None:
    grid = load_grid("smoke")
    assert {c.id for c in grid.configs} == {"ar", "dflash-w2048-bs8", "b8-k4-w2048-bs8", "b4-k4-w2048-bs8"}
    assert (grid.contexts, grid.concurrency, grid.max_new_tokens, grid.requests_per_cell, grid.repeats) == (
        (60, 512), (1, 4), 32, 4, 2)


def test_duplicate_configs_are_deployed_once(tmp_path: Path) -> None:
    data = {**BASE, "configs": [{"budget": 4}, {"budget": 4, "topk": 4}, {"algorithm": "NONE", "budget": 3}, {"algorithm": "NONE"}]}
    assert [c.id for c in load_grid(write(tmp_path, data)).configs] == ["b4-k4-w2048-bs8", "ar"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(colour=1), "unknown key(s) ['colour']"),
        (lambda d: d["configs"].append({"budget": 0}), "configs[3]: budget: 0 is out of range"),
        (lambda d: d["configs"].append({"bugdet": 3}), "configs[3]: unknown key(s) ['bugdet']"),
        (lambda d: d["configs"].append({"draft_window": 4, "block_size": 8}), "configs[3]: draft_window: 4 is out of range"),
        (lambda d: d["configs"].append({"algorithm": "EAGLE"}), "configs[3]: algorithm: unknown value 'EAGLE'"),
        (lambda d: d["client"].update(contexts=[0]), "client.contexts[0]: 0 is out of range"),
        (lambda d: d["client"].update(concurrency="many"), "client.concurrency: expected a non-empty list"),
        (lambda d: d["client"].update(repeats=1.5), "client.repeats: 1.5 is not an integer"),
        (lambda d: d["client"].update(speed=3), "client: unknown key(s) ['speed']"),
        (lambda d: d.update(configs=[]), "configs must be a non-empty list"),
        (lambda d: d.update(quality={"k": 2, "n": 1}), "quality.n: 1 samples cannot give pass@2"),
        (lambda d: d.update(quality={"threshold": 1.5}), "quality.threshold: 1.5 is out of range"),
        (lambda d: d["default"].update(budget=-1), "default: budget: -1 is out of range"),
    ],
)
def test_bad_values_name_the_file_and_the_key(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_unknown_grid_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"known grids: .*'smoke'"):
        load_grid("no-such-grid")


def test_missing_path_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_grid(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_grid(bad)
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_grid(["a"], where="x")


def test_cells_are_in_deploy_order_baseline_then_default() -> None:
    grid = parse_grid({**BASE, "configs": [{"budget": 4}, {}, {"algorithm": "NONE"}]})
    assert [c.id for c in ordered_configs(grid)] == ["ar", "b8-k4-w2048-bs8", "b4-k4-w2048-bs8"]
    kept, removed = cells(grid, max_context=None)
    assert removed == []
    assert [c.id for c in kept[:4]] == ["ar-ctx60-c1", "ar-ctx60-c32", "ar-ctx1024-c1", "ar-ctx1024-c32"]
    assert len(kept) == 3 * 2 * 2
    # each config's cells are contiguous: one deploy per config
    seen = [c.config_id for c in kept]
    assert [k for i, k in enumerate(seen) if i == 0 or seen[i - 1] != k] == ["ar", "b8-k4-w2048-bs8", "b4-k4-w2048-bs8"]


def test_impossible_cells_are_removed_with_a_reason() -> None:
    grid = parse_grid(BASE)
    kept, removed = cells(grid, max_context=1100)
    assert all(c.context == 60 for c in kept)
    assert {c.context for c, _ in removed} == {1024}
    assert len(removed) == 3 * 2
    assert "context 1024 + max_new_tokens 128 = 1152 exceeds the model's context 1100" in removed[0][1]
    kept, removed = cells(grid, max_context=None, max_block_size=4)
    assert {c.config_id for c in kept} == {"ar"}  # NONE has no block
    assert "block_size 8 is more than the drafter can run (4)" in removed[0][1]


def test_cell_ids_and_keys() -> None:
    cell = Cell(SpecConfig(), 60, 1)
    assert cell.id == "b8-k4-w2048-bs8-ctx60-c1"
    assert cell.key == "ctx60-c1"
    assert cell.config_id == "b8-k4-w2048-bs8"


def test_auto_budget_parses_from_a_grid_file(tmp_path: Path) -> None:
    data = {**BASE, "configs": [{"budget": "auto"}, {"budget": "auto", "max_budget": 16}, {"budget": 4}]}
    grid = load_grid(write(tmp_path, data))
    assert [c.id for c in grid.configs] == ["bauto-k4-w2048-bs8", "bauto16-k4-w2048-bs8", "b4-k4-w2048-bs8"]
    auto_default = load_grid(write(tmp_path, {**BASE, "default": {**BASE["default"], "budget": "auto"}}))
    assert auto_default.default.id == "bauto-k4-w2048-bs8"
    assert auto_default.configs[-1].id == "b4-k4-w2048-bs8", "a fixed entry over an auto default"
    with pytest.raises(ConfigError, match=r"configs\[0\]: max_budget: 99 is out of range"):
        parse_grid({**BASE, "configs": [{"budget": "auto", "max_budget": 99}]})


def test_request_rates_sit_beside_concurrency_and_end_their_cell_ids_in_r(tmp_path: Path) -> None:
    both = load_grid(write(tmp_path, {**BASE, "client": {**BASE["client"], "contexts": [60], "request_rates": [2, 0.5]}}))
    assert both.request_rates == (2.0, 0.5) and both.concurrency == (1, 32) and both.arrival_seed == 0
    ids = [c.id for c in cells(both, None)[0] if c.config_id == "ar"]
    assert ids == ["ar-ctx60-c1", "ar-ctx60-c32", "ar-ctx60-r0.5", "ar-ctx60-r2"]
    rate_cell = cells(both, None)[0][2]
    assert (rate_cell.concurrency, rate_cell.request_rate, rate_cell.key) == (0, 0.5, "ctx60-r0.5")
    only_rates = load_grid(write(tmp_path, {**BASE, "client": {"contexts": [60], "request_rates": 4, "arrival_seed": 9}}))
    assert only_rates.concurrency == () and only_rates.request_rates == (4.0,) and only_rates.arrival_seed == 9
    assert {c.load for c in cells(only_rates, None)[0]} == {"r4"}
    assert load_grid(write(tmp_path, {**BASE, "client": {"contexts": [60]}})).concurrency == (1,)  # neither: c1


@pytest.mark.parametrize(("client", "message"), [
    ({"request_rates": [0]}, r"client.request_rates\[0\]: 0 must be a number of requests per second > 0"),
    ({"request_rates": ["fast"]}, r"client.request_rates\[0\]: 'fast' must be a number"),
    ({"request_rates": {"a": 1}}, r"client.request_rates: expected a list of requests per second"),
    ({"arrival_seed": -1}, r"client.arrival_seed: -1 is out of range"),
])
def test_bad_rates_name_the_key(tmp_path: Path, client: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_grid(write(tmp_path, {**BASE, "client": {**BASE["client"], **client}}))


def test_the_slo_block_is_parsed_and_checked_with_the_file_named(tmp_path: Path) -> None:
    grid = load_grid(write(tmp_path, {**BASE, "slo": {"ttft_p99_ms": 2000, "tpot_p90_ms": 50}}))
    assert grid.slo is not None and grid.slo.to_dict() == {"ttft_p99_ms": 2000, "tpot_p90_ms": 50,
                                                           "attainment_target": 0.99}
    assert load_grid(write(tmp_path, BASE)).slo is None
    with pytest.raises(ConfigError, match=r"grid.yaml: slo: unknown key\(s\) \['ttft_ms'\]; allowed: ttft_median_ms"):
        load_grid(write(tmp_path, {**BASE, "slo": {"ttft_ms": 5}}))
    with pytest.raises(ConfigError, match=r"grid.yaml: slo.attainment_target: 0 is out of range"):
        load_grid(write(tmp_path, {**BASE, "slo": {"ttft_p99_ms": 5, "attainment_target": 0}}))
