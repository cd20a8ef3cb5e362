"""The SLO answer per context, the summary that leads with it, and the deploys table."""

from __future__ import annotations

from typing import Any

from ddtree.bench.answer import answer_progress, choose, recommended_points
from ddtree.bench.deploys import cold_starts, deploy_table, read_deploys, write_deploys
from ddtree.bench.report import render_summary
from ddtree.bench.results import CellResult

SLO = {"ttft_p99_ms": 2000.0, "tpot_p90_ms": 50.0, "attainment_target": 0.99}
DEFAULT = "b8-k4-w2048-bs8"


def cell(config_id: str, load: int | float, goodput: float, attainment: float, context: int = 60,
         **metrics: Any) -> CellResult:
    rate = float(load) if isinstance(load, float) else None
    m = {"output_throughput": 100.0 * goodput, "median_tpot_ms": 10.0, "failed": 0, "completed": 10,
         "request_goodput": goodput, "slo_attainment": attainment, "slo_attained": attainment >= 0.99,
         "slo_missed_by": {} if attainment >= 1 else {"tpot_p90_ms": 1}, **metrics}
    return CellResult(config_id=config_id, spec={"algorithm": "NONE"}, context=context,
                      concurrency=0 if rate else int(load), repeats=1, metrics=m, per_repeat=[],
                      client={"slo": SLO}, request_rate=rate)


def test_the_answer_is_the_most_goodput_where_attainment_holds() -> None:
    cells = [cell("ar", 1, 2.0, 1.0), cell("ar", 8, 9.0, 0.95),  # the most goodput, but attainment misses
             cell(DEFAULT, 8, 6.0, 1.0), cell("b4", 4.0, 7.0, 0.995, keeps_up=True),
             cell("b16", 16.0, 8.0, 1.0, keeps_up=False),  # fell behind its arrivals: no load to deploy at
             cell("b12", 12.0, 7.5, 1.0, keeps_up=None)]  # a burst: no evidence it could be sustained
    answer = choose(cells, DEFAULT)[60]
    assert answer.cell is not None and (answer.cell.config_id, answer.cell.load) == ("b4", "r4")


def test_ties_go_to_the_default_and_no_answer_names_the_closest() -> None:
    tied = choose([cell("ar", 8, 6.0, 1.0), cell(DEFAULT, 8, 6.0, 1.0)], DEFAULT)[60]
    assert tied.cell is not None and tied.cell.config_id == DEFAULT
    none = choose([cell("ar", 8, 6.0, 0.9), cell(DEFAULT, 8, 6.0, 0.97)], DEFAULT)[60]
    assert none.cell is None and none.closest is not None and none.closest.config_id == DEFAULT
    failed = choose([cell("ar", 8, 6.0, 1.0, failed=1)], DEFAULT)[60]
    assert failed.cell is None
    assert choose([cell("ar", 8, 6.0, 1.0, slo_attainment=None)], DEFAULT) == {}  # no SLO, no answer


def test_the_summary_leads_with_the_slo_answer() -> None:
    cells = [cell("ar", 1, 2.0, 1.0), cell(DEFAULT, 1, 3.0, 1.0), cell("ar", 1, 1.0, 0.5, context=512)]
    text = render_summary(cells, DEFAULT, None, deploys=[])
    assert text.index("## SLO answer") < text.index("## Recommendation") < text.index("## Pareto frontier")
    assert "SLOs: ttft_p99_ms <= 2000, tpot_p90_ms <= 50; attainment target 0.99" in text
    assert f"| 60 | **{DEFAULT}** (default) | c1 | 3.00 | 100.0% |" in text
    assert "| 512 | none meets the target |" in text and "closest: ar c1, attainment 50.0%" in text
    assert "Not eligible (1 of 3 cells): ar-ctx512-c1 50.0% (missed: tpot_p90_ms 1)" in text
    assert "The recommended b8-k4-w2048-bs8 c1 is on the frontier." in text
    many = [cell("ar", n, 1.0, 0.5) for n in range(1, 16)]
    assert "Not eligible (15 of 15 cells): ar-ctx60-c1 50.0%" in (long := render_summary(many, DEFAULT, None))
    assert "; and 3 more (summary.csv: slo_attained)." in long and "ar-ctx60-c13" not in long
    plain = [cell("ar", 1, 2.0, 1.0, slo_attainment=None)]
    assert "## SLO answer" not in render_summary(plain, DEFAULT, None)


def test_rate_cells_stay_out_of_the_objectives_and_say_when_they_fell_behind() -> None:
    cells = [cell("ar", 1, 2.0, 1.0), cell("ar", 8.0, 1.0, 0.2, keeps_up=False, achieved_request_rate=7.9,
                                           served_request_rate=3.1, max_in_flight=12, keeps_up_repeats="0 of 2")]
    text = render_summary(cells, DEFAULT, None)
    assert "## context 60, 8 requests/s (open loop)" in text and "## context 60, concurrency 1" in text
    assert "Rates the service could not keep up with: ar-ctx60-r8: offered 8, sent 7.90, served 3.10 req/s, " \
           "up to 12 in flight" in text
    assert "Aggregate throughput (highest concurrency, highest output tok/s): **ar** (200.00 tok/s)" in text
    assert recommended_points(cells, DEFAULT, "ar") == {60: ("ar", "c1")}
    assert "(FELL BEHIND)" in answer_progress(cells[1].metrics | {"offered_request_rate": 8.0})
    burst = answer_progress({"offered_request_rate": 40.0, "keeps_up": None})
    assert "(too short to tell whether it kept up)" in burst and "FELL BEHIND" not in burst
    unjudged = cell("ar", 40.0, 20.0, 1.0, keeps_up=None)
    assert "ar-ctx60-r40 100.0% (too short to tell whether the service kept up" in render_summary([unjudged], DEFAULT, None)


def test_deploys_json_appends_and_the_table_totals(tmp_path: Any) -> None:
    first = {"config_id": "ar", "purpose": "sweep", "restarted": True, "ready_s": 10.0, "verified_s": 12.0,
             "spent_s": 12.0, "ok": True, "error": None, "cold_start_s": 12.0}
    failed = {**first, "config_id": "b4", "ok": False, "verified_s": None, "spent_s": 3.0, "cold_start_s": None,
              "error": "ServiceStartError: boom"}
    write_deploys(tmp_path, [first])
    write_deploys(tmp_path, [failed, {**first, "cold_start_s": 14.0, "purpose": "restore"}])
    entries = read_deploys(tmp_path)
    assert [e["config_id"] for e in entries] == ["ar", "b4", "ar"]
    assert cold_starts(entries) == {"ar": 13.0}  # the failed start has no cold-start figure
    table = "\n".join(deploy_table(entries))
    assert "| 2 | b4 | sweep | 10.0 | - | FAILED: ServiceStartError: boom |" in table
    assert "Total: 3 deploys (3 restarts), 27.0 s spent deploying" in table
    assert "No deploy was recorded" in "\n".join(deploy_table([]))
