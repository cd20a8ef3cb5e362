"""CI (.ci/run) does what the README tells a new user: the same installs and the same test command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CI = REPO / ".ci" / "run"


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match[1]


def commands(text: str, program: str) -> list[list[str]]:
    """Each command line that runs `program` (`python -m program` too), as words, without comments."""
    found = []
    for line in text.splitlines():
        if not re.match(rf"\s*(python -m )?{program}\b", line):
            continue  # prose and other commands
        words = shlex.split(line, comments=True)
        if words[:3] == ["python", "-m", program]:
            words = words[2:]
        if words[:1] == [program]:
            found.append(words)
    return found


def test_ci_runs_the_readmes_test_command() -> None:
    readme = commands(readme_section("Tests"), "pytest")
    ci = commands(CI.read_text(), "pytest")
    assert readme and ci, "no pytest command in the README's Tests section or in .ci/run"
    assert ci[-1] == readme[0], f".ci/run runs {shlex.join(ci[-1])!r}, the README's test command is {shlex.join(readme[0])!r}"


def test_the_readmes_cpu_set_up_installs_as_ci_does() -> None:
    readme = [c for c in commands(readme_section("Set-up"), "pip") if c[1:2] == ["install"]]
    ci = [[w for w in c if w != "--quiet"] for c in commands(CI.read_text(), "pip") if c[1:2] == ["install"] and "--upgrade" not in c]
    assert readme == ci, f"README set-up: {[shlex.join(c) for c in readme]}; .ci/run: {[shlex.join(c) for c in ci]}"
