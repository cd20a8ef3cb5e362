"""The suite's pytest plugin, driven whole through pytester against the model-free fake service.

Each case runs an inner pytest in a subprocess (signals, services and global state are involved)
in a temporary directory holding a copy of the real root conftest, the real perf sweep test and
a small grid file, then checks the exit code and the output lines.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddtree.suite.session import OPT_IN_NOTE, SUMMARY_TITLE
from tests.unit.suite_copy import copy_suite

REPO = Path(__file__).resolve().parents[2]
FAKE = ["-p", "no:cacheprovider", "--service", "fake", "--device", "cpu", "--startup-timeout", "30"]

GRID = {
    "default": {"budget": 8, "topk": 4, "draft_window": 2048, "block_size": 8},
    "configs": [{"budget": 4}, {"algorithm": "NONE"}],
    "client": {"contexts": [8], "concurrency": [1, 2], "max_new_tokens": 4,
               "requests_per_cell": 2, "repeats": 1, "warmup_requests": 0},
}


@pytest.fixture
def suite_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A directory with the real root conftest, the real sweep test and grid.yaml."""
    copy_suite(pytester, monkeypatch)
    write_grid(pytester, GRID)
    return pytester


def write_grid(pytester: pytest.Pytester, data: object, name: str = "grid.yaml") -> Path:
    path = pytester.path / name
    path.write_text(yaml.safe_dump(data))
    return path


def run(pytester: pytest.Pytester, *args: str, timeout: float = 90) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*FAKE, "--config-grid", "grid.yaml", "--results-dir", "results",
                                         *args, timeout=timeout)


def test_each_config_is_deployed_once_and_the_default_restored(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir, "-m", "perf")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([
        f"*{SUMMARY_TITLE}*",
        "deploys: 2 (ar, b4-k4-w2048-bs8)",
        "restore: default b8-k4-w2048-bs8 restored and verified (settings*ok*init log line of this start: ok*",
    ])
    cells = sorted(p.name for p in (suite_dir.path / "results" / "cells").iterdir())
    assert cells == ["ar__ctx8__c1.json", "ar__ctx8__c2.json", "b4-k4-w2048-bs8__ctx8__c1.json",
                     "b4-k4-w2048-bs8__ctx8__c2.json"]
    restore = json.loads((suite_dir.path / "results" / "restore.json").read_text())
    assert restore["ok"] is True and restore["config_id"] == "b8-k4-w2048-bs8"
    assert (restore["deploys"], restore["deploy_order"]) == (2, ["ar", "b4-k4-w2048-bs8"])
    assert "Restore: default b8-k4-w2048-bs8 **verified**" in (suite_dir.path / "results/sweep_summary.md").read_text()
    plots = sorted(p.name for p in (suite_dir.path / "results" / "plots").iterdir())
    assert plots == ["budget_ctx8.png", "latency_ctx8.png"]
    assert all((suite_dir.path / "results" / "plots" / p).stat().st_size > 1000 for p in plots)


def test_collect_only_lists_cell_ids_grouped_by_config(suite_dir: pytest.Pytester) -> None:
    write_grid(suite_dir, {**GRID, "configs": [{"budget": 4}, {}, {"algorithm": "NONE"}],
                           "client": {**GRID["client"], "contexts": [60, 8]}})
    result = run(suite_dir, "-m", "perf", "--collect-only")
    ids = re.findall(r"test_sweep\[([^\]]+)\]", result.stdout.str())
    assert ids == [
        "ar-ctx8-c1", "ar-ctx8-c2", "ar-ctx60-c1", "ar-ctx60-c2",
        "b8-k4-w2048-bs8-ctx8-c1", "b8-k4-w2048-bs8-ctx8-c2", "b8-k4-w2048-bs8-ctx60-c1", "b8-k4-w2048-bs8-ctx60-c2",
        "b4-k4-w2048-bs8-ctx8-c1", "b4-k4-w2048-bs8-ctx8-c2", "b4-k4-w2048-bs8-ctx60-c1", "b4-k4-w2048-bs8-ctx60-c2",
    ]
    result.stdout.fnmatch_lines(["ddtree grid: grid (*grid.yaml): 3 configs, 12 cells, 0 removed*",
                                 "ddtree service: fake; device: cpu*", "ddtree results: *results; floors: cpu-fixture*"])


