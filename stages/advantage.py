"""Stage `advantage`: turn scored rollouts into the training batch (advantages, shaping, filters).

Reads this iteration's rollouts and scores (every generation round), joins them on the rollout key and writes
the batch table with one row per rollout: `kept` says whether it enters the loss, `drop_reason` why not.
In order (each step documented in stages/rl/): shaped reward = reward + DAPO overlong penalty; group by
(round, prompt_id) and drop all-equal groups (`zero_variance`) or groups whose mean reward is out of range
(`success_rate_out_of_range`); keep the first `target_groups` groups (`over_target`), reporting a shortfall as
`groups_needed` for the flow to generate another round (an error naming the cap after
`max_generation_rounds`); advantages by the configured estimator (0 in dropped groups); `mask_truncated`
after the baseline; and the skip rule: no kept sample with a nonzero advantage makes the manifest say
`skipped: true`, and train records a skipped step.

All of this is the pure function `build_batch`; `run` only reads, calls it and writes.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.config import AdvantageConfig
from schemas.tables import ROLLOUT_KEY
from stages.harness import StageContext, StageInputError, exit_with
from stages.rl.advantages import compute_advantages, group_index
from stages.rl.filters import (
    DROP_OVER_TARGET,
    DROP_SUCCESS_RATE,
    DROP_TRUNCATED,
    DROP_ZERO_VARIANCE,
    DynamicSamplingExhausted,
    has_variance,
    is_skip_step,
    overlong_penalty,
    rounds_needed,
)


def _key(row: dict[str, Any]) -> tuple:
    return tuple(row[name] for name in ROLLOUT_KEY)


def join_scores(rollouts: list[dict], scores: list[dict], source: str = "scores") -> list[dict]:
    """Each rollout row with its score's reward; every rollout must have exactly one score and vice versa."""
    by_key: dict[tuple, dict] = {}
    for row in scores:
        key = _key(row)
        if key in by_key:
            raise StageInputError(
                f"{source}: duplicate score for rollout {dict(zip(ROLLOUT_KEY, key, strict=True))}"
            )
        by_key[key] = row
    joined = []
    for rollout in rollouts:
        key = _key(rollout)
        score = by_key.pop(key, None)
        if score is None:
            raise StageInputError(
                f"{source}: no score for rollout {dict(zip(ROLLOUT_KEY, key, strict=True))}"
            )
        reward = score["reward"]
        if reward is None or not math.isfinite(reward):
            raise StageInputError(
                f"{source}: reward {reward!r} of rollout {dict(zip(ROLLOUT_KEY, key, strict=True))} is not a "
                "finite number (a scorer bug: refusing to compute advantages from it)"
            )
        joined.append({**rollout, "reward": float(reward)})
    if by_key:
        extra = dict(zip(ROLLOUT_KEY, next(iter(by_key)), strict=True))
        raise StageInputError(f"{source}: {len(by_key)} scores have no rollout, e.g. {extra}")
    return joined


def check_group_sizes(rollouts: list[dict], n_samples: int, source: str) -> None:
    """Every (round, prompt) group has exactly `n_samples` rollouts: a short group (a lost sample) would give
    its members a baseline over fewer samples than the estimator assumes, silently."""
    sizes: dict[tuple, int] = {}
    for row in rollouts:
        key = (row["round"], row["prompt_id"])
        sizes[key] = sizes.get(key, 0) + 1
    for (round_index, prompt_id), size in sizes.items():
        if size != n_samples:
            raise StageInputError(
                f"{source}: prompt {prompt_id} (round {round_index}) has {size} rollouts, but generate.n_samples "
                f"is {n_samples}: the table is incomplete or from another config"
            )


