"""Losses, aggregation, KL estimators and rollout correction on 1-3 token examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from stages.rl.losses import (
    aggregate,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    ppo_clip_loss,
    reinforce_is_loss,
    rejection_mask,
    truncated_is_weights,
    weight_stats,
)

LN = math.log


def t(values):
    return torch.tensor(values, dtype=torch.float64)


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


def test_reinforce_is_loss():
    # loss = -A r: r = [2, 0.5], A = [1, -2] -> [-2, 1]; gradient -A r = [-2, 1] (no clipping)
    logp = t([[LN(2.0), LN(0.5)]]).requires_grad_(True)
    out = reinforce_is_loss(logp, torch.zeros_like(logp), t([[1.0, -2.0]]))
    torch.testing.assert_close(out.loss_BT, t([[-2.0, 1.0]]))
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 1.0]]))


# values [[1, 2, 3], [4, pad, pad]], mask [[1, 1, 1], [1, 0, 0]]
VALUES = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 3)),  # 1.6667, T_norm = padded width 3
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_sum_norm_with_explicit_length():
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(0.5)


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
    keep = rejection_mask(old, behaviour, mask, ["token_k1"], ratio_low=0.6, ratio_high=1.6)
    assert keep.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    # seq_mean_k1: row 0 geometric mean exp((ln2 - ln2 + 0)/3) = 1 -> kept;
    # row 1 = 1.2 -> rejected at high 1.1
    keep = rejection_mask(old, behaviour, mask, ["seq_mean_k1"], ratio_low=0.9, ratio_high=1.1)
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # seq_sum_k1: row 0 product 1 kept; row 1 product 1.44 rejected at high 1.4
    keep = rejection_mask(old, behaviour, mask, ["seq_sum_k1"], ratio_low=0.7, ratio_high=1.4)
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # seq_max_k2: row 0 max (ln 2)^2 / 2 = 0.2402 > 0.1 -> rejected; row 1 (ln 1.2)^2 / 2 = 0.0166 kept
    keep = rejection_mask(old, behaviour, mask, ["seq_max_k2"], divergence_max=0.1)
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # token_k3: k3(ln 2) = 2 - 1 - ln2 = 0.3069, k3(-ln 2) = 0.5 - 1 + ln 2 = 0.1931, k3(ln 1.2) = 0.0177
    keep = rejection_mask(old, behaviour, mask, ["token_k3"], divergence_max=0.2)
    assert keep.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    # criteria combine with AND: token_k1 + seq_max_k2
    keep = rejection_mask(old, behaviour, mask, ["token_k1", "seq_max_k2"], 0.6, 1.6, divergence_max=0.1)
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_weight_stats():
    # w = [1, 3] on the unmasked tokens: mean 2, min 1, max 3, ESS = (1+3)^2 / (2 * (1+9)) = 0.8
    stats = weight_stats(t([[1.0, 3.0, 7.0]]), t([[1.0, 1.0, 0.0]]))
    assert (stats.mean, stats.min, stats.max) == (2.0, 1.0, 3.0)
    assert stats.ess == pytest.approx(0.8)