def test_impossible_cells_are_removed_at_collection_with_the_reason(suite_dir: pytest.Pytester) -> None:
    write_grid(suite_dir, {**GRID, "client": {**GRID["client"], "contexts": [8, 60]}})
    result = run(suite_dir, "-m", "perf", "--collect-only", "-q", "--max-context", "32")
    assert not [line for line in result.stdout.lines if "ctx60" in line and "test_sweep[" in line]
    result.stdout.fnmatch_lines([
        "removed impossible cell ar-ctx60-c1: context 60 + max_new_tokens 4 = 64 exceeds the model's context 32",
    ])


def test_bare_run_deselects_perf_and_says_so(suite_dir: pytest.Pytester) -> None:
    suite_dir.makepyfile(test_plain="def test_plain():\n    assert 1 + 1 == 2\n")
    result = suite_dir.runpytest_subprocess(*FAKE, "--results-dir", "results")
    result.assert_outcomes(passed=1, deselected=16)  # the smoke grid's 16 cells
    result.stdout.fnmatch_lines([f"*{SUMMARY_TITLE}*", f"{OPT_IN_NOTE.format(n=16)}"])
    assert "deploying" not in result.stdout.str()
    # naming the perf folder opts in (and -m perf does, see the other tests)
    named = suite_dir.runpytest_subprocess(*FAKE, "--results-dir", "results", "tests/perf", "--collect-only", "-q")
    named.stdout.fnmatch_lines(["16 tests collected*"])


def test_require_floors_fails_cells_without_one_and_the_summary_lists_them(suite_dir: pytest.Pytester) -> None:
    floors = suite_dir.path / "floors.yaml"
    floors.write_text(yaml.safe_dump({"floors": {"ar": {"ctx8-c1": {"output_throughput": 0.001}}}}))
    result = run(suite_dir, "-m", "perf", "--floors", str(floors), "--require-floors")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines([
        "*ar-ctx8-c2: no floor in floors (*floors.yaml) and --require-floors is set; record one with --update-floors",
        "no floor in floors for 3 cells (failed: --require-floors): ar-ctx8-c2, b4-k4-w2048-bs8-ctx8-c1, "
        "b4-k4-w2048-bs8-ctx8-c2",
    ])
    summary = (suite_dir.path / "results" / "sweep_summary.md").read_text()
    assert "- No floor (3 cells, failed (--require-floors)): ar-ctx8-c2, b4-k4-w2048-bs8-ctx8-c1" in summary
    assert "## Pace and verdicts" in summary and "- Pace (cpu-v4, measured on this machine): median" in summary
    cell = json.loads((suite_dir.path / "results" / "cells" / "b4-k4-w2048-bs8__ctx8__c1.json").read_text())
    assert cell["pace"]["probe"] == "cpu-v4" and len(cell["pace"]["readings"]) == 2  # before and after its 1 repeat
    assert cell["metrics"]["speedup_vs_ar"] > 0 and cell["metrics"]["pace_normalized_throughput"] > 0
    without = run(suite_dir, "-m", "perf", "--floors", str(floors))
    without.assert_outcomes(passed=4)
    without.stdout.fnmatch_lines(["no floor in floors for 3 cells (passed without a floor check): *"])


def test_a_failing_cell_still_restores_and_verifies_the_default(suite_dir: pytest.Pytester) -> None:
    floors = suite_dir.path / "floors.yaml"
    floors.write_text(yaml.safe_dump({"tolerance": 0.1, "floors": {"b4-k4-w2048-bs8": {"ctx8-c1": {
        "output_throughput": 1e12}}}}))
    result = run(suite_dir, "-m", "perf", "--floors", str(floors))
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "E * tok/s < floor 1000000000000.0 x (1-0.1) (absolute), b4-k4-w2048-bs8 @ ctx8 c1",
        "restore: default b8-k4-w2048-bs8 restored and verified*",
        "no floor in floors for 3 cells*",
    ])


def test_a_slow_starting_service_is_waited_for(suite_dir: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_FAKE_LOAD_S", "1.5")  # connections refused while "loading"
    monkeypatch.setenv("DDTREE_FAKE_WARMUP_S", "0.5")  # then 503 from /health_generate
    result = run(suite_dir, "-m", "perf", "-k", "ar-ctx8-c1")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["restore: default b8-k4-w2048-bs8 restored and verified*"])


