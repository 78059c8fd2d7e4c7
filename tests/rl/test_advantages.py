"""Advantage estimators against numbers worked out by hand (the arithmetic is in each test's comments)."""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest

from schemas.config import AdvantageConfig
from stages.rl.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    mean_centered_advantages,
    opo_advantages,
    rloo_advantages,
    whiten,
)


def test_grpo_binary_group():
    # r = [1, 0, 0, 1]: mean 0.5, population std 0.5, so A = +-0.5 / (0.5 + 1e-6)
    adv = grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0]), eps=1e-6)
    expected = 0.5 / 0.500001
    np.testing.assert_allclose(adv, [expected, -expected, -expected, expected], rtol=1e-12)


def test_grpo_uses_population_std():
    # r = [0, 1, 2]: mean 1, population std sqrt(2/3) = 0.8164966 (sample std would be 1.0)
    adv = grpo_advantages(np.array([0.0, 1.0, 2.0]), eps=0.0 + 1e-12)
    np.testing.assert_allclose(adv, [-1.2247449, 0.0, 1.2247449], rtol=1e-6)


def test_grpo_eps_is_added_to_std():
    # r = [0, 1]: mean 0.5, std 0.5; eps 0.5 gives A = 0.5 / 1.0 = 0.5
    np.testing.assert_allclose(grpo_advantages(np.array([0.0, 1.0]), eps=0.5), [-0.5, 0.5])


@pytest.mark.parametrize(
    "fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages, mean_centered_advantages]
)
def test_all_equal_and_singleton_give_exact_zero(fn):
    assert fn(np.array([0.7, 0.7, 0.7])).tolist() == [0.0, 0.0, 0.0]
    assert fn(np.array([1.0])).tolist() == [0.0]


def test_opo_all_equal_and_singleton():
    assert opo_advantages(np.array([0.3, 0.3]), np.array([5, 9])).tolist() == [0.0, 0.0]
    assert opo_advantages(np.array([1.0]), np.array([5])).tolist() == [0.0]


def test_dr_grpo_and_mean_centered():
    # r = [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]
    rewards = np.array([1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(dr_grpo_advantages(rewards), [0.75, -0.25, -0.25, -0.25])
    np.testing.assert_allclose(mean_centered_advantages(rewards), [0.75, -0.25, -0.25, -0.25])


def test_rloo():
    # r = [1, 0, 0, 0]: baselines (0+0+0)/3 = 0 for the first, (1+0+0)/3 for the others
    np.testing.assert_allclose(rloo_advantages(np.array([1.0, 0.0, 0.0, 0.0])), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # equivalently G/(G-1) * (r - mean): r = [2, 4]: mean 3 -> 2 * [-1, 1]
    np.testing.assert_allclose(rloo_advantages(np.array([2.0, 4.0])), [-2.0, 2.0])


def test_opo_length_weighted_baseline():
    # r = [1, 0], L = [10, 30]: b = (10*1 + 30*0) / 40 = 0.25 -> [0.75, -0.25]
    np.testing.assert_allclose(opo_advantages(np.array([1.0, 0.0]), np.array([10, 30])), [0.75, -0.25])
    # every length zero: falls back to the plain mean 0.5
    np.testing.assert_allclose(opo_advantages(np.array([1.0, 0.0]), np.array([0, 0])), [0.5, -0.5])


def test_whiten():
    # v = [1, 3]: mean 2, std 1 -> [-1, 1] / (1 + eps)
    np.testing.assert_allclose(whiten(np.array([1.0, 3.0]), eps=0.0 + 1e-12), [-1.0, 1.0])


def test_reinforce_pp_baseline_batch_whitening():
    # groups a: [1, 0] and b: [2, 0]: group-centred = [0.5, -0.5, 1, -1]
    # batch mean 0, population std sqrt((0.25+0.25+1+1)/4) = sqrt(0.625) = 0.7905694
    rewards = np.array([1.0, 0.0, 2.0, 0.0])
    adv = compute_advantages("reinforce_pp_baseline", rewards, np.array([0, 0, 1, 1]), eps=1e-12)
    s = math.sqrt(0.625)
    np.testing.assert_allclose(adv, [0.5 / s, -0.5 / s, 1 / s, -1 / s], rtol=1e-9)


def test_reinforce_pp_keeps_all_equal_groups_at_exact_zero():
    adv = compute_advantages(
        "reinforce_pp_baseline", np.array([1.0, 0.0, 0.3, 0.3, 0.3]), np.array([0, 0, 1, 1, 1])
    )
    assert adv[2:].tolist() == [0.0, 0.0, 0.0]
    # centred [0.5, -0.5, 0, 0, 0]: mean 0, population std sqrt(0.5 / 5) = sqrt(0.1) -> +-0.5 / sqrt(0.1)
    np.testing.assert_allclose(adv[:2], [1.5811388, -1.5811388], rtol=1e-5)


def test_compute_advantages_dispatches_per_group():
    # group 0: [1, 0] -> grpo +-0.5/(0.5+eps); group 1: singleton -> 0; group 2: all equal -> 0
    rewards = np.array([1.0, 0.0, 0.4, 0.9, 0.9])
    ids = np.array([7, 7, 3, 5, 5])  # any ids: samples that share one are a group
    adv = compute_advantages("grpo", rewards, ids, eps=1e-6)
    np.testing.assert_allclose(adv, [0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0, 0.0], rtol=1e-12)
    # opo needs lengths; rloo group 0: [1, 0] -> [1, -1]
    np.testing.assert_allclose(compute_advantages("rloo", rewards, ids), [1.0, -1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("opo", rewards, ids)


def test_the_config_allows_exactly_the_estimators_of_the_table():
    assert set(get_args(AdvantageConfig.model_fields["estimator"].annotation)) == set(ESTIMATORS)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_nan_reward_is_an_error(estimator):
    rewards = np.array([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="position 1 is nan"):
        compute_advantages(estimator, rewards, np.array([0, 0, 0]), lengths_N=np.array([1, 2, 3]))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", np.array([1.0, 0.0]), np.array([0, 0]))  # type: ignore[arg-type]
