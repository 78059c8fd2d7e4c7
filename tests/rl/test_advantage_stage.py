"""The advantage stage's pure core (`build_batch`, `join_scores`, `check_group_sizes`) on hand-made groups."""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pytest

from schemas.config import AdvantageConfig
from schemas.errors import InputError
from schemas.tables import BATCH, conform
from stages.rl import batch
from stages.rl.batch import check_group_sizes, join_scores


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
        "status": "ok" if reward >= 1.0 else "fail",
    }


def build_batch(samples: list[dict], cfg: AdvantageConfig, max_new_tokens: int) -> tuple[list[dict], dict]:
    """`batch.build_batch` on rows given as dicts; its table (checked against BATCH) back as dicts."""
    table, metrics = batch.build_batch(pa.Table.from_pylist(samples), cfg, max_new_tokens)
    return conform(table, BATCH, "batch").to_pylist(), metrics


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
    # Shaped a: [1 - 0.5, 1 - 1, 1] = [.5, 0, 1]. Filtering on the shaped reward keeps the group (all correct:
    # the default seq_reward, and acc, would drop it: test_dapo_filters_on_correctness_not_the_shaped_reward)
    cfg = AdvantageConfig(
        estimator="mean_centered", overlong_buffer=20, mask_truncated=True, filter_metric="reward"
    )
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


def test_dapo_filters_on_correctness_not_the_shaped_reward():
    # Four correct answers of lengths 50/60/70/81, max 100, overlong buffer 20: only 81 is in the buffer,
    # penalty -(81 - 80) / 20 = -0.05, shaped [1, 1, 1, 0.95]. Filtering on the shaped reward keeps the group and
    # punishes a correct answer: grpo mean 0.9875, population std 0.021651 -> [0.577, 0.577, 0.577, -1.732].
    # DAPO filters on correctness (filter_groups.metric acc): all correct -> zero variance, dropped, no advantage.
    samples = [sample("a", i, 1.0, n) for i, n in enumerate([50, 60, 70, 81])]
    rows, metrics = build_batch(samples, AdvantageConfig(overlong_buffer=20, filter_metric="acc"), 100)
    assert [r["drop_reason"] for r in rows] == ["zero_variance"] * 4 and [r["advantage"] for r in rows] == [0.0] * 4
    assert [r["shaped_reward"] for r in rows] == pytest.approx([1.0, 1.0, 1.0, 0.95])
    assert metrics["skipped"] is True
    rows, _ = build_batch(samples, AdvantageConfig(overlong_buffer=20, filter_metric="reward"), 100)
    assert [r["advantage"] for r in rows] == pytest.approx([0.57735, 0.57735, 0.57735, -1.73205], abs=1e-4)
    # seq_reward is the scored reward before shaping: all 1.0, dropped too
    rows, _ = build_batch(samples, AdvantageConfig(overlong_buffer=20, filter_metric="seq_reward"), 100)
    assert {r["drop_reason"] for r in rows} == {"zero_variance"}


def test_dynamic_sampling_counts_groups_by_the_filter_metric():
    # partial rewards [0.5, 0.2] are both wrong (acc [0, 0]): dropped under acc, kept under seq_reward;
    # with target_groups 2 the acc batch is one group short, the seq_reward one is full
    samples = [sample("a", 0, 1.0), sample("a", 1, 0.0), sample("b", 0, 0.5), sample("b", 1, 0.2)]
    _, metrics = build_batch(samples, AdvantageConfig(target_groups=2, filter_metric="acc"), 96)
    assert metrics["groups_kept"] == 1 and metrics["groups_needed"] == 1
    _, metrics = build_batch(samples, AdvantageConfig(target_groups=2, filter_metric="seq_reward"), 96)
    assert metrics["groups_kept"] == 2 and metrics["groups_needed"] == 0
    # max_generation_rounds 0 is unlimited (verl's max_num_gen_batches 0): short after 9 rounds, no error
    many = [sample(f"p{r}", i, 0.0, round_=r) for r in range(9) for i in range(2)]
    _, metrics = build_batch(many, AdvantageConfig(target_groups=1, max_generation_rounds=0), 96)
    assert metrics["rounds"] == 9 and metrics["groups_needed"] == 1