def test_a_dying_service_is_reported_at_once_with_its_log_tail(suite_dir: pytest.Pytester,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_FAKE_LOAD_S", "5")
    monkeypatch.setenv("DDTREE_FAKE_CRASH_AFTER_S", "0.3")
    started = time.monotonic()
    result = run(suite_dir, "-m", "perf", "-k", "ar-ctx8-c1", "--startup-timeout", "120")
    elapsed = time.monotonic() - started
    result.assert_outcomes(errors=2, deselected=3)  # the cell's setup (one attempt), then the restore at teardown
    result.stdout.fnmatch_lines(["*ERROR at setup of test_sweep[[]ar-ctx8-c1[]]*",
                                 "*ServiceStartError: ar: start failed (1 attempt; not started again): fake service "
                                 "* died while starting*", "*simulated crash*",
                                 "*ERROR at teardown of test_sweep[[]ar-ctx8-c1[]]*", "restore: default b8-k4-w2048-bs8 NOT restored:*"])
    assert elapsed < 30, f"a dead service took {elapsed:.1f} s to report (startup timeout was 120 s)"


KILL_MID_SWEEP = '''
import os
import signal
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.name == "test_sweep[ar-ctx8-c1]":  # the service dies under this cell, after its deploy
        pid = item.funcargs["deployed"].backend.pid
        os.kill(pid, signal.SIGKILL)
        while item.funcargs["deployed"].backend.is_alive()[0]:
            time.sleep(0.05)
    return (yield)
'''


def test_killing_the_service_mid_sweep_fails_those_cells_and_restores_the_default(
        suite_dir: pytest.Pytester) -> None:
    (suite_dir.path / "tests/perf/conftest.py").write_text(KILL_MID_SWEEP)
    result = run(suite_dir, "-m", "perf")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([  # in output order: the redeploy is logged live, failures at the end
        "*service running ar is down*redeploying once*",
        "E   *ServiceDied: service died during ar-ctx8-c1 (pid * killed by SIGKILL)",
        "E *--- service log tail ---",
        "E *Initialized AR worker.",
        "deploys: 3 (ar, ar, b4-k4-w2048-bs8)",
        "restore: default b8-k4-w2048-bs8 restored and verified*",
    ])
    cells = sorted(p.name for p in (suite_dir.path / "results" / "cells").iterdir())
    assert "ar__ctx8__c1.json" not in cells and len(cells) == 3  # a failed cell is an error, not a number


def test_a_failing_start_costs_one_attempt_per_config_or_two_with_a_retry(suite_dir: pytest.Pytester,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_FAKE_START_ERROR",
                       "--speculative-ddtree-budget 4::ModuleNotFoundError: No module named 'flash_attn'")
    for retries, attempts in (("1", 2), (None, 1)):  # the default: no retry
        extra = ["--start-retries", retries] if retries else []
        result = run(suite_dir, "-m", "perf", *extra, "--results-dir", f"results{retries}")
        result.assert_outcomes(passed=2, errors=2)  # both b4 cells error; ar's two pass
        result.stdout.fnmatch_lines([
            f"E   *ServiceStartError: b4-k4-w2048-bs8: start failed ({attempts} attempt*; not started again): "
            f"fake service * died while starting (pid * exited with code 1)*",
            "E *--- service log tail ---", "*ModuleNotFoundError: No module named 'flash_attn'",
            f"deploys: {1 + attempts} (ar, b4-k4-w2048-bs8*)",
            "restore: default b8-k4-w2048-bs8 restored and verified*"])
        logs = "".join(p.read_text() for p in (suite_dir.path / f"results{retries}/service-logs").iterdir())
        assert logs.count("=== ddtree service start b4-k4-w2048-bs8") == attempts, logs


def test_client_processes_share_a_cells_load_and_are_recorded(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir, "-m", "perf", "-k", "ar", "--client-processes", "2")
    result.assert_outcomes(passed=2)
    for cell in (suite_dir.path / "results" / "cells").iterdir():
        data = json.loads(cell.read_text())
        assert data["client"]["client_processes"] == 2
        assert data["metrics"]["completed"] > 0 and data["metrics"]["failed"] == 0


def test_the_same_start_error_on_two_configs_in_a_row_aborts_the_sweep_and_still_restores(
        suite_dir: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_FAKE_START_ERROR", "--speculative-algorithm DDTREE::ImportError: libcuda.so.1: "
                                                  "cannot open shared object file")
    write_grid(suite_dir, {**GRID, "configs": [{"algorithm": "NONE"}, {"budget": 4}, {"budget": 16}, {"budget": 32}]})
    result = run(suite_dir, "-m", "perf")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(passed=2, errors=4)  # ar x2; b4 x2 (one start); b16's first, which aborts; the restore
    result.stdout.fnmatch_lines([
        "E   *SweepAborted: sweep aborted: b4-k4-w2048-bs8 and b16-k4-w2048-bs8 failed to start in a row with the "
        "same error (fake service * died while starting*); no other config is started",
        "E *--- service log tail ---", "E *ImportError: libcuda.so.1: cannot open shared object file",
        "deploys: 3 (ar, b4-k4-w2048-bs8, b16-k4-w2048-bs8)",
        "restore: default b8-k4-w2048-bs8 NOT restored: *died while starting*",
        "*Interrupted: sweep aborted: b4-k4-w2048-bs8 and b16-k4-w2048-bs8 failed to start in a row*"])
    assert "b32" not in "".join(p.read_text() for p in (suite_dir.path / "results/service-logs").iterdir())
    restore = json.loads((suite_dir.path / "results" / "restore.json").read_text())
    assert restore["ok"] is False and "libcuda.so.1" in restore["error"]


INTERRUPTIBLE = '''
import time
import pytest

pytestmark = pytest.mark.perf

def test_hangs(cell, deployed):
    time.sleep(120)
'''


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="ctrl-c"), pytest.param(signal.SIGTERM, id="sigterm")])
def test_ctrl_c_restores_and_verifies_the_default(suite_dir: pytest.Pytester, signum: int) -> None:
    (suite_dir.path / "tests/perf/test_sweep.py").unlink()
    suite_dir.makepyfile(test_hang=INTERRUPTIBLE)
    write_grid(suite_dir, {**GRID, "configs": [{"algorithm": "NONE"}]})
    cmd = [sys.executable, "-m", "pytest", *FAKE, "--config-grid", "grid.yaml", "--results-dir", "results",
           "-m", "perf", "test_hang.py", "-s"]
    proc = subprocess.Popen(cmd, cwd=suite_dir.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:  # wait until the non-default config is deployed
            line = proc.stdout.readline()
            lines.append(line)
            if "ar ready and verified" in line:
                break
        else:
            pytest.fail("the inner run never deployed ar:\n" + "".join(lines))
        time.sleep(0.5)
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output
    assert "restore: default b8-k4-w2048-bs8 restored and verified" in output, output
    assert "init log line of this start: ok [Initialized DDTree worker. block_size=8, tree_budget=8" in output
    restore = json.loads((suite_dir.path / "results" / "restore.json").read_text())
    assert restore["ok"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "ERROR: --repeats: '0' is not valid; expected an integer >= 1"),
        (["--client-processes", "0"], "ERROR: --client-processes: '0' is not valid; expected an integer >= 1"),
        (["--service", "docker"], "ERROR: --service: 'docker' is not valid; expected one of local, sglang, systemd, url, fake"),
        (["--floor-tolerance", "2"], "ERROR: --floor-tolerance: '2' is not valid; expected a fraction in [[]0, 1)*"),
        (["--startup-timeout", "soon"], "ERROR: --startup-timeout: 'soon' is not valid; expected a number of seconds > 0"),
        (["--service", "url"], "ERROR: --service url needs --service-url http://HOST:PORT"),
        (["--config-grid", "nope"], "ERROR: --config-grid: config grid 'nope': no file *; known grids: *"),
        (["--floors", "h200-fixture"], "ERROR: --floors: floors h200-fixture were measured on cuda (probe cuda-v*), "
                                       "this run is on cpu (--device cpu); pass --floors cpu-fixture or a floors file*"),
    ],
    ids=["repeats", "client-processes", "service", "tolerance", "startup-timeout", "url-without-url", "grid-name",
         "floors-of-another-device-kind"],
)
def test_bad_option_values_are_usage_errors(suite_dir: pytest.Pytester, args: list[str], message: str) -> None:
    result = suite_dir.runpytest_subprocess(*FAKE, "--collect-only", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_the_default_floors_follow_the_device_kind(suite_dir: pytest.Pytester) -> None:
    """A GPU run judged by CPU floors would pass every cell whatever the code does."""
    args = ["-p", "no:cacheprovider", "--service", "fake", "-m", "perf", "--collect-only", "--results-dir", "results"]
    gpu = suite_dir.runpytest_subprocess(*args, "--device", "cuda")
    gpu.stdout.fnmatch_lines(["ddtree results: *results; floors: h200-fixture (*h200-fixture.yaml), probe cuda-v*"])
    cpu = suite_dir.runpytest_subprocess(*args, "--device", "cpu")
    cpu.stdout.fnmatch_lines(["ddtree results: *results; floors: cpu-fixture (*cpu-fixture.yaml), probe cpu-v*"])


def test_another_model_or_server_has_no_default_floors(suite_dir: pytest.Pytester) -> None:
    """The fixture profiles hold the fixture pair's numbers on this server; judged by them, a real model on
    its own server would fail (or pass) every cell for nothing."""
    args = ["-p", "no:cacheprovider", "-m", "perf", "--collect-only", "--results-dir", "results", "--device", "cpu"]
    none = "ddtree results: *results; floors: none (no floors file: cells are listed without a floor;*"
    url = suite_dir.runpytest_subprocess(*args, "--service", "url", "--service-url", "http://127.0.0.1:9")
    url.stdout.fnmatch_lines([none])
    other_model = suite_dir.runpytest_subprocess(*args, "--service", "fake", "--model-path", str(suite_dir.path))
    other_model.stdout.fnmatch_lines([none])
    record = suite_dir.runpytest_subprocess(*args, "--service", "url", "--service-url", "http://127.0.0.1:9",
                                            "--update-floors")
    assert record.ret == pytest.ExitCode.USAGE_ERROR
    record.stderr.fnmatch_lines(["ERROR: --update-floors needs --floors PROFILE|PATH to record into (the default for "
                                 "--service url is none)"])


def test_a_bad_grid_file_fails_before_anything_runs(suite_dir: pytest.Pytester) -> None:
    write_grid(suite_dir, {**GRID, "configs": [{"budget": 0}]}, name="bad.yaml")
    result = suite_dir.runpytest_subprocess(*FAKE, "-m", "perf", "--config-grid", "bad.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --config-grid: *bad.yaml: configs[[]0]: budget: 0 is out of range (allowed 1..512)"])


