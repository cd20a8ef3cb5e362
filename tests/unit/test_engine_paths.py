"""The engine's device paths: kernel tree attention (on CPU through its torch reference) and CUDA graphs.

Whatever path a round takes, its committed tokens must be the target's own: every check compares
against plain AR decoding on the eager SDPA path. The CUDA tests also count host synchronisations:
a graphed round reads the device once (the tokens handed back; budget auto's first round once more).
"""

from __future__ import annotations

import pytest
import torch

import ddtree.engine as engine_module
from ddtree.config import Algorithm, SpecConfig
from ddtree.cuda_graphs import ROW_BUCKETS, TREE_BUCKETS, row_bucket, tree_sizes
from ddtree.engine import CALIBRATE_EVERY, CHOOSE_EVERY, DecodeBatch, Engine, Request
from ddtree.errors import ConfigError
from ddtree.kernels import tree_ops
from ddtree.kernels.tree_attention import triton_available
from ddtree.profiling.syncs import round_syncs
from tests.unit.test_engine import AR, make_engine, prompts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, Triton kernels)")

PATH_SPECS = [
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8, draft_window=None), id="dflash-wnone-bs8"),
    pytest.param(SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048), id="b8-k4-w2048-bs8"),
    pytest.param(SpecConfig(budget=2, topk=2, block_size=8, draft_window=None), id="b2-k2-wnone-bs8"),
    # 81 verify tokens: two bitmask words per row
    pytest.param(SpecConfig(budget=80, topk=8, block_size=16, draft_window=16), id="b80-k8-w16-bs16"),
]


def with_attention(engine: Engine, attention: str, cuda_graphs: bool | None = None) -> Engine:
    return Engine(engine.target, engine.drafter, attention=attention, cuda_graphs=cuda_graphs)


@pytest.fixture(scope="module")
def sdpa_engine() -> Engine:
    return make_engine()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", PATH_SPECS)
def test_kernel_attention_rounds_equal_ar(sdpa_engine: Engine, spec: SpecConfig, temperature: float) -> None:
    """Verify through tree_attention (reference backend here, Triton on CUDA) commits AR's tokens."""
    kernel = with_attention(sdpa_engine, "reference")
    assert kernel.attention == "reference" and not kernel.cuda_graphs
    batch = prompts(3, seed=21)
    ref = sdpa_engine.generate(batch, 20, temperature=temperature, spec=AR, seed=5)
    out = kernel.generate(batch, 20, temperature=temperature, spec=spec, seed=5)
    ar_kernel = kernel.generate(batch, 20, temperature=temperature, spec=AR, seed=5)
    for i, (r, o, a) in enumerate(zip(ref, out, ar_kernel)):
        assert o.token_ids == r.token_ids, f"{spec.id} prompt {i}: kernel path differs from AR"
        assert a.token_ids == r.token_ids, f"prompt {i}: AR on the kernel path differs from AR on SDPA"


def test_kernel_attention_logits_match_sdpa(sdpa_engine: Engine) -> None:
    """One verify forward over a tree after a prefix: same logits and taps through both paths."""
    target = sdpa_engine.target
    parents = [0, 0, 1, 1, 2, 4]  # nodes 1..6 under the root
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p]
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 90, (2, 11), generator=gen)
    tokens = torch.randint(0, 90, (2, n), generator=gen)
    outs = []
    for attention in ("sdpa", "reference"):
        cache = target.new_cache(2, 64)
        with torch.no_grad():
            target.forward(prefix, torch.arange(11)[None].expand(2, -1), cache)
            cache.advance(torch.tensor([11, 7]))  # rows of different lengths
            pos = cache.lengths[:, None] + torch.tensor(depth)[None]
            outs.append(target.forward(tokens, pos, cache, mask[None].expand(2, n, n), [0, 3], attention=attention))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_attention_and_graph_choices_are_checked(sdpa_engine: Engine) -> None:
    with pytest.raises(ConfigError, match="attention: 'flash' is not one of"):
        with_attention(sdpa_engine, "flash")
    with pytest.raises(ConfigError, match="cuda_graphs: need a CUDA device"):
        with_attention(sdpa_engine, "reference", cuda_graphs=True)
    assert with_attention(sdpa_engine, "auto").attention == "sdpa"  # CPU: auto keeps SDPA
    with pytest.raises(ValueError, match="attention: 'reference' verifies at most 256 tokens"):
        cache = sdpa_engine.target.new_cache(1, 400)
        sdpa_engine.target.forward(torch.zeros(1, 300, dtype=torch.long), torch.arange(300)[None], cache,
                                   attention="reference")


