"""The multi-turn recipes end to end at a tiny size, through the real flow (`rlpipe run`, Prefect, stage
processes, SmolLM2 on the HF backend, the sandbox, a training step): deployments/configs/retool-cpu.yaml (tool
mode on the shipped math set), tools-cpu.yaml (tools with schemas, Hermes calls through the shipped tools
template) and code-feedback-cpu.yaml (2-turn feedback on pytasks). Each run's rollouts hold
conversations whose loss masks, spans and turn rewards fit together, the train stage ran on them, and the
evaluation reports the multi-turn figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).parents[2]
TINY = [
    "iterations=1", "generate.backend=hf", "generate.prompts_per_iteration=1", "generate.n_samples=2",
    "generate.max_new_tokens=24", "generate.mismatch_samples=1", "data.max_test_prompts=1", "evaluate.n_samples=1",
    "evaluate.k=[1]", "evaluate.greedy=false", "evaluate.max_new_tokens=24", "score.workers=1",
    "train.micro_batch_tokens=1024",
]


def run_recipe(root: Path, recipe: str, *extra: str) -> Path:
    sets = [arg for item in (*TINY, *extra) for arg in ("--set", item)]
    env = {**os.environ, "RLPIPE_ROOT": str(root), "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", f"deployments/configs/{recipe}.yaml", *sets],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1100,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return root / "runs" / recipe


def check_conversations(run_dir: Path, max_turns: int, budget: int) -> list[dict]:
    rollouts = pq.read_table(run_dir / "iter=0000" / "rollouts.parquet").to_pylist()
    assert len(rollouts) == 2
    for row in rollouts:
        mask, spans = row["loss_mask"], row["turn_spans"]
        assert len(mask) == row["num_tokens"] == len(row["response_token_ids"]) <= budget
        assert 1 <= row["num_turns"] == len(spans) <= max_turns
        assert sum(mask) == sum(end - start for start, end in spans)
        assert len(json.loads(row["conversation"])) >= row["num_turns"]
    batch = pq.read_table(run_dir / "iter=0000" / "batch.parquet").num_rows
    assert batch == 2 and pq.read_table(run_dir / "iter=0000" / "train_metrics.parquet").num_rows >= 1
    assert (run_dir / "checkpoints" / "iter=0000" / "model.safetensors").exists()
    return rollouts


def eval_metrics(run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "iter=0000" / "eval.parquet.manifest.json").read_text())
    (dataset,) = [key for key, value in manifest["metrics"].items() if isinstance(value, dict) and "pass@1" in value]
    return manifest["metrics"][dataset]


def test_retool_recipe(tmp_path: Path) -> None:
    run_dir = run_recipe(tmp_path, "retool-cpu", "generate.multi_turn.max_turns=2",
                         "generate.multi_turn.max_response_tokens=64")
    rollouts = check_conversations(run_dir, max_turns=2, budget=64)
    assert all(row["turn_rewards"] is None and row["tool_errors"] <= row["tool_calls"] <= 3 for row in rollouts)
    figures = eval_metrics(run_dir)
    assert {"mean_turns", "tool_calls_per_answer"} <= set(figures) and 0.0 <= figures["pass@1"] <= 1.0


def test_tools_recipe(tmp_path: Path) -> None:
    """The prompts the model saw list both tools (the tools template's system message); every tool message is
    the answer to a call (the packaged model rarely writes a valid one: mostly error observations)."""
    run_dir = run_recipe(tmp_path, "tools-cpu", "generate.multi_turn.max_turns=2",
                         "generate.multi_turn.max_response_tokens=96")
    rollouts = check_conversations(run_dir, max_turns=2, budget=96)
    for row in rollouts:
        assert row["turn_rewards"] is None and row["tool_errors"] <= row["tool_calls"] <= 3
        roles = [m["role"] for m in json.loads(row["conversation"])]
        assert roles.count("tool") == row["tool_calls"]
    from schemas.config import ModelConfig
    from stages.generation.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(ModelConfig()))
    text = tokenizer.decode(rollouts[0]["prompt_token_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '{"name": "code_interpreter"' in text and '{"name": "calculate"' in text
    assert "<|im_start|>user\nSolve the problem. You may call a tool" in text
    figures = eval_metrics(run_dir)
    assert {"mean_turns", "tool_calls_per_answer"} <= set(figures) and 0.0 <= figures["pass@1"] <= 1.0


def test_code_feedback_recipe(tmp_path: Path) -> None:
    run_dir = run_recipe(tmp_path, "code-feedback-cpu", "generate.multi_turn.max_response_tokens=192",
                         "generate.multi_turn.feedback_chars=200", "generate.multi_turn.feedback_tests=all")
    rollouts = check_conversations(run_dir, max_turns=2, budget=192)
    for row in rollouts:
        assert len(row["turn_rewards"]) == row["num_turns"] and row["tool_calls"] == 0
        roles = [m["role"] for m in json.loads(row["conversation"])]
        assert roles in (["assistant"], ["assistant", "user"], ["assistant", "user", "assistant"])
    scores = pq.read_table(run_dir / "iter=0000" / "scores.parquet").to_pylist()
    for row, scored in zip(rollouts, scores, strict=True):  # the score stage grades the final answer: last reward
        if row["finish_reason"] != "budget" or len(json.loads(row["conversation"])) % 2 == 1:
            assert scored["reward"] == pytest.approx(row["turn_rewards"][-1])
    figures = eval_metrics(run_dir)
    assert "mean_turns" in figures and "retried_answers" in figures
    # feedback_tests all in training, but evaluation never shows a held-out test's text (pytasks: `assert
    # candidate(...) == ...`); its response_text is the whole conversation, feedback included
    evaluated = pq.read_table(run_dir / "iter=0000" / "eval.parquet").to_pylist()
    assert any("Your answer failed" in row["response_text"] for row in evaluated)  # 24 tokens: no answer passes
    assert all("candidate(" not in row["response_text"] for row in evaluated)
