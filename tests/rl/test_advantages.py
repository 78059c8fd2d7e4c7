"""Advantage estimators against numbers worked out by hand (the arithmetic is in each test's comments)."""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest

from schemas.config import AdvantageConfig
from stages.rl.advantages import (
    ESTIMATORS,
    EstimatorOptions,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    mean_centered_advantages,
    opo_advantages,
    rloo_advantages,
    whiten,
    whiten_tokens,
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
    adv = compute_advantages(
        "reinforce_pp_baseline", rewards, np.array([0, 0, 1, 1]), options=EstimatorOptions(eps=1e-12)
    )
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
    adv = compute_advantages("grpo", rewards, ids, options=EstimatorOptions(eps=1e-6))
    np.testing.assert_allclose(adv, [0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0, 0.0], rtol=1e-12)
    # opo needs lengths; rloo group 0: [1, 0] -> [1, -1]
    np.testing.assert_allclose(compute_advantages("rloo", rewards, ids), [1.0, -1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("opo", rewards, ids)


# The estimators compute_advantages computes from rewards and groups alone
FROM_REWARDS = [name for name, record in ESTIMATORS.items() if record.from_rewards]


def test_the_config_allows_exactly_the_estimators_of_the_table():
    assert list(get_args(AdvantageConfig.model_fields["estimator"].annotation)) == list(ESTIMATORS)
    assert all(name == record.name for name, record in ESTIMATORS.items())


def test_what_each_estimator_needs():
    # by the papers: GAE and turn-level GAE learn a critic; remax's baseline is a greedy rollout; the group-free
    # ones (no sample compared with another of its prompt) are GAE, ReMax, REINFORCE++ (batch whitening only) and
    # turn-level GAE; the 9 others compare a group's samples
    needs = {name: (r.level, r.needs_critic, r.needs_greedy_baseline, r.needs_group) for name, r in ESTIMATORS.items()}
    assert {name for name, (_, critic, _, _) in needs.items() if critic} == {"gae", "turn_gae"}
    assert {name for name, (_, _, greedy, _) in needs.items() if greedy} == {"remax"}
    assert {name for name, (*_, group) in needs.items() if not group} == {"gae", "remax", "reinforce_pp", "turn_gae"}
    assert {name: level for name, (level, *_) in needs.items() if level != "outcome"} == {
        "gae": "token", "turn_rloo": "turn", "turn_gae": "turn"}
    assert len(FROM_REWARDS) == 9 and "remax" not in FROM_REWARDS
    with pytest.raises(ValueError, match="'gae' needs more than the rewards"):
        compute_advantages("gae", np.array([1.0, 0.0]), np.array([0, 0]))


@pytest.mark.parametrize("estimator", FROM_REWARDS)
def test_nan_reward_is_an_error(estimator):
    rewards = np.array([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="position 1 is nan"):
        compute_advantages(estimator, rewards, np.array([0, 0, 0]), lengths_N=np.array([1, 2, 3]))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", np.array([1.0, 0.0]), np.array([0, 0]))  # type: ignore[arg-type]


def test_grpo_with_verl_sample_std():
    # r = [0, 1, 2]: sample std (ddof 1) = 1 -> A = [-1, 0, 1] / (1 + 1e-6) (population std gave +-1.2247)
    adv = grpo_advantages(np.array([0.0, 1.0, 2.0]), eps=1e-6, ddof=1)
    np.testing.assert_allclose(adv, [-1 / 1.000001, 0.0, 1 / 1.000001], rtol=1e-12)
    options = EstimatorOptions(ddof=1)
    np.testing.assert_allclose(
        compute_advantages("grpo", np.array([0.0, 1.0, 2.0]), np.array([0, 0, 0]), options=options), adv
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "mean_centered"])
def test_singleton_gets_its_raw_reward_on_request(estimator):
    # verl: a one-sample group has mean 0 (and std 1): its advantage is its reward. The two-sample group is unchanged.
    rewards, ids = np.array([0.4, 1.0, 0.0]), np.array([0, 1, 1])
    verl = compute_advantages(estimator, rewards, ids, options=EstimatorOptions(singleton="reward"))
    ours = compute_advantages(estimator, rewards, ids)
    assert verl[0] == 0.4 and ours[0] == 0.0
    np.testing.assert_allclose(verl[1:], ours[1:])


def test_grpo_passk_gives_only_the_best_an_advantage():
    # r = [0.2, 1.0, 0.5, 0.0]: best 1.0, second 0.5: (1.0 - 0.5) / (std + 1e-6), population std 0.376663
    # -> 1.327443; every other sample 0. With the sample std 0.434933: 1.149600.
    rewards = np.array([0.2, 1.0, 0.5, 0.0])
    np.testing.assert_allclose(grpo_passk_advantages(rewards), [0.0, 1.327443, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(grpo_passk_advantages(rewards, ddof=1), [0.0, 1.149600, 0.0, 0.0], rtol=1e-6)
    # two equal maxima: r_max - r_second = 0, nothing; a singleton: 0
    assert grpo_passk_advantages(np.array([1.0, 0.0, 1.0])).tolist() == [0.0, 0.0, 0.0]
    assert grpo_passk_advantages(np.array([1.0])).tolist() == [0.0]


def test_gpg_scales_the_centred_rewards_by_the_nonzero_share():
    # groups [1, 0] and [0.5, 0.5, 0, 0]: 3 of the 6 rewards nonzero -> alpha = 6 / 3 = 2;
    # centred [0.5, -0.5], [0.25, 0.25, -0.25, -0.25] -> times 2
    rewards, ids = np.array([1.0, 0.0, 0.5, 0.5, 0.0, 0.0]), np.array([0, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(compute_advantages("gpg", rewards, ids), [1.0, -1.0, 0.5, 0.5, -0.5, -0.5])
    # no nonzero reward: alpha = 6 / max(0, 1), and every centred value is 0
    assert compute_advantages("gpg", np.zeros(6), ids).tolist() == [0.0] * 6


def test_reinforce_pp_whitens_the_raw_rewards_over_samples_or_tokens():
    # r = [1, 0, 0, 1, 1], groups ignored. Per sample: mean 0.6, std sqrt(0.24) = 0.489898
    rewards, ids, lengths = np.array([1.0, 0.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1, 2]), np.array([1, 3, 1, 1, 2])
    np.testing.assert_allclose(
        compute_advantages("reinforce_pp", rewards, ids, lengths), (rewards - 0.6) / (np.sqrt(0.24) + 1e-6)
    )
    # per token (verl's masked_whiten): 8 tokens, mean (1 + 1 + 2) / 8 = 0.5, var 8 * 0.25 / (8 - 1) = 2 / 7
    # -> +-0.5 / sqrt(2/7 + 1e-8) = +-0.935414
    by_token = compute_advantages("reinforce_pp", rewards, ids, lengths, EstimatorOptions(whiten_by="token"))
    np.testing.assert_allclose(by_token, [0.935414, -0.935414, -0.935414, 0.935414, 0.935414], rtol=1e-6)
    np.testing.assert_allclose(whiten_tokens(rewards, lengths), by_token)
    # all equal: exact zeros
    assert compute_advantages("reinforce_pp", np.full(3, 0.7), np.array([0, 1, 2])).tolist() == [0.0] * 3


def test_reinforce_pp_baseline_whitens_over_tokens_as_verl():
    # groups [1, 0] (lengths 1, 3) and [1, 0] (lengths 2, 2): centred [0.5, -0.5, 0.5, -0.5]
    # per token: 8 tokens, mean (0.5 - 1.5 + 1 - 1) / 8 = -0.125; var sum L (c + 0.125)^2 / 7
    #   = (0.390625 + 3 * 0.140625 + 2 * 0.390625 + 2 * 0.140625) / 7 = 1.875 / 7 = 0.267857
    rewards, ids, lengths = np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1]), np.array([1, 3, 2, 2])
    adv = compute_advantages("reinforce_pp_baseline", rewards, ids, lengths, EstimatorOptions(whiten_by="token"))
    s = math.sqrt(1.875 / 7 + 1e-8)
    np.testing.assert_allclose(adv, [0.625 / s, -0.375 / s, 0.625 / s, -0.375 / s], rtol=1e-9)