def test_buckets() -> None:
    assert [row_bucket(n, 32) for n in (1, 2, 3, 5, 9, 13, 17, 25, 32)] == [1, 2, 4, 8, 12, 16, 24, 32, 32]
    assert row_bucket(20, 20) == 20 and row_bucket(300, 300) == 300  # capped by max_batch, beyond the list
    with pytest.raises(ValueError, match="rows: 0 is out of range"):
        row_bucket(0, 8)
    assert tree_sizes(8) == [1, 2, 3, 4, 6, 8] and tree_sizes(5) == [1, 2, 3, 4, 5]
    assert list(ROW_BUCKETS) == sorted(ROW_BUCKETS) and list(TREE_BUCKETS) == sorted(TREE_BUCKETS)


# -- CUDA: Triton kernels and graphs ------------------------------------------------------------------


def cuda_engine(cuda_graphs: bool) -> Engine:
    cpu = make_engine()
    target = cpu.target.to("cuda")
    drafter = cpu.drafter.to("cuda")
    return Engine(target, drafter, attention="triton" if triton_available() else "sdpa", cuda_graphs=cuda_graphs)


GPU_SPECS = PATH_SPECS[:3] + [
    pytest.param(SpecConfig(budget="auto", max_budget=16, topk=4, block_size=8), id="bauto16-k4-w2048-bs8"),
]


@pytest.mark.gpu
@cuda
def test_a_real_width_bf16_engine_folds_its_norms_and_commits_the_targets_tokens() -> None:
    """The narrow random shape (hidden 1024) in bfloat16: the engine folds by default. One prompt's rounds take
    the folded GEMMs (<= 16 rows), 20 prompts' the add + norm kernels with unit weights; DDTREE commits what AR
    does on the same folded engine, and the greedy tokens are the unfolded engine's (this shape's embedding
    scale gives top-1 margins far above bfloat16's rounding of W * g)."""
    from ddtree.profiling.random_models import random_models

    folded = Engine(*random_models("narrow", device="cuda", dtype=torch.bfloat16))
    assert folded.norms_folded
    unfolded = Engine(*random_models("narrow", device="cuda", dtype=torch.bfloat16), fold_norms=False)
    spec = SpecConfig(budget=8, topk=4, block_size=8, draft_window=2048)
    for count in (1, 20):
        batch = prompts(count, seed=30 + count)
        ref = unfolded.generate(batch, 32, spec=AR)
        for engine, s in ((folded, AR), (folded, spec), (unfolded, spec)):
            out = engine.generate(batch, 32, spec=s)
            assert [o.token_ids for o in out] == [r.token_ids for r in ref], (count, engine.norms_folded, s.id)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_graphed_rounds_equal_ar(spec: SpecConfig, temperature: float) -> None:
    """CUDA graphs on (rows padded to buckets, 5 prompts -> bucket 8): the same tokens as eager AR."""
    eager, graphed = cuda_engine(False), cuda_engine(True)
    batch = prompts(5, seed=8)
    ref = eager.generate(batch, 24, temperature=temperature, spec=AR, seed=3)
    for engine in (graphed, eager):
        out = engine.generate(batch, 24, temperature=temperature, spec=spec, seed=3)
        for i, (r, o) in enumerate(zip(ref, out)):
            assert o.token_ids == r.token_ids, f"{spec.id} graphs={engine.cuda_graphs} prompt {i}: differs from AR"
    ar_graphed = graphed.generate(batch, 24, temperature=temperature, spec=AR, seed=3)
    assert [o.token_ids for o in ar_graphed] == [r.token_ids for r in ref]


