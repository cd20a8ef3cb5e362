"""Coding-quality machinery, independent of models: pass@k, a sandboxed program checker, HumanEval."""

from ddtree.quality.humaneval import (
    GateReport,
    Problem,
    ProblemResult,
    build_chat_program,
    build_program,
    chat_prompt,
    extract_code,
    gate_problem_ids,
    gate_problems,
    load_problems,
    run_gate,
    truncate_completion,
)
from ddtree.quality.passk import mean_pass_at_k, pass_at_k
from ddtree.quality.sandbox import Isolation, Outcome, check_program, sandbox_isolation

__all__ = [
    "GateReport",
    "Isolation",
    "Outcome",
    "Problem",
    "ProblemResult",
    "build_chat_program",
    "build_program",
    "chat_prompt",
    "extract_code",
    "check_program",
    "gate_problem_ids",
    "gate_problems",
    "load_problems",
    "mean_pass_at_k",
    "pass_at_k",
    "run_gate",
    "sandbox_isolation",
    "truncate_completion",
]
