"""Which training prompts an iteration (and each dynamic-sampling round of it) generates for."""

from __future__ import annotations

from stages.generate import select_prompts, select_round_prompts
from stages.registry import instance
from storage.layout import RunLayout, instance_name
from storage.lock import stage_lock_path

PROMPTS = [f"p{i:02d}" for i in range(10)]


def test_iterations_walk_each_epoch_once_in_a_seeded_order() -> None:
    epoch = [pid for k in range(5) for pid in select_prompts(PROMPTS, 7, k, 2)]
    assert sorted(epoch) == PROMPTS  # 5 iterations x 2 prompts = one pass over the 10
    assert epoch != PROMPTS  # shuffled
    assert select_prompts(PROMPTS, 7, 3, 2) == select_prompts(list(reversed(PROMPTS)), 7, 3, 2)  # order-free
    assert select_prompts(PROMPTS, 8, 0, 10) != select_prompts(PROMPTS, 7, 0, 10)  # the seed decides


def test_rounds_draw_unused_prompts_deterministically_until_the_set_runs_out() -> None:
    rounds = [select_round_prompts(PROMPTS, 7, 1, 3, r) for r in range(5)]
    assert rounds[0] == select_prompts(PROMPTS, 7, 1, 3)
    assert [len(r) for r in rounds] == [3, 3, 3, 1, 0]  # 10 prompts: the fourth round gets the last one
    flat = [pid for r in rounds for pid in r]
    assert sorted(flat) == PROMPTS  # no prompt twice within an iteration
    assert rounds == [select_round_prompts(PROMPTS, 7, 1, 3, r) for r in range(5)]  # a rerun picks the same
    assert select_round_prompts(PROMPTS, 7, 2, 3, 1) != rounds[1]  # another iteration, another draw


def test_rounds_have_their_own_paths_and_leases() -> None:
    layout = RunLayout.create("/data", "r1")
    assert layout.table_path("rollouts", 3) == "/data/runs/r1/iter=0003/rollouts.parquet"
    assert layout.table_path("rollouts", 3, 2) == "/data/runs/r1/iter=0003/round=02/rollouts.parquet"
    assert instance_name(3, 2) == "iter=0003/round=02" and instance_name(3) == "iter=0003"
    assert stage_lock_path(layout, instance("generate", 3, 2)) != stage_lock_path(layout, instance("generate", 3))
    assert stage_lock_path(layout, instance("generate", 3, 2)).endswith("locks/generate@iter=0003.round=02.lock")
