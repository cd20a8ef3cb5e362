"""Lossless check: at T=0 every speculative config produces exactly the baseline's tokens, and the target's
log-prob of each of them (`return_logprob`, meta_info.output_token_logprobs) equals the baseline's up to float
tolerance: a check stronger than token equality (a verify that computed the right argmax from slightly wrong
logits would pass the first and fail the second).

    pytest -m quality --config-grid smoke -k lossless

The baseline (NONE, id `ar`) is deployed first in the suite's order, so its outputs are cached in
the session and each speculative config is compared against them without an extra deploy. When
the baseline has not run in this process (a `-k` selection, or xdist put it on another worker),
the test deploys it itself first.
"""

from __future__ import annotations

import httpx
import pytest

from ddtree.config import Algorithm, SpecConfig
from ddtree.service.manager import ServiceManager
from ddtree.suite.options import SuiteOptions

pytestmark = pytest.mark.quality

BASELINE = SpecConfig(algorithm=Algorithm.NONE)
PROMPTS = 4
LOGPROB_TOLERANCE = 1e-3  # nats; float32 verify over a tree vs one token at a time differ by ~1e-5 (CPU fixture)


@pytest.fixture(scope="session")
def baseline_outputs() -> dict[str, list[tuple[list[int], list[float]]]]:
    """NONE's (output ids, their log-probs) per prompt, filled by whichever test first needs them."""
    return {}


def generate(service: ServiceManager, suite: SuiteOptions, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's output ids and the target's log-prob of each (one request at a time, T = 0)."""
    out = []
    with httpx.Client(base_url=service.backend.base_url, timeout=600, trust_env=False) as client:
        for prompt in prompts:
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": suite.grid.max_new_tokens, "temperature": 0, "ignore_eos": True}}
            r = client.post("/generate", json=body)
            assert r.status_code == 200, f"{service.current}: {r.status_code} {r.text[:300]}"
            payload = r.json()
            entries = payload["meta_info"]["output_token_logprobs"]
            assert [e[1] for e in entries] == payload["output_ids"], "log-probs are not of the output ids"
            out.append((payload["output_ids"], [e[0] for e in entries]))
    return out


def test_lossless(
    config_cell: SpecConfig,
    deployed: ServiceManager,
    suite: SuiteOptions,
    prompt_maker,  # type: ignore[no-untyped-def]
    baseline_outputs: dict[str, list[tuple[list[int], list[float]]]],
) -> None:
    prompts = prompt_maker(min(suite.grid.contexts), PROMPTS)
    key = "ar"
    if not config_cell.speculative:
        baseline_outputs[key] = generate(deployed, suite, prompts)
        assert all(len(ids) == suite.grid.max_new_tokens for ids, _ in baseline_outputs[key]), "ignore_eos was not honoured"
        return
    if key not in baseline_outputs:  # the baseline ran elsewhere: deploy it here, then come back
        deployed.ensure(BASELINE)
        baseline_outputs[key] = generate(deployed, suite, prompts)
        deployed.ensure(config_cell)
    outputs = generate(deployed, suite, prompts)
    for i, ((got, got_lp), (want, want_lp)) in enumerate(zip(outputs, baseline_outputs[key], strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, (
            f"{config_cell.id}: prompt {i} differs from the baseline at new token {first} "
            f"(got {got[first:first + 5]}, baseline {want[first:first + 5]}; lengths {len(got)} vs {len(want)})"
        )
        worst = max(range(len(got_lp)), key=lambda j: abs(got_lp[j] - want_lp[j]))
        assert abs(got_lp[worst] - want_lp[worst]) <= LOGPROB_TOLERANCE, (
            f"{config_cell.id}: prompt {i}: the target's log-prob of new token {worst} is {got_lp[worst]:.6f}, "
            f"the baseline's {want_lp[worst]:.6f} (tolerance {LOGPROB_TOLERANCE})"
        )
