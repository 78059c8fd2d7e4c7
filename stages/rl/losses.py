"""Policy-gradient losses, loss aggregation, KL estimators and rollout correction, as pure tensor functions.

Layout: `_BT` tensors are (sequences, response tokens), right-padded; `mask_BT` is 1.0 on response tokens
that take part in the loss and 0.0 on padding and on tokens rejected by rollout correction. Log-probs are
of the sampled tokens only (see stages/rl/logprobs.py). Every function returns per-token values; the
reduction to one scalar happens once, in `aggregate`, so that every loss term (policy, KL, entropy) is
reduced the same way and micro-batches can be summed into exactly the minibatch loss.

Three policies appear (verl's "decoupled" naming): the behaviour policy pi_b that sampled the tokens (the
sampler's logprobs, e.g. vLLM in bf16), the old policy pi_old (the same weights, recomputed by the
trainer before the update) and the current policy pi_theta. PPO clips pi_theta / pi_old; rollout
correction reweights or rejects by pi_old / pi_b; in bypass mode pi_old := pi_b and the correction is of
pi_theta / pi_b. Semantics follow verl's verl/trainer/ppo/core_algos.py and rollout_corr_helper.py and TRL's
trl/trainer/grpo_trainer.py where named; docs/algorithms.md lists every formula with its peers' names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LossAggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
KLEstimator = Literal["k1", "k2", "k3"]
# One rejection rule: (mode, low, high). k1 modes keep low <= ratio <= high; the others divergence <= high.
RejectionRule = tuple[str, float | None, float]

# Log-ratios are clamped before exp() so one wild token cannot overflow to inf (verl uses the same bound).
LOG_RATIO_LIMIT = 20.0


def masked_sum(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (values_BT * mask_BT).sum()


def log_ratio(logp_BT: torch.Tensor, base_logp_BT: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_base) per token, clamped to +-LOG_RATIO_LIMIT."""
    return (logp_BT - base_logp_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


# --------------------------------------------------------------------------------------------------------
# Policy losses (per token; lower is better)


@dataclass
class PolicyLossOutput:
    loss_BT: torch.Tensor  # per-token loss, to be aggregated
    ratio_BT: torch.Tensor  # pi_theta / pi_old (detached)
    clipped_low_BT: torch.Tensor  # 1.0 where the low clip (ratio < 1 - eps_low, A < 0) zeroes the gradient
    clipped_high_BT: torch.Tensor  # 1.0 where the high clip (ratio > 1 + eps_high, A > 0) zeroes the gradient
    clipped_dual_BT: torch.Tensor  # 1.0 where the dual clip (A < 0, ratio > c) caps the loss


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with separate low/high bounds (clip-higher) and optional dual clip.

    r = exp(logp - old_logp);  L = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))   (Schulman 2017;
    DAPO's clip-higher sets eps_high > eps_low, e.g. 0.28 / 0.2).
    Dual clip (Ye et al. 2020), only for A < 0: L = min(L, -A * c) with c > 1 (typically 3), which bounds
    the loss of a negative-advantage token whose ratio has grown large.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip})")
    ratio_BT = torch.exp(log_ratio(logp_BT, old_logp_BT))
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    with torch.no_grad():
        ratio_d_BT = ratio_BT.detach()
        clipped_low_BT = ((ratio_d_BT < 1.0 - clip_low) & (advantages_BT < 0)).float()
        clipped_high_BT = ((ratio_d_BT > 1.0 + clip_high) & (advantages_BT > 0)).float()
        clipped_dual_BT = torch.zeros_like(ratio_d_BT)
    if dual_clip is not None:
        capped_BT = -advantages_BT * dual_clip
        negative_BT = advantages_BT < 0
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, capped_BT), loss_BT)
        clipped_dual_BT = (negative_BT & (ratio_d_BT > dual_clip)).float()
    return PolicyLossOutput(loss_BT, ratio_d_BT, clipped_low_BT, clipped_high_BT, clipped_dual_BT)


def _unclipped(loss_BT: torch.Tensor, ratio_BT: torch.Tensor) -> PolicyLossOutput:
    zeros_BT = torch.zeros_like(ratio_BT)
    return PolicyLossOutput(loss_BT, ratio_BT, zeros_BT, zeros_BT, zeros_BT)


