"""http_vs_engine --runs: a bench run again in fresh processes, its rows kept per run, the median ratio per cell."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from ddtree.profiling import fresh_runs, http_vs_engine


def _row(config: str, concurrency: int, engine: float, stream: float, plain: float | None = None) -> dict:
    row = {"config": config, "context": 1024, "concurrency": concurrency,
           "engine": {"tok_per_s": engine, "round_ms": 0.2, "ttft_ms": 2.0, "p90_over_median_e2e": None},
           "stream": {"tok_per_s": stream, "ratio": stream / engine, "round_ms": 0.21, "ttft_ms": 4.0,
                      "p90_over_median_e2e": 1.1}}
    if plain is not None:
        row["plain"] = {"tok_per_s": plain, "ratio": plain / engine, "round_ms": 0.22, "ttft_ms": None,
                        "p90_over_median_e2e": 1.2}
    return row


def test_without_options_drops_both_spellings_and_keeps_the_rest() -> None:
    argv = ["--configs", "ar", "b4", "--runs", "3", "--out=x.json", "--repeats", "2", "--runs=4", "--out", "y.json"]
    assert fresh_runs.without_options(argv, ("--runs", "--out")) == ["--configs", "ar", "b4", "--repeats", "2"]
    assert fresh_runs.without_options(["--outside", "1"], ("--out",)) == ["--outside", "1"]  # a name, not a prefix


def test_run_paths_sit_beside_out(tmp_path: Path) -> None:
    assert fresh_runs.run_paths(tmp_path / "b.json", 2, tmp_path / "s") == [tmp_path / "b.run1.json", tmp_path / "b.run2.json"]
    assert fresh_runs.run_paths(None, 1, tmp_path) == [tmp_path / "run1.json"]


def test_summary_is_the_median_ratio_over_runs_with_its_range() -> None:
    runs = [[_row("ar", 1, 100, 90, 80), _row("b4", 1, 100, 99)],
            [_row("ar", 1, 100, 96, 85)],
            [_row("ar", 1, 100, 80, 70), _row("b4", 1, 200, 150)]]
    summary = {s["config"]: s for s in fresh_runs.summarize_runs(runs)}
    ar = summary["ar"]
    assert ar["runs"] == 3
    assert ar["stream"]["ratios"] == pytest.approx([0.90, 0.96, 0.80])
    assert ar["stream"]["ratio"] == pytest.approx(0.90)  # the median, not the mean (0.887)
    assert (ar["stream"]["ratio_min"], ar["stream"]["ratio_max"]) == pytest.approx((0.80, 0.96))
    assert ar["plain"]["ratio"] == pytest.approx(0.80) and ar["engine"]["tok_per_s"] == 100
    b4 = summary["b4"]
    assert b4["runs"] == 2 and b4["stream"]["ratio"] == pytest.approx((0.99 + 0.75) / 2) and "plain" not in b4
    text = fresh_runs.format_summary(list(summary.values()))
    assert "0.900" in text and "0.800" in text and "0.960" in text


def _fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ratios: list[float], fail_at: int | None = None) -> None:
    """A module `fakebench` that writes one row per call (ratio by call count) to its --out, as the bench does."""
    (tmp_path / "fakebench.py").write_text(textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        argv = sys.argv[1:]
        out = Path(argv[argv.index("--out") + 1])
        calls = Path({str(tmp_path / 'calls.txt')!r})
        n = len(calls.read_text().splitlines()) if calls.exists() else 0
        calls.write_text((calls.read_text() if calls.exists() else "") + " ".join(argv) + "\\n")
        if n == {fail_at!r}:
            raise SystemExit(3)
        ratio = {ratios!r}[n]
        row = {{"config": "ar", "context": 60, "concurrency": 1, "engine": {{"tok_per_s": 100.0}},
               "stream": {{"tok_per_s": 100.0 * ratio, "ratio": ratio}}}}
        out.write_text(json.dumps({{"meta": {{}}, "rows": [row]}}))
        raise SystemExit(1 if ratio < 0.5 else 0)
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_drive_runs_fresh_processes_and_keeps_every_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bench(tmp_path, monkeypatch, [0.9, 0.4, 0.95])
    out = tmp_path / "res" / "hve.json"
    lines: list[str] = []
    status = fresh_runs.drive("fakebench", ["--configs", "ar", "--runs", "3", "--out", str(out)], 3, out,
                              tmp_path, {"command": "x"}, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert status == 1  # the second run's outputs differed: the driver says so, after all three
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [f"--configs ar --out {out.with_name(f'hve.run{i}.json')}" for i in (1, 2, 3)]
    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 3 and saved["summary"][0]["stream"]["ratio"] == pytest.approx(0.9)
    assert any("over 3 run(s)" in line for line in lines)


def test_drive_stops_at_a_run_that_could_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bench(tmp_path, monkeypatch, [0.9, 0.9, 0.9], fail_at=1)
    out = tmp_path / "hve.json"
    status = fresh_runs.drive("fakebench", [], 3, out, tmp_path, {}, log=lambda *a, **k: None)
    assert status == 3
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2  # the third never started
    assert len(json.loads(out.read_text())["runs"]) == 1  # the first run's rows are kept


def test_runs_is_checked_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_vs_engine.main(["--runs", "0", "--engine", "emulated", "--device", "cpu"]) == 2
    assert "--runs: [0] out of range (allowed >= 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        http_vs_engine.build_parser().parse_args(["--ru", "2"])  # no abbreviations: --runs passes the rest on


def test_a_stopped_driver_stops_its_run_and_keeps_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hve.json"
    signals: list[int] = []

    class Interrupted:
        """A run that has written one cell when the driver is told to stop; it stops on the SIGINT passed on."""

        def __init__(self, cmd: list[str]) -> None:
            path = Path(cmd[cmd.index("--out") + 1])
            path.write_text(json.dumps({"rows": [_row("ar", 1, 100, 97)]}))

        def wait(self, timeout: float | None = None) -> int:
            if not signals:
                raise KeyboardInterrupt
            return -2

        def send_signal(self, sig: int) -> None:
            signals.append(sig)

    monkeypatch.setattr(fresh_runs.subprocess, "Popen", Interrupted)
    status = fresh_runs.drive("x", [], 3, out, tmp_path, {}, log=lambda *a, **k: None)
    assert status == 130 and signals == [fresh_runs.signal.SIGINT]
    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 1 and saved["summary"][0]["stream"]["ratio"] == pytest.approx(0.97)
