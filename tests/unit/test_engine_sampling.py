"""The engine's per-request sampling options: top_k / top_p / min_p at T > 0, min_new_tokens, return_logprob.

Lossless stays exact with them: NONE, DFLASH and DDTREE commit the same tokens for a seed (the draw is from
the processed distribution with the position's coupled noise), and the target's log-prob of each committed
token agrees up to float rounding. Rows with different options share a batch without affecting each other,
eagerly and through the graphed code paths (run eagerly on the CPU; on CUDA as captured graphs).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import DecodeBatch, Engine, Request
from ddtree.sampling import Mode
from tests.unit.test_engine import AR, make_engine, prompts
from tests.unit.test_engine_paths import EagerGraphs, cuda, cuda_engine

SPECS = [AR, SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None), SpecConfig(budget=8, topk=4, block_size=8)]
OPTIONS = [  # one row each, in one batch
    dict(temperature=0.9, seed=1, top_k=5),
    dict(temperature=0.0, return_logprob=True),
    dict(temperature=1.1, seed=2, top_p=0.6, return_logprob=True),
    dict(temperature=0.8, seed=3),  # no truncation, beside rows that truncate
    dict(temperature=0.7, seed=4, min_p=0.2, top_k=20, top_p=0.9, return_logprob=True),
]
NEW = 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def requests(batch: list[list[int]], **extra: object) -> list[Request]:
    return [Request(str(i), p, NEW, **{**o, **extra}) for i, (p, o) in enumerate(zip(batch, OPTIONS))]  # type: ignore[arg-type]


def run_batch(b: DecodeBatch, reqs: list[Request], one_by_one: bool = False) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in reqs}
    pending = list(reqs)

    def absorb(outputs: list) -> None:  # noqa: ANN001 - StepOutputs
        for o in outputs:
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs)

    while pending or b.active:
        if pending and b.free_slots:
            take = 1 if one_by_one else b.free_slots
            absorb(b.settle())  # a round run ahead comes back before anyone joins
            absorb(b.add_many(pending[:take]))
            pending = pending[take:]
        absorb(b.step())
    return out


def check_same(got: dict, want: dict, what: str) -> None:
    for rid, (ids, lps) in want.items():
        assert got[rid][0] == ids, f"{what}: request {rid} tokens differ"
        assert len(got[rid][1]) == len(lps) and torch.allclose(torch.tensor(got[rid][1]), torch.tensor(lps), atol=1e-4), (
            f"{what}: request {rid} log-probs differ")


def test_options_are_lossless_across_algorithms(engine: Engine) -> None:
    batch = prompts(len(OPTIONS), seed=31)
    ref = run_batch(engine.open_batch(AR, max_batch=8, max_len=160), requests(batch))
    for spec in SPECS[1:]:
        check_same(run_batch(engine.open_batch(spec, max_batch=8, max_len=160), requests(batch)), ref, spec.id)
    for i, o in enumerate(OPTIONS):
        ids, lps = ref[str(i)]
        assert len(ids) == NEW and len(lps) == (NEW if o.get("return_logprob") else 0)
        assert all(lp <= 0 for lp in lps)
    # each row alone: the same as beside the others (a neighbour's options never change a row)
    for i in (0, 3):
        alone = run_batch(engine.open_batch(SPECS[2], max_batch=1, max_len=160), [requests(batch)[i]])
        assert alone[str(i)] == ref[str(i)]
    # truncation changes the draw (so the equalities above are about the options, not their absence)
    plain = run_batch(engine.open_batch(AR, max_batch=8, max_len=160),
                      requests(batch, top_k=-1, top_p=1.0, min_p=0.0))
    assert plain["0"][0] != ref["0"][0] and plain["3"][0] == ref["3"][0]


def test_logprobs_are_the_targets_log_softmax(engine: Engine) -> None:
    prompt = prompts(1, seed=5)[0]
    res = engine.generate(prompt, 6, spec=SPECS[2], return_logprob=True)
    ids = prompt + res.token_ids
    logits, _ = engine.target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], engine.target.new_cache(1, 64),
                                      None, None)
    want = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1).gather(-1, torch.tensor(res.token_ids)[:, None])
    assert torch.allclose(torch.tensor(res.logprobs), want[:, 0], atol=1e-4)


def test_min_new_tokens_bans_stop_tokens_by_position(engine: Engine) -> None:
    prompt = prompts(1, seed=6)[0]
    free = engine.generate(prompt, 12, spec=AR).token_ids
    stop = free[2]  # greedy decoding would stop at the third token
    early = engine.generate(prompt, 12, spec=AR, stop_token_ids=[stop])
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    outs = [engine.generate(prompt, 12, spec=spec, stop_token_ids=[stop], min_new_tokens=8).token_ids for spec in SPECS]
    assert outs[0] == outs[1] == outs[2]
    assert stop not in outs[0][:8] and len(outs[0]) >= 8


def test_graphed_code_paths_carry_the_options_on_cpu(engine: Engine) -> None:
    """The graphed batch's code run eagerly on the CPU (staged one-request prefills, padded rows): the same
    tokens and log-probs, and the sampling mode in every graph key."""
    batch = prompts(len(OPTIONS), seed=31)
    ref = run_batch(engine.open_batch(AR, max_batch=8, max_len=160), requests(batch))
    b = engine.open_batch(SPECS[2], max_batch=3, max_len=160)
    b.runner.graphs = graphs = EagerGraphs()  # type: ignore[assignment]
    check_same(run_batch(b, requests(batch), one_by_one=True), ref, "graphed code")
    modes = {k[3] for k in graphs.keys if k[0] == "round"}
    assert Mode.SAMPLED | Mode.FILTERED | Mode.LOGPROBS in modes
    assert {k[2] for k in graphs.keys if k[0] == "prefill"} == {Mode.SAMPLED | Mode.FILTERED, Mode.LOGPROBS,
                                                                Mode.SAMPLED | Mode.FILTERED | Mode.LOGPROBS, Mode.SAMPLED}


@pytest.mark.gpu
@cuda
def test_captured_graphs_carry_the_options() -> None:
    eager, graphed = cuda_engine(False), cuda_engine(True)
    batch = prompts(len(OPTIONS), seed=31)
    ref = run_batch(eager.open_batch(AR, max_batch=8, max_len=160), requests(batch))
    for spec in SPECS:
        check_same(run_batch(graphed.open_batch(spec, max_batch=8, max_len=160), requests(batch)), ref, f"graphed {spec.id}")
        check_same(run_batch(graphed.open_batch(spec, max_batch=8, max_len=160), requests(batch), one_by_one=True), ref,
                   f"graphed {spec.id}, joining one by one")
    prompt = batch[0]
    free = eager.generate(prompt, 12, spec=AR).token_ids
    want = eager.generate(prompt, 12, spec=AR, stop_token_ids=[free[2]], min_new_tokens=8).token_ids
    for spec in SPECS:
        assert graphed.generate(prompt, 12, spec=spec, stop_token_ids=[free[2]], min_new_tokens=8).token_ids == want