@pytest.mark.gpu
@cuda
def test_graphed_auto_times_every_captured_round() -> None:
    """The first auto round ahead captures every tree size for buckets 1..8 and times each replay: the costs
    it chooses with are those times (+inf where no graph exists), and the batch's tokens stay AR's."""
    engine = cuda_engine(True)
    spec = SpecConfig(budget="auto", max_budget=16, topk=4, block_size=8)
    batch = prompts(5, seed=8)
    ref = engine.generate(batch, 24, spec=AR)
    b = engine.open_batch(spec, max_batch=5, max_len=256, profile=False)
    b.add_many([Request(str(i), p, 24) for i, p in enumerate(batch)])
    b.step()  # the first round decides with a second sync
    b.step()  # the first round ahead: captures and times
    assert b.budget.sizes_captured == {(rows, False) for rows in (1, 2, 4, 5)}
    on_graph = set(tree_sizes(16))
    for rows in (1, 2, 4, 5):
        seconds = b.budget.round_tables[(rows, 16)]
        assert all((0 < t < 0.5) if size in on_graph else t == float("inf") for size, t in enumerate(seconds, 1))
        assert b.budget.round_costs(rows, 16, graphed=True).cpu().tolist() == pytest.approx(seconds)
    b.clear()
    assert [o.token_ids for o in engine.generate(batch, 24, spec=spec)] == [r.token_ids for r in ref]


def _join_one_by_one(b: DecodeBatch, batch: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each prompt joins as soon as a slot is free (one prefill each) and leaves when done: their tokens."""
    pending = [Request(str(i), p, n) for i, (p, n) in enumerate(zip(batch, lengths))]
    got: dict[str, list[int]] = {r.request_id: [] for r in pending}
    while pending or b.active:
        while pending and b.free_slots:
            for o in b.settle() + b.add(pending.pop(0)):  # a round run ahead comes back before anyone joins
                got[o.request_id] += o.new_token_ids
        for o in b.step():
            got[o.request_id] += o.new_token_ids
    return [got[str(i)] for i in range(len(batch))]


@pytest.mark.gpu
@cuda
def test_graphed_slots_refill_across_buckets() -> None:
    """Requests finish and join between rounds (batch sizes 1..3 -> buckets 1, 2, 4): outputs equal AR's."""
    engine = cuda_engine(True)
    spec = SpecConfig(budget=6, topk=3, block_size=6, draft_window=None)
    batch = prompts(6, seed=14)
    lengths = [5, 31, 9, 40, 12, 3]
    ref = [engine.generate(p, n, spec=AR).token_ids for p, n in zip(batch, lengths)]
    b = engine.open_batch(spec, max_batch=3, max_len=160)
    assert _join_one_by_one(b, batch, lengths) == ref
    assert b.graphs is not None and b.graphs.replays > b.graphs.captures > 0


class EagerGraphs:
    """GraphCache's interface without CUDA: every run calls fn, which is what a replay recomputes."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.captures = 0  # nothing is ever captured: every round counts for budget auto's calibration
        self._last: dict[tuple, object] = {}

    def __contains__(self, key: tuple) -> bool:
        return False  # nothing is kept: every run recomputes

    def run(self, key: tuple, fn, state=()):  # noqa: ANN001, ANN201 - GraphCache.run's signature
        self.keys.append(key)
        self._last[key] = fn
        return fn()

    def replay(self, key: tuple):  # noqa: ANN201 - GraphCache.replay's signature
        self.keys.append(key)
        return self._last[key]()  # what the graph run under `key` would redo


@pytest.mark.parametrize("spec", [AR, SpecConfig(budget=6, topk=3, block_size=6, draft_window=None),
                                  SpecConfig(budget="auto", max_budget=12, topk=3, block_size=6, draft_window=None)],
                         ids=["ar", "b6-k3", "bauto12-k3"])
def test_graphed_code_paths_equal_ar_on_cpu(sdpa_engine: Engine, spec: SpecConfig) -> None:
    """The graphed batch's code (staged one-request prefills copied into their slot by a device index, rows
    padded to buckets) run eagerly on the CPU: requests joining and leaving get AR's tokens."""
    kernel = with_attention(sdpa_engine, "reference")
    batch = prompts(5, seed=14)
    lengths = [5, 31, 9, 40, 12]
    ref = [sdpa_engine.generate(p, n, spec=AR).token_ids for p, n in zip(batch, lengths)]
    b = kernel.open_batch(spec, max_batch=3, max_len=160)
    b.runner.graphs = graphs = EagerGraphs()  # type: ignore[assignment]
    b.budget.calibrate_every = 8  # a rewrite within these few rounds
    assert _join_one_by_one(b, batch, lengths) == ref
    assert {k for k in graphs.keys if k[0] == "prefill"} == {("prefill", 64, False)}  # every prompt <= 64 tokens
    if spec.auto_budget:  # after the first round, each round's tree size was chosen by the round before
        rounds = [k for k in graphs.keys if k[0] in ("round", "draft")]
        assert rounds[0][0] == "draft" and rounds[-1][0] == "round"
        assert {k[4] for k in rounds if k[0] == "round"} == {True, False}  # choosing rounds and the ones between
        assert b.budget_rounds > 1 and {k[2] for k in rounds if k[0] == "round"} <= set(tree_sizes(12))
        # the first such round ran every tree size auto may choose for its row bucket and every bucket below
        # (capturing them all up front), and put the batch back as it was: the tokens above are still AR's
        for m in {k[1] for k in rounds if k[0] == "round"}:
            assert {k[2] for k in rounds if k[0] == "round" and k[1] == m} == set(tree_sizes(12)), f"rows {m}"
        assert b.budget.sizes_captured == {(m, False) for m in (1, 2, 3)}  # max_batch 3: buckets 1, 2, 3
        assert b.budget.gains is not None and float(b.budget.gains[0]) >= 0  # the choice's running mean of gains moved

        # the rounds after the first were timed, and every `calibrate_every` of them rewrote the costs the
        # captured choice reads: measured sizes at their mean, off-graph sizes still +inf
        budget = b.budget
        assert budget.calibration is not None and budget.calibrated_rounds == b.budget_rounds - 1 >= budget.calibrate_every
        rewritten = 0
        for (m, cap), costs in b.budget.auto_costs.items():
            table = b.budget.cost_model.round_costs(m, cap, "cpu")
            on_graph = [size - 1 for size in tree_sizes(cap)]
            off_graph = [i for i in range(cap) if i not in on_graph]
            assert torch.isinf(costs[off_graph]).all()
            rewritten += not torch.equal(costs[on_graph], table[on_graph])
        assert rewritten, "no round cost was rewritten from measured rounds"


