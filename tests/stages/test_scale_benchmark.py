"""benchmarks/scale.py's pure parts, hand-computed: how two rollouts tables of the same requests are compared, and
what counts as sharding's own cost."""

from __future__ import annotations

import pyarrow as pa
import pytest

from benchmarks.scale import ShardedScore, rollouts_agreement


def rollouts(tokens: list[list[int]], logprobs: list[list[float]]) -> pa.Table:
    return pa.table({"response_token_ids": tokens, "response_logprobs": logprobs})


def test_logprobs_are_compared_only_on_rows_whose_tokens_are_equal() -> None:
    first = rollouts([[1, 2], [3], [4, 5]], [[-0.5, -1.0], [-2.0], [-0.1, -0.2]])
    second = rollouts([[1, 2], [7], [4, 5]], [[-0.5, -1.25], [-9.0], [-0.1, -0.2]])
    agreement = rollouts_agreement(first, second)
    assert (agreement.rows, agreement.same_tokens, agreement.max_logprob_diff) == (3, 2, 0.25)
    assert "2/3 rows" in agreement.line() and "66.7%" in agreement.line()
    with pytest.raises(ValueError, match="2 and 3 rows"):
        rollouts_agreement(rollouts([[1], [2]], [[0.0], [0.0]]), first)


def test_sharding_cost_is_dispatch_the_longest_parts_write_and_the_whole_merge() -> None:
    score = ShardedScore(wall=20.0, part_walls=[15.0, 17.0], merge_wall=2.0, part_write=0.25, validation=0.5)
    assert score.planning == pytest.approx(1.0)  # 20 - 17 - 2
    assert score.cost == pytest.approx(3.25)  # 1 + 0.25 + 2
