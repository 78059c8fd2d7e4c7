"""The advantage and train stages through the real harness, on a tiny Llama saved as the run's base model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from flows.cli import start_run
from schemas.config import TrainConfig, load_config
from stages import advantage, base_model, train
from stages.common import StageContext, run_stage
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw
from storage.layout import BASE, RunLayout

from .conftest import make_tiny_model

N_PROMPTS, N_SAMPLES = 2, 4


def save_tiny_model(directory: Path) -> Path:
    model = make_tiny_model(seed=3)
    model.save_pretrained(directory, safe_serialization=True)
    # the train stage never tokenizes; the base-model check only wants tokenizer files to exist
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return directory


def write_prompts(ctx: StageContext) -> None:
    rows = [
        {"prompt_id": f"p{i}", "dataset": "toy", "split": "train", "source_row": i,
         "messages": json.dumps([{"role": "user", "content": f"q{i}"}]),
         "reward_spec": json.dumps({"kind": "math", "answer": "1"}), "metadata": "{}"}
        for i in range(N_PROMPTS)
    ]
    ctx.write_table("prompts", pa.Table.from_pylist(rows))


def fake_generate(ctx: StageContext) -> None:
    """Random responses with their logprobs under the policy (a sampler that agrees with the trainer)."""
    from stages.rl.checkpoint import load_policy

    cfg = TrainConfig()
    model = load_policy(ctx.policy_dir(), cfg)
    helper = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    rng = np.random.default_rng(ctx.iteration)
    samples, keys = [], []
    for p in range(N_PROMPTS):
        for s in range(N_SAMPLES):
            prompt = [1, 3 + p] + rng.integers(3, 16, size=3).tolist()
            response = rng.integers(3, 16, size=int(rng.integers(2, 8))).tolist()
            samples.append(TrainSample(prompt, response, [0.0] * len(response), 0.0))
            keys.append((f"p{p}", s))
    logprobs = helper.sequence_logprobs(helper.policy, samples)
    rows = []
    for (prompt_id, s), sample, logp in zip(keys, samples, logprobs, strict=True):
        rows.append({
            "run_id": ctx.run_id, "iteration": ctx.iteration, "round": 0, "prompt_id": prompt_id, "sample_idx": s,
            "policy_version": ctx.inputs["policy"].sha256, "prompt_token_ids": sample.prompt_ids,
            "response_token_ids": sample.response_ids, "response_logprobs": logp.tolist(), "response_text": "",
            "finish_reason": "stop", "truncated": False, "num_tokens": len(sample.response_ids), "seed": 0,
            "backend": "fake",
        })
    ctx.write_table("rollouts", pa.Table.from_pylist(rows))


def fake_score(equal: bool):  # noqa: ANN201
    def run(ctx: StageContext) -> None:
        rows = []
        for r in ctx.read_input("rollouts").to_pylist():
            reward = 1.0 if equal else float(r["sample_idx"] % 2)
            rows.append({**{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")},
                         "reward": reward, "passed": int(reward), "total": 1, "status": "ok", "tests": "[]",
                         "code": None, "sandbox_seconds": 0.0})
        ctx.write_table("scores", pa.Table.from_pylist(rows))

    return run


def run_iteration(layout: RunLayout, k: int, equal_rewards: bool = False) -> list:
    run_stage("generate", layout, k, fake_generate)
    run_stage("score", layout, k, fake_score(equal_rewards))
    [batch_manifest] = run_stage("advantage", layout, k, advantage.run)
    return [batch_manifest, *run_stage("train", layout, k, train.run)]


@pytest.fixture
def run_layout(tmp_path: Path):  # noqa: ANN201
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    overrides = ["run_id=t", f"model.name_or_path={model_dir}", "iterations=3", "threads=1", "train.lr=1e-2",
                 "generate.max_new_tokens=8"]

    def make(*extra: str) -> RunLayout:
        layout = start_run(load_config(None, [*overrides, *extra]), str(tmp_path / "root"))
        run_stage("prompts", layout, BASE, write_prompts)
        run_stage("base_model", layout, BASE, base_model.run)
        return layout

    return make, model_dir


def test_two_iterations_then_a_skipped_one(run_layout):
    make, model_dir = run_layout
    layout = make()
    batch_manifest, checkpoint, metrics_manifest = run_iteration(layout, 0)
    assert batch_manifest.rows == N_PROMPTS * N_SAMPLES and batch_manifest.metrics["skipped"] is False
    assert batch_manifest.metrics["groups_kept"] == N_PROMPTS
    ckpt = Path(checkpoint.path)
    assert {"model.safetensors", "config.json", "optimizer.pt", "trainer_state.json", "tokenizer_config.json"} <= {
        p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 1
    table = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert len(table) == 1 and table[0]["skipped"] is False and table[0]["step"] == 0
    assert table[0]["grad_norm"] > 0 and table[0]["tokens"] > 0 and table[0]["approx_kl"] == 0.0
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
    layout = make("train.kl_coef=0.1", "train.lora_rank=4", "train.epochs=2", "train.minibatches=2",
                  "train.is_level=token", "train.rejection=[token_k1]", "train.gradient_checkpointing=true",
                  "train.dtype=bfloat16", "train.lr_schedule=cosine", "train.warmup_steps=1")
    _, checkpoint, manifest = run_iteration(layout, 0)
    rows = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and manifest.metrics["steps"] == 4
    assert rows[-1]["kl_ref"] > 0.0  # the policy moved away from the base model
    # LoRA is merged: the checkpoint is a plain model that loads without peft
    weights = load_file(Path(checkpoint.path) / "model.safetensors")
    assert not any("lora" in k for k in weights)
