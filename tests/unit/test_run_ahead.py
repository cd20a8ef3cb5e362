"""DecodeBatch.step() running ahead: the next round is launched before this one's tokens are read.

The rounds ahead must change nothing a caller sees: every request's tokens and finish reason equal those of a
batch that reads each round before launching the next, including requests that finish (a stop token, or
max_new_tokens) while a round ahead is in flight (they are handed out at once; that round's share for them is
dropped when it is read), requests that join as slots free up, and sampling at T > 0. On the CPU the rounds run as they are launched; the same
host logic drives the CUDA graphs (tests/unit/test_engine_paths.py runs the engine's GPU paths).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import DecodeBatch, Engine, Request
from ddtree.kernels.tree_attention import triton_available
from ddtree.profiling.syncs import round_syncs
from tests.unit.test_engine import AR, make_engine, prompts

SPECS = [
    pytest.param(AR, id="ar"),
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None), id="dflash-wnone-bs8"),
    pytest.param(SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048), id="b8-k4-w2048-bs8"),
    pytest.param(SpecConfig(budget=2, topk=2, block_size=4, draft_window=None), id="b2-k2-wnone-bs4"),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def _requests(count: int, temperature: float, stops: tuple[int, ...]) -> list[Request]:
    """Prompts of 3-40 tokens with different max_new_tokens; some rows will meet a stop token."""
    return [Request(str(i), p, 24 + 6 * (i % 4), temperature, seed=100 + i, stop_token_ids=stops)
            for i, p in enumerate(prompts(count, seed=31))]


def _drive(batch: DecodeBatch, requests: list[Request]) -> tuple[dict[str, tuple[list[int], str | None]], int]:
    """Run `requests` through `batch` as Engine.generate does (joining as slots free up): each request's tokens
    and finish reason, and how many steps handed out a finished request with a round ahead still in flight."""
    pending = list(requests)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str | None] = {}
    early = 0

    def absorb(outputs: list) -> None:
        for o in outputs:
            assert o.request_id not in reasons, f"request {o.request_id} has outputs after it finished"
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    while pending or batch.active:
        while pending and batch.free_slots:
            absorb(batch.settle())
            joining, pending = pending[: batch.free_slots], pending[batch.free_slots:]
            absorb(batch.add_many(joining))
        outputs = batch.step()
        assert all(n == 1 for n in Counter(o.request_id for o in outputs).values()), "one output a request a step"
        early += batch.round_ahead and any(o.finished for o in outputs)
        absorb(outputs)
    assert batch.settle() == [], "a round ahead of finished rows only has nothing to hand out"
    assert not batch.round_ahead and not batch.rows
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}, early


def _stop_tokens(engine: Engine, spec: SpecConfig, temperature: float) -> tuple[int, ...]:
    """Tokens that some rows produce mid-way and others never (from a run without stops): those rows stop early,
    the others run to max_new_tokens."""
    batch = engine.open_batch(spec, max_batch=3, max_len=200, profile=False, run_ahead=False)
    seen, _ = _drive(batch, _requests(6, temperature, ()))
    outputs = [toks for toks, _ in seen.values()]
    rows_with = Counter(t for toks in outputs for t in set(toks))
    mid = [t for toks in outputs for t in toks[10:18] if rows_with[t] <= 2]
    return tuple(dict.fromkeys(mid))[:2]


def _with_and_without(engine: Engine, spec: SpecConfig, temperature: float) -> dict[bool, tuple]:
    """Six requests through three slots, with stop tokens, by run_ahead: (outputs, steps that handed out a
    finished request with a round ahead in flight, rounds run ahead)."""
    stops = _stop_tokens(engine, spec, temperature)
    results = {}
    for run_ahead in (False, True):
        batch = engine.open_batch(spec, max_batch=3, max_len=200, profile=False, run_ahead=run_ahead)
        results[run_ahead] = (*_drive(batch, _requests(6, temperature, stops)), batch.rounds_run_ahead)
    return results


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", SPECS)
def test_rounds_ahead_change_no_output(engine: Engine, spec: SpecConfig, temperature: float) -> None:
    """Six requests through three slots, with stop tokens: the same tokens and reasons with and without the
    rounds ahead; rounds did run ahead, and rows finished with a round in flight (handed out at once)."""
    results = _with_and_without(engine, spec, temperature)
    (plain, _, none_ahead), (ahead, early, rounds_ahead) = results[False], results[True]
    assert ahead == plain
    assert none_ahead == 0 and rounds_ahead > 0
    assert "stop" in {reason for _, reason in plain.values()} and "length" in {r for _, r in plain.values()}
    assert early > 0, "no row finished while a round ahead was in flight: the test did not reach that path"


def test_rounds_ahead_equal_ar_decoding(engine: Engine) -> None:
    """DDTREE run ahead commits plain AR decoding's tokens (greedy, no stop tokens)."""
    reqs = _requests(4, 0.0, ())
    ar = engine.generate([r.prompt_ids for r in reqs], 27, spec=AR)
    batch = engine.open_batch(SpecConfig(budget=8, topk=4, block_size=8), max_batch=4, max_len=200, profile=False)
    got, _ = _drive(batch, [Request(r.request_id, r.prompt_ids, 27) for r in reqs])
    assert [got[r.request_id][0] for r in reqs] == [a.token_ids for a in ar]
    assert batch.rounds_run_ahead > 0


