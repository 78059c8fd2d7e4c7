"""Stage `score`: run every rollout's code (or check its answer) in the sandbox and record the reward.

One sandbox (a pool of warm workers) serves the whole stage. Each score row carries the reward, the number
of tests passed out of total, a status (ok / fail / timeout / error / no_code), the per-test results, the
extracted code, and the sandbox time, so `rlpipe show` can tell a sample's whole story. A multi-turn rollout
is graded on its final answer (`graded_text`).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pyarrow as pa

from schemas.errors import InputError
from schemas.tables import BASELINE_SAMPLE_IDX
from stages.generation.agent_loop import final_answer
from stages.harness import StageContext, exit_with
from stages.sandbox import ScoreJob, rewards


def graded_text(row: dict) -> str:
    """What a rollout is graded on: the response, or in a multi-turn rollout its final answer (the last assistant
    message of `conversation`), not the tool outputs or the earlier attempts."""
    if row.get("conversation") is None:
        return row["response_text"]
    return final_answer(json.loads(row["conversation"]))


def run(ctx: StageContext) -> None:
    prompts = {row["prompt_id"]: row for row in ctx.read_input("prompts").to_pylist()}
    rollouts = ctx.read_input("rollouts").to_pylist()
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
        "mean_reward": sum(sampled) / max(len(sampled), 1),
        "programs_per_second": round(len(results) / seconds, 2) if seconds > 0 else None,
        "sandbox_wall_seconds": round(seconds, 3),
        "reward_functions": reward_functions,
        # `sandbox_seconds` is measured wall time, so a rerun never reproduces the table byte for byte (the
        # rewards do reproduce, unless a program's outcome depends on time, e.g. a test near its timeout).
        "deterministic": False,
        "nondeterministic_columns": ["sandbox_seconds"],
    })


if __name__ == "__main__":
    exit_with("score", run)
