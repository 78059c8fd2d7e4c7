"""Advantage estimators for outcome rewards: one scalar reward per sample, samples grouped by prompt.

Each estimator turns the rewards of one group (the G samples of one prompt) into one advantage per sample,
which the trainer broadcasts to the sample's response tokens. They are critic-free: the baseline comes from
the other samples of the same prompt, so easy and hard prompts both give a centred signal.

Conventions (tested in tests/rl/test_advantages.py): float64 numpy, `_G` one group, `_N` a flat batch. A NaN
or infinite reward is a `ValueError` naming the sample (a scorer bug), never a silent zero. A singleton group
gets advantage 0 by default (verl falls back to the raw reward, a biased uncentred signal: `singleton_advantage:
reward`). A group of equal rewards gets exactly 0 (the std-normalised estimators compute 0 / (0 + eps)). Each
formula cites the verl function (verl/trainer/ppo/core_algos.py) it matches; docs/algorithms.md lists them.
Below them: token-level GAE with a critic, and the turn-level estimators of multi-turn rollouts (`turn_rloo`,
`turn_gae`: one advantage per model turn, spread over the turn's model tokens by the batch builder). Last,
`ESTIMATORS`: one record per `advantage.estimator` (its function, level, and whether it needs a critic, a greedy
baseline, a group), which every stage and check asks, and `check_estimator_fits`, the load-time refusals that
depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from schemas.config import AdvantageConfig, ConfigError, RunConfig


@dataclass(frozen=True)
class EstimatorOptions:
    """The knobs of advantage.* the estimators read (defaults: rlpipe's choices, docs/algorithms.md)."""

    eps: float = 1e-6  # added to the group std
    ddof: int = 0  # of the group std: 0 population, 1 sample (verl's torch.std)
    singleton: str = "zero"  # a sample alone in its group: "zero", or verl's "reward"
    whiten_by: str = "sample"  # batch whitening over samples, or over response tokens (verl)


# (rewards_G, lengths_G or None, options) -> advantages_G: one group's formula
GroupFormula = Callable[[np.ndarray, np.ndarray | None, EstimatorOptions], np.ndarray]
# (rewards_N, group_ids_N, lengths_N or None, options) -> advantages_N: a flat batch of groups
BatchEstimator = Callable[[np.ndarray, np.ndarray, np.ndarray | None, EstimatorOptions], np.ndarray]


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


def grpo_advantages(rewards_G: np.ndarray, eps: float = 1e-6, ddof: int = 0) -> np.ndarray:
    """A_i = (r_i - mean(r)) / (std(r) + eps), std with `ddof` (default 0, the population std). GRPO, Shao et
    al. 2024; verl's compute_grpo_outcome_advantage with ddof = 1 (torch.std).

    Population std (ddof = 0) is a choice: with binary rewards and G samples it makes |A| depend only on
    the success rate, and it is defined for G = 1 (verl uses torch.std, ddof = 1: `advantage.std_ddof`).
    eps (default 1e-6) is added to the std, not under a square root, so an all-equal group gives exactly
    0 / eps = 0.
    """
    rewards_G = check_finite(rewards_G)
    if _no_signal(rewards_G):
        return np.zeros_like(rewards_G)
    centred_G = rewards_G - rewards_G.mean()
    return centred_G / (rewards_G.std(ddof=ddof) + eps)


def grpo_passk_advantages(rewards_G: np.ndarray, eps: float = 1e-6, ddof: int = 0) -> np.ndarray:
    """Only the group's best sample gets an advantage: A_best = (r_max - r_second) / (std(r) + eps), every
    other sample 0 (Pass@k training, arXiv 2503.19595 as verl's compute_grpo_passk_outcome_advantage cites it).
    The first of equal maxima is the best (then r_max = r_second: 0). A singleton group has no second sample:
    0 (verl refuses it)."""
    rewards_G = check_finite(rewards_G)
    advantages_G = np.zeros_like(rewards_G)
    if _no_signal(rewards_G):
        return advantages_G
    best = int(np.argmax(rewards_G))
    second = float(np.max(np.delete(rewards_G, best)))
    advantages_G[best] = (rewards_G[best] - second) / (rewards_G.std(ddof=ddof) + eps)
    return advantages_G


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


def whiten_tokens(values_N: np.ndarray, lengths_N: np.ndarray) -> np.ndarray:
    """verl's masked_whiten over the response tokens when each of sample i's L_i tokens holds v_i:
    mu = sum L v / sum L, var = sum L (v - mu)^2 / (sum L - 1) (Bessel over tokens), w = (v - mu) / sqrt(var +
    1e-8). A long response weighs L times a one-token one in the mean and the variance."""
    values_N = check_finite(values_N, "value")
    lengths_N = np.asarray(lengths_N, dtype=np.float64)
    tokens = lengths_N.sum()
    if values_N.size == 0 or tokens < 2:
        return np.zeros_like(values_N)
    mean = (lengths_N * values_N).sum() / tokens
    var = (lengths_N * (values_N - mean) ** 2).sum() / (tokens - 1)
    return (values_N - mean) / np.sqrt(var + 1e-8)


def whiten_batch(values_N: np.ndarray, lengths_N: np.ndarray | None, options: EstimatorOptions) -> np.ndarray:
    """Whitening over the batch by `options.whiten_by` (samples: `whiten`; tokens: `whiten_tokens`). Exact zeros
    stay exact when every value is equal (nothing to whiten), as the skip rule tests `== 0`."""
    if values_N.size == 0 or bool(np.all(values_N == values_N[0])):
        return np.zeros_like(values_N)
    if options.whiten_by == "token":
        if lengths_N is None:
            raise ValueError("token whitening needs response lengths")
        return whiten_tokens(values_N, lengths_N)
    return whiten(values_N, options.eps)


def per_group(formula: GroupFormula) -> BatchEstimator:
    """The batch estimator that applies `formula` to each group (the samples sharing a group id) on its own;
    a singleton group gets `singleton_advantages` (0, or verl's raw reward)."""

    def estimate(
        rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, options: EstimatorOptions
    ) -> np.ndarray:
        advantages_N = np.zeros_like(rewards_N)
        for group in np.unique(group_ids_N):
            members = np.flatnonzero(group_ids_N == group)
            lengths_G = None if lengths_N is None else lengths_N[members]
            if members.size == 1 and options.singleton == "reward":
                advantages_N[members] = rewards_N[members]
                continue
            advantages_N[members] = formula(rewards_N[members], lengths_G, options)
        return advantages_N

    return estimate


def reinforce_pp_baseline_advantages(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, options: EstimatorOptions
) -> np.ndarray:
    """A = whiten_batch(r_i - mean_group(r)). REINFORCE++-baseline, Hu et al. 2025 (verl's
    compute_reinforce_plus_plus_baseline_outcome_advantage).

    The group mean removes the prompt's difficulty and the whitening over every sample passed in sets the
    scale. Whitening is per sample by default; verl whitens over response tokens, which weights long
    responses more (`whiten_by: token`). Pass only the samples that will be trained on (after filtering), so
    dropped groups do not set the scale. Singleton groups contribute a 0 before whitening and stay exactly 0
    after it (their raw reward with `singleton_advantage: reward`); an all-zero batch stays all zero.
    """
    advantages_N = per_group(lambda rewards_G, lengths_G, options: mean_centered_advantages(rewards_G))(
        rewards_N, group_ids_N, lengths_N, options
    )
    # The batch mean of group-centred values is 0 up to rounding, so whitening would turn an exact 0
    # (an all-equal group) into +-1e-17: keep exact zeros exact, the skip rule tests `== 0`.
    zero_N = advantages_N == 0.0
    advantages_N = whiten_batch(advantages_N, lengths_N, options)
    advantages_N[zero_N] = 0.0
    return advantages_N


def reinforce_pp_advantages(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, options: EstimatorOptions
) -> np.ndarray:
    """A = whiten_batch(r): REINFORCE++ without a baseline (Hu et al. 2025; verl's
    compute_reinforce_plus_plus_outcome_advantage with gamma = 1, where every token's return is the outcome
    reward). Groups play no part: the batch mean is the only baseline."""
    return whiten_batch(check_finite(rewards_N), lengths_N, options)


def gpg_advantages(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, lengths_N: np.ndarray | None, options: EstimatorOptions
) -> np.ndarray:
    """A_i = alpha * (r_i - mean_group(r)), alpha = N / max(#{i: r_i != 0}, 1) over the N samples passed in.
    GPG, Chu et al. 2025 (verl's compute_gpg_outcome_advantage, f_norm = 1): no std division; alpha scales the
    batch up by the share of samples with a nonzero reward. Pair it with `train.policy_loss: reinforce` and no
    `is_level` (verl's gpg loss, -A log pi)."""
    rewards_N = check_finite(rewards_N)
    alpha = rewards_N.size / max(int(np.count_nonzero(rewards_N)), 1)
    centred_N = per_group(lambda rewards_G, lengths_G, options: mean_centered_advantages(rewards_G))(
        rewards_N, group_ids_N, lengths_N, options
    )
    return alpha * centred_N


def remax_advantages(rewards_N: np.ndarray, baselines_N: np.ndarray) -> np.ndarray:
    """A_i = r_i - r_greedy(prompt of i). ReMax, Li et al. 2023 (verl's compute_remax_outcome_advantage: the
    return minus the baseline on every response token, no whitening, no std division).

    The baseline is the reward of one extra greedy (temperature 0) response to the same prompt, generated and
    scored beside the sampled ones and never trained on: it depends on the prompt only, not on sample i, so the
    estimator is unbiased; unlike a group mean it does not shrink with G, and all-equal sampled rewards still
    get a signal when the greedy response did better or worse. `baselines_N`: each sample's greedy reward."""
    rewards_N = check_finite(rewards_N)
    baselines_N = check_finite(baselines_N, "baseline reward")
    if baselines_N.shape != rewards_N.shape:
        raise ValueError(f"baselines shape {baselines_N.shape} != rewards shape {rewards_N.shape}")
    return rewards_N - baselines_N


def compute_advantages(
    estimator: str,
    rewards_N: np.ndarray,
    group_ids_N: np.ndarray,
    lengths_N: np.ndarray | None = None,
    options: EstimatorOptions | None = None,
) -> np.ndarray:
    """Advantages of a flat batch by the outcome estimator named `estimator` (a key of ESTIMATORS whose advantages
    come from the rewards alone: `from_rewards`); samples that share a group id are one group. `lengths_N`
    (response token counts) is needed by opo and token whitening."""
    record = ESTIMATORS.get(estimator)
    if record is None:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {sorted(ESTIMATORS)}")
    if not record.from_rewards:
        raise ValueError(f"advantage estimator {estimator!r} needs more than the rewards (its level is "
                         f"{record.level}; the batch builder, stages/rl/batch.py, computes it)")
    rewards_N = check_finite(rewards_N)
    group_ids_N = np.asarray(group_ids_N)
    if group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"group_ids shape {group_ids_N.shape} != rewards shape {rewards_N.shape}")
    if lengths_N is not None:
        lengths_N = np.asarray(lengths_N, dtype=np.float64)
    return record.function(rewards_N, group_ids_N, lengths_N, options or EstimatorOptions())