def test_graphed_auto_costs_are_the_timed_rounds_on_cpu(sdpa_engine: Engine) -> None:
    """Graphed code on the CPU, stage clocks off: the first round ahead times every tree size of buckets 1..3
    (each replay from the batch's state) and chooses with those seconds (+inf where no graph exists); the
    calibration moves every size alike; the tokens stay AR's."""
    kernel = with_attention(sdpa_engine, "reference")
    spec = SpecConfig(budget="auto", max_budget=12, topk=3, block_size=6, draft_window=None)
    batch, lengths = prompts(4, seed=21), [30, 12, 26, 35]
    ref = [sdpa_engine.generate(p, n, spec=AR).token_ids for p, n in zip(batch, lengths)]
    b = kernel.open_batch(spec, max_batch=3, max_len=160, profile=False)
    b.runner.graphs = EagerGraphs()  # type: ignore[assignment]
    assert _join_one_by_one(b, batch, lengths) == ref
    on_graph = set(tree_sizes(12))
    assert sorted(b.budget.round_tables) == [(1, 12), (2, 12), (3, 12)]
    for (rows, cap), seconds in b.budget.round_tables.items():
        assert all((0 < t < 5) if size in on_graph else t == float("inf") for size, t in enumerate(seconds, 1))
        shift = [c - t for c, t, size in zip(b.budget.round_costs(rows, cap, True).tolist(), seconds, range(1, 13))
                 if size in on_graph]
        assert max(shift) - min(shift) == pytest.approx(0, abs=1e-5), f"rows {rows}: sizes moved apart"


