"""Which samples and groups enter the loss, and reward shaping that depends on the response, not its score.

Pure functions over numpy arrays (`_N` one entry per sample, `_K` one per group), used by the advantage stage
in this order: `overlong_penalty` (DAPO's soft length penalty, added before any group statistic so it takes
part in the baseline); group filters `has_variance` (DAPO dynamic sampling) and `success_rate_in_range`, on
the values `advantage.filter_metric` names (a dropped group's samples stay in the table with `kept = False`
and a `drop_reason`); the `truncated` sample
mask (out of the loss, still in the baseline: dropping them there would bias the others' advantages); and
`is_skip_step`: with no kept nonzero advantage the step is skipped, since it would only move the policy
through KL/entropy terms and Adam's momentum, drift rather than learning.

Dynamic sampling across rounds is planned by `rounds_needed` and bounded by `max_rounds` (None: unbounded),
which raises `DynamicSamplingExhausted` at the cap.
"""

from __future__ import annotations

import numpy as np

# drop_reason values in the batch table (None when kept)
DROP_ZERO_VARIANCE = "zero_variance"
DROP_SUCCESS_RATE = "success_rate_out_of_range"
DROP_TRUNCATED = "truncated"
DROP_OVER_TARGET = "over_target"  # dynamic sampling produced more kept groups than the batch needs


def overlong_penalty(
    lengths_N: np.ndarray, max_length: int, buffer_length: int, factor: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment: p = min(-(L - (L_max - L_buffer)) / L_buffer * factor, 0).

    0 up to L_max - L_buffer tokens, then falling linearly to -factor at L = L_max (lower still past L_max;
    generation stops at L_max, so -factor is the floor in practice). Added to the reward.
    """
    if buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(f"overlong buffer must be in 1..max_length={max_length} (got {buffer_length})")
    lengths_N = np.asarray(lengths_N, dtype=np.float64)
    exceed_N = lengths_N - (max_length - buffer_length)
    return np.minimum(-exceed_N / buffer_length * factor, 0.0)


def has_variance(rewards_G: np.ndarray, one_sample_varies: bool = False) -> bool:
    """DAPO filter_groups: keep a group only if its rewards are not all equal (std > 0).

    A group with one sample has no variance, unless `one_sample_varies`: for an estimator that does not compare
    a group's samples (gae, remax, reinforce_pp, turn_gae) a sample alone is not a degenerate group, and they
    train with n_samples 1. Exact equality is the test: rewards are computed from pass counts, so equal outcomes
    give bit-equal floats, and any real difference carries signal.
    """
    rewards_G = np.asarray(rewards_G, dtype=np.float64)
    if rewards_G.size == 1:
        return one_sample_varies
    return rewards_G.size > 1 and bool(np.any(rewards_G != rewards_G[0]))


def success_rate_in_range(rewards_G: np.ndarray, low: float, high: float) -> bool:
    """Keep a group if low <= mean(r) <= high (e.g. [0.1, 0.9] drops prompts that are nearly always
    solved or nearly never solved)."""
    if low > high:
        raise ValueError(f"success-rate range is empty: low {low} > high {high}")
    mean = float(np.mean(rewards_G))
    return low <= mean <= high


def is_skip_step(advantages_N: np.ndarray, loss_mask_N: np.ndarray) -> bool:
    """True when no sample that enters the loss has a nonzero advantage (or none enters at all)."""
    advantages_N = np.asarray(advantages_N, dtype=np.float64)
    loss_mask_N = np.asarray(loss_mask_N, dtype=bool)
    return not bool(np.any(advantages_N[loss_mask_N] != 0.0))


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling hit its cap on generation rounds before the batch held enough kept groups."""


def rounds_needed(kept_groups: int, target_groups: int, rounds_done: int, max_rounds: int | None) -> int:
    """How many more groups (prompts) to generate in the next round; 0 when the batch is full.

    Raises DynamicSamplingExhausted when `rounds_done` rounds are already the cap and the batch is short,
    with a message that says what to change. `max_rounds` None: no cap (verl's max_num_gen_batches: 0).
    """
    if target_groups < 1 or (max_rounds is not None and max_rounds < 1):
        raise ValueError("target_groups and max_rounds must be >= 1")
    missing = target_groups - kept_groups
    if missing <= 0:
        return 0
    if max_rounds is not None and rounds_done >= max_rounds:
        raise DynamicSamplingExhausted(
            f"dynamic sampling kept {kept_groups} of the {target_groups} groups the batch needs after "
            f"{rounds_done} generation round(s) (the cap, advantage.max_generation_rounds={max_rounds}): "
            "too many prompts have all-equal rewards. Raise the cap, lower advantage.target_groups, "
            "or turn off advantage.drop_zero_variance_groups."
        )
    return missing
