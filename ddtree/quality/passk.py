"""The unbiased pass@k estimator (Chen et al. 2021): n samples per problem, c of them correct.

pass@k = 1 - C(n-c, k) / C(n, k), the chance that a random k-subset of the n samples holds at
least one correct one. The binomials overflow floats for realistic n, so it is computed as the
product 1 - prod_{i=n-c+1..n} (1 - k/i), which stays in [0, 1] and loses nothing to cancellation.
This module knows nothing about programs or models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ddtree.errors import ConfigError

__all__ = ["mean_pass_at_k", "pass_at_k"]


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a sample count is almost certainly a bug upstream
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n >= 1 samples, 0 <= c <= n correct, 1 <= k <= n."""
    n, c, k = _check_int("n", n), _check_int("c", c), _check_int("k", k)
    if n < 1:
        raise ConfigError(f"n: {n} samples; allowed: n >= 1")
    if not 0 <= c <= n:
        raise ConfigError(f"c: {c} correct samples out of n={n}; allowed: 0 <= c <= n")
    if not 1 <= k <= n:
        raise ConfigError(f"k: {k}; allowed: 1 <= k <= n (n={n})")
    if n - c < k:
        # every k-subset must contain a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(results: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems, each given as (n, c); every problem needs n >= k."""
    values = [pass_at_k(n, c, k) for n, c in results]
    if not values:
        raise ConfigError("results: no problems given; need at least one (n, c) pair")
    return math.fsum(values) / len(values)