def build_batch(
    samples: list[dict], cfg: AdvantageConfig, max_new_tokens: int
) -> tuple[list[dict], dict[str, Any]]:
    """Batch rows (one per sample, BATCH schema) and the manifest metrics, from joined rollout+score rows.

    `samples` need the rollout key, `reward`, `num_tokens` and `truncated`.
    """
    samples = sorted(samples, key=lambda r: (r["round"], r["prompt_id"], r["sample_idx"]))
    rewards_N = np.array([r["reward"] for r in samples], dtype=np.float64)
    lengths_N = np.array([r["num_tokens"] for r in samples], dtype=np.float64)
    shaped_N = rewards_N.copy()
    if cfg.overlong_buffer > 0:
        max_length = cfg.overlong_max_length or max_new_tokens
        shaped_N = shaped_N + overlong_penalty(
            lengths_N, max_length, cfg.overlong_buffer, cfg.overlong_penalty_factor
        )

    group_keys = [(r["round"], r["prompt_id"]) for r in samples]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(group_keys):
        groups.setdefault(key, []).append(i)

    # Group filters, in a fixed order: the first that fails names the reason.
    group_reason: dict[tuple, str | None] = {}
    for key, members in groups.items():
        reason = None
        if cfg.drop_zero_variance_groups and not has_variance(shaped_N[members]):
            reason = DROP_ZERO_VARIANCE
        else:
            mean = float(rewards_N[members].mean())
            low = -math.inf if cfg.min_group_mean is None else cfg.min_group_mean
            high = math.inf if cfg.max_group_mean is None else cfg.max_group_mean
            if not low <= mean <= high:
                reason = DROP_SUCCESS_RATE
        group_reason[key] = reason

    kept_groups = [key for key in groups if group_reason[key] is None]  # (round, prompt) order
    rounds_done = len({key[0] for key in groups})
    groups_needed = 0
    if cfg.target_groups is not None:
        for key in kept_groups[cfg.target_groups :]:
            group_reason[key] = DROP_OVER_TARGET
        kept_groups = kept_groups[: cfg.target_groups]
        try:
            groups_needed = rounds_needed(
                len(kept_groups), cfg.target_groups, rounds_done, cfg.max_generation_rounds
            )
        except DynamicSamplingExhausted as error:
            raise StageInputError(str(error)) from None

    # Advantages over the samples of kept groups (truncated ones included: they are part of the baseline).
    advantages_N = np.zeros_like(shaped_N)
    in_kept = np.array([group_reason[k] is None for k in group_keys], dtype=bool)
    if in_kept.any():
        index = np.flatnonzero(in_kept)
        group_ids, _ = group_index([group_keys[i] for i in index])
        advantages_N[index] = compute_advantages(
            cfg.estimator, shaped_N[index], group_ids, lengths_N[index], cfg.std_epsilon
        )

    rows, reasons = [], Counter()
    for i, sample in enumerate(samples):
        key = group_keys[i]
        members = groups[key]
        reason = group_reason[key]
        if reason is None and cfg.mask_truncated and sample["truncated"]:
            reason = DROP_TRUNCATED
        reasons[reason or "kept"] += 1
        rows.append(
            {
                **{name: sample[name] for name in ROLLOUT_KEY},
                "reward": float(rewards_N[i]),
                "shaped_reward": float(shaped_N[i]),
                "advantage": float(advantages_N[i]),
                "kept": reason is None,
                "drop_reason": reason,
                "group_size": len(members),
                "group_mean": float(shaped_N[members].mean()),
                "group_std": float(shaped_N[members].std(ddof=0)),
            }
        )

    kept_N = np.array([row["kept"] for row in rows], dtype=bool)
    group_reasons = Counter(group_reason.values())
    metrics = {
        "estimator": cfg.estimator,
        "samples": len(rows),
        "samples_kept": int(kept_N.sum()),
        "samples_dropped": {k: v for k, v in sorted(reasons.items()) if k != "kept"},
        "groups": len(groups),
        "groups_kept": len(kept_groups),
        "groups_dropped": {k: v for k, v in sorted(group_reasons.items(), key=str) if k is not None},
        "rounds": rounds_done,
        "groups_needed": groups_needed,
        "nonzero_advantages": int(np.count_nonzero(advantages_N[kept_N])),
        "mean_reward": float(rewards_N.mean()) if len(rows) else 0.0,
        "mean_shaped_reward": float(shaped_N.mean()) if len(rows) else 0.0,
        "skipped": is_skip_step(advantages_N, kept_N),
    }
    return rows, metrics


def run(ctx: StageContext) -> None:
    # Every generation round of the iteration (round 0, plus the rounds dynamic sampling asked for).
    rollouts = ctx.read_rounds("rollouts", [*ROLLOUT_KEY, "num_tokens", "truncated"]).to_pylist()
    scores = ctx.read_rounds("scores", [*ROLLOUT_KEY, "reward"]).to_pylist()
    rollouts_paths = ", ".join(ctx.inputs[name].path for name in ctx.round_input_names("rollouts"))
    scores_paths = ", ".join(ctx.inputs[name].path for name in ctx.round_input_names("scores"))
    check_group_sizes(rollouts, ctx.config.generate.n_samples, rollouts_paths)
    samples = join_scores(rollouts, scores, scores_paths)
    rows, metrics = build_batch(samples, ctx.config.advantage, ctx.config.generate.max_new_tokens)
    ctx.write_table("batch", pa.Table.from_pylist(rows), metrics)


if __name__ == "__main__":
    exit_with("advantage", run)
