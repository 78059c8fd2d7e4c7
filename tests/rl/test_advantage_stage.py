"""The advantage stage's pure core (`build_batch`, `join_scores`) on hand-made groups."""

from __future__ import annotations

import math

import pytest

from schemas.config import AdvantageConfig
from stages.advantage import build_batch, join_scores
from stages.harness import StageInputError


def sample(
    prompt: str, idx: int, reward: float, num_tokens: int = 10, truncated: bool = False, round_: int = 0
):
    return {
        "run_id": "r",
        "iteration": 0,
        "round": round_,
        "prompt_id": prompt,
        "sample_idx": idx,
        "reward": reward,
        "num_tokens": num_tokens,
        "truncated": truncated,
    }


def by_key(rows):
    return {(r["round"], r["prompt_id"], r["sample_idx"]): r for r in rows}


def test_grpo_batch_with_zero_variance_group():
    # a: [1, 0] -> +-0.5 / (0.5 + 1e-6); b: [1, 1] all equal -> dropped, advantage 0
    rows, metrics = build_batch(
        [sample("a", 0, 1.0), sample("a", 1, 0.0), sample("b", 0, 1.0), sample("b", 1, 1.0)],
        AdvantageConfig(),
        max_new_tokens=96,
    )
    got = by_key(rows)
    assert got[(0, "a", 0)]["advantage"] == pytest.approx(0.5 / 0.500001)
    assert got[(0, "a", 1)]["advantage"] == pytest.approx(-0.5 / 0.500001)
    assert [got[(0, "b", i)]["drop_reason"] for i in (0, 1)] == ["zero_variance"] * 2
    assert [got[(0, "b", i)]["advantage"] for i in (0, 1)] == [0.0, 0.0]
    assert got[(0, "a", 0)]["group_mean"] == 0.5 and got[(0, "a", 0)]["group_std"] == 0.5
    assert metrics["groups_kept"] == 1 and metrics["groups_dropped"] == {"zero_variance": 1}
    assert metrics["samples_kept"] == 2 and metrics["skipped"] is False


def test_everything_equal_is_a_skipped_step():
    rows, metrics = build_batch([sample("a", 0, 0.0), sample("a", 1, 0.0)], AdvantageConfig(), 96)
    assert metrics["skipped"] is True and metrics["samples_kept"] == 0
    # with the zero-variance filter off, the group is kept but every advantage is 0: still skipped
    rows, metrics = build_batch(
        [sample("a", 0, 0.0), sample("a", 1, 0.0)], AdvantageConfig(drop_zero_variance_groups=False), 96
    )
    assert metrics["skipped"] is True and metrics["samples_kept"] == 2


def test_overlong_shaping_and_truncation_mask():
    # max 100, buffer 20: length 90 -> -0.5, 100 -> -1 (and truncated).
    # Shaped a: [1 - 0.5, 1 - 1, 1] = [.5, 0, 1]
    cfg = AdvantageConfig(estimator="mean_centered", overlong_buffer=20, mask_truncated=True)
    rows, metrics = build_batch(
        [sample("a", 0, 1.0, 90), sample("a", 1, 1.0, 100, truncated=True), sample("a", 2, 1.0, 50)], cfg, 100
    )
    got = by_key(rows)
    assert [got[(0, "a", i)]["shaped_reward"] for i in range(3)] == [0.5, 0.0, 1.0]
    # mean 0.5 -> advantages [0, -0.5, 0.5]; the truncated sample is in the baseline but not in the loss
    assert [got[(0, "a", i)]["advantage"] for i in range(3)] == [0.0, -0.5, 0.5]
    assert got[(0, "a", 1)]["kept"] is False and got[(0, "a", 1)]["drop_reason"] == "truncated"
    assert metrics["samples_dropped"] == {"truncated": 1}


def test_success_rate_range_and_rounds():
    # group a mean 0.25 (outside [0.3, 0.9]), group b in round 1 mean 0.5 (inside)
    cfg = AdvantageConfig(min_group_mean=0.3, max_group_mean=0.9, estimator="rloo")
    samples = [sample("a", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    samples += [sample("b", i, r, round_=1) for i, r in enumerate([1.0, 0.0])]
    rows, metrics = build_batch(samples, cfg, 96)
    got = by_key(rows)
    assert {got[(0, "a", i)]["drop_reason"] for i in range(4)} == {"success_rate_out_of_range"}
    assert [got[(1, "b", i)]["advantage"] for i in range(2)] == [1.0, -1.0]  # rloo of [1, 0]
    assert metrics["rounds"] == 2 and metrics["groups_kept"] == 1


def test_dynamic_sampling_target():
    samples = [sample(p, i, float(i)) for p in ("a", "b", "c") for i in range(2)]
    rows, metrics = build_batch(samples, AdvantageConfig(target_groups=2, max_generation_rounds=2), 96)
    assert {r["drop_reason"] for r in rows if r["prompt_id"] == "c"} == {"over_target"}
    assert metrics["groups_needed"] == 0
    # short of the target with rounds left: the flow is told how many more groups it needs
    rows, metrics = build_batch(samples, AdvantageConfig(target_groups=5, max_generation_rounds=2), 96)
    assert metrics["groups_needed"] == 2
    # at the cap: a clear error
    with pytest.raises(StageInputError, match="max_generation_rounds=1"):
        build_batch(samples, AdvantageConfig(target_groups=5, max_generation_rounds=1), 96)


def test_join_scores_errors():
    rollout = {k: v for k, v in sample("a", 0, 0.0).items() if k != "reward"}
    score = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "a", "sample_idx": 0, "reward": math.nan}
    with pytest.raises(StageInputError, match="not a finite number"):
        join_scores([rollout], [score])
    with pytest.raises(StageInputError, match="no score for rollout"):
        join_scores([rollout], [])
    with pytest.raises(StageInputError, match="have no rollout"):
        join_scores([], [{**score, "reward": 1.0}])
    assert join_scores([rollout], [{**score, "reward": 1.0}])[0]["reward"] == 1.0


def test_group_sizes_must_equal_n_samples_in_every_round():
    from stages.advantage import check_group_sizes

    full = [sample("a", i, 1.0) for i in range(4)] + [sample("a", i, 0.0, round_=1) for i in range(4)]
    check_group_sizes(full, 4, "rollouts.parquet")
    with pytest.raises(StageInputError, match=r"rollouts.parquet: prompt a \(round 1\) has 3 rollouts.*n_samples is 4"):
        check_group_sizes(full[:-1], 4, "rollouts.parquet")
