"""A run on the real harness with a tiny Llama as its base model, and fake generate/score stages: the
advantage and train stages run for real on it (tests/rl/test_train_stage.py, test_deepspeed.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from schemas.config import TrainConfig, load_config
from schemas.tables import SINGLE_TURN_ROLLOUT
from stages import advantage, base_model, train
from stages.harness import StageContext
from stages.registry import policy_step
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw
from storage.layout import BASE, RunLayout
from tests.support.stages import run_stage_at, start_run

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
        {
            "prompt_id": f"p{i}",
            "dataset": "toy",
            "split": "train",
            "source_row": i,
            "messages": json.dumps([{"role": "user", "content": f"q{i}"}]),
            "reward_spec": json.dumps({"kind": "math", "answer": "1"}),
            "metadata": "{}",
        }
        for i in range(N_PROMPTS)
    ]
    ctx.write_table("prompts", pa.Table.from_pylist(rows))


def start_tiny_run(directory: Path, run_id: str, iterations: int) -> RunLayout:
    """A run on the tiny Llama under `directory` (its model in tiny-model/, the root in root/) with its prompts and
    base model stages done: what run_iteration needs."""
    model_dir = save_tiny_model(directory / "tiny-model")
    config = load_config(None, [f"run_id={run_id}", f"model.name_or_path={model_dir}", f"iterations={iterations}",
                                "threads=1", "generate.max_new_tokens=8"])
    layout = start_run(config, str(directory / "root"))
    run_stage_at("prompts", layout, BASE, write_prompts)
    run_stage_at("base_model", layout, BASE, base_model.run)
    return layout


def write_policy_rollouts(ctx: StageContext, sample_indices: list[int], seed: int) -> None:
    """For each prompt, one random response per entry of `sample_indices` (BASELINE_SAMPLE_IDX for a greedy row)
    with its logprobs under the policy, after the fixed prompt [1, 3 + p, 5, 6]: the rollouts table."""
    from stages.rl.checkpoint import load_policy

    cfg = TrainConfig()
    model = load_policy(ctx.policy_dir(), cfg)
    helper = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    rng = np.random.default_rng(seed)
    samples, keys = [], []
    for p in range(N_PROMPTS):
        for s in sample_indices:
            response = rng.integers(3, 16, size=int(rng.integers(2, 8))).tolist()
            samples.append(TrainSample([1, 3 + p, 5, 6], response, [0.0] * len(response), 0.0))
            keys.append((f"p{p}", s))
    logprobs = helper.sequence_logprobs(helper.policy, samples)
    rows = [
        {"run_id": ctx.run_id, "iteration": ctx.iteration, "round": 0, "prompt_id": prompt_id, "sample_idx": s,
         "policy_version": ctx.inputs["policy"].sha256, "prompt_token_ids": sample.prompt_ids,
         "response_token_ids": sample.response_ids, "response_logprobs": logp.tolist(), "response_text": "",
         "finish_reason": "stop", "truncated": False, "num_tokens": len(sample.response_ids), "seed": 0,
         "backend": "fake", **SINGLE_TURN_ROLLOUT}
        for (prompt_id, s), sample, logp in zip(keys, samples, logprobs, strict=True)
    ]
    ctx.write_table("rollouts", pa.Table.from_pylist(rows))


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
        rows.append(
            {
                "run_id": ctx.run_id,
                "iteration": ctx.iteration,
                "round": 0,
                "prompt_id": prompt_id,
                "sample_idx": s,
                "policy_version": ctx.inputs["policy"].sha256,
                "prompt_token_ids": sample.prompt_ids,
                "response_token_ids": sample.response_ids,
                "response_logprobs": logp.tolist(),
                "response_text": "",
                "finish_reason": "stop",
                "truncated": False,
                "num_tokens": len(sample.response_ids),
                "seed": 0,
                "backend": "fake", **SINGLE_TURN_ROLLOUT,
                "policy_step": policy_step(ctx.sources["policy"]),  # the checkpoint the harness resolved
            }
        )
    ctx.write_table("rollouts", pa.Table.from_pylist(rows))


def fake_score(equal: bool):  # noqa: ANN201
    def run(ctx: StageContext) -> None:
        rows = []
        for r in ctx.read_input("rollouts").to_pylist():
            reward = 1.0 if equal else float(r["sample_idx"] % 2)
            rows.append(
                {
                    **{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")},
                    "reward": reward,
                    "passed": int(reward),
                    "total": 1,
                    "status": "ok" if reward == 1.0 else "fail",
                    "tests": "[]",
                    "code": None,
                    "sandbox_seconds": 0.0,
                }
            )
        ctx.write_table("scores", pa.Table.from_pylist(rows))

    return run


def run_iteration(layout: RunLayout, k: int, equal_rewards: bool = False) -> list:
    run_stage_at("generate", layout, k, fake_generate)
    run_stage_at("score", layout, k, fake_score(equal_rewards))
    [batch_manifest] = run_stage_at("advantage", layout, k, advantage.run)
    return [batch_manifest, *run_stage_at("train", layout, k, train.run)]