def test_a_round_ahead_must_be_settled_before_rows_change(engine: Engine) -> None:
    """With a round ahead in flight, joining and cancelling are refused with what to do; a split launch takes
    that round, and collect(run_ahead=True) leaves the next one in flight; settle() hands a round ahead's
    outputs back; clear() drops it with the rows."""
    batch = engine.open_batch(AR, max_batch=2, max_len=200, profile=False)
    reqs = _requests(2, 0.0, ())
    batch.add_many(reqs)
    first = batch.step()
    assert batch.round_ahead and [o.request_id for o in first] == ["0", "1"]
    extra = Request("x", [5, 6, 7], 4)
    for action in (lambda: batch.add_many([extra]), lambda: batch.cancel("0")):
        with pytest.raises(RuntimeError, match=r"settle\(\) first"):
            action()
    batch.launch()  # the round in flight is this round: nothing new is launched
    assert not batch.round_ahead and batch.rounds_run_ahead == 1
    taken = batch.collect()
    assert [o.request_id for o in taken] == ["0", "1"] and all(len(o.new_token_ids) == 1 for o in taken)
    assert not batch.round_ahead
    batch.launch()
    batch.collect(run_ahead=True)
    assert batch.round_ahead and batch.rounds_run_ahead == 2
    settled = batch.settle()
    assert [o.request_id for o in settled] == ["0", "1"] and all(len(o.new_token_ids) == 1 for o in settled)
    assert batch._ahead is None and batch.settle() == []
    assert batch.cancel("0") and batch.active == 1
    batch.step()
    assert batch._ahead is not None
    batch.clear()
    assert batch._ahead is None and batch.active == 0
    batch.add_many([extra])  # the batch is usable again
    assert batch.active == 1


@pytest.mark.parametrize("spec", [pytest.param(AR, id="ar"),
                                  pytest.param(SpecConfig(budget=4, topk=2, block_size=4), id="b4-k2-bs4")])
