"""The engine: DDTREE and DFLASH are lossless against NONE at any temperature, on small random models.

The target's weights are scaled up so its distributions are peaked (a near-uniform random model
would make greedy outputs hinge on float noise); the drafter is a random DFlash head over the same
target, so acceptance is low but non-trivial. The property under test does not depend on the drafter
being good: whatever it proposes, the committed tokens must be the target's own.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ddtree.config import Algorithm, SpecConfig
from ddtree.engine import Engine, Request, prefill_chunks
from ddtree.errors import ConfigError, ModelLoadError, RequestError
from ddtree.models import DrafterConfig, TargetConfig, init_drafter, init_target
from ddtree.serving.scheduler import Failure, Scheduler

VOCAB = 97
MASK_ID = VOCAB - 1


def make_engine(block_size: int = 8, seed: int = 0, hidden: int = 48) -> Engine:
    target_cfg = TargetConfig(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=512, eos_token_id=None,
    )
    target = init_target(target_cfg, seed=seed).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(8)
    drafter_cfg = DrafterConfig(
        hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=VOCAB, block_size=block_size, target_layer_ids=(0, 2, 3), mask_token_id=MASK_ID,
        num_target_layers=4, max_position_embeddings=512,
    )
    drafter = init_drafter(drafter_cfg, target, seed=seed + 1).eval()
    return Engine(target, drafter)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(MASK_ID) for _ in range(rng.randint(3, 40))] for _ in range(count)]


SPECS = [
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None), id="dflash-wnone-bs8"),
    pytest.param(SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048), id="b8-k4-w2048-bs8"),
    pytest.param(SpecConfig(budget=1, topk=1, block_size=4, draft_window=None), id="b1-k1-wnone-bs4"),
    pytest.param(SpecConfig(budget=32, topk=8, block_size=16, draft_window=16), id="b32-k8-w16-bs16"),
    pytest.param(SpecConfig(budget=12, topk=6, block_size=8, draft_window=8), id="b12-k6-w8-bs8"),
    pytest.param(SpecConfig(budget=5, topk=2, block_size=5, draft_window=None), id="b5-k2-wnone-bs5"),
    # fewer nodes than the block is deep: the verify window (budget + 1) is narrower than a full path
    pytest.param(SpecConfig(budget=2, topk=2, block_size=8, draft_window=None), id="b2-k2-wnone-bs8"),
]
AR = SpecConfig(algorithm=Algorithm.NONE)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", SPECS)
def test_speculative_output_equals_ar(engine: Engine, spec: SpecConfig, temperature: float) -> None:
    batch = prompts(4, seed=hash(spec.id) % 1000)
    ref = engine.generate(batch, 24, temperature=temperature, spec=AR, seed=11)
    out = engine.generate(batch, 24, temperature=temperature, spec=spec, seed=11)
    for i, (r, o) in enumerate(zip(ref, out)):
        assert o.token_ids == r.token_ids, f"{spec.id} T={temperature} prompt {i}: differs from AR"
        assert len(o.token_ids) == 24
        assert all(1 <= a <= spec.block_size for a in o.accept_lengths), o.accept_lengths
        # completion = the prefill's token + every round's accepted length (cut at max_new_tokens)
        assert 1 + sum(o.accept_lengths) >= len(o.token_ids)
        assert o.verify_steps == len(o.accept_lengths) > 0


def test_budget_below_depth_fits_a_tight_cache(engine: Engine) -> None:
    """A cache sized exactly for prompt + max_new_tokens + budget + 1 is enough, even when budget < depth."""
    spec = SpecConfig(budget=3, topk=3, block_size=8, draft_window=None)
    prompt = prompts(1, seed=9)[0]
    ref = engine.generate(prompt, 40, spec=AR).token_ids
    batch = engine.open_batch(spec, max_batch=1, max_len=len(prompt) + 40 + spec.max_nodes)
    got: list[int] = []
    outs = batch.add(Request("0", prompt, 40))
    while True:
        got += [t for o in outs for t in o.new_token_ids]
        if any(o.finished for o in outs):
            break
        outs = batch.step()
    assert got == ref


def test_batched_equals_alone(engine: Engine) -> None:
    """A request's output does not depend on what else is in the batch (rows of different lengths)."""
    spec = SpecConfig(budget=8, topk=4, block_size=8)
    batch = prompts(5, seed=3)
    together = engine.generate(batch, 20, spec=spec)
    for p, t in zip(batch, together):
        alone = engine.generate(p, 20, spec=spec)
        assert alone.token_ids == t.token_ids
        assert alone.accept_lengths == t.accept_lengths