def test_dynamic_sampling_target():
    samples = [sample(p, i, float(i)) for p in ("a", "b", "c") for i in range(2)]
    rows, metrics = build_batch(samples, AdvantageConfig(target_groups=2, max_generation_rounds=2), 96)
    assert {r["drop_reason"] for r in rows if r["prompt_id"] == "c"} == {"over_target"}
    assert metrics["groups_needed"] == 0
    # short of the target with rounds left: the flow is told how many more groups it needs
    rows, metrics = build_batch(samples, AdvantageConfig(target_groups=5, max_generation_rounds=2), 96)
    assert metrics["groups_needed"] == 2
    # at the cap: a clear error
    with pytest.raises(InputError, match="max_generation_rounds=1"):
        build_batch(samples, AdvantageConfig(target_groups=5, max_generation_rounds=1), 96)


ROLLOUT_SCHEMA = pa.schema([("run_id", pa.string()), ("iteration", pa.int32()), ("round", pa.int32()),
                            ("prompt_id", pa.string()), ("sample_idx", pa.int32()), ("num_tokens", pa.int32()),
                            ("truncated", pa.bool_())])
SCORE_SCHEMA = pa.schema([*(ROLLOUT_SCHEMA.field(name) for name in ROLLOUT_SCHEMA.names[:5]), ("reward", pa.float64()),
                          ("status", pa.string())])


