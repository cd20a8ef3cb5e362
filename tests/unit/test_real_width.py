"""The real-width bench on CPU: shapes, in-memory random pairs, HBM floors, the profile tables, the engine bench's
floors column. Timings on the CPU mean nothing; the code paths and the arithmetic of the floors do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree.engine import Engine
from ddtree.errors import ConfigError
from ddtree.profiling import real_width
from ddtree.profiling.engine_bench import main as bench_main
from ddtree.profiling.flags import FIXTURE_TARGET
from ddtree.profiling.hbm import copy_bandwidth, floors_ms, step_bytes, tensor_bytes
from ddtree.profiling.kernel_profile import kind_of
from ddtree.profiling.peer import peer_part
from ddtree.profiling.random_models import SHAPES, random_drafter, random_models


def _target_params(name: str) -> int:
    s = SHAPES[name]
    attn = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden + 2 * s.head_dim
    mlp = 3 * s.hidden * s.intermediate
    assert s.vocab is not None
    return s.layers * (attn + mlp + 2 * s.hidden) + s.vocab * s.hidden + s.hidden  # tied head, final norm


def test_the_8b_shape_is_qwen3_8b_with_a_tied_head() -> None:
    s = SHAPES["8b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab) == (
        4096, 36, 32, 8, 128, 12288, 151936)
    assert 7.5e9 < _target_params("8b") < 7.6e9  # 15.1 GB in bfloat16


def test_in_memory_pair_and_its_bytes() -> None:
    target, drafter = random_models("tiny", dtype=torch.float32)
    assert drafter.target is target and drafter.config.num_hidden_layers == SHAPES["tiny"].draft_layers
    one = random_drafter(target, "tiny", draft_layers=1)
    assert one.config.num_hidden_layers == 1 and len(one.config.target_layer_ids) == 1
    with pytest.raises(ConfigError, match="draft_layers"):
        random_drafter(target, "tiny", draft_layers=0)
    engine = Engine(target, drafter)
    b = step_bytes(engine, 2, 100)
    c = target.config
    assert b["target_weights"] == sum(p.numel() * 4 for p in target.parameters())
    assert b["target_kv"] == c.num_hidden_layers * 2 * c.num_key_value_heads * 100 * c.head_dim * 2 * 4
    assert b["drafter_weights"] == tensor_bytes(drafter.parameters()) + target.lm_head_weight.numel() * 4
    f = floors_ms(b, 1e9)
    assert f["weights"] < f["ar"] < f["round"]
    assert f["round"] == pytest.approx(1000 * sum(b.values()) / 1e9)
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2) > 0


def test_kernel_names_group_into_kinds() -> None:
    assert kind_of("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "gemm (cuBLAS)"
    assert kind_of("_fused_linear_kernel") == "triton gemv"
    assert kind_of("_tree_attention_kernel") == "attention"
    assert kind_of("_add_rms_norm_kernel") == "add + rmsnorm (triton)"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise (torch)"
    assert kind_of("something else") == "other"


def test_main_on_the_tiny_shape_writes_forward_rounds_and_profiles(tmp_path: Path) -> None:
    rc = real_width.main(["--shapes", "tiny", "--device", "cpu", "--context", "24", "--batches", "1",
                          "--variants", "fused", "torch ops", "--parts", "forward", "rounds",
                          "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "real_width.json").read_text())
    part = report["shapes"]["tiny"]
    assert "errors" not in part
    assert {(r["q"], r["variant"]) for r in part["forward"]} == {(q, v) for q in (1, 9) for v in ("fused", "torch ops")}
    assert all(r["ms"] > 0 and r["profile"]["kernels"] for r in part["forward"])
    configs = {(r["variant"], r["config"]) for r in part["rounds"]}
    assert ("fused", "ar") in configs and ("torch ops", "b8-k4-w2048-bs8") in configs
    md = (tmp_path / "real_width.md").read_text()
    assert "RANDOM WEIGHTS" in md and "| kind | launches |" in md and "/ AR step" in md


def test_the_peer_times_generate_eager_unless_asked_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers compiles a static cache's forward on CUDA unless told not to, which took the 8b peer past
    its time limit under an "eager" label: the peer passes disable_compile, and compiles only when asked."""
    transformers = pytest.importorskip("transformers")
    calls: list[bool] = []
    real = transformers.Qwen3ForCausalLM.generate

    def spy(self, *args, **kwargs):
        calls.append(kwargs["disable_compile"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "generate", spy)
    out = peer_part("tiny", torch.device("cpu"), torch.float32, context=16, steps=2)
    # a timing of 2 tiny steps on a loaded CPU may even come out below 0: what it says is not checked here
    assert isinstance(out["generate_static_eager_ms"], float) and "generate_static_compiled_ms" not in out
    assert calls and all(calls), "generate ran with its forward left to auto-compile"
    calls.clear()
    out = peer_part("tiny", torch.device("cpu"), torch.float32, context=16, steps=2, compiled=True)
    assert {"generate_static_eager_ms", "generate_static_compiled_ms"} <= set(out)
    assert True in calls and False in calls


def test_a_default_variant_outside_the_variants_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        real_width.main(["--shapes", "tiny", "--device", "cpu", "--variants", "fused", "torch ops",
                         "--default-variant", "fused, skinny gemm"])
    assert "--default-variant 'fused, skinny gemm' is not among --variants" in capsys.readouterr().err


def test_engine_bench_builds_in_memory_and_prints_floors(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = bench_main(["--shape", "tiny", "--in-memory", "--device", "cpu", "--configs", "ar", "b4-k4-w2048-bs8",
                     "--contexts", "24", "--concurrency", "1", "--max-new-tokens", "8", "--repeats", "1",
                     "--floors", "on", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["meta"]["copy_gbps"] > 0 and "RANDOM WEIGHTS" in report["meta"]["shape_label"]
    ar, tree = report["rows"]
    assert 0 < ar["floor_ms"] < tree["floor_ms"]  # a round also reads the drafter and the head again
    assert ar["step_ms"] > 0 and tree["step_ms"] > 0


def test_the_folded_variant_folds_the_targets_norms_and_restores_them(tmp_path: Path) -> None:
    from ddtree.models import load_target

    name = "fused, skinny gemm, norms folded"
    target = load_target(FIXTURE_TARGET, dtype=torch.float32)
    target.fuse_projections()
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(ValueError, match="pass the target"), real_width.variant(name, torch.device("cpu")):
        pass
    with real_width.variant(name, torch.device("cpu"), target):
        assert target.norms_folded
    assert not target.norms_folded
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())
    rc = real_width.main(["--shapes", "tiny", "--device", "cpu", "--context", "24", "--batches", "1",
                          "--variants", "fused", name, "--default-variant", "fused", "--parts", "forward",
                          "--out-dir", str(tmp_path)])
    assert rc == 0
    part = json.loads((tmp_path / "real_width.json").read_text())["shapes"]["tiny"]
    assert "errors" not in part and {r["variant"] for r in part["forward"]} == {"fused", name}
