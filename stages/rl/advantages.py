"""Advantage estimators for outcome rewards: one scalar reward per sample, samples grouped by prompt.

Each estimator turns the rewards of one group (the G samples of one prompt) into one advantage per sample,
which the trainer broadcasts to the sample's response tokens. They are critic-free: the baseline comes from
the other samples of the same prompt, so easy and hard prompts both give a centred signal.

Conventions (tested in tests/rl/test_advantages.py): float64 numpy, `_G` one group, `_N` a flat batch. A NaN
or infinite reward is a `ValueError` naming the sample (a scorer bug), never a silent zero. A singleton group
gets advantage 0 (verl falls back to the raw reward, a biased uncentred signal). A group of equal rewards gets
exactly 0 (the std-normalised estimators compute 0 / (0 + eps)).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# (rewards_G, lengths_G or None, eps) -> advantages_G: one group's formula
GroupFormula = Callable[[np.ndarray, np.ndarray | None, float], np.ndarray]
# (rewards_N, group_ids_N, lengths_N or None, eps) -> advantages_N: a flat batch of groups
BatchEstimator = Callable[[np.ndarray, np.ndarray, np.ndarray | None, float], np.ndarray]


def check_finite(rewards_N: np.ndarray, what: str = "reward") -> np.ndarray:
    """Return `rewards_N` as float64, or raise ValueError naming the first non-finite entry."""
    rewards_N = np.asarray(rewards_N, dtype=np.float64)
    bad_N = ~np.isfinite(rewards_N)
    if bad_N.any():
        first = int(np.flatnonzero(bad_N)[0])
        raise ValueError(
            f"{what} at position {first} is {float(rewards_N[first])}; "
            f"{int(bad_N.sum())} of {rewards_N.size} "
            f"{what}s are NaN or infinite (a scorer bug: refusing to compute advantages from it)"
        )
    return rewards_N


def _no_signal(rewards_G: np.ndarray) -> bool:
    """A singleton or all-equal group: the mean of equal floats can be off by one ulp (3 x 0.7 averages to
    0.7000000000000001), so test equality directly and return exact zeros."""
    return rewards_G.size <= 1 or bool(np.all(rewards_G == rewards_G[0]))


def mean_centered_advantages(rewards_G: np.ndarray) -> np.ndarray:
    """A_i = r_i - mean(r).

    The plain group baseline (tinker-cookbook's `compute_advantages`). Unbiased up to the O(1/G) term
    that RLOO removes; no scale normalisation, so the gradient scale follows the reward scale.
    """
    rewards_G = check_finite(rewards_G)
    if _no_signal(rewards_G):
        return np.zeros_like(rewards_G)
    return rewards_G - rewards_G.mean()


def grpo_advantages(rewards_G: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean(r)) / (std(r) + eps), std the population std (ddof = 0). GRPO, Shao et al. 2024.

    Population std (ddof = 0) is a choice: with binary rewards and G samples it makes |A| depend only on
    the success rate, and it is defined for G = 1 (verl uses torch.std, ddof = 1). eps (default 1e-6) is
    added to the std, not under a square root, so an all-equal group gives exactly 0 / eps = 0.
    """
    rewards_G = check_finite(rewards_G)
    if _no_signal(rewards_G):
        return np.zeros_like(rewards_G)
    centred_G = rewards_G - rewards_G.mean()
    return centred_G / (rewards_G.std(ddof=0) + eps)


def dr_grpo_advantages(rewards_G: np.ndarray) -> np.ndarray:
    """A_i = r_i - mean(r). Dr. GRPO, Liu et al. 2025 ("Understanding R1-Zero-Like Training").

    Numerically the same as `mean_centered_advantages`: Dr. GRPO's point is to drop the std division
    (which up-weights too-easy and too-hard prompts) *and* the per-sequence length normalisation in the
    loss. The second half lives in the loss: pair this estimator with
    `loss_aggregation="seq-mean-token-sum-norm"` (the train stage does not change the loss behind your back).
    """
    return mean_centered_advantages(rewards_G)


def rloo_advantages(rewards_G: np.ndarray) -> np.ndarray:
    """A_i = r_i - (sum_{j != i} r_j) / (G - 1) = G / (G - 1) * (r_i - mean(r)). RLOO, Ahmadian et al. 2024.

    The leave-one-out baseline does not depend on the sample it is subtracted from, so the estimator is
    unbiased. Undefined for G = 1 (no other sample): advantage 0 there.
    """
    rewards_G = check_finite(rewards_G)
    size = rewards_G.size
    if _no_signal(rewards_G):
        return np.zeros_like(rewards_G)
    baseline_G = (rewards_G.sum() - rewards_G) / (size - 1)
    return rewards_G - baseline_G


def opo_advantages(rewards_G: np.ndarray, lengths_G: np.ndarray | None) -> np.ndarray:
    """A_i = r_i - b, b = sum_j L_j r_j / sum_j L_j. OPO, Hao et al. 2025 ("On-Policy RL with Optimal
    reward baseline").

    The length-weighted mean is the variance-minimising baseline when the gradient norm of a sequence
    grows with its token count L. Lengths are response token counts; a group whose lengths sum to 0
    (every response empty) falls back to the plain mean.
    """
    if lengths_G is None:
        raise ValueError("the opo estimator needs response lengths")
    rewards_G = check_finite(rewards_G)
    lengths_G = np.asarray(lengths_G, dtype=np.float64)
    if lengths_G.shape != rewards_G.shape:
        raise ValueError(f"lengths shape {lengths_G.shape} != rewards shape {rewards_G.shape}")
    if (lengths_G < 0).any():
        raise ValueError("response lengths must be >= 0")
    if _no_signal(rewards_G):
        return np.zeros_like(rewards_G)
    total_length = lengths_G.sum()
    baseline = (lengths_G * rewards_G).sum() / total_length if total_length > 0 else rewards_G.mean()
    return rewards_G - baseline


def whiten(values_N: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """w_i = (v_i - mean(v)) / (std(v) + eps) over the whole batch, std with ddof = 0."""
    values_N = check_finite(values_N, "value")
    if values_N.size == 0:
        return values_N
    return (values_N - values_N.mean()) / (values_N.std(ddof=0) + eps)


def per_group(formula: GroupFormula) -> BatchEstimator:
    """The batch estimator that applies `formula` to each group (the samples sharing a group id) on its own."""

    def estimate(
        rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, eps: float
    ) -> np.ndarray:
        advantages_N = np.zeros_like(rewards_N)
        for group in np.unique(group_ids_N):
            members = np.flatnonzero(group_ids_N == group)
            lengths_G = None if lengths_N is None else lengths_N[members]
            advantages_N[members] = formula(rewards_N[members], lengths_G, eps)
        return advantages_N

    return estimate


def reinforce_pp_baseline_advantages(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, eps: float
) -> np.ndarray:
    """A = whiten_batch(r_i - mean_group(r)). REINFORCE++-baseline, Hu et al. 2025: the one batch-level estimator.

    The group mean removes the prompt's difficulty and the whitening over every sample passed in sets the
    scale. Whitening is per sample, not per token (verl whitens over response tokens, which weights long
    responses more). Pass only the samples that will be trained on (after filtering), so dropped groups do
    not set the scale. Singleton groups contribute a 0 before whitening and stay exactly 0 after it; an
    all-zero batch stays all zero.
    """
    advantages_N = per_group(lambda rewards_G, lengths_G, eps: mean_centered_advantages(rewards_G))(
        rewards_N, group_ids_N, lengths_N, eps
    )
    # The batch mean of group-centred values is 0 up to rounding, so whitening would turn an exact 0
    # (an all-equal group) into +-1e-17: keep exact zeros exact, the skip rule tests `== 0`.
    zero_N = advantages_N == 0.0
    advantages_N = whiten(advantages_N, eps)
    advantages_N[zero_N] = 0.0
    return advantages_N


# Every estimator by name, each name written here once: `advantage.estimator` in schemas/config.py lists the
# same names (tests/rl/test_advantages.py checks the two agree). A new estimator is one entry.
ESTIMATORS: dict[str, BatchEstimator] = {
    "grpo": per_group(lambda rewards_G, lengths_G, eps: grpo_advantages(rewards_G, eps)),
    "dr_grpo": per_group(lambda rewards_G, lengths_G, eps: dr_grpo_advantages(rewards_G)),
    "rloo": per_group(lambda rewards_G, lengths_G, eps: rloo_advantages(rewards_G)),
    "opo": per_group(lambda rewards_G, lengths_G, eps: opo_advantages(rewards_G, lengths_G)),
    "mean_centered": per_group(lambda rewards_G, lengths_G, eps: mean_centered_advantages(rewards_G)),
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(
    estimator: str,
    rewards_N: np.ndarray,
    group_ids_N: np.ndarray,
    lengths_N: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Advantages of a flat batch by the estimator named `estimator` (a key of ESTIMATORS); samples that
    share a group id are one group. `lengths_N` (response token counts) is needed by opo only."""
    estimate = ESTIMATORS.get(estimator)
    if estimate is None:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {sorted(ESTIMATORS)}")
    rewards_N = check_finite(rewards_N)
    group_ids_N = np.asarray(group_ids_N)
    if group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"group_ids shape {group_ids_N.shape} != rewards shape {rewards_N.shape}")
    if lengths_N is not None:
        lengths_N = np.asarray(lengths_N, dtype=np.float64)
    return estimate(rewards_N, group_ids_N, lengths_N, eps)