def test_resume_skips_cells_that_have_a_file(suite_dir: pytest.Pytester) -> None:
    run(suite_dir, "-m", "perf", "-k", "ar-ctx8-c1").assert_outcomes(passed=1, deselected=3)
    result = run(suite_dir, "-m", "perf", "--resume")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["resumed: 1 cells kept from an earlier run: ar-ctx8-c1"])
    assert len(list((suite_dir.path / "results" / "cells").iterdir())) == 4


def test_update_floors_records_the_medians(suite_dir: pytest.Pytester) -> None:
    floors = suite_dir.path / "recorded.yaml"
    floors.write_text("# kept header\ntolerance: 0.2\nfloors: {}\n")
    run(suite_dir, "-m", "perf", "--floors", str(floors), "--update-floors").assert_outcomes(passed=4)
    text = floors.read_text()
    data = yaml.safe_load(text)
    assert text.startswith("# kept header")
    assert data["tolerance"] == 0.2
    assert set(data["floors"]) == {"ar", "b4-k4-w2048-bs8"}
    assert data["floors"]["ar"]["ctx8-c1"]["output_throughput"] > 0
    assert data["floors"]["b4-k4-w2048-bs8"]["ctx8-c2"]["accept_length"] > 1
    assert "accept_length" not in data["floors"]["ar"]["ctx8-c1"]


@pytest.mark.slow  # two workers, two services: ~15 s on 2 cores
def test_xdist_gives_each_worker_a_service_and_merges_one_report(suite_dir: pytest.Pytester) -> None:
    result = run(suite_dir, "-m", "perf", "-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["deploys: 2 (*)", "restore: default b8-k4-w2048-bs8 restored and verified*"])
    assert len(list((suite_dir.path / "results" / "cells").iterdir())) == 4
    summary = (suite_dir.path / "results" / "sweep_summary.md").read_text()
    assert "4 cells, 2 configs" in summary and "**verified**" in summary
    logs = list((suite_dir.path / "results" / "service-logs").iterdir())
    assert len(logs) == 2, f"expected one service per worker, got logs {logs}"
