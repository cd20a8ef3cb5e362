"""Lossless check: at T=0 every speculative config produces exactly the baseline's tokens.

    pytest -m quality --config-grid smoke -k lossless

The baseline (NONE, id `ar`) is deployed first in the suite's order, so its outputs are cached in
the session and each speculative config is compared against them without an extra deploy. When
the baseline has not run in this process (a `-k` selection, or xdist put it on another worker),
the test deploys it itself first.
"""

from __future__ import annotations

import pytest

from ddtree.bench.loadgen import run_load
from ddtree.config import Algorithm, SpecConfig
from ddtree.service.manager import ServiceManager
from ddtree.suite.options import SuiteOptions

pytestmark = pytest.mark.quality

BASELINE = SpecConfig(algorithm=Algorithm.NONE)
PROMPTS = 4


@pytest.fixture(scope="session")
def baseline_outputs() -> dict[str, list[list[int]]]:
    """NONE's output ids per prompt set, filled by whichever test first needs them."""
    return {}


def generate(service: ServiceManager, suite: SuiteOptions, prompts: list[list[int]]) -> list[list[int]]:
    records = run_load(service.backend.base_url, prompts, 1, suite.grid.max_new_tokens,
                       temperature=0.0, ignore_eos=True, stream=False)
    errors = [r.error for r in records if not r.ok]
    assert not errors, f"{service.current}: {len(errors)} requests failed: {errors[:3]}"
    return [r.output_ids for r in records]


def test_lossless(
    config_cell: SpecConfig,
    deployed: ServiceManager,
    suite: SuiteOptions,
    prompt_maker,  # type: ignore[no-untyped-def]
    baseline_outputs: dict[str, list[list[int]]],
) -> None:
    prompts = prompt_maker(min(suite.grid.contexts), PROMPTS)
    key = "ar"
    if not config_cell.speculative:
        baseline_outputs[key] = generate(deployed, suite, prompts)
        assert all(len(o) == suite.grid.max_new_tokens for o in baseline_outputs[key]), "ignore_eos was not honoured"
        return
    if key not in baseline_outputs:  # the baseline ran elsewhere: deploy it here, then come back
        deployed.ensure(BASELINE)
        baseline_outputs[key] = generate(deployed, suite, prompts)
        deployed.ensure(config_cell)
    outputs = generate(deployed, suite, prompts)
    for i, (got, want) in enumerate(zip(outputs, baseline_outputs[key], strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, (
            f"{config_cell.id}: prompt {i} differs from the baseline at new token {first} "
            f"(got {got[first:first + 5]}, baseline {want[first:first + 5]}; lengths {len(got)} vs {len(want)})"
        )