def test_small_batch_slots_refill(engine: Engine) -> None:
    """More prompts than slots: finished rows free their slot and waiting prompts join between rounds."""
    spec = SpecConfig(budget=6, topk=3, block_size=6, draft_window=None)
    batch = prompts(5, seed=4)
    lengths = [5, 17, 9, 30, 12]
    ref = [engine.generate(p, n, spec=AR).token_ids for p, n in zip(batch, lengths)]
    b = engine.open_batch(spec, max_batch=2, max_len=128)
    pending = [Request(str(i), p, n) for i, (p, n) in enumerate(zip(batch, lengths))]
    got: dict[str, list[int]] = {r.request_id: [] for r in pending}
    finished = set()
    while pending or b.active:
        while pending and b.free_slots:
            for o in b.add(pending.pop(0)):
                got[o.request_id] += o.new_token_ids
                finished |= {o.request_id} if o.finished else set()
        for o in b.step():
            got[o.request_id] += o.new_token_ids
            finished |= {o.request_id} if o.finished else set()
    assert finished == {str(i) for i in range(5)}
    assert [got[str(i)] for i in range(5)] == ref


def test_window_changes_acceptance_never_output(engine: Engine) -> None:
    batch = prompts(3, seed=5)
    batch = [p * 4 for p in batch]  # longer contexts than the small window
    wide = engine.generate(batch, 24, spec=SpecConfig(budget=8, topk=4, block_size=8, draft_window=None))
    narrow = engine.generate(batch, 24, spec=SpecConfig(budget=8, topk=4, block_size=8, draft_window=8))
    assert [r.token_ids for r in wide] == [r.token_ids for r in narrow]
    assert [r.accept_lengths for r in wide] != [r.accept_lengths for r in narrow]


def test_stop_tokens_and_lengths(engine: Engine) -> None:
    prompt = prompts(1, seed=6)[0]
    free = engine.generate(prompt, 30, spec=AR)
    stop = free.token_ids[7]
    first = free.token_ids.index(stop)
    for spec in (AR, SpecConfig(budget=8, topk=4, block_size=8)):
        out = engine.generate(prompt, 30, spec=spec, stop_token_ids=[stop])
        assert out.token_ids == free.token_ids[: first + 1]
        assert out.finish_reason == "stop"
    one = engine.generate(prompt, 1, spec=SpecConfig())
    assert len(one.token_ids) == 1 and one.finish_reason == "length"


def test_statistics(engine: Engine) -> None:
    out = engine.generate(prompts(1, seed=7)[0], 40, spec=SpecConfig(budget=8, topk=4, block_size=8))
    hist = out.accept_histogram
    assert sum(hist) == out.verify_steps
    assert sum(i * c for i, c in enumerate(hist)) == sum(out.accept_lengths)
    assert set(out.timings) == {"prefill", "draft", "build", "verify", "walk", "compact"}
    assert all(v >= 0 for v in out.timings.values()) and out.timings["verify"] > 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(budget=0), "budget"),
        (dict(topk=0), "topk"),
        (dict(draft_window=4, block_size=8), "draft_window"),
        (dict(block_size=1), "block_size"),
        (dict(algorithm="EAGLE"), "algorithm"),
    ],
)
def test_bad_configs_fail_before_any_forward(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SpecConfig(**kwargs)


def test_speculation_without_drafter_is_rejected(engine: Engine) -> None:
    ar_only = Engine(engine.target)
    with pytest.raises(ConfigError, match="draft model"):
        ar_only.generate([1, 2, 3], 4, spec=SpecConfig())


def test_bad_requests(engine: Engine) -> None:
    with pytest.raises(RequestError, match="vocabulary"):
        engine.generate([1, VOCAB + 5], 4, spec=AR)
    with pytest.raises(RequestError, match="context length"):
        engine.generate([1] * 500, 100, spec=SpecConfig())
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate([1, 2], 0, spec=AR)


def test_drafter_that_does_not_fit_is_rejected(engine: Engine) -> None:
    cfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, block_size=8, target_layer_ids=(0, 9), mask_token_id=MASK_ID, num_target_layers=4,
    )
    with pytest.raises(ModelLoadError):
        init_drafter(cfg, engine.target)


