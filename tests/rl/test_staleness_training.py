"""Overlapped iterations on the real harness: a tiny Llama, stand-in generate and score stages (the generating
checkpoint is the one the harness resolved for the `policy` input), the real advantage and train stages.

With pipeline.max_staleness 1 the stages run in the overlapped order (generate k+1 before train k): generate 1
must find its input (the base model) while checkpoint 0 does not exist yet, generate 2 reads checkpoint 0, and
train k still starts from checkpoint k-1. Every expected number is derived by hand from the design: the sampler
of iteration k is checkpoint k-1-N (policy_step k-N, 0 for the base), staleness = k - policy_step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages import advantage, train
from stages.registry import instance, stage_state
from storage.layout import BASE, RunLayout
from storage.manifest import read_manifest, stage_key
from storage.run import Run
from tests.support.stages import run_stage_at

from .pipeline_helpers import fake_generate, fake_score, run_iteration

ITERATIONS = 3


def checkpoint_sha(layout: RunLayout, iteration: int) -> str:
    return read_manifest(layout.fs, f"{layout.checkpoint_dir(iteration)}/manifest.json").sha256


def rows_of(layout: RunLayout, table: str, k: int) -> list[dict]:
    return pq.read_table(layout.table_path(table, k)).to_pylist()


def test_an_overlapped_run_samples_one_checkpoint_behind_and_reports_it(run_layout) -> None:  # noqa: ANN001
    make, _ = run_layout
    layout = make("pipeline.max_staleness=1", "train.is_level=token")
    order = [("generate", 0), ("score", 0), ("generate", 1), ("advantage", 0), ("train", 0), ("score", 1),
             ("generate", 2), ("advantage", 1), ("train", 1), ("score", 2), ("advantage", 2), ("train", 2)]
    work = {"generate": fake_generate, "score": fake_score(False), "advantage": advantage.run, "train": train.run}
    manifests = {}
    for stage, k in order:
        manifests[stage, k] = run_stage_at(stage, layout, k, work[stage])

    sampler = [checkpoint_sha(layout, BASE), checkpoint_sha(layout, BASE), checkpoint_sha(layout, 0)]
    for k in range(ITERATIONS):
        rollouts = rows_of(layout, "rollouts", k)
        assert {r["policy_step"] for r in rollouts} == {[0, 0, 1][k]}, k
        assert {r["policy_version"] for r in rollouts} == {sampler[k]}, k
        # train k starts from checkpoint k-1, the proximal policy, whatever sampled its rows
        [checkpoint, _] = manifests["train", k]
        assert checkpoint.inputs["policy"] == (checkpoint_sha(layout, k - 1) if k else checkpoint_sha(layout, BASE))
        metrics = rows_of(layout, "train_metrics", k)
        assert not any(r["skipped"] for r in metrics)
        assert {(r["staleness_mean"], r["staleness_max"]) for r in metrics} == {([0.0, 1.0, 1.0][k], [0, 1, 1][k])}
        assert max(r["staleness_max"] for r in metrics) <= 1  # never past pipeline.max_staleness
        assert checkpoint.metrics["staleness_max"] == [0, 1, 1][k]
    # the run is consistent: every instance is done for its config and inputs (a resume reruns nothing)
    run = Run.open(layout.root, layout.run_id)
    assert all(stage_state(run, instance(stage, k)).done for stage, k in order)


def test_a_strict_run_keeps_its_keys_and_reports_no_staleness(run_layout) -> None:  # noqa: ANN001
    make, _ = run_layout
    layout = make()
    config = Run.open(layout.root, layout.run_id).config
    prompts_sha = read_manifest(layout.fs, f"{layout.table_path('prompts', BASE)}.manifest.json").sha256
    for k in range(ITERATIONS):
        run_iteration(layout, k)
        assert {r["policy_step"] for r in rows_of(layout, "rollouts", k)} == {k}
        assert {(r["staleness_mean"], r["staleness_max"]) for r in rows_of(layout, "train_metrics", k)} == {(0.0, 0)}
        # the key every generate stage had before pipeline.max_staleness: its sections and checkpoint k-1
        generate_fields = config.model_dump(mode="json")["generate"]
        for field in ("warm_engine", "warm_engine_min_free_gib", "warm_engine_idle_s", "engines"):
            del generate_fields[field]
        previous = checkpoint_sha(layout, k - 1) if k else checkpoint_sha(layout, BASE)
        expected = stage_key("generate", {"generate": generate_fields, "seed": config.seed},
                             {"prompts": prompts_sha, "policy": previous})
        assert read_manifest(layout.fs, f"{layout.table_path('rollouts', k)}.manifest.json").key == expected


def key(prompt: str, idx: int) -> dict:
    return {"run_id": "r", "iteration": 3, "round": 0, "prompt_id": prompt, "sample_idx": idx}


def test_staleness_counts_the_kept_rows_with_a_response_and_a_null_step_as_strict() -> None:
    batch = [{**key("p", i), "kept": kept} for i, kept in enumerate([True, True, True, False, True])]
    rollouts = [
        {**key("p", 0), "response_token_ids": [3], "policy_step": 1},  # 3 - 1 = 2
        {**key("p", 1), "response_token_ids": [3], "policy_step": 2},  # 1
        {**key("p", 2), "response_token_ids": [3], "policy_step": None},  # a v2 table's row: strict, 0
        {**key("p", 3), "response_token_ids": [3], "policy_step": 0},  # not kept
        {**key("p", 4), "response_token_ids": [], "policy_step": 0},  # nothing to train on
    ]
    assert train.staleness(3, batch, rollouts) == {"staleness_mean": 1.0, "staleness_max": 2}
    empty = train.staleness(3, [{**key("p", 3), "kept": False}], rollouts)
    assert math.isnan(empty["staleness_mean"]) and empty["staleness_max"] == 0


@pytest.mark.slow
def test_the_generate_stage_records_the_step_of_the_checkpoint_it_sampled_with(tmp_path: Path) -> None:
    """The real generate stage (packaged model, HF backend, 1 prompt x 2 samples x 4 tokens) with max_staleness 1:
    iterations 0 and 1 sample with the base (step 0, generate 1 running before train 0 exists), iteration 2 with
    checkpoint 0 (step 1); train 0 is a skipped step (equal rewards), its checkpoint a copy of the base."""
    from schemas.config import load_config
    from stages import base_model, generate, prompts
    from tests.reliability import helpers as h
    from tests.support.stages import start_run

    overrides = h.run_overrides(
        tmp_path / "sources", "iterations=3", "generate.backend=hf", "generate.prompts_per_iteration=1",
        "generate.n_samples=2", "generate.max_new_tokens=4", "generate.mismatch_samples=0", "data.max_test_prompts=1",
        "pipeline.max_staleness=1", "train.is_level=token", "advantage.drop_zero_variance_groups=false",
    )
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    run_stage_at("base_model", layout, BASE, base_model.run)
    steps = {}
    for stage, k, work in [("generate", 0, generate.run), ("score", 0, fake_score(True)), ("generate", 1, generate.run),
                           ("advantage", 0, advantage.run), ("train", 0, train.run), ("generate", 2, generate.run)]:
        [manifest, *_] = run_stage_at(stage, layout, k, work)
        if stage == "generate":
            steps[k] = manifest.metrics["policy_step"]
            assert {r["policy_step"] for r in rows_of(layout, "rollouts", k)} == {steps[k]}
    assert steps == {0: 0, 1: 0, 2: 1}
    assert {r["policy_version"] for r in rows_of(layout, "rollouts", 2)} == {checkpoint_sha(layout, 0)}
    [train_row] = rows_of(layout, "train_metrics", 0)
    assert train_row["skipped"] and (train_row["staleness_mean"], train_row["staleness_max"]) == (0.0, 0)
