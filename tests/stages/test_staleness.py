"""Overlapped iterations (pipeline.max_staleness), the data side: which checkpoint each stage reads, and the
config checks. Expected inputs are written out by hand (the strict ones are the inputs every stage had before
the pipeline section existed), never computed by the registry itself."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import ConfigError, RunConfig, load_config
from schemas.tables import ROLLOUTS
from stages.registry import (
    PROMPTS,
    Output,
    declared_inputs,
    instance,
    policy_step,
    sampler_output,
)
from storage.fs import filesystem
from storage.layout import BASE
from storage.tables import read_table

STALE = ["pipeline.max_staleness=1", "train.is_level=token"]


def config(*overrides: str) -> RunConfig:
    return load_config(None, list(overrides))


def ckpt(iteration: int) -> Output:
    return Output("checkpoint", iteration)


def inputs(cfg: RunConfig, stage: str, k: int) -> dict[str, Output]:
    return declared_inputs(cfg, instance(stage, k))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_strict_run_keeps_the_inputs_it_had(k: int) -> None:
    cfg = config()
    previous = ckpt(k - 1) if k > 0 else ckpt(BASE)
    assert inputs(cfg, "generate", k) == {"prompts": PROMPTS, "policy": previous}
    assert inputs(cfg, "advantage", k) == {"rollouts": Output("rollouts", k), "scores": Output("scores", k)}
    assert inputs(cfg, "train", k) == {"batch": Output("batch", k), "rollouts": Output("rollouts", k),
                                       "policy": previous, "reference": ckpt(BASE)}
    gae = config("advantage.estimator=gae", "advantage.use_kl_in_reward=true", "advantage.kl_ctrl=adaptive")
    expected = {"rollouts": Output("rollouts", k), "scores": Output("scores", k), "reference": ckpt(BASE)}
    if k > 0:
        expected |= {"policy": ckpt(k - 1), "previous_batch": Output("batch", k - 1)}
    assert inputs(gae, "advantage", k) == expected


def test_the_pipeline_section_enters_no_stage_payload() -> None:
    from stages.registry import STAGES

    for spec in STAGES.values():
        assert "pipeline" not in spec.config_payload(config(*STALE)), spec.name


@pytest.mark.parametrize(("staleness", "sampled_with"), [
    (1, [BASE, BASE, 0, 1, 2]),
    (2, [BASE, BASE, BASE, 0, 1]),
])
def test_generate_samples_with_checkpoint_k_minus_1_minus_n(staleness: int, sampled_with: list[int]) -> None:
    cfg = config(f"pipeline.max_staleness={staleness}", "train.bypass_old_logprobs=true")
    for k, checkpoint in enumerate(sampled_with):
        assert sampler_output(cfg, k) == ckpt(checkpoint)
        assert inputs(cfg, "generate", k)["policy"] == ckpt(checkpoint)
        # train k still starts from (and recomputes its proximal logprobs with) checkpoint k-1
        assert inputs(cfg, "train", k)["policy"] == (ckpt(k - 1) if k > 0 else ckpt(BASE))


def test_policy_step_counts_train_stages() -> None:
    assert [policy_step(ckpt(j)) for j in (BASE, 0, 1, 4)] == [0, 1, 2, 5]


def test_the_critic_values_come_from_the_sampler() -> None:
    cfg = config(*STALE, "advantage.estimator=gae")
    assert "policy" not in inputs(cfg, "advantage", 0)
    assert "policy" not in inputs(cfg, "advantage", 1)  # sampled with the base: a new critic's values are 0
    assert inputs(cfg, "advantage", 2)["policy"] == ckpt(0)
    assert inputs(cfg, "advantage", 3)["policy"] == ckpt(1)


def test_staleness_needs_a_correction_for_the_stale_sampler() -> None:
    with pytest.raises(ConfigError) as error:
        config("pipeline.max_staleness=1")
    assert "train.is_level" in str(error.value) and "train.bypass_old_logprobs" in str(error.value)
    assert config("pipeline.max_staleness=1", "train.is_level=sequence").pipeline.max_staleness == 1
    assert config("pipeline.max_staleness=2", "train.bypass_old_logprobs=true").pipeline.max_staleness == 2


def test_staleness_refuses_dynamic_sampling() -> None:
    with pytest.raises(ConfigError) as error:
        config(*STALE, "advantage.target_groups=4")
    assert "advantage.target_groups" in str(error.value) and "pipeline.max_staleness" in str(error.value)


def test_staleness_is_not_negative() -> None:
    with pytest.raises(ConfigError, match="pipeline.max_staleness"):
        config("pipeline.max_staleness=-1")


def test_a_v2_rollouts_table_reads_with_a_null_policy_step(tmp_path: Path) -> None:
    """A rollouts table from before policy_step (v2) still reads; its rows get null (strict order: step k)."""
    v2 = pa.schema([field for field in ROLLOUTS.schema if field.name != "policy_step"])
    row = {"run_id": "r", "iteration": 1, "round": 0, "prompt_id": "p", "sample_idx": 0, "policy_version": "h",
           "prompt_token_ids": [1], "response_token_ids": [2], "response_logprobs": [-0.5], "response_text": "x",
           "finish_reason": "stop", "truncated": False, "num_tokens": 1, "seed": 7, "backend": "hf",
           "loss_mask": None, "turn_spans": None, "turn_rewards": None, "num_turns": 1, "tool_calls": 0,
           "tool_errors": 0, "tool_seconds": 0.0, "conversation": None}
    path = tmp_path / "rollouts.parquet"
    table = pa.Table.from_pylist([row], schema=v2).replace_schema_metadata({b"rlpipe.schema": b"rollouts/v2"})
    pq.write_table(table, path)
    read = read_table(filesystem(str(tmp_path)), str(path), ROLLOUTS).to_pylist()[0]
    assert read["policy_step"] is None and read["policy_version"] == "h"


def test_trackers_log_the_staleness_of_each_iteration() -> None:
    from flows.trackers import iteration_scalars
    from reports.html import ReportData

    steps = [{"iteration": 2, "step": i, "skipped": False, "loss": 1.0, "lr": 1e-5, "tokens": 10, "seconds": 1.0,
              "staleness_mean": 1.0, "staleness_max": 1} for i in range(2)]
    scalars = iteration_scalars(ReportData(run_id="r", root="/x", config=None, ks=[1], train=steps), 2)
    assert scalars["update/staleness_mean"] == 1.0 and scalars["update/staleness_max"] == 1


def test_the_rollouts_contract_bounds_the_staleness(tmp_path: Path) -> None:
    """iteration - policy_step must lie within 0..max_staleness (a null step, an older table's, counts as 0)."""
    from schemas.contracts import validate_table
    from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec

    synthetic = SyntheticRun(str(tmp_path), SyntheticSpec(run_id="c", iterations=3))
    rollouts = synthetic.iteration_tables(2, "f" * 64)["rollouts"]
    values = synthetic.config.model_dump(mode="json")
    strict = synthetic.config
    stale = RunConfig.model_validate({**values, "pipeline": {"max_staleness": 1},
                                      "train": {**values["train"], "is_level": "token"}})

    def staleness_failures(steps: list[int | None], config: RunConfig) -> int:
        column = rollouts.schema.get_field_index("policy_step")
        table = rollouts.set_column(column, ROLLOUTS.schema.field("policy_step"), pa.array(steps, pa.int32()))
        result = validate_table("rollouts", table, config)
        return sum(f.unexpected_count for f in result.failures if f.column == "_staleness")

    rows = rollouts.num_rows
    assert staleness_failures([2] * rows, strict) == 0
    assert staleness_failures([None] * rows, strict) == 0
    assert staleness_failures([1] * rows, strict) == rows  # one behind where none may be
    assert staleness_failures([1] * rows, stale) == 0
    assert staleness_failures([0] + [1] * (rows - 1), stale) == 1  # two behind
    assert staleness_failures([3] + [2] * (rows - 1), stale) == 1  # a policy from the future