# --------------------------------------------------------------------------------------------------------
# Token-level: GAE with a critic, and the KL penalty in the reward (verl's apply_kl_penalty)

# The batch table's per-token columns (GAE's), null for outcome estimators and in dropped groups.
TOKEN_COLUMNS = ("values", "returns", "token_advantages")


def token_rewards(reward: float, kl_T: np.ndarray | None, beta: float) -> np.ndarray:
    """A response's per-token rewards: the outcome reward on its last token, minus beta * kl_t on every token
    (verl: token_level_rewards = token_level_scores - beta * kld, the score at the last valid token)."""
    length = 0 if kl_T is None else len(kl_T)
    rewards_T = np.zeros(length) if kl_T is None else -beta * np.asarray(kl_T, dtype=np.float64)
    if length:
        rewards_T[-1] += reward
    return rewards_T


def gae(rewards_T: np.ndarray, values_T: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over one response, V after its end = 0:

      delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  R_t = A_t + V_t
    verl's compute_gae_advantage_return on one sequence (before its whitening, `whiten_tokens`). Returns (A, R).
    """
    rewards_T = np.asarray(rewards_T, dtype=np.float64)
    values_T = np.asarray(values_T, dtype=np.float64)
    advantages_T = np.zeros_like(rewards_T)
    next_value, running = 0.0, 0.0
    for t in range(len(rewards_T) - 1, -1, -1):
        delta = rewards_T[t] + gamma * next_value - values_T[t]
        running = delta + gamma * lam * running
        advantages_T[t] = running
        next_value = values_T[t]
    return advantages_T, advantages_T + values_T


def whiten_token_values(values_by_sample: list[np.ndarray]) -> list[np.ndarray]:
    """verl's masked_whiten over every token of every sample: (v - mean) / sqrt(var + 1e-8), the variance with
    Bessel's correction over the token count; the samples' values back, each whitened."""
    flat_N = np.concatenate(values_by_sample) if values_by_sample else np.zeros(0)
    if flat_N.size < 2:
        return [np.zeros_like(v) for v in values_by_sample]
    mean = flat_N.mean()
    var = ((flat_N - mean) ** 2).sum() / (flat_N.size - 1)
    scale = 1.0 / np.sqrt(var + 1e-8)
    return [(v - mean) * scale for v in values_by_sample]


def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The next KL-in-reward coefficient of the adaptive controller (Ziegler et al. 2019; verl's
    AdaptiveKLController.update): coef * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
    error = float(np.clip(current_kl / target - 1.0, -0.2, 0.2))
    return coef * (1.0 + error * n_steps / horizon)


# --------------------------------------------------------------------------------------------------------
# Turn level (multi-turn rollouts): each model turn is one step; its advantage goes to every model token of it.


def delta_shaped_rewards(turn_rewards_K: np.ndarray) -> np.ndarray:
    """r'_k = r_k - r_{k-1}, r_0 = 0 (delta reward shaping): a turn is rewarded for its improvement over the
    previous turn's reward, so the rewards of a conversation sum to its last turn's (sum_k r'_k = r_K) and a turn
    that only repeats an earlier partial success earns nothing for it."""
    turn_rewards_K = check_finite(turn_rewards_K, "turn reward")
    return np.diff(turn_rewards_K, prepend=0.0)


def turn_returns(turn_rewards_K: np.ndarray) -> np.ndarray:
    """G_k = sum_{l >= k} r'_l = r_K - r_{k-1} (undiscounted, delta-shaped): what the conversation gains from
    turn k on. G_1 = r_K, the outcome."""
    return np.cumsum(delta_shaped_rewards(turn_rewards_K)[::-1])[::-1].copy()


def turn_rloo_advantages(turn_rewards_by_sample: list[np.ndarray]) -> list[np.ndarray]:
    """Turn-level RLOO over one group (the G conversations of one prompt), one advantage per model turn:

      r'_k = r_k - r_{k-1} (r_0 = 0);  G^i_k = sum_{l >= k} r'^i_l = r^i_{K_i} - r^i_{k-1}
      A^i_k = G^i_k - (1 / (|S_k| - 1)) sum_{j in S_k, j != i} G^j_k,   S_k = {j : K_j >= k}
    A conversation's first turn is therefore plain RLOO on the outcome (G_1 = r_K); a later turn k is credited
    with the improvement made from it on, against the other conversations that also reached turn k.
    Different turn counts: the baseline of turn index k is over the members that have a turn k (a conversation
    that ended earlier has no state there); a turn index that only one member reaches gets advantage 0 (no other
    sample, as RLOO with G = 1), and so does an index where every member's G_k is equal.
    """
    returns = [turn_returns(rewards_K) for rewards_K in turn_rewards_by_sample]
    advantages = [np.zeros_like(returns_K) for returns_K in returns]
    for k in range(max((len(returns_K) for returns_K in returns), default=0)):
        members = [i for i, returns_K in enumerate(returns) if len(returns_K) > k]
        returns_S = np.array([returns[i][k] for i in members])
        if _no_signal(returns_S):
            continue
        baseline_S = (returns_S.sum() - returns_S) / (len(members) - 1)
        for i, advantage in zip(members, returns_S - baseline_S, strict=True):
            advantages[i][k] = advantage
    return advantages


def turn_gae(
    turn_rewards_K: np.ndarray, turn_values_K: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE over the turns of one conversation, each turn a step (V after the last turn = 0):

      r'_k = r_k - r_{k-1} (r_0 = 0);  V_k = the critic's value at turn k's first model token
      delta_k = r'_k + gamma V_{k+1} - V_k;  A_k = sum_l (gamma lam)^l delta_{k+l};  R_k = A_k + V_k
    `gae` with turns for tokens and the delta-shaped turn rewards. Returns (A, R), one per turn."""
    return gae(delta_shaped_rewards(turn_rewards_K), turn_values_K, gamma, lam)


def spread_over_turns(per_turn_K: np.ndarray, spans_K2: list[list[int]], loss_mask_T: np.ndarray) -> np.ndarray:
    """(T,) per response token: turn k's value on each model token of its span [start, end), 0 on observation
    tokens (loss mask 0) and outside every span."""
    out_T = np.zeros(len(loss_mask_T))
    for value, (start, end) in zip(per_turn_K, spans_K2, strict=True):
        out_T[start:end] = value
    return out_T * (np.asarray(loss_mask_T) > 0)


# --------------------------------------------------------------------------------------------------------
# The estimators by name: what each `advantage.estimator` is, asked by every stage and check that depends on it.

Level = Literal["outcome", "token", "turn"]


@dataclass(frozen=True)
class Estimator:
    """One `advantage.estimator`: its function and what it needs.

    `level`: one advantage per sample (`outcome`), per response token (`token`: GAE) or per model turn (`turn`);
    token and turn estimators write the batch's per-token columns (TOKEN_COLUMNS). `needs_critic`: the critic's
    values in the advantage stage, its update in train. `needs_greedy_baseline`: one more greedy rollout per
    (round, prompt) group, sample_idx BASELINE_SAMPLE_IDX (schemas/tables.py), made by generate and never trained
    on. `needs_group`: the estimator compares the samples of a group (a group of one has no signal), so a
    one-sample group counts as zero variance and `drop_zero_variance_groups` defaults to on for outcome
    estimators (`drops_zero_variance_by_default`).
    """

    name: str
    # outcome: a BatchEstimator, or remax_advantages(rewards_N, baselines_N); token: gae; turn: turn_rloo_advantages
    # or turn_gae (stages/rl/batch.py calls each with its inputs)
    function: Callable[..., Any]
    level: Level
    needs_critic: bool = False
    needs_greedy_baseline: bool = False
    needs_group: bool = True

    @property
    def from_rewards(self) -> bool:
        """Whether `compute_advantages` computes it from the rewards and groups alone (a BatchEstimator)."""
        return self.level == "outcome" and not self.needs_greedy_baseline

    @property
    def drops_zero_variance_by_default(self) -> bool:
        """`drop_zero_variance_groups: null`: on for an outcome estimator that compares the samples of a group (an
        all-equal group gets exactly 0). Off for the estimators without a group, whose all-equal groups still
        carry a signal (the critic's values, the greedy baseline, the batch mean), and for turn_rloo, whose signal
        can be in turn rewards that `filter_metric` (the outcome) does not see."""
        return self.needs_group and self.level == "outcome"


# Every estimator, each name written here once: `advantage.estimator` in schemas/config.py lists the same names
# (tests/rl/test_advantages.py checks the two agree). A new estimator is one entry.
ESTIMATORS: dict[str, Estimator] = {
    record.name: record
    for record in [
        Estimator("grpo", per_group(lambda rewards_G, lengths_G, o: grpo_advantages(rewards_G, o.eps, o.ddof)),
                  "outcome"),
        Estimator("grpo_passk",
                  per_group(lambda rewards_G, lengths_G, o: grpo_passk_advantages(rewards_G, o.eps, o.ddof)),
                  "outcome"),
        Estimator("dr_grpo", per_group(lambda rewards_G, lengths_G, o: dr_grpo_advantages(rewards_G)), "outcome"),
        Estimator("rloo", per_group(lambda rewards_G, lengths_G, o: rloo_advantages(rewards_G)), "outcome"),
        Estimator("reinforce_pp", reinforce_pp_advantages, "outcome", needs_group=False),
        Estimator("reinforce_pp_baseline", reinforce_pp_baseline_advantages, "outcome"),
        Estimator("opo", per_group(lambda rewards_G, lengths_G, o: opo_advantages(rewards_G, lengths_G)), "outcome"),
        Estimator("gpg", gpg_advantages, "outcome"),
        Estimator("mean_centered", per_group(lambda rewards_G, lengths_G, o: mean_centered_advantages(rewards_G)),
                  "outcome"),
        Estimator("gae", gae, "token", needs_critic=True, needs_group=False),
        Estimator("turn_rloo", turn_rloo_advantages, "turn"),
        Estimator("turn_gae", turn_gae, "turn", needs_critic=True, needs_group=False),
        Estimator("remax", remax_advantages, "outcome", needs_greedy_baseline=True, needs_group=False),
    ]
}


def drops_zero_variance_groups(cfg: AdvantageConfig) -> bool:
    """Whether the zero-variance group filter is on: `advantage.drop_zero_variance_groups`, or when that is null
    the estimator's default (`Estimator.drops_zero_variance_by_default`)."""
    if cfg.drop_zero_variance_groups is not None:
        return cfg.drop_zero_variance_groups
    return ESTIMATORS[cfg.estimator].drops_zero_variance_by_default


def check_estimator_fits(config: RunConfig) -> None:
    """Refuse, naming the fields, a run whose estimator the rest of its config cannot serve: a critic on a backend
    without one, a greedy baseline in multi-turn rollouts, a group estimator with one-sample groups (every group
    dropped as zero variance, or every advantage 0). The config's own validators cannot ask ESTIMATORS (schemas
    import no library): the CLI calls this where it loads a config, the stage harness before a stage runs."""
    advantage, record = config.advantage, ESTIMATORS[config.advantage.estimator]
    name = f"advantage.estimator={record.name}"
    if record.needs_critic and config.train.backend != "torch":
        raise ConfigError(
            f"{name} trains a critic, which the torch backend does (train.backend=torch); the DeepSpeed backend "
            f"(train.backend={config.train.backend}) has no critic yet"
        )
    if record.needs_greedy_baseline and config.generate.multi_turn.mode != "off":
        raise ConfigError(
            f"{name} takes its baseline from one greedy response per prompt, which the generate stage makes for "
            f"single-turn rollouts only (generate.multi_turn.mode={config.generate.multi_turn.mode}); use "
            "turn_rloo or grpo for multi-turn"
        )
    if record.needs_group and config.generate.n_samples == 1:
        without_group = ", ".join(r.name for r in ESTIMATORS.values() if not r.needs_group)
        if drops_zero_variance_groups(advantage):
            setting = "null: on for this estimator" if advantage.drop_zero_variance_groups is None else "true"
            raise ConfigError(
                f"{name} compares the samples of a prompt's group, and generate.n_samples=1 makes every group one "
                f"sample, which advantage.drop_zero_variance_groups ({setting}) drops as zero variance: every "
                f"sample of every iteration. Set generate.n_samples >= 2, or use an estimator without a group "
                f"({without_group})"
            )
        if not (record.level == "outcome" and advantage.singleton_advantage == "reward"):
            raise ConfigError(
                f"{name} compares the samples of a prompt's group, and generate.n_samples=1 makes every group one "
                f"sample, whose advantage is 0 (advantage.singleton_advantage={advantage.singleton_advantage}): "
                f"every step would be skipped. Set generate.n_samples >= 2, or use an estimator without a group "
                f"({without_group})"
            )