# -- batched prefill -------------------------------------------------------------------------------


def run_to_end(batch, first: list) -> dict[str, tuple[list[int], list[int]]]:
    """Drive `batch` until every row finishes; request id -> (tokens, accept lengths)."""
    got: dict[str, tuple[list[int], list[int]]] = {}
    outs = first
    while True:
        for o in outs:
            toks, acc = got.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            acc += o.accept_lengths
        if not batch.active:
            return got
        outs = batch.step()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
def test_add_many_equals_one_by_one(engine: Engine, temperature: float) -> None:
    """Prompts of very different lengths prefilled together decode exactly as when added one at a time."""
    spec = SpecConfig(budget=8, topk=4, block_size=8, draft_window=16)
    rng = random.Random(12)
    lengths = [2, 150, 7, 61, 1, 33]
    reqs = [Request(str(i), [rng.randrange(MASK_ID) for _ in range(n)], 16, temperature, seed=5 + i)
            for i, n in enumerate(lengths)]
    one = engine.open_batch(spec, max_batch=len(reqs), max_len=256)
    firsts = [o for r in reqs for o in one.add(r)]
    alone = run_to_end(one, firsts)
    many = engine.open_batch(spec, max_batch=len(reqs), max_len=256)
    many.forward_cost = 10_000  # all six in one forward, padded to 150 (the default keeps 1 and 150 apart)
    outs = many.add_many(reqs)
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]  # request order, not length order
    assert many.active == len(reqs)
    together = run_to_end(many, outs)
    assert together == alone
    # and both are the target's own tokens
    ar = engine.generate([r.prompt_ids for r in reqs], 16, temperature=temperature, spec=AR, seed=5)
    assert together["0"][0] == ar[0].token_ids


def test_prefill_chunks_bound_padded_tokens() -> None:
    lengths = [5, 300, 40, 41, 7, 1000, 39]
    chunks = prefill_chunks(lengths, 128)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for c in chunks:
        padded = len(c) * max(lengths[i] for i in c)
        assert padded <= 128 or len(c) == 1  # only a prompt longer than the bound runs alone
    assert [lengths[c[0]] for c in chunks] == sorted(lengths[c[0]] for c in chunks)  # short ones first
    assert prefill_chunks([10] * 8, 40) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert prefill_chunks([], 40) == []
    # padding vs forwards: free forwards keep every length apart; costly ones share a padded forward
    assert prefill_chunks([13, 10, 12, 11], 1000) == [[1], [3], [2], [0]]
    assert prefill_chunks([13, 10, 12, 11], 1000, forward_cost=100) == [[1, 3, 2, 0]]
    assert prefill_chunks([13, 10, 12, 11], 26, forward_cost=100) == [[1, 3], [2, 0]]


