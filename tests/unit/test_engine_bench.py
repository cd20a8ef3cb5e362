"""The engine benchmark (python -m ddtree.profiling.engine_bench), its random-weight pairs and the nightly GPU workflow, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ddtree.config import SpecConfig
from ddtree.engine import Engine
from ddtree.errors import ConfigError
from ddtree.models import load_drafter, load_target
from ddtree.profiling import engine_bench
from ddtree.profiling.engine_bench import Cell, cell_prompts, main
from ddtree.profiling.flags import parse_configs
from ddtree.profiling.random_models import MARKER, build_random_pair, fixture_vocab, parameter_count

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "nightly-gpu.yml"


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny random pair under tiny/ (as --random-model-dir lays it out)."""
    root = tmp_path_factory.mktemp("random-models")
    build_random_pair(root / "tiny", "tiny")
    return root


def bench_args(random_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--shape", "tiny", "--random-model-dir", str(random_dir), "--configs", "ar", "b4-k4-w2048-bs8",
            "--concurrency", "2", "--max-new-tokens", "8", "--repeats", "1", "--warmup-tokens", "4",
            "--device", "cpu", "--out", str(out), *extra]


def test_main_writes_rows_meta_and_skips_a_cell_beyond_the_context(random_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    # the tiny target's context is 512: 500 + 16 new tokens does not fit and is skipped with its reason
    rc = main(bench_args(random_dir, out, "--contexts", "40", "500", "--max-new-tokens", "16", "--markdown", str(md)))
    assert rc == 0
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["torch"] == torch.__version__ and meta["device_name"].startswith("cpu")
    assert meta["shape"] == "tiny" and "RANDOM WEIGHTS" in meta["shape_label"]
    assert meta["date"] and meta["command"].startswith("python -m ddtree.profiling.engine_bench --shape tiny")
    rows = report["rows"]
    assert [r["config"] for r in rows] == ["ar", "b4-k4-w2048-bs8"]
    for row in rows:
        assert (row["context"], row["concurrency"]) == (40, 2)
        assert row["tokens"] == 2 * 16 and row["tok_per_s"] > 0 and row["lossless"] is True
        assert row["tau"] >= 1.0 and row["efficiency"] == pytest.approx(row["speedup"] / row["tau"])
        assert sum(row["share"].values()) == pytest.approx(1.0)
    ar, tree = rows
    assert ar["speedup"] == pytest.approx(1.0) and ar["mean_budget"] is None
    assert tree["mean_budget"] == pytest.approx(4.0)
    assert tree["speedup"] == pytest.approx(tree["tok_per_s"] / ar["tok_per_s"])
    assert report["skipped"] == [{"context": 500, "concurrency": 2,
                                  "reason": "context 500 + max_new_tokens 16 = 516 exceeds the model's context length (512)"}]
    text = capsys.readouterr().out
    assert "skip context 500 x 2" in text and "b4-k4-w2048-bs8" in text
    markdown = md.read_text()
    assert "#### context 40, concurrency 2" in markdown and "| b4-k4-w2048-bs8 |" in markdown
    assert "Skipped: context 500 x 2" in markdown


def test_an_auto_row_keeps_the_cost_table_it_chose_from(random_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = bench_args(random_dir, out, "--contexts", "40")
    args[args.index("b4-k4-w2048-bs8")] = "bauto8-k4-w2048-bs8"
    assert main(args) == 0
    ar, auto = json.loads(out.read_text())["rows"]
    assert ar["cost_model"] is None
    table = auto["cost_model"]
    assert table["rows"] and table["nodes"][-1] == 9 and len(table["verify_s"]) == len(table["rows"])
    assert 1 <= auto["mean_budget"] <= 8 and auto["lossless"] is True


def test_an_output_that_differs_from_ar_fails_the_run(random_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = Engine.generate

    def corrupt_tree_outputs(self, prompts, max_new_tokens, spec=None, **kwargs):
        results = real(self, prompts, max_new_tokens, spec=spec, **kwargs)
        if spec is not None and spec.speculative:
            results[1].token_ids[-1] += 1  # prompt 1's last token no longer matches AR's
        return results

    monkeypatch.setattr(Engine, "generate", corrupt_tree_outputs)
    out = tmp_path / "bench.json"
    assert main(bench_args(random_dir, out, "--contexts", "24")) == 1
    tree = json.loads(out.read_text())["rows"][1]
    assert tree["lossless"] is False and tree["mismatched_prompts"] == [1]


def test_bad_config_ids_fail_before_any_model_is_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"\['b8-k4', 'zzz'\]"):
        parse_configs(["b8-k4", "ar", "zzz"])
    missing = tmp_path / "no-such-model"
    rc = main(["--target", str(missing), "--drafter", str(missing), "--configs", "ar", "b8-k4", "zzz"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--configs" in err and "'b8-k4'" in err and "'zzz'" in err
    assert main(["--target", str(missing), "--concurrency", "0"]) == 2
    assert "--concurrency: 0 is out of range" in capsys.readouterr().err
    assert main(["--target", str(tmp_path), "--configs", "ar"]) == 2  # a folder without tokenizer or card
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_parse_configs_puts_ar_first_once() -> None:
    ids = [s.id for s in parse_configs(["b8-k4-w2048-bs8", "ar", "bauto-k4-w2048-bs8", "b8-k4-w2048-bs8"])]
    assert ids == ["ar", "b8-k4-w2048-bs8", "bauto-k4-w2048-bs8"]
    assert [s.id for s in parse_configs(engine_bench.DEFAULT_CONFIGS)] == engine_bench.DEFAULT_CONFIGS


def test_cell_prompts_tile_the_heldout_files_to_the_concurrency(random_dir: Path) -> None:
    target = random_dir / "tiny" / "target"
    prompts = cell_prompts(target, Cell(context=1500, concurrency=45))  # more prompts than held-out files
    assert len(prompts) == 45 and all(len(p) == 1500 for p in prompts)
    distinct = {tuple(p) for p in prompts}
    assert 1 < len(distinct) < 45
    assert cell_prompts(target, Cell(context=10**7, concurrency=2)) == []  # no file is that long


def test_random_pair_is_a_loadable_folder_built_once(random_dir: Path) -> None:
    folder = random_dir / "tiny"
    target = load_target(folder / "target")
    drafter = load_drafter(folder / "drafter", target)
    assert target.config.vocab_size == fixture_vocab() and drafter.config.hidden_size == target.config.hidden_size
    assert parameter_count(folder) == sum(p.numel() for p in target.parameters())
    for sub in ("target", "drafter"):
        assert (folder / sub / "tokenizer.json").is_file()
        assert "RANDOM WEIGHTS" in (folder / sub / "README.md").read_text()
    stamp = (folder / MARKER).stat().st_mtime_ns
    build_random_pair(folder, "tiny")  # complete: reused, not rebuilt
    assert (folder / MARKER).stat().st_mtime_ns == stamp
    engine = Engine(target, drafter)
    prompt = list(range(5, 25))
    ar = engine.generate(prompt, 6, spec=SpecConfig.from_id("ar"))
    tree = engine.generate(prompt, 6, spec=SpecConfig.from_id("b8-k4-w2048-bs8"))
    assert tree.token_ids == ar.token_ids and len(ar.token_ids) == 6
    with pytest.raises(ConfigError, match="shape: 'huge'"):
        build_random_pair(folder, "huge")


def test_nightly_workflow_parses_and_runs_the_three_commands() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert triggers["schedule"][0]["cron"]
    job = workflow["jobs"]["gpu"]
    assert job["runs-on"] == ["self-hosted", "gpu"]
    steps = job["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "pip install -c constraints/gpu.txt -e '.[test,gpu]'" in runs  # pinned as CPU CI, less torch and triton
    assert "pytest tests/kernels" in runs
    assert 'pytest -m "perf or quality" --config-grid full --device cuda --results-dir results/nightly' in runs
    assert "--floors h200-fixture" in runs and (REPO / "fixtures/floors/h200-fixture.yaml").is_file()
    assert "pytest tests/unit/test_engine_paths.py" in runs  # the GPU engine paths (graphs, syncs)
    assert ("python -m ddtree.profiling.engine_bench --device cuda --out results/nightly/engine_bench.json "
            "--markdown results/nightly/engine_bench.md") in runs
    assert "python -m ddtree.kernels.bench --out results/nightly/kernel_bench.json" in runs
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["path"] == "results/nightly"
