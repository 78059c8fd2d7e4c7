"""pipeline.shards without processes: the config's refusals, how a shard's prompt groups are chosen, how its part
is named and where it lives, and how the shards' manifest figures combine (hand-computed). The drills with real
processes, kills and the merged tables are in tests/reliability/test_shards.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

from schemas.config import ConfigError, load_config
from stages.harness import StageContext, combine_part_metrics, trailing_rows_last
from stages.registry import outputs_of, shards_of
from stages.sandbox.rewards import combine_reward_metrics
from storage.layout import BASE, RunLayout, Shard, StageInstance


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, list(overrides))
    return str(caught.value)


def test_shards_of_a_stage_that_cannot_shard_are_refused_naming_the_field() -> None:
    for stage in ("train", "advantage"):
        message = refusal(f"pipeline.shards={{{stage}: 2}}")
        assert "pipeline.shards" in message and f"stage '{stage}' cannot be sharded" in message
    assert "at least 1" in refusal("pipeline.shards={score: 0}")


def test_more_shards_than_prompt_groups_are_refused_at_load() -> None:
    message = refusal("pipeline.shards={score: 3}", "generate.prompts_per_iteration=2")
    assert "pipeline.shards.score=3 is more than the 2 prompt groups" in message
    assert load_config(None, ["pipeline.shards={score: 2}", "generate.prompts_per_iteration=2"]).pipeline.shards == {
        "score": 2}


def test_the_hf_backend_shards_only_one_request_at_a_time() -> None:
    message = refusal("pipeline.shards={evaluate: 2}", "generate.backend=hf", "generate.batch_size=4")
    assert "pipeline.shards.evaluate=2" in message and "generate.batch_size=1" in message
    config = load_config(None, ["pipeline.shards={generate: 2}", "generate.backend=hf", "generate.batch_size=1"])
    assert config.pipeline.shards_of("generate") == 2
    # score has no engine: any backend
    assert load_config(None, ["pipeline.shards={score: 2}", "generate.backend=hf"]).pipeline.shards_of("score") == 2


def test_evaluate_shards_also_split_evaluate_base_and_unsharded_stages_have_none() -> None:
    config = load_config(None, ["pipeline.shards={evaluate: 3}"])
    assert [t.shard for t in shards_of(config, StageInstance("evaluate_base"))] == [Shard(0, 3), Shard(1, 3),
                                                                                    Shard(2, 3)]
    assert shards_of(config, StageInstance("generate", 0)) == []


def test_a_shard_has_its_own_label_lease_name_and_part_file_beside_the_table() -> None:
    part = StageInstance("score", 3, 1).part(1, 2)
    assert part.label == "score iter=3 round=1 part-01-of-02"
    assert part.slug == "score@iter=0003.round=01.part-01-of-02"
    assert part.whole == StageInstance("score", 3, 1)
    layout = RunLayout.create("/data", "r")
    [output] = outputs_of(part)
    assert output.path(layout) == "/data/runs/r/iter=0003/round=01/scores.parquet.parts/part-01-of-02.parquet"
    assert output.manifest_path(layout).endswith("scores.parquet.parts/part-01-of-02.parquet.manifest.json")
    assert output.whole.path(layout) == "/data/runs/r/iter=0003/round=01/scores.parquet"
    assert Shard.parse("1/2") == Shard(1, 2)
    with pytest.raises(ValueError, match="0 <= INDEX < COUNT"):
        Shard.parse("2/2")


def groups_of(stage: str, shard: Shard | None, ids: list[str]) -> list[str]:
    ctx = StageContext(run=None, instance=StageInstance(stage, 0 if stage != "evaluate_base" else BASE, 0, shard),
                       resolved=None)  # type: ignore[arg-type] - shard_groups reads only the instance
    return ctx.shard_groups(ids)


def test_shard_groups_are_contiguous_ranges_of_whole_groups() -> None:
    ids = ["e", "a", "a", "c", "b", "e", "d"]  # rows of five groups, first seen in the order e a c b d
    assert groups_of("score", None, ids) == ["e", "a", "c", "b", "d"]
    assert [groups_of("score", Shard(k, 2), ids) for k in range(2)] == [["e", "a"], ["c", "b", "d"]]
    assert [groups_of("score", Shard(k, 3), ids) for k in range(3)] == [["e"], ["a", "c"], ["b", "d"]]
    seven = list("abcdefg")
    assert [len(groups_of("generate", Shard(k, 3), seven)) for k in range(3)] == [2, 2, 3]


def test_more_shards_than_groups_at_plan_time_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"pipeline.shards.evaluate=3 is more than the 2 prompt groups"):
        groups_of("evaluate_base", Shard(0, 3), ["a", "b"])


def test_part_metrics_combine_counts_times_and_agreements() -> None:
    parts = [{"backend": "hf", "status_counts": {"ok": 2, "fail": 1}, "prompts": 2, "policy_step": 3,
              "generation_seconds": 4.0, "mean_reward": 0.5, "engine": {"max_model_len": 512, "start_seconds": 1.0}},
             {"backend": "hf", "status_counts": {"ok": 1, "timeout": 1}, "prompts": 3, "policy_step": 3,
              "generation_seconds": 6.5, "mean_reward": 0.25, "engine": {"max_model_len": 512, "start_seconds": 2.0}}]
    assert combine_part_metrics(parts, {"status_counts", "prompts"}) == {
        "backend": "hf", "status_counts": {"ok": 3, "fail": 1, "timeout": 1}, "prompts": 5, "policy_step": 3,
        "generation_seconds": 6.5, "mean_reward": None, "engine": {"max_model_len": 512, "start_seconds": 2.0}}


def test_reward_function_figures_combine_as_over_all_calls() -> None:
    def term(calls: int, errors: int, values: int, mean: float | None, first: str | None) -> dict:
        return {"fn": "code_tests", "weight": 1.0, "calls": calls, "errors": errors, "error_frac": errors / calls,
                "values": values, "mean": mean, "first_error": first}

    combined = combine_reward_metrics([{"t": term(4, 0, 4, 0.5, None)}, {"t": term(4, 2, 2, 1.0, "boom")}])
    # over all 8 calls: values 0.5 x 4 and 1.0 x 2 -> mean 4/6; 2 errors of 8
    assert combined == {"t": term(8, 2, 6, 4 / 6, "boom") | {"error_frac": 0.25}}


def test_trailing_rows_move_to_the_end_in_their_order() -> None:
    table = pa.table({"i": [0, 1, 2, 3, 4], "tail": [False, True, False, True, False]})
    assert trailing_rows_last(table, table["tail"].combine_chunks())["i"].to_pylist() == [0, 2, 4, 1, 3]