def test_add_many_across_chunks_equals_one_by_one(engine: Engine) -> None:
    """More padded tokens than prefill_tokens: several forwards, same result as one request at a time."""
    spec = SpecConfig(budget=6, topk=3, block_size=6, draft_window=None)
    rng = random.Random(13)
    lengths = [30, 3, 64, 17, 29, 31, 90, 8]
    reqs = [Request(str(i), [rng.randrange(MASK_ID) for _ in range(n)], 1 if i == 1 else 12)
            for i, n in enumerate(lengths)]
    one = engine.open_batch(spec, max_batch=len(reqs), max_len=160)
    alone = run_to_end(one, [o for r in reqs for o in one.add(r)])
    calls: list[tuple[int, int]] = []
    real_forward = engine.target.forward

    def spy(input_ids, *args, **kwargs):
        calls.append(tuple(input_ids.shape))
        return real_forward(input_ids, *args, **kwargs)

    many = engine.open_batch(spec, max_batch=len(reqs), max_len=160, prefill_tokens=64)
    many.forward_cost = 1000  # forwards "cost" more than padding: only prefill_tokens splits them
    engine.target.forward = spy
    try:
        outs = many.add_many(reqs)
    finally:
        del engine.target.forward
    assert len(calls) >= 4 and all(k * w <= 64 or k == 1 for k, w in calls), calls
    assert max(k for k, _ in calls) >= 2  # padded rows really share forwards
    assert sum(k for k, _ in calls) == len(reqs)
    assert outs[1].finished and many.active == len(reqs) - 1  # max_new_tokens=1 is done at its first token
    assert run_to_end(many, outs) == alone


def test_bad_request_in_add_many_changes_nothing(engine: Engine) -> None:
    spec = SpecConfig(budget=4, topk=2, block_size=4)
    batch = engine.open_batch(spec, max_batch=4, max_len=128)
    batch.add(Request("running", [1, 2, 3], 8))
    before = (batch.active, batch.slots.cache.lengths.clone(), batch.slots.bonus.clone())
    good = Request("good", [4, 5, 6], 8)
    for bad, field in [
        (Request("bad", [1, VOCAB + 3], 8), "input_ids"),
        (Request("bad", [], 8), "input_ids"),
        (Request("bad", [1, 2], 0), "max_new_tokens"),
        (Request("bad", [1] * 120, 20), "max_new_tokens"),
        (Request("bad", [1, 2], 4, temperature=-1.0), "temperature"),
        (Request("running", [1, 2], 4), "request_id"),
    ]:
        with pytest.raises(RequestError, match="'bad'|'running'") as err:
            batch.add_many([good, bad])
        assert err.value.field == field
        assert batch.active == before[0]
        assert torch.equal(batch.slots.cache.lengths, before[1]) and torch.equal(batch.slots.bonus, before[2])
    with pytest.raises(RequestError, match="no free slot") as err:
        batch.add_many([Request(str(i), [1, 2], 4) for i in range(4)])
    assert err.value.status_code == 503 and batch.active == 1
    with pytest.raises(ConfigError, match="prefill_tokens"):
        engine.open_batch(spec, max_batch=1, prefill_tokens=0)


def test_scheduler_admits_together_and_fails_only_the_bad_request(engine: Engine) -> None:
    """The server's scheduler prefills queued requests with add_many; a bad one fails alone."""
    spec = SpecConfig(budget=6, topk=3, block_size=6)
    batch = engine.open_batch(spec, max_batch=4, max_len=128)
    calls: list[int] = []
    real_add_many = batch.add_many
    batch.add_many = lambda reqs: calls.append(len(reqs)) or real_add_many(reqs)
    good = prompts(3, seed=14)
    reqs = [Request("a", good[0], 10), Request("bad", [1, VOCAB + 1], 10),
            Request("b", good[1], 10), Request("c", good[2], 10)]
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    done = threading.Event()

    def sink_for(rid: str):
        def sink(ev) -> None:
            events[rid].append(ev)
            if all(e and (isinstance(e[-1], Failure) or e[-1].finished) for e in events.values()):
                done.set()
        return sink

    sched = Scheduler(batch, max_running=4)
    for r in reqs:  # all queued before the thread starts: one admission takes them together
        sched.submit(r, sink_for(r.request_id))
    sched.start()
    try:
        assert done.wait(60)
    finally:
        sched.stop()
    assert calls == [3]
    assert isinstance(events["bad"][-1], Failure) and events["bad"][-1].field == "input_ids"
    ref = engine.generate(good, 10, spec=AR)
    for rid, r in zip("abc", ref):
        assert [t for ev in events[rid] for t in ev.new_token_ids] == r.token_ids