def test_graphed_auto_chooses_one_round_in_few_on_cpu(sdpa_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphed auto (run eagerly on the CPU): one round in CHOOSE_EVERY builds the cap's tree and chooses the
    next size; the rounds between build and verify that size only (a fixed budget's round); tokens stay AR's."""
    kernel = with_attention(sdpa_engine, "reference")
    spec = SpecConfig(budget="auto", max_budget=12, topk=3, block_size=6, draft_window=None)
    batch = prompts(2, seed=5)
    ref = [sdpa_engine.generate(p, 60, spec=AR).token_ids for p in batch]
    b = kernel.open_batch(spec, max_batch=2, max_len=160, profile=False)
    b.runner.graphs = EagerGraphs()  # type: ignore[assignment]
    built: list[int] = []  # build_trees' size argument, call by call
    build_trees = tree_ops.build_trees
    monkeypatch.setattr(tree_ops, "build_trees", lambda logits, size, topk: built.append(size) or build_trees(logits, size, topk))
    rounds: list[tuple[tuple, list[int]]] = []  # (graph key, sizes built) of each round a step ran
    capture_tree_sizes, run_stages = b.budget.capture_tree_sizes, b.runner.run
    capturing = False

    def capture(*args):  # noqa: ANN002, ANN202 - wraps AutoBudget.capture_tree_sizes
        nonlocal capturing
        capturing = True
        try:
            capture_tree_sizes(*args)
        finally:
            capturing = False

    def run(key, make_stages, prev):  # noqa: ANN001, ANN202 - wraps StageRunner.run
        built.clear()
        s = run_stages(key, make_stages, prev)
        if not capturing:
            rounds.append((key, list(built)))
        return s

    monkeypatch.setattr(b.budget, "capture_tree_sizes", capture)
    monkeypatch.setattr(b.runner, "run", run)
    assert _join_one_by_one(b, batch, [60, 60]) == ref
    assert [k[0] for k, _ in rounds[:2]] == ["draft", "verify"]  # the first round reads b* back
    ahead = rounds[2:]
    assert len(ahead) > 2 * CHOOSE_EVERY
    for j, ((kind, _, size, _, choosing), sizes) in enumerate(ahead):
        assert kind == "round" and choosing == (j % CHOOSE_EVERY == 0), f"round {j}"
        assert sizes == [12 if choosing else size], f"round {j}: built {sizes}"
        if j % CHOOSE_EVERY != 1 and j > 0:  # only a choosing round hands on a new size
            assert size == ahead[j - 1][0][2], f"round {j}"


def test_graphed_auto_does_not_calibrate_unless_told(sdpa_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graphed batch chooses with its captured rounds' own times: no round feeds the calibration and the
    costs stay the timed table (an eager batch calibrates every CALIBRATE_EVERY rounds)."""
    kernel = with_attention(sdpa_engine, "reference")
    spec = SpecConfig(budget="auto", max_budget=12, topk=3, block_size=6, draft_window=None)
    assert kernel.open_batch(spec, max_batch=2, max_len=160).budget.calibrate_every == CALIBRATE_EVERY > 0  # eager
    monkeypatch.setattr(engine_module, "GraphCache", lambda device: EagerGraphs())
    kernel.cuda_graphs = True
    b = kernel.open_batch(spec, max_batch=2, max_len=160, profile=False)
    assert isinstance(b.graphs, EagerGraphs) and b.budget.calibrate_every == 0
    batch = prompts(2, seed=9)
    ref = [sdpa_engine.generate(p, 40, spec=AR).token_ids for p in batch]
    assert _join_one_by_one(b, batch, [40, 40]) == ref
    assert b.budget_rounds > 2 and b.budget.calibrated_rounds == 0
    assert sorted(b.budget.round_tables) == [(1, 12), (2, 12)]
    for (rows, cap), seconds in b.budget.round_tables.items():
        assert b.budget.round_costs(rows, cap, True).tolist() == pytest.approx(seconds), f"rows {rows}"


def test_round_state_drops_what_the_round_used_up(sdpa_engine: Engine) -> None:
    """A round's state (a captured graph's outputs) no longer holds the drafter's logits or the target's
    taps at its end: only what the host and the next stage read."""
    b = sdpa_engine.open_batch(SpecConfig(budget=6, topk=3, block_size=6), max_batch=2, max_len=96)
    b.add_many([Request(str(i), p, 8) for i, p in enumerate(prompts(2, seed=3))])
    states = []
    run_stages = b.runner.run

    def keep(key, make_stages, prev):  # noqa: ANN001, ANN202 - StageRunner.run's signature
        states.append(run_stages(key, make_stages, prev))
        return states[-1]

    b.runner.run = keep  # type: ignore[method-assign]
    b.step()
    assert states and not hasattr(states[-1], "draft_logits") and not hasattr(states[-1], "taps")
    assert hasattr(states[-1], "host") and hasattr(states[-1], "trees")


def test_auto_budget_costs_follow_measured_rounds(sdpa_engine: Engine) -> None:
    """Every `calibrate_every` timed rounds the costs auto chooses with become the table shifted by the measured
    gap, in place: a captured choice reads the same tensor."""
    b = sdpa_engine.open_batch(SpecConfig(budget="auto", max_budget=8, topk=3, block_size=6), max_batch=2, max_len=64)
    assert b.budget.calibration is not None and b.budget.cost_model is not None
    costs = b.budget.round_costs(2, 8, graphed=False)
    table = b.budget.cost_model.round_costs(2, 8, "cpu").tolist()
    for i in range(b.budget.calibrate_every - 1):
        b.budget.calibrate(2, 8, budget=4 if i % 2 else 6, seconds=0.5 if i % 2 else 0.9)
    assert costs.tolist() == pytest.approx(table), "rewritten before calibrate_every rounds"
    b.budget.calibrate(2, 8, budget=4, seconds=0.5)
    assert b.budget.round_costs(2, 8, graphed=False) is costs  # the same tensor, rewritten in place
    gap = ((0.5 - table[3]) + (0.9 - table[5])) / 2
    assert costs.tolist() == pytest.approx([t + gap for t in table])


def _syncs_per_round(engine: Engine, spec: SpecConfig, rows: int, rounds: int = 3) -> list[int]:
    batch = engine.open_batch(spec, max_batch=rows, max_len=256)
    batch.budget.calibrate_every = 8
    batch.add_many([Request(str(i), p, 100) for i, p in enumerate(prompts(rows, seed=2))])
    return round_syncs(batch, rounds=rounds, warmup_rounds=3)  # the warm-up rounds capture every graph


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("spec", "syncs"), [
    pytest.param(SpecConfig(budget=8, topk=4, block_size=8), 1, id="b8-k4"),
    pytest.param(SpecConfig(Algorithm.DFLASH, block_size=8), 1, id="dflash"),
    pytest.param(AR, 1, id="ar"),
    # after its first round, budget auto's choice rides along with the tokens
    pytest.param(SpecConfig(budget="auto", max_budget=16, topk=4, block_size=8), 1, id="bauto16-k4"),
])
def test_graphed_round_syncs_only_to_hand_back_tokens(spec: SpecConfig, syncs: int) -> None:
    """At batch 32 a graphed round waits on the device only for the tokens (budget auto: also in the round
    that rewrites its costs from measured rounds, an asynchronous copy)."""
    engine = cuda_engine(True)
    rounds = 8 + 1 if spec.auto_budget else 3  # budget auto: one rewrite of its costs (calibrate_every 8)
    assert _syncs_per_round(engine, spec, rows=32, rounds=rounds) == [syncs] * rounds


def test_trees_wider_than_the_kernel_fall_back_to_sdpa(sdpa_engine: Engine) -> None:
    """A budget past the kernel's 256 verify tokens runs that batch on SDPA (eagerly), still lossless."""
    kernel = with_attention(sdpa_engine, "reference")
    wide = SpecConfig(budget=300, topk=8, block_size=16, draft_window=None)
    assert kernel.open_batch(wide, max_batch=1, max_len=400).attention == "sdpa"
    assert kernel.open_batch(SpecConfig(budget=8, topk=4), max_batch=1, max_len=400).attention == "reference"
    batch = prompts(2, seed=31)
    ref = sdpa_engine.generate(batch, 12, spec=AR)
    out = kernel.generate(batch, 12, spec=wide)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


def test_graphed_auto_budget_measures_exactly_the_sizes_it_chooses_among(sdpa_engine: Engine) -> None:
    engine = with_attention(sdpa_engine, "sdpa")
    assert engine._cost_widths(32) == [2, 3, 5, 9, 17, 33]  # eager: interpolated between these
    engine.cuda_graphs = True  # what a CUDA engine has (the choice itself needs no device)
    assert engine._cost_widths(32) == [b + 1 for b in tree_sizes(32)] == [2, 3, 4, 5, 7, 9, 13, 17, 25, 33]
