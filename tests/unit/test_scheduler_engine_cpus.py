"""DDTREE_ENGINE_CPUS: the CPUs the engine process pins itself to (a taskset-like list), refused with the
variable named when it is not one."""

from __future__ import annotations

import os

import pytest

from ddtree.errors import ConfigError
from ddtree.serving import engine_worker as ep


def test_a_cpu_list_reads_as_taskset_reads_it() -> None:
    assert ep.engine_cpus("15", 16) == {15}
    assert ep.engine_cpus("12-15", 16) == {12, 13, 14, 15}
    assert ep.engine_cpus(" 0, 2-3 ,7", 16) == {0, 2, 3, 7}


@pytest.mark.parametrize("value", ["16", "3-16", "-1", "a", "1,,2", "5-3", ""])
def test_a_bad_cpu_list_is_refused_naming_the_variable_and_the_range(value: str) -> None:
    with pytest.raises(ConfigError, match=r"DDTREE_ENGINE_CPUS: .*allowed: CPU numbers 0-15"):
        ep.engine_cpus(value, 16)


def test_the_engine_process_pins_itself_where_the_variable_says(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    monkeypatch.setenv(ep.ENGINE_CPUS_ENV, str(one))
    try:
        ep.pin_to_cpus()
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)
    monkeypatch.delenv(ep.ENGINE_CPUS_ENV)
    ep.pin_to_cpus()  # unset: left where it is
    assert os.sched_getaffinity(0) == before
