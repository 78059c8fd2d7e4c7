"""The evaluation statistics: unbiased pass@k, its two-level bootstrap interval, and the paired gain."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.evaluation.metrics import (
    aggregate,
    answer_counts,
    bootstrap_mean_gain,
    bootstrap_pass_at_k,
    bootstrap_pass_at_k_gain,
    cluster_weights,
    clusters_of,
    mean_rewards,
    paired_gains,
    pass_at_k,
)


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct one
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def rows(correct_by_prompt: dict[str, list[bool]], greedy: dict[str, bool]) -> list[dict]:
    table = [{"prompt_id": p, "mode": "sampled", "correct": c, "num_tokens": 10}
             for p, cs in correct_by_prompt.items() for c in cs]
    return table + [{"prompt_id": p, "mode": "greedy", "correct": c, "num_tokens": 20} for p, c in greedy.items()]


def test_aggregate_numbers_and_interval() -> None:
    table = rows({"a": [True, False, False, False], "b": [True, True, False, False]}, {"a": True, "b": False})
    assert answer_counts(table) == {"a": (4, 1), "b": (4, 2)}
    assert answer_counts(table, "greedy") == {"a": (1, 1), "b": (1, 0)}  # pass@1 of these = greedy accuracy
    summary = aggregate(table, [1, 2])
    assert summary["prompts"] == 2 and summary["greedy_accuracy"] == 0.5
    assert summary["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    # pass@2: a = 1 - C(3,2)/C(4,2) = 1/2, b = 1 - C(2,2)/C(4,2) = 5/6
    assert summary["pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
    assert summary["mean_num_tokens"] == pytest.approx((8 * 10 + 2 * 20) / 10)
    for k in (1, 2):
        assert summary[f"pass@{k}_ci_low"] <= summary[f"pass@{k}"] <= summary[f"pass@{k}_ci_high"]
    assert aggregate(table, [1]) == aggregate(table, [1])  # the interval is seeded: one table, one interval


def test_bootstrap_degenerate_cases() -> None:
    n_P = np.array([4, 4, 4])
    assert bootstrap_pass_at_k(n_P, np.array([4, 4, 4]), 1) == (1.0, 1.0)
    assert bootstrap_pass_at_k(n_P, np.array([0, 0, 0]), 2) == (0.0, 0.0)
    with pytest.raises(ValueError, match="k=5"):
        bootstrap_pass_at_k(n_P, np.array([1, 1, 1]), 5)


def test_bootstrap_sample_level_by_hand() -> None:
    """One problem, 4 samples, 2 correct: only the sample level varies. c* ~ Binomial(4, 1/2), and
    P(c* = 0) = P(c* = 4) = 1/16 = 6.25% > 2.5%, so the interval of pass@1 = c*/4 is the full [0, 1]."""
    assert bootstrap_pass_at_k(np.array([4]), np.array([2]), 1) == (0.0, 1.0)
    # 8 samples, 4 correct: P(c* <= 1) = 9/256 = 3.5% > 2.5% >= P(c* = 0) = 0.4%, so the 2.5th percentile is
    # c* = 1, pass@1 = 1/8; by symmetry the 97.5th is 7/8.
    assert bootstrap_pass_at_k(np.array([8]), np.array([4]), 1, resamples=20000) == (0.125, 0.875)


def test_bootstrap_problem_level_matches_the_binomial_interval() -> None:
    """40 problems solved always or never (half each): only the problem level varies, the resampled mean
    is Binomial(40, 1/2) / 40, whose 95% range is about 0.5 +- 1.96 * sqrt(0.25 / 40) = 0.5 +- 0.155."""
    n_P = np.full(40, 4)
    c_P = np.array([4, 0] * 20)
    low, high = bootstrap_pass_at_k(n_P, c_P, 1, resamples=20000)
    assert low == pytest.approx(0.5 - 0.155, abs=0.03) and high == pytest.approx(0.5 + 0.155, abs=0.03)


def test_paired_gain() -> None:
    n_P = np.full(20, 4)
    none = np.zeros(20, dtype=int)
    # The same results before and after: no gain, and an interval that straddles it.
    same = np.array([1, 3] * 10)
    gain, low, high = bootstrap_pass_at_k_gain(n_P, same, n_P, same, 1)
    assert gain == 0.0 and low < 0 < high
    # Everything solved after, nothing before: gain 1, no doubt about it.
    assert bootstrap_pass_at_k_gain(n_P, none, n_P, np.full(20, 4), 1) == (1.0, 1.0, 1.0)
    # Half the problems go from never to always solved: gain 0.5, problem-level spread only,
    # Binomial(20, 1/2) / 20: 0.5 +- 1.96 * sqrt(0.25 / 20) = 0.5 +- 0.22.
    gain, low, high = bootstrap_pass_at_k_gain(n_P, none, n_P, np.array([4, 0] * 10), 1, resamples=20000)
    assert gain == 0.5 and low == pytest.approx(0.28, abs=0.05) and high == pytest.approx(0.72, abs=0.05)
    with pytest.raises(ValueError, match="same problems"):
        bootstrap_pass_at_k_gain(n_P, none, n_P[:3], none[:3], 1)


def test_mean_rewards_per_mode() -> None:
    table = [{"prompt_id": "a", "mode": "sampled", "reward": r} for r in (0.0, 0.5, 1.0, 0.5)]
    table += [{"prompt_id": "b", "mode": "sampled", "reward": -0.2},
              {"prompt_id": "a", "mode": "greedy", "reward": 1.0}]
    assert mean_rewards(table) == {"a": pytest.approx(0.5), "b": pytest.approx(-0.2)}
    assert mean_rewards(table, "greedy") == {"a": 1.0}


def test_paired_mean_gain() -> None:
    before = np.array([0.1, 0.2, 0.3, 0.4] * 5)
    # The same shift on every problem: the gain, with no spread at all.
    gain, low, high = bootstrap_mean_gain(before, before + 0.1)
    assert gain == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # Half the problems +0.2, half unchanged: mean of the differences 0.1; the resampled mean is
    # 0.2 * Binomial(20, 1/2) / 20, so 0.1 +- 1.96 * 0.2 * sqrt(0.25 / 20) = 0.1 +- 0.044.
    gain, low, high = bootstrap_mean_gain(before, before + np.array([0.2, 0.0] * 10), resamples=20000)
    assert gain == pytest.approx(0.1)
    assert low == pytest.approx(0.056, abs=0.01) and high == pytest.approx(0.144, abs=0.01)
    # Paired: a large problem-to-problem spread that both sides share does not widen the interval.
    spread = np.linspace(-1.0, 1.0, 20)
    assert bootstrap_mean_gain(spread, spread + 0.05)[1:] == (pytest.approx(0.05), pytest.approx(0.05))
    with pytest.raises(ValueError, match="same"):
        bootstrap_mean_gain(before, before[:3])


def test_paired_gains_of_evaluation_rows() -> None:
    """Problem a: base 0/2 sampled, greedy wrong; after 2/2, greedy right. Problem b: unchanged (1/2,
    greedy wrong). Problem c is only in the base table and is not compared. Pass@1 gain (1.0 + 0) / 2 = 0.5,
    greedy gain 0.5, reward gain ((1 - 0) + 0) / 2 = 0.5."""
    def answers(prompt_id: str, sampled: list[bool], greedy: bool) -> list[dict]:
        rows = [{"prompt_id": prompt_id, "mode": "sampled", "correct": c, "reward": float(c)} for c in sampled]
        return rows + [{"prompt_id": prompt_id, "mode": "greedy", "correct": greedy, "reward": float(greedy)}]

    base = answers("a", [False, False], False) + answers("b", [True, False], False) + answers("c", [True], True)
    after = answers("a", [True, True], True) + answers("b", [True, False], False)
    gains = paired_gains(base, after)
    assert set(gains) == {"pass@1", "greedy", "reward"}
    for name in ("greedy", "reward"):
        # Resampling two problems: both a (+1), both b (0) or one of each (+0.5).
        assert gains[name] == (pytest.approx(0.5), pytest.approx(0.0), pytest.approx(1.0)), name
    # pass@1 also resamples b's two answers on each side, so b alone can come out -1 .. +1.
    gain, low, high = gains["pass@1"]
    assert gain == pytest.approx(0.5) and -0.5 <= low < 0.0 and high == pytest.approx(1.0)
    assert paired_gains(base, answers("d", [True], True)) == {}


def test_cluster_weights_draw_whole_clusters() -> None:
    weights_RP = cluster_weights(np.array(["a", "a", "b", "b", "b"]), 5, 1000, np.random.default_rng(0))
    assert weights_RP.shape == (1000, 5)
    # Two draws of clusters per resample; a drawn cluster brings every one of its problems.
    assert (weights_RP[:, 0] == weights_RP[:, 1]).all() and (weights_RP[:, 2] == weights_RP[:, 4]).all()
    assert ((weights_RP[:, 0] + weights_RP[:, 2]) == 2).all()
    assert set(np.unique(weights_RP[:, 0])) == {0, 1, 2}
    # No clusters: every problem its own, P draws per resample.
    assert (cluster_weights(None, 5, 100, np.random.default_rng(0)).sum(axis=1) == 5).all()


def test_family_clusters_widen_the_interval_to_what_the_families_support() -> None:
    """Ten problems in two families of five: every problem of family A goes from wrong to right, family B
    stays wrong (one answer per problem, so no sample noise). Gain 0.5. As ten independent problems the
    interval is about 0.5 +- 1.96 * sqrt(0.25 / 10) = [0.2, 0.8]; as two families the resamples are AA (+1),
    AB (+0.5) or BB (0), so the interval is [0, 1]: two families cannot show more."""
    n_P, before_P = np.ones(10, dtype=np.int64), np.zeros(10, dtype=np.int64)
    after_P = np.array([1] * 5 + [0] * 5)
    family_P = np.array(["A"] * 5 + ["B"] * 5)
    gain, low, high = bootstrap_pass_at_k_gain(n_P, before_P, n_P, after_P, 1, resamples=20000)
    assert gain == 0.5 and low == pytest.approx(0.2, abs=0.001) and high == pytest.approx(0.8, abs=0.001)
    assert bootstrap_pass_at_k_gain(n_P, before_P, n_P, after_P, 1, cluster_P=family_P) == (0.5, 0.0, 1.0)
    assert bootstrap_mean_gain(before_P, after_P, cluster_P=family_P) == (0.5, 0.0, 1.0)
    assert bootstrap_pass_at_k(n_P, after_P, 1, cluster_P=family_P) == (0.0, 1.0)


def test_clusters_come_from_the_family_in_prompt_metadata() -> None:
    prompts = [{"prompt_id": "p1", "metadata": json.dumps({"family": "sum_even", "task_id": "t1"})},
               {"prompt_id": "p2", "metadata": json.dumps({"family": "sum_even"})},
               {"prompt_id": "h1", "metadata": json.dumps({"task_id": "HumanEval/3"})}]
    clusters = clusters_of(prompts)
    assert clusters == {"p1": "sum_even", "p2": "sum_even", "h1": "h1"}
    rows = [{"prompt_id": p, "mode": "sampled", "correct": True, "num_tokens": 3} for p in ("p1", "p2", "h1")]
    assert aggregate(rows, [1], clusters)["clusters"] == 2 and aggregate(rows, [1])["clusters"] == 3
