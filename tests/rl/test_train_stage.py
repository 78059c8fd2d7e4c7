"""The advantage and train stages through the real harness, on a tiny Llama saved as the run's base model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from .pipeline_helpers import N_PROMPTS, N_SAMPLES, run_iteration


def test_two_iterations_then_a_skipped_one(run_layout):
    make, model_dir = run_layout
    layout = make()
    batch_manifest, checkpoint, metrics_manifest = run_iteration(layout, 0)
    assert batch_manifest.rows == N_PROMPTS * N_SAMPLES and batch_manifest.metrics["skipped"] is False
    assert batch_manifest.metrics["groups_kept"] == N_PROMPTS
    ckpt = Path(checkpoint.path)
    assert {
        "model.safetensors",
        "config.json",
        "optimizer.pt",
        "trainer_state.json",
        "tokenizer_config.json",
    } <= {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 1
    table = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert len(table) == 1 and table[0]["skipped"] is False and table[0]["step"] == 0
    assert table[0]["grad_norm"] > 0 and table[0]["tokens"] > 0
    # one on-policy step: PPO ratio 1, so the token-mean policy loss is -sum_i A_i L_i / sum_i L_i over the kept
    # rows, from the batch table's advantages and the rollouts' response lengths (not from the trainer)
    batch_rows = pq.read_table(Path(layout.table_path("batch", 0))).to_pylist()
    batch = {(r["prompt_id"], r["sample_idx"]): r for r in batch_rows}
    rollouts = pq.read_table(Path(layout.table_path("rollouts", 0))).to_pylist()
    lengths = {(r["prompt_id"], r["sample_idx"]): len(r["response_token_ids"]) for r in rollouts}
    kept = [key for key, row in batch.items() if row["kept"]]
    expected = -sum(batch[k]["advantage"] * lengths[k] for k in kept) / sum(lengths[k] for k in kept)
    assert table[0]["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert table[0]["loss_tokens"] == sum(lengths[k] for k in kept)
    # the sampler agreed with the trainer: importance ratios are 1
    assert table[0]["is_ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert table[0]["is_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    before = load_file(model_dir / "model.safetensors")
    after = load_file(ckpt / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics_manifest.metrics["optimizer_resumed"] is False

    # iteration 1 trains checkpoint 0 and resumes its optimizer state and step count
    _, checkpoint_1, manifest_1 = run_iteration(layout, 1)
    assert manifest_1.metrics["optimizer_resumed"] is True
    assert pq.read_table(Path(layout.table_path("train_metrics", 1))).to_pylist()[0]["step"] == 1

    # iteration 2: every reward equal -> nothing kept -> skipped step, checkpoint = copy of checkpoint 1
    batch_2, checkpoint_2, manifest_2 = run_iteration(layout, 2, equal_rewards=True)
    assert batch_2.metrics["skipped"] is True and manifest_2.metrics["skipped"] is True
    [row] = pq.read_table(Path(layout.table_path("train_metrics", 2))).to_pylist()
    assert row["skipped"] is True and row["step"] == 2 and row["tokens"] == 0
    w1 = load_file(Path(checkpoint_1.path) / "model.safetensors")
    w2 = load_file(Path(checkpoint_2.path) / "model.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert (Path(checkpoint_2.path) / "optimizer.pt").is_file()


def test_kl_lora_and_off_policy_options(run_layout):
    make, _ = run_layout
    layout = make(
        "train.kl_coef=0.1",
        "train.lora_rank=4",
        "train.epochs=2",
        "train.minibatches=2",
        "train.is_level=token",
        "train.rejection=[token_k1]",
        "train.gradient_checkpointing=true",
        "train.dtype=bfloat16",
        "train.lr_schedule=cosine",
        "train.warmup_steps=1",
    )
    _, checkpoint, manifest = run_iteration(layout, 0)
    rows = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and manifest.metrics["steps"] == 4
    assert rows[-1]["kl_ref"] > 0.0  # the policy moved away from the base model
    # LoRA is merged: the checkpoint is a plain model that loads without peft
    weights = load_file(Path(checkpoint.path) / "model.safetensors")
    assert not any("lora" in k for k in weights)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_advantage_names_the_row(bad):
    from schemas.errors import InputError
    from stages.train import training_samples

    def row(sample_idx: int, advantage: float) -> dict:
        return {"run_id": "t", "iteration": 0, "round": 0, "prompt_id": "p7", "sample_idx": sample_idx,
                "kept": True, "advantage": advantage}  # fmt: skip

    rollout = {"prompt_token_ids": [1, 5], "response_token_ids": [3], "response_logprobs": [-1.0]}
    rollouts = [{**row(i, 0.0), **rollout} for i in range(2)]
    # the finite row alone is fine
    samples, empty = training_samples([row(0, 0.5)], rollouts, "iter=0/batch")
    assert empty == 0 and samples[0]["advantage"] == 0.5
    with pytest.raises(InputError) as error:
        training_samples([row(0, 0.5), row(1, bad)], rollouts, "iter=0/batch")
    message = str(error.value)
    # the source table, the field, the value, and the rollout key (run_id, iteration, round, prompt_id,
    # sample_idx) of the offending row
    assert message.startswith("iter=0/batch: advantage") and f"advantage {bad} " in message
    assert "('t', 0, 0, 'p7', 1)" in message
    # a dropped row (kept False) is not read, whatever its advantage
    samples, _ = training_samples([row(0, 0.5), {**row(1, bad), "kept": False}], rollouts)
    assert len(samples) == 1