def rollouts(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist([{k: v for k, v in r.items() if k not in ("reward", "status")} for r in rows],
                                schema=ROLLOUT_SCHEMA)


def scores(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=SCORE_SCHEMA)


def test_join_scores_errors():
    a0, a1 = sample("a", 0, 0.0), sample("a", 1, 1.0)
    nan_message = r"s.parquet: reward nan of rollout \{.*'prompt_id': 'a', 'sample_idx': 0\} is not a finite number"
    with pytest.raises(InputError, match=nan_message):
        join_scores(rollouts(a0), scores({**a0, "reward": math.nan}), "s.parquet")
    with pytest.raises(InputError, match=r"no score for rollout \{.*'sample_idx': 1\}"):
        join_scores(rollouts(a0, a1), scores(a0))
    with pytest.raises(InputError, match=r"1 scores have no rollout, e.g. \{.*'sample_idx': 1\}"):
        join_scores(rollouts(a0), scores(a0, a1))
    with pytest.raises(InputError, match=r"duplicate score for rollout \{.*'sample_idx': 1\}"):
        join_scores(rollouts(a0, a1), scores(a0, a1, a1))
    # the first rollout at fault, in rollout order, is the one named
    with pytest.raises(InputError, match=r"reward inf of rollout \{.*'sample_idx': 1\}"):
        join_scores(rollouts(a1, a0), scores({**a1, "reward": math.inf}))
    joined = join_scores(rollouts(a1, a0), scores(a0, a1)).sort_by("sample_idx")
    assert joined["reward"].to_pylist() == [0.0, 1.0] and joined["num_tokens"].to_pylist() == [10, 10]


def test_group_sizes_must_equal_n_samples_in_every_round():
    full = [sample("a", i, 1.0) for i in range(4)] + [sample("a", i, 0.0, round_=1) for i in range(4)]
    check_group_sizes(rollouts(*full), 4, "rollouts.parquet")
    with pytest.raises(InputError, match=r"rollouts.parquet: prompt a \(round 1\) has 3 rollouts.*n_samples is 4"):
        check_group_sizes(rollouts(*full[:-1]), 4, "rollouts.parquet")
    # a repeated rollout with a lost one keeps the count right: the repeat itself is refused
    repeat = r"rollouts.parquet: duplicate rollout \{.*'round': 1, .*'sample_idx': 2\}"
    with pytest.raises(InputError, match=repeat):
        check_group_sizes(rollouts(*full[:-1], full[-2]), 4, "rollouts.parquet")


def test_every_column_by_hand_from_shuffled_rows():
    # Two rounds; max length 100, overlong buffer 20 (penalty -(L - 80) / 20), mask_truncated, target 2 groups.
    #   round 0, "b": rewards [1, 0, 1], lengths [90, 50, 100 truncated] -> shaped [0.5, 0, 0]: mean 1/6,
    #     population std sqrt(((1/3)^2 + 2 (1/6)^2) / 3) = sqrt(1/18); kept; rloo A_i = r_i - mean(others):
    #     [0.5 - 0, 0 - 0.25, 0 - 0.25] = [0.5, -0.25, -0.25]; the truncated one masked, still in the baseline
    #   round 0, "a" sorts first: rewards [1, 1, 1], lengths 10 -> shaped all 1: zero_variance, advantage 0
    #   round 1, "a": rewards [0, 1, 1], lengths 10 -> kept: rloo [0 - 1, 1 - 0.5, 1 - 0.5] = [-1, 0.5, 0.5]
    #   round 1, "c": rewards [1, 0, 0] -> would be kept, but the target of 2 groups is full: over_target
    #   mean reward (2 + 3 + 2 + 1) / 12, mean shaped reward (0.5 + 3 + 2 + 1) / 12
    rows = [sample("b", i, r, n, truncated=n == 100) for i, (r, n) in enumerate([(1.0, 90), (0.0, 50), (1.0, 100)])]
    rows += [sample("a", i, 1.0) for i in range(3)]
    rows += [sample("a", i, r, round_=1) for i, r in enumerate([0.0, 1.0, 1.0])]
    rows += [sample("c", i, r, round_=1) for i, r in enumerate([1.0, 0.0, 0.0])]
    random.Random(0).shuffle(rows)
    cfg = AdvantageConfig(estimator="rloo", overlong_buffer=20, mask_truncated=True, target_groups=2,
                          max_generation_rounds=2)
    got, metrics = build_batch(rows, cfg, 100)
    assert [(r["round"], r["prompt_id"], r["sample_idx"]) for r in got] == [
        (0, "a", 0), (0, "a", 1), (0, "a", 2), (0, "b", 0), (0, "b", 1), (0, "b", 2),
        (1, "a", 0), (1, "a", 1), (1, "a", 2), (1, "c", 0), (1, "c", 1), (1, "c", 2),
    ]
    assert [r["shaped_reward"] for r in got] == [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert [r["advantage"] for r in got] == pytest.approx([0, 0, 0, 0.5, -0.25, -0.25, -1, 0.5, 0.5, 0, 0, 0])
    assert [r["drop_reason"] for r in got] == ["zero_variance"] * 3 + [None, None, "truncated"] + [None] * 3 + [
        "over_target"] * 3
    assert [r["kept"] for r in got] == [False] * 3 + [True, True, False] + [True] * 3 + [False] * 3
    assert {r["group_size"] for r in got} == {3}
    assert [got[i]["group_mean"] for i in (0, 3, 6, 9)] == pytest.approx([1.0, 1 / 6, 2 / 3, 1 / 3])
    assert [got[i]["group_std"] for i in (0, 3, 6, 9)] == pytest.approx([0.0, math.sqrt(1 / 18), math.sqrt(2 / 9),
                                                                        math.sqrt(2 / 9)])
    assert metrics == {
        "estimator": "rloo", "samples": 12, "samples_kept": 5,
        "samples_dropped": {"over_target": 3, "truncated": 1, "zero_variance": 3},
        "groups": 4, "groups_kept": 2, "groups_dropped": {"over_target": 1, "zero_variance": 1},
        "rounds": 2, "groups_needed": 0, "nonzero_advantages": 5,
        "mean_reward": pytest.approx(8 / 12), "mean_shaped_reward": pytest.approx(6.5 / 12), "skipped": False,
    }


def test_an_empty_success_rate_range_is_a_config_error():
    with pytest.raises(InputError, match="min_group_mean 0.8 > advantage.max_group_mean 0.2"):
        cfg = AdvantageConfig(min_group_mean=0.8, max_group_mean=0.2)
        build_batch([sample("a", 0, 1.0), sample("a", 1, 0.0)], cfg, 96)
