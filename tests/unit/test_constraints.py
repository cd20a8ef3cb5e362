"""constraints/cpu.txt pins every dependency CI and the README's CPU set-up install, within pyproject's ranges.

A dependency added to pyproject without refreshing the file would float in CI (the constraints only
bind what they name), and a pin outside a range would make pip refuse the install. Pins for the
transitive dependencies come from the same freeze, so they move only when the file is refreshed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
EXTRAS = ("test", "interop")  # what .ci/run installs; sglang goes in with --no-deps
PINNED_OUTSIDE_PYPROJECT = {"torch": "2.13.0", "sglang": "0.5.23"}
REFRESH = "run tools/refresh-constraints.sh and commit constraints/cpu.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")
# Linux x86-64 under CPython: where CI and the CPU set-up run
ENVIRONMENT = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "os_name": "posix"}


def read_pins(path: Path) -> dict[str, Version]:
    """name -> pinned version; every line that is not a comment must be `name==version`."""
    pins: dict[str, Version] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"{path.name}:{number}: {line!r} is not an exact `name==version` pin"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{path.name}:{number}: {name} is pinned twice"
        pins[name] = Version(match[2])
    return pins


def project_requirements(pyproject: Path, extras: tuple[str, ...]) -> list[Requirement]:
    """The project's dependencies and those of `extras` that apply on Linux x86-64."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = [(Requirement(r), "") for r in project["dependencies"]]
    wanted += [(Requirement(r), extra) for extra in extras for r in project["optional-dependencies"][extra]]
    return [r for r, extra in wanted if r.marker is None or r.marker.evaluate(ENVIRONMENT | {"extra": extra})]


def unpinned(pins: dict[str, Version], requirements: list[Requirement]) -> list[str]:
    """What each requirement lacks in `pins`: no pin, or a pin outside its range."""
    problems = []
    for req in requirements:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name} is not pinned")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}=={pin} is outside pyproject's {req}")
    return problems


def test_every_dependency_is_pinned_within_its_range() -> None:
    problems = unpinned(read_pins(CONSTRAINTS), project_requirements(REPO / "pyproject.toml", EXTRAS))
    assert not problems, f"{CONSTRAINTS.name}: {'; '.join(problems)}; {REFRESH}"


@pytest.mark.parametrize(("name", "version"), PINNED_OUTSIDE_PYPROJECT.items())
def test_what_pyproject_leaves_open_is_pinned_as_the_readme_installs_it(name: str, version: str) -> None:
    assert read_pins(CONSTRAINTS).get(name) == Version(version), f"{CONSTRAINTS.name} must pin {name}=={version}; {REFRESH}"


def test_ci_installs_every_package_with_the_constraints() -> None:
    installs = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if re.search(r"\bpip install\b", line)]
    assert installs, ".ci/run installs nothing with pip"
    loose = [line.strip() for line in installs if "-c constraints/cpu.txt" not in line]
    assert not loose, f".ci/run installs without -c constraints/cpu.txt: {loose}"


def test_a_missing_or_out_of_range_pin_is_reported(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["numpy>=2", "uvloop; sys_platform == \'win32\'"]\n'
                         '[project.optional-dependencies]\ntest = ["pytest<9.2"]\n')
    requirements = project_requirements(pyproject, ("test",))
    pins = {"numpy": Version("1.26.4")}
    assert unpinned(pins, requirements) == ["numpy==1.26.4 is outside pyproject's numpy>=2", "pytest is not pinned"]
    (tmp_path / "loose.txt").write_text("numpy>=2\n")
    with pytest.raises(AssertionError, match="not an exact"):
        read_pins(tmp_path / "loose.txt")


def test_the_gpu_constraints_are_the_cpu_ones_less_torch_and_triton() -> None:
    gpu = read_pins(REPO / "constraints" / "gpu.txt")
    cpu = {name: v for name, v in read_pins(CONSTRAINTS).items() if name not in ("torch", "triton")}
    assert gpu == cpu, f"constraints/gpu.txt differs from constraints/cpu.txt less torch and triton; {REFRESH}"
