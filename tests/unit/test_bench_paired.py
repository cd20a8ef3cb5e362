"""ddtree.profiling.paired: in-round ratios, the lossless check, argument errors before loading, a CPU run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ddtree.engine import POOLED_BATCHES, GenerationResult
from ddtree.profiling import paired
from ddtree.profiling.flags import parse_configs


class _ScriptedEngine:
    """generate() returns fixed outputs and accept lengths per config; the clock advances by a scripted wall."""

    device = torch.device("cpu")

    def __init__(self, walls: dict[str, list[float]], outputs: dict[str, list[int]], accepts: dict[str, list[int]],
                 clock: list[float], budgets: dict[str, list[int]] | None = None) -> None:
        self.walls, self.outputs, self.accepts, self.clock = walls, outputs, accepts, clock
        self.budgets = budgets or {}
        self.calls: dict[str, int] = {}

    def generate(self, prompts, max_new_tokens, spec, ignore_eos):
        n = self.calls.get(spec.id, 0)
        self.calls[spec.id] = n + 1
        if n > 0:  # the first call per config is the untimed warm-up
            self.clock[0] += self.walls[spec.id][n - 1]
        return [GenerationResult(list(self.outputs[spec.id]), len(p), "length", 1, list(self.accepts[spec.id]), {},
                                 budgets=list(self.budgets.get(spec.id, [])))
                for p in prompts]


def test_ratios_are_taken_within_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = parse_configs(["b4-k4-w2048-bs8"])  # AR is put first
    clock = [0.0]
    monkeypatch.setattr(paired.time, "perf_counter", lambda: clock[0])
    # AR slows down in round 2; DDTree with it: the in-round speed-up stays 1.5
    engine = _ScriptedEngine(
        walls={"ar": [1.0, 2.0, 1.0], "b4-k4-w2048-bs8": [2 / 3, 4 / 3, 2 / 3]},
        outputs={"ar": [5, 6, 7, 8], "b4-k4-w2048-bs8": [5, 6, 7, 8]},
        accepts={"ar": [], "b4-k4-w2048-bs8": [2, 3, 2, 3]}, clock=clock)
    rows = paired.run_pairs(engine, [[1, 2, 3]], specs, max_new_tokens=4, pairs=3)  # type: ignore[arg-type]
    ar, tree = rows
    assert ar["config"] == "ar" and ar["tok_per_s"] == {"median": 4.0, "min": 2.0, "max": 4.0}
    assert tree["tau"] == pytest.approx(2.5)
    assert tree["speedup"]["min"] == pytest.approx(1.5) and tree["speedup"]["max"] == pytest.approx(1.5)
    assert tree["efficiency"]["median"] == pytest.approx(1.5 / 2.5)
    assert tree["lossless"] and tree["tok_per_s_rounds"] == pytest.approx([6.0, 3.0, 6.0])


def test_each_round_starts_one_config_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that slows the device for the next one does not always precede the same one."""
    specs = parse_configs(["dflash-w2048-bs8", "b4-k4-w2048-bs8"])
    engine = _ScriptedEngine(walls={s.id: [1.0] * 3 for s in specs}, outputs={s.id: [5] for s in specs},
                             accepts={s.id: [1] for s in specs}, clock=[0.0])
    order: list[str] = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, n, spec, ignore_eos: order.append(spec.id) or
                        generate(prompts, n, spec=spec, ignore_eos=ignore_eos))
    paired.run_pairs(engine, [[1]], specs, max_new_tokens=1, pairs=3)  # type: ignore[arg-type]
    ids = [s.id for s in specs]
    assert order == ids + ids + ids[1:] + ids[:1] + ids[2:] + ids[:2]  # warm-up, then rounds 0, 1, 2


def test_rows_count_the_tree_sizes_each_config_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budget auto's sizes vary by round: the row has their mean and histogram (AR verifies no tree)."""
    specs = parse_configs(["bauto-k4-w2048-bs8"])
    clock = [0.0]
    monkeypatch.setattr(paired.time, "perf_counter", lambda: clock[0])
    engine = _ScriptedEngine(walls={"ar": [1.0, 1.0], "bauto-k4-w2048-bs8": [0.5, 0.5]},
                             outputs={"ar": [5, 6, 7], "bauto-k4-w2048-bs8": [5, 6, 7]},
                             accepts={"ar": [], "bauto-k4-w2048-bs8": [2, 1]}, clock=clock,
                             budgets={"bauto-k4-w2048-bs8": [4, 12]})
    ar, auto = paired.run_pairs(engine, [[1, 2]], specs, max_new_tokens=3, pairs=2)  # type: ignore[arg-type]
    assert ar["tree_size"] is None and ar["tree_sizes"] == {}
    assert auto["tree_size"] == pytest.approx(8.0) and auto["tree_sizes"] == {4: 2, 12: 2}
    table = paired.format_rows([ar, auto]).splitlines()
    assert table[0].split()[6] == "size" and table[1].split()[5] == "-" and table[2].split()[5] == "8.0"


def test_a_different_output_is_not_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = parse_configs(["dflash-w2048-bs8"])
    clock = [0.0]
    monkeypatch.setattr(paired.time, "perf_counter", lambda: clock[0])
    engine = _ScriptedEngine(walls={"ar": [1.0], "dflash-w2048-bs8": [1.0]},
                             outputs={"ar": [5, 6], "dflash-w2048-bs8": [5, 9]},
                             accepts={"ar": [], "dflash-w2048-bs8": [2]}, clock=clock)
    rows = paired.run_pairs(engine, [[1], [2]], specs, max_new_tokens=2, pairs=1)  # type: ignore[arg-type]
    assert not rows[1]["lossless"] and rows[1]["mismatched_prompts"] == [0, 1]


@pytest.mark.parametrize(("args", "message"), [
    (["--pairs", "0"], r"--pairs: 0 is out of range \(allowed >= 1\)"),
    (["--context", "-5"], r"--context: -5 is out of range"),
    (["--configs", "b4-k9"], r"unknown config id"),
    (["--configs", *[f"b{b}-k4-w2048-bs8" for b in range(1, POOLED_BATCHES + 1)]],
     rf"out of range \(allowed 1..{POOLED_BATCHES}"),
])
def test_bad_arguments_fail_before_loading(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(paired.Engine, "from_pretrained", no_load)
    assert paired.main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m ddtree.profiling.paired: error:") and re.search(message, err), err


def test_cpu_run_on_the_fixture_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "paired.json"
    code = paired.main(["--device", "cpu", "--context", "60", "--pairs", "2", "--max-new-tokens", "8",
                        "--configs", "ar", "b4-k4-w2048-bs8", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "[round 2/2]" in text and "b4-k4-w2048-bs8" in text
    report = json.loads(out.read_text())
    assert report["meta"]["pairs"] == 2 and report["meta"]["command"].startswith("python -m ddtree.profiling.paired")
    ar, tree = report["rows"]
    assert ar["config"] == "ar" and tree["lossless"] and len(tree["tok_per_s_rounds"]) == 2
    assert tree["tau"] >= 1.0
    assert tree["efficiency"]["median"] == pytest.approx(tree["speedup"]["median"] / tree["tau"], rel=1e-9)
