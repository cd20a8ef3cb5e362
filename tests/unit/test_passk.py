"""pass@k against a brute-force count of k-subsets, exact binomials, and hand-worked values."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.errors import ConfigError
from ddtree.quality import mean_pass_at_k, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(1 for s in subsets if any(i < c for i in s))
    return hits / len(subsets)


# no per-example deadline: on a loaded 2-core CI machine a process stalls past hypothesis' 200 ms now and then
NO_DEADLINE = settings(deadline=None)


@st.composite
def nck(draw: st.DrawFn, max_n: int) -> tuple[int, int, int]:
    n = draw(st.integers(1, max_n))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@NO_DEADLINE
@given(nck(max_n=10))
def test_matches_brute_force_subset_count(args: tuple[int, int, int]) -> None:
    n, c, k = args
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), args


@NO_DEADLINE
@given(nck(max_n=400))
def test_matches_exact_binomials_for_large_n(args: tuple[int, int, int]) -> None:
    n, c, k = args
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), args


@NO_DEADLINE
@given(nck(max_n=50))
def test_monotone_in_correct_count_and_k(args: tuple[int, int, int]) -> None:
    n, c, k = args
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        pytest.param(1, 1, 1, 1.0, id="single-correct"),
        pytest.param(1, 0, 1, 0.0, id="single-wrong"),
        pytest.param(10, 3, 1, 0.3, id="pass1-is-c-over-n"),
        pytest.param(4, 2, 2, 5 / 6, id="n4-c2-k2"),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        pytest.param(5, 1, 5, 1.0, id="k-equals-n-one-correct"),
        pytest.param(10, 0, 5, 0.0, id="none-correct"),
        pytest.param(10, 10, 3, 1.0, id="all-correct"),
        pytest.param(10, 6, 5, 1.0, id="too-few-wrong-for-k"),
        pytest.param(200, 1, 1, 0.005, id="n200-pass1"),
        pytest.param(200, 1, 100, 0.5, id="n200-one-correct-half"),  # C(199,100)/C(200,100) = 100/200
    ],
)
def test_known_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_huge_n_stays_finite() -> None:
    # C(10^6, 500) overflows a float; the product form must not
    value = pass_at_k(1_000_000, 1000, 500)
    assert math.isfinite(value) and 0.0 < value < 1.0
    assert value == pytest.approx(1 - (1 - 1000 / 1_000_000) ** 500, rel=1e-3)


@pytest.mark.parametrize(
    ("n", "c", "k", "field"),
    [
        pytest.param(0, 0, 1, "n", id="n-zero"),
        pytest.param(-3, 0, 1, "n", id="n-negative"),
        pytest.param(5, -1, 1, "c", id="c-negative"),
        pytest.param(5, 6, 1, "c", id="c-above-n"),
        pytest.param(5, 2, 0, "k", id="k-zero"),
        pytest.param(5, 2, 6, "k", id="k-above-n"),
        pytest.param(5.0, 2, 1, "n", id="n-float"),
        pytest.param(5, True, 1, "c", id="c-bool"),
    ],
)
def test_bad_input_names_the_field(n: object, c: object, k: object, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        pass_at_k(n, c, k)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_mean_is_the_average_over_problems() -> None:
    results = [(10, 3), (10, 0), (5, 5), (4, 2)]
    expected = (pass_at_k(10, 3, 2) + 0.0 + 1.0 + 5 / 6) / 4
    assert mean_pass_at_k(results, 2) == pytest.approx(expected)
    assert mean_pass_at_k(iter(results), 1) == pytest.approx((0.3 + 0 + 1 + 0.5) / 4)


def test_mean_rejects_empty_and_k_above_some_n() -> None:
    with pytest.raises(ConfigError, match="^results:"):
        mean_pass_at_k([], 1)
    with pytest.raises(ConfigError, match="^k:"):
        mean_pass_at_k([(10, 3), (2, 1)], 5)
