"""Filters and shaping on small hand-worked examples."""

from __future__ import annotations

import numpy as np
import pytest

from stages.rl.filters import (
    DynamicSamplingExhausted,
    has_variance,
    is_skip_step,
    overlong_penalty,
    rounds_needed,
    success_rate_in_range,
)


def test_overlong_penalty():
    # L_max 100, buffer 20, factor 1: free up to 80 tokens; 90 -> -(10/20) = -0.5; 100 -> -1
    np.testing.assert_allclose(overlong_penalty(np.array([50, 80, 90, 100]), 100, 20), [0.0, 0.0, -0.5, -1.0])
    # factor 0.5 halves it: 95 -> -(15/20) * 0.5 = -0.375
    np.testing.assert_allclose(overlong_penalty(np.array([95]), 100, 20, factor=0.5), [-0.375])
    with pytest.raises(ValueError):
        overlong_penalty(np.array([1]), 100, 0)


def test_has_variance():
    assert has_variance(np.array([0.0, 1.0, 1.0]))
    assert not has_variance(np.array([0.5, 0.5, 0.5]))
    assert not has_variance(np.array([1.0]))  # a singleton has no variance
    # ... unless the estimator has no group (gae, remax, ...): a sample alone is not a degenerate group there
    assert has_variance(np.array([1.0]), one_sample_varies=True)
    assert not has_variance(np.array([0.5, 0.5]), one_sample_varies=True)


def test_success_rate_range():
    # mean of [1, 0, 0, 0] is 0.25
    assert success_rate_in_range(np.array([1.0, 0.0, 0.0, 0.0]), 0.2, 0.8)
    assert not success_rate_in_range(np.array([1.0, 0.0, 0.0, 0.0]), 0.3, 0.8)
    assert success_rate_in_range(np.array([1.0, 1.0]), 0.0, 1.0)  # bounds are inclusive
    with pytest.raises(ValueError):
        success_rate_in_range(np.array([1.0]), 0.9, 0.1)


def test_skip_rule():
    assert is_skip_step(np.array([0.0, 0.0]), np.array([True, True]))
    assert not is_skip_step(np.array([0.0, 0.3]), np.array([True, True]))
    # a nonzero advantage that is masked out of the loss does not count
    assert is_skip_step(np.array([0.0, 0.3]), np.array([True, False]))
    assert is_skip_step(np.array([]), np.array([], dtype=bool))


def test_rounds_needed():
    assert rounds_needed(kept_groups=8, target_groups=8, rounds_done=1, max_rounds=3) == 0
    assert rounds_needed(kept_groups=5, target_groups=8, rounds_done=1, max_rounds=3) == 3
    with pytest.raises(DynamicSamplingExhausted, match="kept 5 of the 8 groups .* after 3 generation round"):
        rounds_needed(kept_groups=5, target_groups=8, rounds_done=3, max_rounds=3)
