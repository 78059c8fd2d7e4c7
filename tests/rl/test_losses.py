"""Losses, aggregation, KL estimators and rollout correction on 1-3 token examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from stages.rl.losses import (
    aggregate,
    cispo_loss,
    gspo_loss,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    m2po_mask,
    ppo_clip_loss,
    reinforce_loss,
    rejection_mask,
    sapo_loss,
    sequence_skip_mask,
    step_stat_metrics,
    step_stat_sums,
    truncated_is_weights,
)

LN = math.log


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def rules(modes, low=0.5, high=2.0, divergence_max=2.0):
    """Rejection rules with shared thresholds: (mode, low, high) for k1 modes, (mode, None, max) for the others."""
    return [(mode, low, high) if mode.endswith("k1") else (mode, None, divergence_max) for mode in modes]


def test_ppo_clip_loss_per_token():
    # old logp 0 everywhere; ratios r = [1.5, 0.5, 1.1, 0.7]; A = [+1, -1, -1, +1]; eps_low 0.2, eps_high 0.28
    # token 0: A>0, r=1.5 -> max(-1.5, -1.28) = -1.28 (high clip active)
    # token 1: A<0, r=0.5 -> max(0.5, 0.8) = 0.8 (low clip active)
    # token 2: A<0, r=1.1 -> max(1.1, 1.1) = 1.1 (inside the range)
    # token 3: A>0, r=0.7 -> max(-0.7, -0.8) = -0.7 (unclipped branch; no clip for A>0 below 1)
    logp = t([[LN(1.5), LN(0.5), LN(1.1), LN(0.7)]]).requires_grad_(True)
    out = ppo_clip_loss(
        logp, torch.zeros_like(logp), t([[1.0, -1.0, -1.0, 1.0]]), clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(out.loss_BT, t([[-1.28, 0.8, 1.1, -0.7]]))
    assert out.clipped_high_BT.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert out.clipped_low_BT.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # gradient d loss / d logp = -A * r where unclipped, 0 where clipped: [0, 0, 1.1, -0.7]
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, 1.1, -0.7]]))


def test_ppo_clip_on_policy_gradient_is_reinforce():
    # r = 1: loss = -A, gradient -A * 1
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    out = ppo_clip_loss(logp, logp.detach().clone(), t([[2.0, -3.0]]))
    torch.testing.assert_close(out.loss_BT, t([[-2.0, 3.0]]))
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 3.0]]))


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, r = 5, c = 3: PPO loss max(5, 0.8) = 5, capped at -A*c = 3; A = -1, r = 2: 2 < 3 stays 2
    logp = t([[LN(5.0), LN(2.0), LN(5.0)]])
    out = ppo_clip_loss(logp, torch.zeros_like(logp), t([[-1.0, -1.0, 1.0]]), dual_clip=3.0)
    # token 2: A=+1, r=5 -> max(-5, -1.2) = -1.2 (dual clip does not touch positive advantages)
    torch.testing.assert_close(out.loss_BT, t([[3.0, 2.0, -1.2]]))
    assert out.clipped_dual_BT.tolist() == [[1.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, logp, logp, dual_clip=0.9)


def test_reinforce_loss_weighs_log_pi_by_the_detached_weight():
    # verl's reinforce: L = -A * w * log pi, w detached. logp = [ln 0.5, ln 0.25], A = [1, -2], w = [2, 0.5]:
    #   L = [-1 * 2 * ln 0.5, 2 * 0.5 * ln 0.25] = [1.386294, -1.386294]; dL/dlogp = -A w = [-2, 1]
    # (ratios pi / pi_old = [0.5, 0.25] play no part; the old -A * r would have given the gradient -A r = [-0.5, 0.5])
    logp = t([[LN(0.5), LN(0.25)]]).requires_grad_(True)
    weights = t([[2.0, 0.5]]).requires_grad_(True)
    out = reinforce_loss(logp, torch.zeros_like(logp), t([[1.0, -2.0]]), weights)
    torch.testing.assert_close(out.loss_BT, t([[2 * LN(2.0), -2 * LN(2.0)]]))
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 1.0]]))
    assert weights.grad is None  # the weight is a constant of the loss
    # without weights (w = 1): plain REINFORCE / GPG, gradient -A
    logp.grad = None
    reinforce_loss(logp, torch.zeros_like(logp), t([[1.0, -2.0]]), None).loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.0, 2.0]]))


# values [[1, 2, 3], [4, pad, pad]], mask [[1, 1, 1], [1, 0, 0]]
VALUES = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3
        ("seq-mean-token-sum-norm", (6 + 4) / 3),  # 3.3333: verl divides by T_norm (padded width 3) only
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_sum_norm_with_explicit_length():
    # (6 + 4) / 10 = 1.0 (the old (#sequences x T) normaliser gave 10 / 20 = 0.5)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_add_up_to_the_minibatch(mode):
    # splitting rows into micro-batches and passing the minibatch totals gives the same scalar
    whole = aggregate(VALUES, MASK, mode, norm_length=3)
    parts = sum(
        aggregate(VALUES[i : i + 1], MASK[i : i + 1], mode, num_sequences=2, num_tokens=4, norm_length=3)
        for i in range(2)
    )
    assert parts.item() == pytest.approx(whole.item())


def test_aggregate_ignores_fully_masked_sequences():
    # the second row is fully rejected: seq-mean over the one remaining sequence
    mask = t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert aggregate(VALUES, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate(VALUES, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_kl_estimators():
    # d = logp - ref = ln 2: k1 = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227;
    # k3 = 1/2 - 1 + ln 2 = 0.193147
    logp, ref = t([[LN(2.0)]]), t([[0.0]])
    assert kl_k1(logp, ref).item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_k2(logp, ref).item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_k3(logp, ref).item() == pytest.approx(0.193147, abs=1e-6)
    # d = -ln 2: k1 = -0.693147 (negative), k3 = 2 - 1 - ln 2 = 0.306853
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-0.693147, abs=1e-6)
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(0.306853, abs=1e-6)
    # identical policies: all zero
    assert kl_estimate(ref, ref, "k2").item() == 0.0
    with pytest.raises(ValueError):
        kl_estimate(ref, ref, "k4")  # type: ignore[arg-type]


def test_truncated_is_weights():
    # rho = pi_old / pi_b = [[2, 0.5, 4], [1.5, pad, pad]], threshold 3
    old = t([[LN(2.0), LN(0.5), LN(4.0)], [LN(1.5), 0.0, 0.0]])
    behaviour = torch.zeros_like(old)
    mask = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token = truncated_is_weights(old, behaviour, mask, "token", threshold=3.0)
    torch.testing.assert_close(token, t([[2.0, 0.5, 3.0], [1.5, 0.0, 0.0]]))
    # sequence: prod = 2 * 0.5 * 4 = 4 -> min(4, 3) = 3; second: 1.5
    seq = truncated_is_weights(old, behaviour, mask, "sequence", threshold=3.0)
    torch.testing.assert_close(seq, t([[3.0, 3.0, 3.0], [1.5, 0.0, 0.0]]))


def test_rejection_modes():
    # l = log rho: row 0 rho = [2, 0.5, 1], row 1 rho = [1.2, 1.2, pad]
    old = t([[LN(2.0), LN(0.5), 0.0], [LN(1.2), LN(1.2), 5.0]])
    behaviour = torch.zeros_like(old)
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # token_k1 in [0.6, 1.6]: rejects the 2 and the 0.5
    keep = rejection_mask(old, behaviour, mask, rules(["token_k1"], 0.6, 1.6))
    assert keep.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    # seq_mean_k1: row 0 geometric mean exp((ln2 - ln2 + 0)/3) = 1 -> kept;
    # row 1 = 1.2 -> rejected at high 1.1
    keep = rejection_mask(old, behaviour, mask, rules(["seq_mean_k1"], 0.9, 1.1))
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # seq_sum_k1: row 0 product 1 kept; row 1 product 1.44 rejected at high 1.4
    keep = rejection_mask(old, behaviour, mask, rules(["seq_sum_k1"], 0.7, 1.4))
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # seq_max_k2: row 0 max (ln 2)^2 / 2 = 0.2402 > 0.1 -> rejected; row 1 (ln 1.2)^2 / 2 = 0.0166 kept
    keep = rejection_mask(old, behaviour, mask, rules(["seq_max_k2"], divergence_max=0.1))
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # token_k3: k3(ln 2) = 2 - 1 - ln2 = 0.3069, k3(-ln 2) = 0.5 - 1 + ln 2 = 0.1931, k3(ln 1.2) = 0.0177
    keep = rejection_mask(old, behaviour, mask, rules(["token_k3"], divergence_max=0.2))
    assert keep.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    # criteria combine with AND: token_k1 + seq_max_k2
    keep = rejection_mask(old, behaviour, mask, rules(["token_k1", "seq_max_k2"], 0.6, 1.6, divergence_max=0.1))
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_kl_k3_clamps_at_10():
    # k3 = exp(-d) - 1 + d, clamped to <= 10 (verl's low_var_kl bound), on both sides of d = 0:
    # d = -2.6: e^2.6 - 3.6 = 13.463738 - 3.6 = 9.863738 (below the bound, unchanged)
    # d = -2.7: e^2.7 - 3.7 = 14.879732 - 3.7 = 11.179732 -> 10
    # d = 10.5: e^-10.5 + 9.5 = 9.500028 (unchanged);  d = 11.5: e^-11.5 + 10.5 = 10.500010 -> 10
    logp = t([[-2.6, -2.7, 10.5, 11.5]]).requires_grad_(True)
    k3 = kl_k3(logp, torch.zeros_like(logp))
    torch.testing.assert_close(k3, t([[9.863738, 10.0, 9.500028, 10.0]]), atol=1e-6, rtol=0)
    # d k3 / d d = 1 - exp(-d) below the bound: 1 - e^2.6 = -12.463738, 1 - e^-10.5 = 0.999972;
    # a clamped token gives no gradient
    k3.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-12.463738, 0.0, 0.999972, 0.0]]), atol=1e-6, rtol=0)
    # the estimator reached through kl_estimate is the clamped one
    assert kl_estimate(t([[-3.0]]), t([[0.0]]), "k3").item() == 10.0  # unclamped: e^3 - 4 = 16.085537


# The example of test_rejection_modes: l = log rho, row 0 rho = [2, 0.5, 1], row 1 rho = [1.2, 1.2, pad]
#   k2 = l^2 / 2:       row 0 [0.240227, 0.240227, 0],  row 1 [0.016621, 0.016621]
#   k3 = rho - 1 - l:   row 0 [2 - 1 - ln 2 = 0.306853, 0.5 - 1 + ln 2 = 0.193147, 0],
#                       row 1 [0.2 - ln 1.2 = 0.017678, 0.017678]
# The padding token holds a wild log-ratio (5) that must play no part.
REJ_OLD = t([[LN(2.0), LN(0.5), 0.0], [LN(1.2), LN(1.2), 5.0]])
REJ_BEHAVIOUR = torch.zeros_like(REJ_OLD)
REJ_MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "divergence_max", "expected"),
    [
        # token_k2: 0.240227 > 0.2 rejects both ln 2 tokens; 0 and 0.016621 kept
        ("token_k2", 0.2, [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]),
        # at 0.01 the 0.016621 tokens of row 1 go too
        ("token_k2", 0.01, [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
        # seq_mean_k2: row 0 (0.240227 * 2 + 0) / 3 = 0.160151 > 0.1 -> rejected; row 1 0.016621 kept
        ("seq_mean_k2", 0.1, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        # at 0.2 row 0's mean 0.160151 is kept (seq_max_k2 would reject it: max 0.240227)
        ("seq_mean_k2", 0.2, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        # the mean is over response tokens only: row 1 = 2 * 0.016621 / 2 = 0.016621 > 0.016 -> rejected
        # (dividing by the padded width 3 would give 0.011080 and keep it)
        ("seq_mean_k2", 0.016, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        # seq_mean_k3: row 0 (0.306853 + 0.193147 + 0) / 3 = 0.5 / 3 = 0.166667: kept at 0.17, not at 0.16
        ("seq_mean_k3", 0.17, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        ("seq_mean_k3", 0.16, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        # seq_max_k3: row 0 max 0.306853: kept at 0.31, rejected at 0.3 (where seq_mean_k3 keeps it)
        ("seq_max_k3", 0.31, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        ("seq_max_k3", 0.3, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        # row 1 max 0.017678 > 0.017 -> rejected as well
        ("seq_max_k3", 0.017, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ],
)
def test_rejection_divergence_modes(mode, divergence_max, expected):
    keep = rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, rules([mode], divergence_max=divergence_max))
    assert keep.tolist() == expected


def test_rejection_k3_is_not_clamped_and_unknown_mode_fails():
    # rejection's k3 has no clamp at 10 (that bound belongs to the KL penalty): rho = e^3 gives
    # k3 = e^3 - 1 - 3 = 16.085537, rejected at 12 (a clamp at 10 would keep it)
    keep = rejection_mask(t([[3.0]]), t([[0.0]]), t([[1.0]]), rules(["token_k3"], divergence_max=12.0))
    assert keep.tolist() == [[0.0]]
    keep = rejection_mask(t([[3.0]]), t([[0.0]]), t([[1.0]]), rules(["token_k3"], divergence_max=16.1))
    assert keep.tolist() == [[1.0]]
    with pytest.raises(ValueError, match="unknown rejection mode"):
        rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, [("seq_max_k1", 0.5, 2.0)])


# ------------------------------------------------------------------------------------------------------------
# Step statistics (the train_metrics columns clip_frac_*, rejected_frac, is_ratio_*, is_ess)
#
# pi_old logp 0 everywhere. r = pi_theta / pi_old: row 0 [1.5, 1.0, 1.4], row 1 [0.5, 1.3, pad];
# A = +1 on row 0, -1 on row 1; eps_low = eps_high = 0.2.
#   clipped_high: A > 0 and r > 1.2 -> row 0 tokens 0 and 2;  clipped_low: A < 0 and r < 0.8 -> row 1 token 0
#   (row 1 token 1: A < 0, r = 1.3 takes the unclipped branch, max(1.3, 1.2): not a clip)
# rho = pi_old / pi_b: row 0 [1, 1, 4], row 1 [0.5, 1, pad] (the sampler's pad holds a wild value, 9)
# token_k1 rejection in [0.4, 3]: rejects row 0 token 2 (rho 4) -> keep [[1, 1, 0], [1, 1, 0]]
STAT_LOGP = t([[LN(1.5), 0.0, LN(1.4)], [LN(0.5), LN(1.3), 0.0]])
STAT_OLD = torch.zeros_like(STAT_LOGP)
STAT_SAMPLER = t([[0.0, 0.0, -LN(4.0)], [LN(2.0), 0.0, 9.0]])
STAT_ADV = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
STAT_MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_step_stats_by_hand():
    out = ppo_clip_loss(STAT_LOGP, STAT_OLD, STAT_ADV, clip_low=0.2, clip_high=0.2)
    keep = rejection_mask(STAT_OLD, STAT_SAMPLER, STAT_MASK, rules(["token_k1"], 0.4, 3.0))
    assert keep.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    sums = step_stat_sums(out, keep, STAT_MASK, STAT_OLD, STAT_SAMPLER)
    # clip_high counts kept tokens only: row 0 token 0 (token 2 is clipped but rejected) -> 1
    # loss_tokens 4, response_tokens 5, rejected 5 - 4 = 1
    # ratios over all 5 response tokens (the rejected one too): [1, 1, 4, 0.5, 1]
    #   w_sum = 7.5, w_sq_sum = 1 + 1 + 16 + 0.25 + 1 = 19.25, w_count = 5, min 0.5, max 4
    assert sums == pytest.approx(
        {
            "clip_low": 1.0,
            "clip_high": 1.0,
            "clip_dual": 0.0,
            "loss_tokens": 4.0,
            "response_tokens": 5.0,
            "rejected": 1.0,
            "w_sum": 7.5,
            "w_sq_sum": 19.25,
            "w_count": 5.0,
            "w_min": 0.5,
            "w_max": 4.0,
        }
    )
    # clip_frac_* = 1 / 4 = 0.25 of the loss tokens; rejected_frac = 1 / 5 = 0.2;
    # is_ratio_mean = 7.5 / 5 = 1.5; is_ess = 7.5^2 / (5 * 19.25) = 56.25 / 96.25 = 45 / 77 = 0.584416
    assert step_stat_metrics(sums) == pytest.approx(
        {
            "clip_frac_low": 0.25,
            "clip_frac_high": 0.25,
            "clip_frac_dual": 0.0,
            "is_ratio_mean": 1.5,
            "is_ratio_min": 0.5,
            "is_ratio_max": 4.0,
            "is_ess": 45 / 77,
            "rejected_frac": 0.2,
        }
    )


def test_step_stats_add_up_over_micro_batches_and_dual_clip():
    # the two rows as two micro-batches: sums add, min/max combine -> the same metrics as the whole batch
    out = ppo_clip_loss(STAT_LOGP, STAT_OLD, STAT_ADV, clip_low=0.2, clip_high=0.2, dual_clip=1.2)
    keep = rejection_mask(STAT_OLD, STAT_SAMPLER, STAT_MASK, rules(["token_k1"], 0.4, 3.0))
    whole = step_stat_sums(out, keep, STAT_MASK, STAT_OLD, STAT_SAMPLER)
    # dual clip c = 1.2 for A < 0: row 1 token 1 has r = 1.3 > 1.2 -> 1 dual-clipped kept token; 1 / 4
    assert whole["clip_dual"] == 1.0 and step_stat_metrics(whole)["clip_frac_dual"] == 0.25
    rows = []
    for i in range(2):
        row_out = ppo_clip_loss(
            STAT_LOGP[i : i + 1], STAT_OLD[i : i + 1], STAT_ADV[i : i + 1], 0.2, 0.2, dual_clip=1.2
        )
        rows.append(
            step_stat_sums(row_out, keep[i : i + 1], STAT_MASK[i : i + 1], STAT_OLD[i : i + 1], STAT_SAMPLER[i : i + 1])
        )
    combined = {k: rows[0][k] + rows[1][k] for k in rows[0]}
    combined["w_min"] = min(r["w_min"] for r in rows)
    combined["w_max"] = max(r["w_max"] for r in rows)
    assert step_stat_metrics(combined) == pytest.approx(step_stat_metrics(whole))


def test_step_stats_with_nothing_to_count():
    # no response token: ratios default to 1 (a sampler in exact agreement), fractions to 0
    out = ppo_clip_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]))
    sums = step_stat_sums(out, t([[0.0]]), t([[0.0]]), t([[0.0]]), t([[0.0]]))
    assert sums["w_count"] == 0 and sums["w_min"] == math.inf and sums["w_max"] == -math.inf
    metrics = step_stat_metrics(sums)
    assert metrics["is_ratio_min"] == metrics["is_ratio_max"] == metrics["is_ess"] == 1.0
    assert metrics["clip_frac_low"] == metrics["rejected_frac"] == 0.0


def test_token_k1_bounds_the_inverse_ratio_as_verl():
    # verl's token_k1 is -log r, r = pi_old / pi_b: it keeps pi_b / pi_old in [low, high]. With [0.6, 1.6]:
    # r = 0.62 -> 1 / 0.62 = 1.613 > 1.6: rejected (r itself is inside [0.6, 1.6]);
    # r = 1.65 -> 1 / 1.65 = 0.606 >= 0.6: kept (r itself is outside); r = 1: kept
    old = t([[LN(0.62), LN(1.65), 0.0]])
    keep = rejection_mask(old, torch.zeros_like(old), torch.ones_like(old), [("token_k1", 0.6, 1.6)])
    assert keep.tolist() == [[0.0, 1.0, 1.0]]
    # the sequence forms use -sum / -mean of l too: prod r = 0.62 * 1.65 = 1.023 -> inverse 0.9775
    assert rejection_mask(old, torch.zeros_like(old), torch.ones_like(old), [("seq_sum_k1", 0.98, 1.5)]).sum() == 0
    assert rejection_mask(old, torch.zeros_like(old), torch.ones_like(old), [("seq_sum_k1", 0.97, 1.5)]).sum() == 3


@pytest.mark.parametrize(
    ("mode", "high", "expected"),
    [
        # seq_sum_k2: row 0 2 * 0.240227 = 0.480453, row 1 2 * 0.016621 = 0.033241
        ("seq_sum_k2", 0.4, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        ("seq_sum_k2", 0.03, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        # seq_sum_k3: row 0 0.306853 + 0.193147 = 0.5, row 1 2 * 0.017678 = 0.035357
        ("seq_sum_k3", 0.04, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        ("seq_sum_k3", 0.5001, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
    ],
)
def test_rejection_seq_sum_divergences(mode, high, expected):
    assert rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, [(mode, None, high)]).tolist() == expected


def test_cispo_weighs_log_pi_by_the_capped_ratio():
    # r = [1.5, 0.5], A = [1, -1], eps_high 0.28: w = min(r, 1.28) = [1.28, 0.5] (no lower bound)
    # L = -w A log pi = [-1.28 ln 1.5, 0.5 ln 0.5]; dL/dlogp = -w A = [-1.28, 0.5]
    logp = t([[LN(1.5), LN(0.5)]]).requires_grad_(True)
    out = cispo_loss(logp, torch.zeros_like(logp), t([[1.0, -1.0]]), clip_high=0.28)
    torch.testing.assert_close(out.loss_BT, t([[-1.28 * LN(1.5), 0.5 * LN(0.5)]]))
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.28, 0.5]]))
    assert out.clipped_high_BT.tolist() == [[1.0, 0.0]]


def test_sapo_soft_gate():
    # L = -(4 / tau) sigmoid(tau (r - 1)) A, tau 1 for A > 0, 1.05 for A < 0:
    #   r = 1.5, A = 1:  -4 sigmoid(0.5) = -2.489837;  r = 0.5, A = -1: (4 / 1.05) sigmoid(-0.525) = 1.415938
    # dL/dlogp = -A 4 s (1 - s) r: -4 * 0.622459 * 0.377541 * 1.5 = -1.410022;  4 * s(1-s) * 0.5 = 0.467070
    logp = t([[LN(1.5), LN(0.5)]]).requires_grad_(True)
    out = sapo_loss(logp, torch.zeros_like(logp), t([[1.0, -1.0]]), tau_pos=1.0, tau_neg=1.05)
    torch.testing.assert_close(out.loss_BT, t([[-2.489837, 1.415938]]), atol=1e-6, rtol=0)
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.410022, 0.467070]]), atol=1e-6, rtol=0)
    # at r = 1 the gradient is -A, PPO's
    logp = t([[0.0]]).requires_grad_(True)
    sapo_loss(logp, t([[0.0]]), t([[2.0]]), 1.0, 1.05).loss_BT.sum().backward()
    assert logp.grad.item() == pytest.approx(-2.0)


def test_gspo_sequence_ratio():
    # row 0: token ratios [1.1, 1.0] -> s = exp((ln 1.1 + 0) / 2) = sqrt(1.1) = 1.048809, inside [0.8, 1.2]:
    #   L = -A s on both tokens; dL/dlogp_t = -A s (not the token's own ratio: [-1.1, -1.0] under PPO)
    # row 1: one token, ratio 0.5, A = -1: s = 0.5 < 0.8 -> low clip, L = max(0.5, 0.8) = 0.8, no gradient
    logp = t([[LN(1.1), 0.0], [LN(0.5), 0.0]]).requires_grad_(True)
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    out = gspo_loss(logp, torch.zeros_like(logp), t([[1.0, 1.0], [-1.0, -1.0]]), mask, 0.2, 0.2)
    torch.testing.assert_close(out.loss_BT[0], t([-1.048809, -1.048809]), atol=1e-6, rtol=0)
    assert out.loss_BT[1, 0].item() == pytest.approx(0.8)
    (out.loss_BT * mask).sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.048809, -1.048809], [0.0, 0.0]]), atol=1e-6, rtol=0)
    assert out.clipped_low_BT.tolist()[1][0] == 1.0


def test_m2po_drops_the_largest_squared_log_ratios():
    # l = [0.5, -0.3, 0.1, 0], l^2 = [0.25, 0.09, 0.01, 0], mean 0.0875 (the pad's 9 plays no part)
    # tau 0.04: drop 0.25 -> (0.09 + 0.01 + 0) / 3 = 0.0333 <= 0.04;  tau 0.03: also drop 0.09 -> 0.005
    ratio = t([[0.5, -0.3], [0.1, 0.0], [9.0, 0.0]])
    mask = t([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    behaviour = torch.zeros_like(ratio)
    assert m2po_mask(ratio, behaviour, mask, 0.04).tolist() == [[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert m2po_mask(ratio, behaviour, mask, 0.03).tolist() == [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    assert m2po_mask(ratio, behaviour, mask, 0.1).tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]


def test_sequence_skip_mask():
    # mean token ratio pi_theta / pi_old: row 0 (2 + 4) / 2 = 3, row 1 (1 + 1.5) / 2 = 1.25, row 2 one token 2.5
    logp = t([[LN(2.0), LN(4.0)], [0.0, LN(1.5)], [LN(2.5), 7.0]])
    mask = t([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    assert sequence_skip_mask(logp, torch.zeros_like(logp), mask, 2.5).tolist() == [[0.0], [1.0], [1.0]]
