"""Stage `score`: run every rollout's code (or check its answer) in the sandbox and record the reward.

One sandbox (a pool of warm workers) serves the whole stage. Each score row carries the reward, the number
of tests passed out of total, a status (ok / fail / timeout / error / no_code), the per-test results, the
extracted code, and the sandbox time, so `rlpipe show` can tell a sample's whole story. A multi-turn rollout
is graded on its final answer (`graded_text`). Sharded (pipeline.shards.score), each shard scores a contiguous range
of the rollouts' prompt groups and `merge` puts the parts back into the unsharded table's row order.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import InputError
from schemas.tables import BASELINE_SAMPLE_IDX
from stages.generation.agent_loop import final_answer
from stages.harness import StageContext, concatenate_parts, exit_with, trailing_rows_last
from stages.sandbox import ScoreJob, rewards
from storage.manifest import Manifest


def graded_text(row: dict) -> str:
    """What a rollout is graded on: the response, or in a multi-turn rollout its final answer (the last assistant
    message of `conversation`), not the tool outputs or the earlier attempts."""
    if row.get("conversation") is None:
        return row["response_text"]
    return final_answer(json.loads(row["conversation"]))


def run(ctx: StageContext) -> None:
    prompts = {row["prompt_id"]: row for row in ctx.read_input("prompts").to_pylist()}
    rollouts = ctx.read_input("rollouts").to_pylist()
    groups = set(ctx.shard_groups([row["prompt_id"] for row in rollouts]))  # all, or this shard's (pipeline.shards)
    rollouts = [row for row in rollouts if row["prompt_id"] in groups]
    jobs, inputs = [], []
    for row in rollouts:
        prompt = prompts.get(row["prompt_id"])
        if prompt is None:
            raise InputError(
                f"{ctx.inputs['rollouts'].path}: prompt_id {row['prompt_id']} is not in the prompts table"
            )
        jobs.append(ScoreJob(response_text=graded_text(row), reward_spec=json.loads(prompt["reward_spec"])))
        inputs.append(rewards.RewardInput.of_prompt(prompt))

    started = time.monotonic()
    results = rewards.score_with_progress(ctx.config.score, jobs, ctx.instance.label, inputs)
    seconds = time.monotonic() - started
    # one line per reward function (its mean, its failed share); a broken one stops the stage here (exit code 2)
    reward_functions = rewards.account_for(ctx.config.score, results)

    key_columns = ("run_id", "iteration", "round", "prompt_id", "sample_idx")
    rows = [
        {
            **{column: row[column] for column in key_columns},
            "reward": result.reward, "passed": result.passed, "total": result.total, "status": result.status,
            "tests": json.dumps(result.tests), "code": result.code, "sandbox_seconds": result.seconds,
        }
        for row, result in zip(rollouts, results, strict=True)
    ]
    statuses = Counter(result.status for result in results)
    # The policy's own samples: remax's greedy baseline rows are scored, but are not the policy's reward.
    sampled = [result.reward for row, result in zip(rollouts, results, strict=True)
               if row["sample_idx"] != BASELINE_SAMPLE_IDX]
    ctx.write_table("scores", pa.Table.from_pylist(rows, schema=None), {
        "status_counts": dict(statuses),
        "mean_reward": mean_reward(sampled),
        "programs_per_second": round(len(results) / seconds, 2) if seconds > 0 else None,
        "sandbox_wall_seconds": round(seconds, 3),
        "reward_functions": reward_functions,
        # `sandbox_seconds` is measured wall time, so a rerun never reproduces the table byte for byte (the
        # rewards do reproduce, unless a program's outcome depends on time, e.g. a test near its timeout).
        "deterministic": False,
        "nondeterministic_columns": ["sandbox_seconds"],
    })


def mean_reward(rewards: list[float]) -> float:
    return sum(rewards) / max(len(rewards), 1)


def merge(ctx: StageContext, parts: list[pa.Table], manifests: list[Manifest]) -> tuple[pa.Table, dict[str, Any]]:
    """The shards' parts as the unsharded stage writes the table (rows in the rollouts' order: remax's greedy rows
    after every group's samples), the mean reward and the reward functions' figures over all of it."""
    table, metrics = concatenate_parts(ctx, parts, manifests, counts={"status_counts"})
    baseline = pc.equal(table["sample_idx"], BASELINE_SAMPLE_IDX)
    table = trailing_rows_last(table, baseline)
    sampled = table.filter(pc.invert(baseline))["reward"].to_pylist()
    seconds = metrics["sandbox_wall_seconds"]
    metrics |= {"mean_reward": mean_reward(sampled),
                "programs_per_second": round(table.num_rows / seconds, 2) if seconds else None,
                "reward_functions": rewards.combine_reward_metrics([m.metrics["reward_functions"] for m in manifests])}
    return table, metrics


if __name__ == "__main__":
    exit_with("score", run, merge)
