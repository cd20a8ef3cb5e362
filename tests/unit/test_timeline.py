"""The per-request timeline: stamps off unless asked for, the join and checks, and a whole emulated run
through the two-process server in which every stage is stamped, in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.bench.loadgen import RequestRecord
from ddtree.engine import Request, StepOutput
from ddtree.profiling import timeline
from ddtree.serving import stamps


def test_stamps_are_off_without_the_variable() -> None:
    env = {k: v for k, v in os.environ.items() if k != stamps.ENV}
    code = "from ddtree.serving import stamps; import sys; sys.exit(0 if not stamps.ON and stamps.dump() is None else 1)"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def _ordered(mode: str, step: int = 10_000) -> dict[str, int]:
    return {stage: i * step for i, stage in enumerate(timeline.STAGES[mode])}


def test_check_finds_a_missing_stage_and_one_out_of_order() -> None:
    good = _ordered("stream")
    assert timeline.check([good, good], "stream") == []
    assert timeline.check([good, {k: v for k, v in good.items() if k != "next_send"}], "stream") == []  # the last
    missing = {k: v for k, v in good.items() if k != "e_read"}
    assert timeline.check([missing, good], "stream") == ["request 0: no e_read"]
    early = dict(good, h_first_event=good["e_first_out"] - 5_000)
    assert timeline.check([early], "stream") == ["request 0: h_first_event 5 us before e_first_out"]
    # stages that race (the client's last chunk and the server's [DONE]) may come either way round
    racing = dict(good, c_last=good["h_done"] + 1, h_done=good["c_last"])
    assert timeline.check([racing], "stream") == []
    plain = _ordered("plain")
    assert timeline.check([plain], "plain") == []
    assert timeline.check([dict(plain, c_done=plain["h_answer"] - 1)], "plain") != []


def test_join_matches_the_client_to_the_server_by_rid_and_adds_the_next_send() -> None:
    a = RequestRecord(ok=True, rid="r1", stamps={"c_send": 100, "c_end": 200})
    b = RequestRecord(ok=True, rid="r2", stamps={"c_send": 300, "c_end": 400})
    rows = timeline.join([b, a], {"r1": {"h_in": 150}, "r2": {"h_in": 350}})
    assert rows == [{"h_in": 150, "c_send": 100, "c_end": 200, "next_send": 300},
                    {"h_in": 350, "c_send": 300, "c_end": 400}]
    table = {e["stage"]: e for e in timeline.medians(rows, "plain")}
    assert table["h_in"]["ms"] == pytest.approx(50 / 1e6) and table["h_in"]["step_ms"] == pytest.approx(50 / 1e6)
    assert table["next_send"]["step_ms"] == pytest.approx(100 / 1e6) and table["next_send"]["n"] == 1


class _Batch:
    """add / step only (no add_many, no launch/collect): the wrapper must not invent them."""

    def __init__(self) -> None:
        self.free_slots = 4

    def add(self, request: Request) -> list[StepOutput]:
        return [StepOutput(request.request_id, [1], False, None, 0, [])]

    def step(self) -> list[StepOutput]:
        return [StepOutput("a", [2], True, "length", 1, [1])]


def test_stamped_batch_stamps_prefills_and_finishes_and_hides_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[tuple[str, str]] = []
    monkeypatch.setattr(stamps, "stamp", lambda rid, stage, at=None: rows.append((rid, stage)))
    batch = stamps.StampedBatch(_Batch())
    assert getattr(batch, "add_many", None) is None and getattr(batch, "collect", None) is None
    assert batch.free_slots == 4
    batch.add(Request("a", [5], 2))
    batch.step()
    assert rows == [("a", "e_admit"), ("a", "e_prefilled"), ("a", "e_last")]
    rows.clear()
    deliver = stamps.stamped_deliver(lambda items: rows.append(("delivered", str(len(items)))))
    deliver([(None, StepOutput("a", [1], False, None, 0, [])), (None, StepOutput("a", [2], False, None, 1, []))])
    deliver([(None, StepOutput("a", [3], True, "length", 2, []))])
    assert rows == [("a", "e_first_out"), ("delivered", "2"), ("a", "e_last_out"), ("delivered", "1")]


def test_emulated_run_stamps_every_stage_in_order(tmp_path: Path) -> None:
    """The real server (both processes) in front of the emulated batch: every stage of every request, in order."""
    out = tmp_path / "tl"
    code = timeline.main(["--engine", "emulated", "--round-ms", "0.2", "--prefill-ms", "0.5", "--context", "256",
                          "--requests", "6", "--warmup", "1", "--max-new-tokens", "16", "--out", str(out)])
    result = json.loads((out / "timeline.json").read_text())
    ar = result["configs"]["ar"]
    assert ar["stream"]["problems"] == [] and ar["plain"]["problems"] == []
    assert code == 0
    for mode in ("stream", "plain"):
        rows = ar[mode]["rows"]
        assert len(rows) == 6
        assert all(set(timeline.STAGES[mode]) - {"next_send"} <= set(row) for row in rows)
        table = {e["stage"]: e for e in ar[mode]["table"]}
        assert table["e_prefilled"]["step_ms"] >= 0.5  # the emulated prefill's wait is inside its own stage
    http = next(facts for name, facts in ar["facts"].items() if name.startswith("http-"))
    assert http["http"] and http["loop"]  # what uvicorn runs on: its HTTP protocol and the event loop