def test_a_row_that_reaches_max_new_tokens_leaves_with_the_round_ahead(engine: Engine, spec: SpecConfig) -> None:
    """A row that reaches max_new_tokens beside one that runs on is handed out at once, with the round after
    it in flight: it no longer counts as active, and leaves when that round is settled. Where every row may end
    in the round, none runs ahead. Requests that fill the whole context run rounds ahead to the end within the
    caches' room (the eager bounds check would refuse a write past it)."""
    short = engine.open_batch(spec, max_batch=2, max_len=200, profile=False)
    short.add_many([Request("0", [3, 4, 5], 2), Request("1", [6, 7], 40)])  # "0": the next round ends it
    done = short.step()
    assert {o.request_id: o.finish_reason for o in done} == {"0": "length", "1": None}
    assert short.round_ahead and short.rounds_run_ahead == 1
    assert short.active == 1 and short.free_slots == 1 and len(short.rows) == 2
    with pytest.raises(RuntimeError, match=r"settle\(\) first"):
        short.add_many([Request("2", [5], 3)])
    assert [o.request_id for o in short.settle()] == ["1"] and len(short.rows) == 1 and not short.round_ahead
    alone = engine.open_batch(spec, max_batch=2, max_len=200, profile=False)
    alone.add_many([Request("0", [3, 4, 5], 2)])  # every row ends in the round: none runs ahead (all waste)
    assert [o.finish_reason for o in alone.step()] == ["length"] and not alone.round_ahead and not alone.rows
    _fill_the_context(engine, spec)


def _fill_the_context(engine: Engine, spec: SpecConfig, max_len: int = 48) -> None:
    """Two requests as long as validate() allows (prompt + max_new_tokens = max_len - the tree's nodes), run
    with and without rounds ahead: the same tokens, every one of them."""
    context = max_len - spec.max_nodes
    full = [Request(str(i), p[:6], context - len(p[:6])) for i, p in enumerate(prompts(2, seed=5))]
    got = {}
    for run_ahead in (False, True):
        batch = engine.open_batch(spec, max_batch=2, max_len=max_len, profile=False, run_ahead=run_ahead)
        got[run_ahead], _ = _drive(batch, full)
        assert batch.rounds_run_ahead > 0 if run_ahead else batch.rounds_run_ahead == 0
    assert got[True] == got[False] and all(len(toks) == r.max_new_tokens for r, (toks, _) in zip(full, got[True].values()))


def test_no_round_ahead_where_it_could_be_mistimed(engine: Engine) -> None:
    """No round runs ahead under a profiling timer (exact stage times), with budget auto (which reads its next
    tree size back with the tokens), or on a batch opened without run_ahead, whatever collect() is asked."""
    spec = SpecConfig(budget=4, topk=2, block_size=4)
    off = engine.open_batch(spec, max_batch=2, max_len=200, profile=False, run_ahead=False)
    off.add_many(_requests(2, 0.0, ()))
    off.launch()
    off.collect(run_ahead=True)
    assert not off.round_ahead and off.rounds_run_ahead == 0
    for batch in (engine.open_batch(spec, max_batch=2, max_len=200, profile=True),
                  engine.open_batch(SpecConfig(budget="auto", max_budget=4, topk=2, block_size=4), max_batch=2,
                                    max_len=200, profile=False)):
        got, _ = _drive(batch, _requests(2, 0.0, ()))
        assert batch.rounds_run_ahead == 0 and all(reason == "length" for _, reason in got.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("spec", SPECS[:3])
def test_graphed_rounds_ahead_change_no_output(spec: SpecConfig) -> None:
    """The same on CUDA graphs, where a round ahead overwrites the graph's outputs before the round behind it
    is read (the read-back copies them first): stops, joins and T > 0 as above; one host sync a round."""
    cpu = make_engine()
    cuda = Engine(cpu.target.to("cuda"), cpu.drafter.to("cuda"), attention="triton" if triton_available() else "sdpa",
                  cuda_graphs=True)
    for temperature in (0.0, 0.8):
        results = _with_and_without(cuda, spec, temperature)
        (plain, _, _), (ahead, early, rounds_ahead) = results[False], results[True]
        assert ahead == plain and rounds_ahead > 0 and early > 0
    _fill_the_context(cuda, spec)  # a round ahead writes past max_len into the caches' room, not another row
    batch = cuda.open_batch(spec, max_batch=3, max_len=200, profile=False)
    batch.add_many(_requests(3, 0.0, ()))
    assert round_syncs(batch, rounds=3, warmup_rounds=2) == [1, 1, 1]
    assert batch.rounds_run_ahead >= 4
    batch.clear()
