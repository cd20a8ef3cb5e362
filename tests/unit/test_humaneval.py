"""HumanEval loading, the gate subset, program building, completion trimming and run_gate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.quality import (
    GateReport,
    Problem,
    build_program,
    check_program,
    gate_problem_ids,
    gate_problems,
    load_problems,
    run_gate,
    truncate_completion,
)
from ddtree.quality.humaneval import GATE_FILE, STOP_SEQUENCES

GATE = gate_problems()


def test_packaged_humaneval_has_all_164_problems() -> None:
    problems = load_problems()
    assert len(problems) == 164
    first = problems["HumanEval/0"]
    assert first.entry_point == "has_close_elements"
    assert first.prompt.startswith("from typing import List")
    assert "def check(candidate)" in first.test


def test_load_problems_hands_out_copies() -> None:
    load_problems().clear()
    assert len(load_problems()) == 164


def test_load_problems_reads_a_plain_jsonl_and_reports_bad_records(tmp_path: Path) -> None:
    row = {"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
           "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(row) + "\n\n")
    assert load_problems(good) == {"T/0": Problem(**row)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "T/1"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: not a HumanEval problem record"):
        load_problems(bad)


def test_gate_file_lists_at_least_20_distinct_known_ids() -> None:
    ids = gate_problem_ids()
    assert len(ids) >= 20
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"HumanEval/\d+", i) for i in ids), ids
    assert set(ids) <= set(load_problems())
    assert [p.task_id for p in GATE] == ids
    assert GATE_FILE.read_text().startswith("#"), "the gate file opens with a comment header"


def test_gate_problems_are_short() -> None:
    # the tiny fixture model has to learn these; long solutions would make the gate measure the model
    for problem in GATE:
        body = [line for line in problem.canonical_solution.splitlines() if line.strip()]
        assert len(body) <= 4, f"{problem.task_id}: canonical solution has {len(body)} lines, want <= 4"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        pytest.param("# only a comment\n", "lists no task ids", id="empty"),
        pytest.param("HumanEval/2\nHumanEval/2\n", "listed twice", id="duplicate"),
        pytest.param("HumanEval/2\nHumanEval/999\n", "unknown task ids", id="unknown-id"),
    ],
)
def test_bad_gate_files_are_rejected(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "gate.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        gate_problems(path)


def test_missing_gate_file_says_where_it_looked_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.txt not found; it lists the coding gate's .*: restore it, or name"):
        gate_problem_ids(tmp_path / "nope.txt")


def test_build_program_layout() -> None:
    problem = Problem("T/0", "def f(x):\n", "    return x\n", "def check(candidate):\n    assert candidate(2) == 2\n", "f")
    program = build_program(problem, "    return x\n")
    assert program == (
        "def f(x):\n    return x\n\ndef check(candidate):\n    assert candidate(2) == 2\n\ncheck(f)\n"
    )


def test_canonical_solutions_of_every_gate_problem_pass() -> None:
    # checks the sandbox and build_program together: a false "failed" on a known-good program
    # would make the gate useless
    report = run_gate(GATE, lambda prompt, n: [by_prompt(prompt).canonical_solution] * n, k=1, n=1)
    failures = {r.task_id: r.first_failure for r in report.per_problem if r.c != r.n}
    assert not failures, failures
    assert report.pass_at_k == 1.0


def by_prompt(prompt: str) -> Problem:
    return next(p for p in GATE if p.prompt == prompt)


@pytest.mark.parametrize(
    ("completion", "status"),
    [
        pytest.param("    return None\n", "failed", id="wrong-answer"),
        pytest.param("    raise RuntimeError('boom')\n", "failed", id="raises"),
        pytest.param("    return (\n", "error", id="syntax-error"),
        pytest.param("    import sys\n    sys.exit(0)\n", "failed", id="exits-early"),
    ],
)
def test_wrong_completions_do_not_pass(completion: str, status: str) -> None:
    problem = GATE[0]
    outcome = check_program(build_program(problem, completion))
    assert outcome.status == status, outcome


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("    return x\n", "    return x\n", id="nothing-to-cut"),
        pytest.param("    return x\n\ndef other():\n    pass\n", "    return x\n", id="next-def"),
        pytest.param("    return x\nclass A:\n    pass\n", "    return x", id="class"),
        pytest.param("    return x\nif __name__ == '__main__':\n    f()\n", "    return x", id="main-guard"),
        pytest.param("    return x\nprint(f(1))\n", "    return x", id="print"),
        pytest.param("    return x\n# tests\nassert f(1)\n", "    return x", id="comment-at-column-0"),
        pytest.param("    # a comment\n    return x\n", "    # a comment\n    return x\n", id="indented-comment-kept"),
        pytest.param("    def helper(y):\n        return y\n    return helper(x)\n",
                     "    def helper(y):\n        return y\n    return helper(x)\n", id="nested-def-kept"),
        pytest.param("    return x\nprint (1)\ndef g(): pass\n", "    return x\nprint (1)", id="earliest-stop-wins"),
        pytest.param("    s = 'a\\ndef b'\n    return s\n", "    s = 'a\\ndef b'\n    return s\n", id="escaped-newline-in-string"),
        pytest.param("", "", id="empty"),
    ],
)
def test_truncate_completion(text: str, expected: str) -> None:
    assert truncate_completion(text) == expected
    assert truncate_completion(expected) == expected  # idempotent


def test_stop_sequences_start_at_column_0() -> None:
    assert all(seq.startswith("\n") and not seq[1].isspace() for seq in STOP_SEQUENCES)


def test_run_gate_counts_passes_per_problem_and_truncates() -> None:
    problems = GATE[:3]
    calls: list[tuple[str, int]] = []

    def complete(prompt: str, n: int) -> list[str]:
        calls.append((prompt, n))
        good = by_prompt(prompt).canonical_solution
        if prompt == problems[0].prompt:
            return [good, good + "\ndef junk(:\n", "    return None\n"]  # 2 of 3 pass after truncation
        if prompt == problems[1].prompt:
            return ["    return None\n"] * 3
        return [good] * 3

    report = run_gate(problems, complete, k=2, n=3, timeout_s=5.0)
    assert calls == [(p.prompt, 3) for p in problems]
    assert [(r.task_id, r.c) for r in report.per_problem] == [(p.task_id, c) for p, c in zip(problems, [2, 0, 3])]
    assert report.per_problem[0].statuses == ["passed", "passed", "failed"]
    assert report.per_problem[1].first_failure.startswith("failed:")
    # pass@2 per problem: 1 (one wrong of three), 0, 1
    assert report.pass_at_k == pytest.approx(2 / 3)
    as_dict = report.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["pass_at_k"] == pytest.approx(2 / 3) and as_dict["k"] == 2 and as_dict["n"] == 3
    assert [p["c"] for p in as_dict["per_problem"]] == [2, 0, 3]


def test_run_gate_without_truncation_keeps_the_junk() -> None:
    problem = GATE[0]
    completion = problem.canonical_solution + "\ndef junk(:\n"
    report = run_gate([problem], lambda prompt, n: [completion] * n, k=1, n=1, truncate=False)
    assert report.per_problem[0].statuses == ["error"]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        pytest.param({"k": 0, "n": 1}, "^k:", id="k-zero"),
        pytest.param({"k": 3, "n": 2}, "^k:", id="k-above-n"),
        pytest.param({"k": 1, "n": 0}, "^n:", id="n-zero"),
    ],
)
def test_run_gate_rejects_bad_k_and_n(kwargs: dict[str, int], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        run_gate(GATE[:1], lambda prompt, n: [""] * n, **kwargs)


def test_run_gate_rejects_no_problems_and_wrong_completion_count() -> None:
    with pytest.raises(ConfigError, match="^problems:"):
        run_gate([], lambda prompt, n: [""] * n)
    with pytest.raises(ValueError, match=r"returned 1 completions for HumanEval/\d+; expected a list of n=2"):
        run_gate(GATE[:1], lambda prompt, n: [""], k=1, n=2)


def test_empty_report_has_no_pass_at_k() -> None:
    with pytest.raises(ConfigError, match="^results:"):
        _ = GateReport(k=1, n=1).pass_at_k