def test_device_lengths_track_the_host_bookkeeping(engine: Engine) -> None:
    """The round reads committed lengths from the cache (no host copy); they must equal the host's."""
    spec = SpecConfig(budget=8, topk=4, block_size=8, draft_window=16)
    batch = engine.open_batch(spec, max_batch=3, max_len=256)
    batch.add_many([Request(str(i), p, 40) for i, p in enumerate(prompts(3, seed=11))])
    for _ in range(6):
        batch.step()
        rows = batch.rows
        assert batch.slots.cache.lengths[: len(rows)].tolist() == [r.committed for r in rows]
        assert batch.slots.ctx.total[: len(rows)].tolist() == [r.committed for r in rows]


# -- budget auto ------------------------------------------------------------------------------------
AUTO_SPECS = [
    pytest.param(SpecConfig(budget="auto", topk=4, block_size=8), id="bauto-k4-w2048-bs8"),
    pytest.param(SpecConfig(budget="auto", max_budget=12, topk=6, block_size=8, draft_window=8), id="bauto12-k6-w8-bs8"),
]


def _cost_model(per_node: float):
    from ddtree.budget import VerifyCostModel

    nodes = (2, 9, 33, 64)
    return VerifyCostModel((1, 8), nodes, tuple(tuple(1e-3 + per_node * n * r for n in nodes) for r in (1, 8)),
                           (1e-3, 1e-3))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", AUTO_SPECS)
def test_auto_budget_output_equals_ar(engine: Engine, spec: SpecConfig, temperature: float) -> None:
    """The engine measures its cost model once and picks a tree size per round; the output stays AR's."""
    batch = prompts(4, seed=5)
    ref = engine.generate(batch, 24, temperature=temperature, spec=AR, seed=11)
    out = engine.generate(batch, 24, temperature=temperature, spec=spec, seed=11)
    for i, (r, o) in enumerate(zip(ref, out)):
        assert o.token_ids == r.token_ids, f"{spec.id} T={temperature} prompt {i}: differs from AR"
        assert len(o.budgets) == o.verify_steps == len(o.accept_lengths) > 0
        assert all(1 <= b <= spec.max_budget for b in o.budgets), o.budgets


@pytest.mark.parametrize(("per_node", "expect"), [(1.0, 1), (0.0, 16)], ids=["steep-chain", "flat-cap"])
def test_auto_budget_follows_the_cost_model(per_node: float, expect: int) -> None:
    """A steep per-node verify cost verifies 1 node a round; a flat one verifies max_budget; both lossless."""
    engine = make_engine()
    engine.cost_model = _cost_model(per_node)  # as if loaded from --speculative-ddtree-cost-profile
    spec = SpecConfig(budget="auto", max_budget=16, topk=4, block_size=8)
    batch = prompts(3, seed=8)
    ref = engine.generate(batch, 20, spec=AR)
    out = engine.generate(batch, 20, spec=spec)
    for r, o in zip(ref, out):
        assert o.token_ids == r.token_ids
        assert set(o.budgets) == {expect}, o.budgets


def test_cost_model_is_measured_once_per_engine() -> None:
    engine = make_engine()
    spec = SpecConfig(budget="auto", max_budget=8, topk=4, block_size=8)
    first = engine.open_batch(spec, max_batch=2, max_len=128)
    again = engine.open_batch(spec, max_batch=2, max_len=128)
    assert first.budget.cost_model is again.budget.cost_model is not None
    assert first.budget.cost_model.nodes[-1] == 9 and first.budget.cost_model.rows == (1, 2, 4, 8)
    wider = engine.open_batch(spec, max_batch=16, max_len=128)  # more rows than measured: measure again
    assert wider.budget.cost_model is not first.budget.cost_model and wider.budget.cost_model.rows[-1] == 16
    fixed = engine.open_batch(SpecConfig(budget=8), max_batch=2, max_len=128)
    assert fixed.budget.cost_model is None
    out = engine.generate(prompts(1, seed=2)[0], 12, spec=SpecConfig(budget=8))
    assert set(out.budgets) == {8}, "a fixed budget verifies its budget every round"
