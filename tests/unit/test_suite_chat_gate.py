"""The chat-mode coding gate: the DDTree paper's HumanEval chat prompt, code from the reply's first
fenced python block, pass@k as in completion mode; alone and through the suite (grid quality.mode)."""

from __future__ import annotations

import json
import os

import pytest

from ddtree.errors import ConfigError
from ddtree.grid import parse_grid
from ddtree.quality import build_chat_program, chat_prompt, extract_code, gate_problems, load_problems, run_gate
from ddtree.quality.sandbox import check_program
from tests.unit.test_suite_plugin import GRID, REPO, run, suite_dir, write_grid  # noqa: F401 - suite_dir is a fixture

PROBLEM = load_problems()["HumanEval/2"]  # truncate_number
SOLUTION = PROBLEM.prompt + PROBLEM.canonical_solution


def test_the_chat_prompt_is_the_papers_humaneval_form() -> None:
    assert chat_prompt(PROBLEM) == ("Write a solution to the following problem and make sure that it passes the "
                                    f"tests:\n```python\n{PROBLEM.prompt}\n```")


@pytest.mark.parametrize(("reply", "code"), [
    ("Sure.\n```python\nA = 1\n```\nand\n```python\nB = 2\n```\n", "A = 1\n"),
    ("```text\nnot code\n```\n```py\nA = 1\n```", "A = 1\n"),
    ("```\nA = 1\n```", "A = 1\n"),
    ("~~~python\nA = 1\n~~~", "A = 1\n"),
    ("    return 1\n", "    return 1\n"),
], ids=["first-python-block", "py-tag-over-text", "untagged", "tilde-fence", "no-fence-is-the-reply"])
def test_the_first_fenced_python_block_is_the_code(reply: str, code: str) -> None:
    assert extract_code(reply) == code


def test_a_reply_with_the_function_or_only_its_body_both_run() -> None:
    body = PROBLEM.canonical_solution
    assert check_program(build_chat_program(PROBLEM, SOLUTION), 10, 1024).passed
    assert check_program(build_chat_program(PROBLEM, body), 10, 1024).passed  # taken for a completion
    assert not check_program(build_chat_program(PROBLEM, PROBLEM.prompt + "    return 0.0\n"), 10, 1024).passed


def test_run_gate_in_chat_mode_sends_the_chat_prompt_and_checks_the_block() -> None:
    problems = gate_problems()[:2]
    seen: list[str] = []

    def chat(prompt: str, n: int) -> list[str]:
        seen.append(prompt)
        problem = next(p for p in problems if p.prompt in prompt)
        return [f"Here you go:\n```python\n{problem.prompt + problem.canonical_solution}```\nDone."] * n

    report = run_gate(problems, chat, k=1, n=2, mode="chat")
    assert report.pass_at_k == 1.0 and seen == [chat_prompt(p) for p in problems]
    wrong = run_gate(problems, lambda p, n: ["```python\ndef nothing(): pass\n```"] * n, mode="chat")
    assert wrong.pass_at_k == 0.0


def test_quality_mode_is_completion_or_chat() -> None:
    assert parse_grid({"configs": [{}]}).quality.mode == "completion"
    assert parse_grid({"configs": [{}], "quality": {"mode": "chat"}}).quality.mode == "chat"
    with pytest.raises(ConfigError, match=r"grid: quality.mode: 'instruct'; allowed: completion, chat"):
        parse_grid({"configs": [{}], "quality": {"mode": "instruct"}})


CHAT_GRID = {**GRID, "quality": {"mode": "chat", "problems": 2, "k": 1, "n": 1, "threshold": 1.0,
                                 "max_new_tokens": 256, "accept_floor": 2.0}}


@pytest.mark.parametrize("wrong", [False, True], ids=["solving", "wrong-code"])
def test_the_suite_runs_the_chat_gate_against_a_chat_service(suite_dir: pytest.Pytester,  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch, wrong: bool) -> None:
    quality = suite_dir.path / "tests" / "quality"
    quality.mkdir()
    (quality / "test_coding_gate.py").write_text((REPO / "tests/quality/test_coding_gate.py").read_text())
    write_grid(suite_dir, CHAT_GRID)
    if wrong:
        monkeypatch.setenv("DDTREE_FAKE_CHAT_WRONG", "1")
    result = run(suite_dir, "-m", "quality", "tests/quality")
    if wrong:
        result.assert_outcomes(failed=2)
        result.stdout.fnmatch_lines(["*pass@1 0.00 < threshold 1.00 on 2 problems (chat), ar*"])
        return
    result.assert_outcomes(passed=2)  # one per config: ar, b4-k4-w2048-bs8
    record = json.loads((suite_dir.path / "results" / "quality" / "b4-k4-w2048-bs8.json").read_text())
    assert (record["mode"], record["pass_at_k"], record["passed"], record["threshold"]) == ("chat", 1.0, True, 1.0)
    assert record["isolation"] == "namespaces"
    assert "best-effort isolation" not in result.stdout.str()
    assert record["accept_length"] >= 2.0  # from sglext.spec_tokens_details, as SGLang reports it


NO_USERNS_BWRAP = "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"


@pytest.mark.parametrize("unsafe", [False, True], ids=["refused", "unsafe-exec"])
def test_without_namespaces_the_gate_refuses_unless_unsafe_exec_which_is_recorded(
        suite_dir: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, unsafe: bool) -> None:  # noqa: F811
    quality = suite_dir.path / "tests" / "quality"
    quality.mkdir()
    (quality / "test_coding_gate.py").write_text((REPO / "tests/quality/test_coding_gate.py").read_text())
    write_grid(suite_dir, {**CHAT_GRID, "configs": [{"budget": 4}]})
    fake = suite_dir.path / "bin" / "bwrap"  # fails as bwrap does where user namespaces are disabled
    fake.parent.mkdir()
    fake.write_text(NO_USERNS_BWRAP)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    result = run(suite_dir, "-m", "quality", "tests/quality", *(["--unsafe-exec"] if unsafe else []))
    record_path = suite_dir.path / "results" / "quality" / "b4-k4-w2048-bs8.json"
    if not unsafe:
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*SandboxUnavailable: cannot run model-written code in namespaces*--unsafe-exec*"])
        assert not record_path.exists()
        return
    result.assert_outcomes(passed=1)
    assert json.loads(record_path.read_text())["isolation"] == "best-effort"
    result.stdout.fnmatch_lines(["coding gate: model-written programs ran with best-effort isolation, not in namespaces "
                                 "(--unsafe-exec): b4-k4-w2048-bs8"])
