"""benchmarks/seeds.py's interval over seeds, against numbers worked by hand."""

from __future__ import annotations

import math

import pytest

from benchmarks.seeds import mean_over_seeds


def test_the_interval_over_three_seeds_is_t_with_two_degrees_of_freedom() -> None:
    # mean 0.2, s = 0.1, s/√3 = 0.057735; t(0.975, 2) = 4.302653 (a t table): half-width 0.248414
    mean, low, high = mean_over_seeds([0.1, 0.3, 0.2])
    assert math.isclose(mean, 0.2)
    assert math.isclose(low, 0.2 - 0.248414, abs_tol=1e-6) and math.isclose(high, 0.2 + 0.248414, abs_tol=1e-6)


def test_equal_gains_have_no_spread_and_one_seed_has_no_interval() -> None:
    assert mean_over_seeds([0.05, 0.05]) == pytest.approx((0.05, 0.05, 0.05))
    with pytest.raises(ValueError, match="at least 2 values, got 1"):
        mean_over_seeds([0.1])
