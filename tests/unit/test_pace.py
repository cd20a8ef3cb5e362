"""The pace probe (ddtree.bench.pace) and the suite's readings of it (ddtree.suite.pace)."""

from __future__ import annotations

import ast
import json
import math
import os
import sys
from pathlib import Path

import pytest

from ddtree.bench import pace
from ddtree.suite.pace import PaceLog, PaceProbe, PaceUnavailable, cell_pace, local_argv, standalone_argv

CPU_COMPONENTS = {"interpreter", "dispatch", "gemm", "pipeline", "pipeline_loaded"}


def test_the_probe_uses_torch_and_the_standard_library_only() -> None:
    """A probe built from ddtree's own code would slow down with a slower engine and hide it."""
    tree = ast.parse(Path(pace.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" in imported
    assert imported - {"torch", "__future__"} <= set(sys.stdlib_module_names), imported


@pytest.mark.parametrize(("factor", "expected"), [pytest.param(1.0, 1.0, id="reference"),
                                                  pytest.param(2.0, 0.5, id="twice-as-slow"),
                                                  pytest.param(0.5, 2.0, id="twice-as-fast")])
def test_the_score_is_the_weighted_geometric_mean_of_reference_over_measured(factor: float, expected: float) -> None:
    components = {name: ms * factor for name, ms in pace.REFERENCE_MS["cpu"].items()}
    assert pace.score_of("cpu", components) == pytest.approx(expected)
    slow_pipeline = dict(pace.REFERENCE_MS["cpu"], pipeline=pace.REFERENCE_MS["cpu"]["pipeline"] * 4)
    assert pace.score_of("cpu", slow_pipeline) == pytest.approx(4 ** -0.7)  # the pipeline weighs 0.7
    slow_python = dict(pace.REFERENCE_MS["cpu"], interpreter=pace.REFERENCE_MS["cpu"]["interpreter"] * 4)
    assert pace.score_of("cpu", slow_python) == pytest.approx(4 ** -0.1)  # a hog-like part 0.1
    loaded = dict(pace.REFERENCE_MS["cpu"], pipeline_loaded=pace.REFERENCE_MS["cpu"]["pipeline_loaded"] * 4)
    assert pace.score_of("cpu", loaded) == pytest.approx(1.0)  # one request's score ignores the loaded pipeline
    assert pace.score_of("cpu", loaded, loaded=True) == pytest.approx(4 ** -0.7)  # and the loaded score the plain one
    slow_gemm = dict(pace.REFERENCE_MS["cuda"], gemm=pace.REFERENCE_MS["cuda"]["gemm"] * 16)
    assert pace.score_of("cuda", slow_gemm) == pytest.approx(0.5)  # a quarter on CUDA: 16^(1/4) = 2


def test_a_reading_times_every_component_and_the_pipeline_hops_die_with_the_probe() -> None:
    probe = pace.Probe("cpu")
    try:
        reading = probe.measure()
        pids = list(probe.pipeline.pids)  # type: ignore[union-attr]
    finally:
        probe.close()
    assert reading["probe"] == "cpu-v4" and set(reading["components_ms"]) == CPU_COMPONENTS
    assert all(ms > 0 for ms in reading["components_ms"].values()) and reading["score"] > 0
    assert reading["score_loaded"] > 0
    assert reading["seconds"] < 10
    for pid in pids:  # reaped by close(): no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("argv", [pytest.param(local_argv, id="module"),
                                  pytest.param(lambda device: standalone_argv(device, sys.executable), id="standalone")])
def test_the_serving_probe_answers_readings_and_quits(argv, tmp_path: Path) -> None:
    log = PaceLog(tmp_path / "pace" / "main.json", "this machine", lambda: PaceProbe(argv("cpu"), "this machine"))
    first, second = log.read("cell before repeat 1"), log.read("end")
    process = log.probe.process  # type: ignore[union-attr]
    log.close()
    assert process.poll() is not None  # gone after close
    assert first is not None and second is not None and first["label"] == "cell before repeat 1"
    record = json.loads((tmp_path / "pace" / "main.json").read_text())
    assert [r["label"] for r in record["readings"]] == ["cell before repeat 1", "end"]
    assert record["unavailable"] is None and record["readings"][0]["where"] == "this machine"


def test_a_probe_that_cannot_start_is_recorded_once_and_readings_stop(tmp_path: Path) -> None:
    starts = []

    def start() -> PaceProbe:
        starts.append(1)
        return PaceProbe([sys.executable, "-c", "import sys; sys.stderr.write('no torch here'); sys.exit(3)"], "gpu1")

    log = PaceLog(tmp_path / "pace.json", "gpu1 (over ssh)", start)
    assert log.read("a") is None and log.read("b") is None
    assert len(starts) == 1
    assert log.unavailable is not None and "exited with 3" in log.unavailable and "no torch here" in log.unavailable
    assert json.loads((tmp_path / "pace.json").read_text())["unavailable"] == log.unavailable


def test_a_missing_program_is_a_clear_error() -> None:
    with pytest.raises(PaceUnavailable, match="pace probe on here did not start"):
        PaceProbe(["/nonexistent/python3"], "here")


def test_each_repeat_takes_the_geometric_mean_of_the_readings_either_side() -> None:
    readings = [{"probe": "cpu-v1", "score": s, "score_loaded": 2 * s, "where": "this machine"} for s in (1.0, 0.25, 0.5)]
    record = cell_pace(readings)
    assert record is not None
    assert record["per_repeat"] == [0.5, pytest.approx(math.sqrt(0.125), abs=1e-4)]
    assert record["score"] == pytest.approx(0.5, abs=1e-4) and record["probe"] == "cpu-v1"
    loaded = cell_pace(readings, loaded=True)  # a cell with several requests in flight
    assert loaded is not None and loaded["score_key"] == "score_loaded" and loaded["per_repeat"][0] == 1.0
    assert cell_pace([readings[0], None]) is None and cell_pace(readings[:1]) is None


def test_the_command_line_rejects_a_bad_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pace.main(["--device", "tpu"])
    assert "--device: 'tpu' is not valid; expected cpu, cuda or cuda:N" in capsys.readouterr().err