def reinforce_loss(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor, weights_BT: torch.Tensor | None
) -> PolicyLossOutput:
    """L = -A * w * log pi_theta, w detached (1 when None). verl's compute_policy_loss_reinforce (bypass mode,
    loss_type reinforce): w is the truncated importance weight, so the gradient is -A * w * grad(log pi_theta),
    bounded by the truncation (at ratio 5 and threshold 2: -2A, where -A * r would give -5A). Also GPG's loss
    (verl's compute_policy_loss_gpg) with w = 1."""
    ratio_BT = torch.exp(log_ratio(logp_BT.detach(), old_logp_BT))
    weighted_BT = advantages_BT if weights_BT is None else advantages_BT * weights_BT.detach()
    return _unclipped(-weighted_BT * logp_BT, ratio_BT)


def cispo_loss(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor, clip_high: float
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, Chen et al. 2025): L = -sg(min(r, 1 + eps_high)) * A * log pi_theta.

    The clipped ratio only weighs the token: every token keeps a gradient, never zeroed by a clip. As TRL's
    loss_type cispo (its epsilon_high is the cap itself, here 1 + clip_high) with the paper's lower bound off.
    `clipped_high` marks the tokens whose weight the cap lowered.
    """
    ratio_BT = torch.exp(log_ratio(logp_BT.detach(), old_logp_BT))
    weights_BT = ratio_BT.clamp(max=1.0 + clip_high)
    out = _unclipped(-weights_BT * advantages_BT * logp_BT, ratio_BT)
    out.clipped_high_BT = (ratio_BT > 1.0 + clip_high).to(ratio_BT.dtype)
    return out


def sapo_loss(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor, tau_pos: float, tau_neg: float
) -> PolicyLossOutput:
    """SAPO soft gate (TRL's loss_type sapo): L = -(4 / tau) * sigmoid(tau * (r - 1)) * A, tau = tau_pos where
    A > 0 else tau_neg. At r = 1 its gradient is -A * grad(log pi) like PPO's; away from 1 the gate fades the
    gradient smoothly instead of cutting it at a clip."""
    ratio_BT = torch.exp(log_ratio(logp_BT, old_logp_BT))
    tau_BT = torch.where(advantages_BT > 0, tau_pos, tau_neg).to(ratio_BT.dtype)
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * 4.0 / tau_BT
    return _unclipped(-gate_BT * advantages_BT, ratio_BT.detach())


def gspo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025; verl's compute_policy_loss_gspo): one ratio per sequence,
    s = exp(mean_t log(pi_theta / pi_old)) over its response tokens, given to every token as
    s_t = sg(s) * pi_theta(t) / sg(pi_theta(t)) (so the gradient is token-level), clamped at log 10 like verl;
    L = max(-A s_t, -A clip(s_t, 1 - eps_low, 1 + eps_high)). verl aggregates it seq-mean-token-mean
    whatever loss_agg_mode says; here the configured aggregation applies (docs/algorithms.md)."""
    mask_BT = mask_BT.to(logp_BT.dtype)
    tokens_B = mask_BT.sum(-1).clamp(min=1.0)
    seq_log_B = (log_ratio(logp_BT.detach(), old_logp_BT) * mask_BT).sum(-1) / tokens_B
    log_s_BT = (logp_BT - logp_BT.detach() + seq_log_B[:, None]).clamp(max=10.0)
    ratio_BT = torch.exp(log_s_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        ratio_d_BT = ratio_BT.detach()
        clipped_low_BT = ((ratio_d_BT < 1.0 - clip_low) & (advantages_BT < 0)).to(ratio_d_BT.dtype)
        clipped_high_BT = ((ratio_d_BT > 1.0 + clip_high) & (advantages_BT > 0)).to(ratio_d_BT.dtype)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    return PolicyLossOutput(loss_BT, ratio_d_BT, clipped_low_BT, clipped_high_BT, torch.zeros_like(ratio_d_BT))


# --------------------------------------------------------------------------------------------------------
# Aggregation


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: LossAggregation,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to the scalar loss.

    With m the mask, S the sequences that have at least one unmasked token and T_norm a constant length:
      token-mean:              sum_{b,t} v m / sum_{b,t} m                       (DAPO; every token equal)
      seq-mean-token-sum:      (1/|S|) sum_b sum_t v m
      seq-mean-token-mean:     (1/|S|) sum_b (sum_t v m / sum_t m)               (original GRPO)
      seq-mean-token-sum-norm: sum_{b,t} v m / T_norm                            (Dr. GRPO; no length bias)
    The names and formulas are verl's agg_loss (verl/trainer/ppo/core_algos.py). seq-mean-token-sum-norm is
    not divided by |S| (verl divides by T only): its scale grows with the minibatch's sequences, |S| times
    TRL's dr_grpo (sum / (|S| * max_completion_length)); under Adam a constant scale changes nothing but the
    weight of max_grad_norm. `num_sequences` / `num_tokens` override |S| and sum m: pass the minibatch's
    totals when this call sees one micro-batch of it, so that the micro-batch results add up to the
    minibatch's loss exactly (gradient accumulation without reweighting). `norm_length` defaults to the
    padded width T of `values_BT` (PolicyTrainer always passes one: generate.max_new_tokens in the stage).
    """
    mask_BT = mask_BT.to(values_BT.dtype)
    tokens_B = mask_BT.sum(-1)
    if num_sequences is None:
        num_sequences = float((tokens_B > 0).sum().item())
    if num_tokens is None:
        num_tokens = float(tokens_B.sum().item())
    num_sequences = max(num_sequences, 1.0)
    num_tokens = max(num_tokens, 1.0)
    if mode == "token-mean":
        return masked_sum(values_BT, mask_BT) / num_tokens
    if mode == "seq-mean-token-sum":
        return masked_sum(values_BT, mask_BT) / num_sequences
    if mode == "seq-mean-token-mean":
        per_seq_B = (values_BT * mask_BT).sum(-1) / tokens_B.clamp(min=1.0)
        return per_seq_B.sum() / num_sequences
    if mode == "seq-mean-token-sum-norm":
        length = float(norm_length if norm_length is not None else values_BT.shape[-1])
        return masked_sum(values_BT, mask_BT) / length
    raise ValueError(f"unknown loss aggregation {mode!r}")


# --------------------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", 2020). Samples come from pi; d = logp - ref_logp.


def kl_k1(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """k1 = d = log(pi / pi_ref). Unbiased for KL(pi || pi_ref), high variance, can be negative."""
    return log_ratio(logp_BT, ref_logp_BT)


def kl_k2(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2. Biased, low variance, >= 0; its gradient is that of KL to first order."""
    return 0.5 * log_ratio(logp_BT, ref_logp_BT) ** 2


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) - 1 + d = pi_ref/pi - 1 - log(pi_ref/pi). Unbiased, low variance, >= 0 (GRPO's KL).

    Clamped to <= 10 like verl's low_var_kl, so one token far from the reference cannot dominate the loss.
    """
    d_BT = log_ratio(logp_BT, ref_logp_BT)
    return (torch.exp(-d_BT) - 1.0 + d_BT).clamp(max=10.0)


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    if estimator == "k1":
        return kl_k1(logp_BT, ref_logp_BT)
    if estimator == "k2":
        return kl_k2(logp_BT, ref_logp_BT)
    if estimator == "k3":
        return kl_k3(logp_BT, ref_logp_BT)
    raise ValueError(f"unknown KL estimator {estimator!r}")


# --------------------------------------------------------------------------------------------------------
# Rollout correction: the sampler (pi_b) and the trainer (pi_old) disagree a little even with equal weights.


def truncated_is_weights(
    old_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: Literal["token", "sequence"],
    threshold: float,
) -> torch.Tensor:
    """Truncated importance weights w (detached), broadcast to tokens, 0 on masked-out tokens.

    token:    w_t = min(pi_old(t) / pi_b(t), C)                    (TIS, Yao et al. 2025)
    sequence: w_t = min(prod_t' pi_old(t') / pi_b(t'), C) for every t of the sequence
    The product runs over `mask_BT`: pass the response mask, not the mask after rejection, as verl's
    compute_rollout_correction_and_rejection_mask computes the weights before it rejects (a rejected token
    still counts in its sequence's weight).
    """
    with torch.no_grad():
        mask_BT = mask_BT.to(old_logp_BT.dtype)
        log_rho_BT = log_ratio(old_logp_BT, behaviour_logp_BT) * mask_BT
        if level == "token":
            weights_BT = torch.exp(log_rho_BT)
        elif level == "sequence":
            log_rho_B = log_rho_BT.sum(-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            weights_BT = torch.exp(log_rho_B)[:, None].expand_as(log_rho_BT)
        else:
            raise ValueError(f"unknown importance-weight level {level!r}")
        return weights_BT.clamp(max=threshold) * mask_BT


def rejection_mask(
    old_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    rules: list[RejectionRule] | tuple[RejectionRule, ...],
) -> torch.Tensor:
    """1.0 for tokens kept, 0.0 for tokens rejected (and for padding). Rules combine with AND.

    verl's compute_rollout_rejection_mask (rollout_corr_helper.py). With l_t = log(pi_old(t) / pi_b(t)) over the
    sequence's response tokens, k1_t = -l_t, k2_t = l_t^2 / 2, k3_t = exp(l_t) - 1 - l_t, each rule (mode,
    low, high) keeps:
      token_k1:              log(low) <= k1_t <= log(high)    i.e. pi_b / pi_old in [low, high], per token
      token_k2 / token_k3:   k_t <= high, per token
      seq_sum_k1 / seq_mean_k1:  log(low) <= sum_t / mean_t of k1 <= log(high), the whole sequence
      seq_sum_k2/k3, seq_mean_k2/k3, seq_max_k2/k3:  sum_t / mean_t / max_t of k <= high, the whole sequence
    k1 bounds the inverse ratio (verl's -log r): the same for symmetric bounds [1/u, u], not for 0.6_1.6.
    Rejected tokens leave the loss and its denominator.
    """
    with torch.no_grad():
        keep_BT = mask_BT.to(old_logp_BT.dtype).clone()
        valid_BT = keep_BT > 0
        log_rho_BT = log_ratio(old_logp_BT, behaviour_logp_BT).masked_fill(~valid_BT, 0.0)
        tokens_B = valid_BT.sum(-1).clamp(min=1)
        stats_BT = {"k1": -log_rho_BT, "k2": 0.5 * log_rho_BT**2, "k3": torch.exp(log_rho_BT) - 1.0 - log_rho_BT}
        for mode, low, high in rules:
            level, _, estimator = mode.rpartition("_")
            stat_BT = stats_BT.get(estimator)
            if stat_BT is None or level not in ("token", "seq_sum", "seq_mean", "seq_max") or mode == "seq_max_k1":
                raise ValueError(f"unknown rejection mode {mode!r}")
            if level == "token":
                value = stat_BT
            elif level == "seq_sum":
                value = stat_BT.sum(-1, keepdim=True)
            elif level == "seq_mean":
                value = stat_BT.sum(-1, keepdim=True) / tokens_B[:, None]
            else:
                value = stat_BT.masked_fill(~valid_BT, -math.inf).max(-1, keepdim=True).values
            if estimator == "k1":
                assert low is not None, f"rejection rule {mode} needs a lower bound"
                passes = (value >= math.log(low)) & (value <= math.log(high))
            else:
                passes = value <= high
            keep_BT *= passes.expand_as(keep_BT).to(keep_BT.dtype)
        return keep_BT


def m2po_mask(
    ratio_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor, threshold: float
) -> torch.Tensor:
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse"): drop the tokens with the largest squared
    log-ratio l_t^2, l_t = log(pi_ratio(t) / pi_b(t)), until the mean of l^2 over the remaining tokens is at
    most `threshold` (the paper's tau = 0.04). Over every token of `mask_BT` at once (the minibatch): a bound on
    the second moment of the log importance weights, instead of clipping each ratio. 1.0 kept, 0.0 dropped."""
    with torch.no_grad():
        mask_BT = mask_BT.to(ratio_logp_BT.dtype)
        squared_BT = log_ratio(ratio_logp_BT, behaviour_logp_BT) ** 2 * mask_BT
        squared_N = squared_BT[mask_BT > 0]
        order_N = torch.argsort(squared_N, descending=True, stable=True)
        sorted_N = squared_N[order_N].double()
        # mean of the tokens left after dropping the j largest, for j = 0..n-1
        remaining_sum_N = sorted_N.sum() - torch.cat([sorted_N.new_zeros(1), sorted_N.cumsum(0)[:-1]])
        remaining_count_N = torch.arange(len(sorted_N), 0, -1, dtype=torch.float64)
        fits_N = remaining_sum_N / remaining_count_N <= threshold
        drop = int(torch.nonzero(fits_N)[0]) if bool(fits_N.any()) else len(sorted_N)
        keep_N = torch.ones_like(squared_N)
        keep_N[order_N[:drop]] = 0.0
        keep_BT = torch.zeros_like(mask_BT)
        keep_BT[mask_BT > 0] = keep_N
        return keep_BT


def sequence_skip_mask(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Colossal-RL's skip_threshold (ColossalChat coati/distributed/loss.py): leave out a sequence whose mean
    token ratio pi_theta / pi_old over its response tokens exceeds `threshold` (Colossal skips a whole
    micro-batch by the mean over it; per sequence here, so packing does not decide). (B, 1) of 1.0 / 0.0."""
    with torch.no_grad():
        mask_BT = mask_BT.to(logp_BT.dtype)
        ratio_BT = torch.exp(log_ratio(logp_BT, old_logp_BT)) * mask_BT
        mean_B = ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        return (mean_B <= threshold).to(logp_BT.dtype)[:, None]


# --------------------------------------------------------------------------------------------------------
# Per-step statistics (the train_metrics columns that describe clipping and rollout correction)


def step_stat_sums(
    policy_out: PolicyLossOutput,
    keep_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    ratio_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
) -> dict[str, float]:
    """Additive statistics of one micro-batch, for `step_stat_metrics` (all detached floats).

    With m the response mask, k the loss mask after rejection (k <= m), and
    rho_t = exp(l_t), l_t = log(pi_ratio(t) / pi_b(t)) clamped like `log_ratio`, where pi_ratio is pi_old
    (pi_theta in bypass mode, where pi_old := pi_b and the mismatch shows in the PPO ratio itself):
      clip_low / clip_high / clip_dual = sum_t k_t * clipped_*_t      (the masks of PolicyLossOutput)
      loss_tokens = sum_t k_t;  response_tokens = sum_t m_t;  rejected = sum_t (m_t - k_t)
      w_sum = sum_t m_t rho_t;  w_sq_sum = sum_t m_t rho_t^2;  w_count = sum_t m_t
      w_min / w_max = min / max of rho_t over m_t = 1 (+inf / -inf when there is none)
    The ratio statistics are over every response token, rejected ones included, and are the raw ratios,
    not the truncated weights `truncated_is_weights` applies: they describe the mismatch, not the correction.
    """
    with torch.no_grad():
        keep_BT = keep_BT.to(policy_out.loss_BT.dtype)
        mask_BT = mask_BT.to(keep_BT.dtype)
        rho_N = torch.exp(log_ratio(ratio_logp_BT.detach(), behaviour_logp_BT))[mask_BT > 0].double()
        return {
            "clip_low": float((policy_out.clipped_low_BT * keep_BT).sum()),
            "clip_high": float((policy_out.clipped_high_BT * keep_BT).sum()),
            "clip_dual": float((policy_out.clipped_dual_BT * keep_BT).sum()),
            "loss_tokens": float(keep_BT.sum()),
            "response_tokens": float(mask_BT.sum()),
            "rejected": float((mask_BT - keep_BT).sum()),
            "w_sum": float(rho_N.sum()),
            "w_sq_sum": float((rho_N**2).sum()),
            "w_count": float(rho_N.numel()),
            "w_min": float(rho_N.min()) if rho_N.numel() else math.inf,
            "w_max": float(rho_N.max()) if rho_N.numel() else -math.inf,
        }


def step_stat_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The metrics row's clip, rejection and importance-ratio columns from `step_stat_sums` totals.

      clip_frac_{low,high,dual} = clip_{low,high,dual} / max(loss_tokens, 1)     (fractions of loss tokens)
      rejected_frac = rejected / max(response_tokens, 1)
      is_ratio_mean = w_sum / w_count;  is_ratio_min = w_min;  is_ratio_max = w_max
      is_ess = w_sum^2 / (w_count * w_sq_sum)   (Kong 1992, normalised: 1 when every ratio is equal)
    With no ratio (w_count = 0) the ratio columns are 1, the value of a sampler that agrees exactly.
    """
    loss_tokens = max(sums["loss_tokens"], 1.0)
    count = sums["w_count"]
    return {
        "clip_frac_low": sums["clip_low"] / loss_tokens,
        "clip_frac_high": sums["clip_high"] / loss_tokens,
        "clip_frac_dual": sums["clip_dual"] / loss_tokens,
        "is_ratio_mean": sums["w_sum"] / count if count else 1.0,
        "is_ratio_min": sums["w_min"] if count else 1.0,
        "is_ratio_max": sums["w_max"] if count else 1.0,
        "is_ess": sums["w_sum"] ** 2 / (count * sums["w_sq_sum"]) if count else 1.0,
        "rejected_frac": sums["rejected"] / max(sums["response_tokens"], 1.0),
    }
