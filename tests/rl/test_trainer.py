"""The update loop on a tiny real Llama: schedules, exact gradient accumulation, learning on a toy task."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from schemas.config import TrainConfig
from stages.rl.advantages import ESTIMATORS, compute_advantages
from stages.rl.schedule import lr_at
from stages.rl.trainer import PolicyTrainer, StepTotals, TorchStepper, TrainSample, make_adamw, metrics_row

from .conftest import make_tiny_model


def test_lr_schedule_by_hand():
    cfg = TrainConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", lr_decay_steps=6, lr_min_ratio=0.2)
    # warmup 1/2, 2/2; then cosine over steps 2..6: p = 0, 0.25, 0.5, ..., 1
    # p = 0.5: 0.2 + 0.8 * (1 + cos(pi/2)) / 2 = 0.6; p >= 1: 0.2
    assert [lr_at(s, cfg) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.6, 0.2, 0.2])
    linear = TrainConfig(lr=1.0, lr_schedule="linear", lr_decay_steps=4, lr_min_ratio=0.0)
    assert [lr_at(s, linear) for s in (0, 1, 4)] == pytest.approx([1.0, 0.75, 0.0])
    assert lr_at(100, TrainConfig(lr=3e-6)) == 3e-6


def _samples(model, n: int = 6, seed: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt = [1] + rng.integers(3, 16, size=int(rng.integers(1, 5))).tolist()
        response = rng.integers(3, 16, size=int(rng.integers(1, 7))).tolist()
        samples.append(TrainSample(prompt, response, [-2.0] * len(response), advantage=float(i % 3) - 0.8))
    # behaviour logprobs close to the model's own (a small sampler/trainer mismatch)
    trainer = PolicyTrainer(model, TrainConfig(), TorchStepper(model, make_adamw(model, TrainConfig()), 1.0))
    for sample, logp in zip(samples, trainer.sequence_logprobs(trainer.policy, samples), strict=True):
        sample.behaviour_logprobs = (logp + 0.05 * torch.randn(logp.shape)).tolist()
    return samples


def _grads_after_one_step(budget: int, aggregation: str, **overrides) -> list[torch.Tensor]:
    model = make_tiny_model()
    samples = _samples(model)
    cfg = TrainConfig(micro_batch_tokens=budget, loss_aggregation=aggregation, lr=1e-9, **overrides)

    class Recording(TorchStepper):
        def step(self, lr: float) -> float:
            self.grads = [p.grad.clone() for p in self.params]
            return super().step(lr)

    stepper = Recording(model, make_adamw(model, cfg), max_grad_norm=1e9)
    PolicyTrainer(model, cfg, stepper, norm_length=8).train(samples)
    return stepper.grads


AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batching_gives_the_same_gradient(aggregation):
    # budget 16 splits the 6 sequences into several micro-batches, 4096 keeps them in one
    small = _grads_after_one_step(16, aggregation)
    whole = _grads_after_one_step(4096, aggregation)
    for a, b in zip(small, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_micro_batching_with_rejection_and_is_weights():
    kwargs = {
        "rejection": ["token_k1"],
        "rejection_ratio_low": 0.97,
        "rejection_ratio_high": 1.03,
        "is_level": "sequence",
        "is_threshold": 1.02,
    }
    small = _grads_after_one_step(16, "token-mean", **kwargs)
    whole = _grads_after_one_step(4096, "token-mean", **kwargs)
    for a, b in zip(small, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_fast_path_equals_recomputed_old_logprobs():
    # one step: old logprobs from the training forward itself == a separate no-grad pass (rejection forces it
    # with a range so wide nothing is rejected)
    fast = _grads_after_one_step(4096, "token-mean")
    recomputed = _grads_after_one_step(
        4096, "token-mean", rejection=["token_k1"], rejection_ratio_low=1e-9, rejection_ratio_high=1e9
    )
    for a, b in zip(fast, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_metrics_row_and_multi_step():
    model = make_tiny_model()
    samples = _samples(model)
    cfg = TrainConfig(epochs=2, minibatches=3, lr=1e-3, clip_low=0.2, clip_high=0.28)
    rows = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0), global_step=5).train(
        samples
    )
    assert [r["step"] for r in rows] == [5, 6, 7, 8, 9, 10]
    assert [r["epoch"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert sum(r["sequences"] for r in rows) == 12
    # the first step is on-policy w.r.t. the recomputed old logprobs: ratio 1, no clipping, approx KL 0
    assert rows[0]["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert rows[0]["clip_frac_low"] == rows[0]["clip_frac_high"] == 0.0
    assert rows[-1]["approx_kl"] > 0.0  # later steps are off-policy
    for row in rows:
        assert 0 < row["is_ess"] <= 1 and row["is_ratio_min"] <= row["is_ratio_mean"] <= row["is_ratio_max"]
        assert row["grad_norm"] > 0 and row["entropy"] > 0 and row["tokens"] > row["loss_tokens"] > 0


# Two samples of 2 response tokens; the sampler's logprobs are set to the model's own minus ln r, so the
# mismatch pi_trainer / pi_sampler is exactly r = [1.5, 0.9] on sample 0 and [0.5, 1.1] on sample 1.
# Advantages +2 and -3; clip 0.2 / 0.2; token-mean; one step (the metrics are those of the forward pass
# before the update). In every mode the is_ratio columns are r (pi_old / pi_b, or pi_theta / pi_b under
# bypass, and pi_theta = pi_old before the first update): mean (1.5 + 0.9 + 0.5 + 1.1) / 4 = 1, min 0.5,
# max 1.5, ESS = 4^2 / (4 * (2.25 + 0.81 + 0.25 + 1.21)) = 16 / 18.08 = 0.884956.
MISMATCH_R = [[1.5, 0.9], [0.5, 1.1]]


def _with_mismatch(trainer: PolicyTrainer, samples: list[TrainSample], ratios: list[list[float]]) -> None:
    """Set each sample's sampler logprobs to the model's own minus ln r: pi_trainer / pi_sampler = r exactly."""
    for sample, logp, r in zip(samples, trainer.sequence_logprobs(trainer.policy, samples), ratios, strict=True):
        sample.behaviour_logprobs = (logp.double() - torch.tensor(r, dtype=torch.float64).log()).tolist()


def _two_samples() -> list[TrainSample]:
    return [TrainSample([1, 5, 6], [3, 4], [0.0, 0.0], 2.0), TrainSample([1, 7], [8, 9], [0.0, 0.0], -3.0)]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # recomputed pi_old, PPO ratio 1, per-token loss -A = [-2, -2], [3, 3]:
        # seq-mean-token-sum: (-4 + 6) / 2 = 1.0
        ({"loss_aggregation": "seq-mean-token-sum"}, {"policy_loss": 1.0, "clip_frac_low": 0.0}),
        # seq-mean-token-sum-norm, no norm_length given: the token sum 2 / the batch's longest response 2 = 1.0
        # (verl divides by T only; the old (#sequences x T) normaliser gave 2 / 4 = 0.5)
        ({"loss_aggregation": "seq-mean-token-sum-norm"}, {"policy_loss": 1.0}),
        # bypass: old := sampler, PPO ratio = r.
        #   (0,0) A=2, r=1.5: max(-3, -2.4) = -2.4 (high clip)  (0,1) r=0.9: max(-1.8, -1.8) = -1.8
        #   (1,0) A=-3, r=0.5: max(1.5, 2.4) = 2.4 (low clip)   (1,1) r=1.1: max(3.3, 3.3) = 3.3
        #   policy_loss (-2.4 - 1.8 + 2.4 + 3.3) / 4 = 0.375; clip fractions 1/4 each;
        #   approx_kl = mean k3(pi_b || pi_theta) = mean(r - 1 - ln r)
        #     = (0.094535 + 0.005361 + 0.193147 + 0.004690) / 4 = 0.074433
        (
            {"bypass_old_logprobs": True},
            {"policy_loss": 0.375, "clip_frac_low": 0.25, "clip_frac_high": 0.25, "approx_kl": 0.074433},
        ),
        # token_k1 rejection in [0.8, 1.6] keeps pi_b / pi_old = 1 / r = [0.667, 1.111], [2, 0.909] inside it:
        # rejects (0,0) and (1,0), rejected_frac 2/4; ratio 1 on the kept: (-2 + 3) / 2 = 0.5
        (
            {"rejection": ["token_k1"], "rejection_ratio_low": 0.8, "rejection_ratio_high": 1.6},
            {"policy_loss": 0.5, "rejected_frac": 0.5, "loss_tokens": 2},
        ),
        # token TIS, C = 1.2: loss -A min(r, 1.2): -2 * 1.2, -2 * 0.9, 3 * 0.5, 3 * 1.1 -> 0.6 / 4 = 0.15
        ({"is_level": "token", "is_threshold": 1.2}, {"policy_loss": 0.15, "rejected_frac": 0.0}),
        # verl's bypass recipe: bypass, token IS 2.0, rejection token_k1 0.6_1.6 and seq_max_k2 2.5. The
        # rejection compares pi_theta (= pi_old at the first step) with the sampler: 1 / r = 2 > 1.6 rejects
        # (1,0); seq max k2 = (ln 1.5)^2 / 2 = 0.082, (ln 0.5)^2 / 2 = 0.240 <= 2.5 keep both rows. ppo_clip
        # applies no IS weight under bypass (its ratio is r): (-2.4 - 1.8 + 3.3) / 3 = -0.3; one of the 3 kept
        # tokens high-clipped; approx_kl over the kept: (0.094535 + 0.005361 + 0.004690) / 3 = 0.034862
        (
            {"bypass_old_logprobs": True, "is_level": "token", "is_threshold": 2.0,
             "rejection": ["token_k1", "seq_max_k2"], "rejection_thresholds": ["0.6_1.6", "2.5"]},
            {"policy_loss": -0.3, "rejected_frac": 0.25, "loss_tokens": 3, "clip_frac_high": 1 / 3,
             "clip_frac_low": 0.0, "approx_kl": 0.034862},
        ),
        # the same with seq_max_k2 at 0.2: row 1's 0.240 > 0.2 rejects it whole: (-2.4 - 1.8) / 2 = -2.1
        (
            {"bypass_old_logprobs": True, "rejection": ["token_k1", "seq_max_k2"],
             "rejection_thresholds": ["0.6_1.6", "0.2"]},
            {"policy_loss": -2.1, "rejected_frac": 0.5, "loss_tokens": 2},
        ),
        # sequence IS weights under token rejection (decoupled): token_k1 0.5_2.0 keeps 1 / r in [0.5, 2]:
        # all kept here; weights min(prod r, 2) = min(1.35, 2), min(0.55, 2): (-2 * 1.35 * 2 + 3 * 0.55 * 2) / 4
        # = (-5.4 + 3.3) / 4 = -0.525
        (
            {"is_level": "sequence", "rejection": ["token_k1"], "rejection_thresholds": ["0.5_2.0"]},
            {"policy_loss": -0.525, "rejected_frac": 0.0},
        ),
    ],
)
def test_metrics_by_hand_with_a_known_mismatch(overrides, expected):
    model = make_tiny_model()
    cfg = TrainConfig(lr=1e-9, clip_low=0.2, clip_high=0.2, **overrides)
    trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    samples = _two_samples()
    _with_mismatch(trainer, samples, MISMATCH_R)
    [row] = trainer.train(samples)
    expected = {
        "is_ratio_mean": 1.0, "is_ratio_min": 0.5, "is_ratio_max": 1.5, "is_ess": 16 / 18.08,
        "clip_frac_dual": 0.0, **expected,
    }  # fmt: skip
    assert {k: row[k] for k in expected} == pytest.approx(expected, abs=1e-5)
    assert row["loss"] == pytest.approx(row["policy_loss"])  # no KL, no entropy term


def test_sequence_weights_count_the_rejected_tokens_as_verl():
    # r = pi_old / pi_sampler: sample 0 [0.41, 0.71], sample 1 [1, 1]; A = +2, -3; token_k1 0.5_2.0 rejects
    # (0,0) (1 / 0.41 = 2.44 > 2). Sequence weight of sample 0 over every response token (verl computes the
    # weights before rejecting): 0.41 * 0.71 = 0.2911; over the kept token only it would be 0.71.
    # Kept tokens, PPO ratio 1: (-2 * 0.2911 + 3 + 3) / 3 = 1.805933 (kept-only: (-1.42 + 6) / 3 = 1.526667)
    model = make_tiny_model()
    cfg = TrainConfig(lr=1e-9, is_level="sequence", is_threshold=2.0, rejection=["token_k1"],
                      rejection_ratio_low=0.5, rejection_ratio_high=2.0)
    trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    samples = _two_samples()
    _with_mismatch(trainer, samples, [[0.41, 0.71], [1.0, 1.0]])
    [row] = trainer.train(samples)
    assert row["policy_loss"] == pytest.approx((-2 * 0.41 * 0.71 + 6) / 3, abs=1e-5)
    assert row["rejected_frac"] == pytest.approx(0.25)


def test_dual_clip_is_on_by_default_at_3():
    # bypass, r = pi_theta / pi_sampler: sample 0 [1, 1] (A = +2), sample 1 [5, 1] (A = -3).
    # (1,0): PPO max(-A r, -A clip(r)) = max(15, 3.6) = 15, capped by the dual clip at -A * 3 = 9.
    # token-mean: (-2 - 2 + 9 + 3) / 4 = 2.0 (without the dual clip (-4 + 15 + 3) / 4 = 3.5); 1 of 4 dual-clipped
    assert TrainConfig().dual_clip == 3.0
    rows = {}
    for dual_clip in (3.0, None):
        model = make_tiny_model()
        cfg = TrainConfig(lr=1e-9, bypass_old_logprobs=True) if dual_clip else TrainConfig(
            lr=1e-9, bypass_old_logprobs=True, dual_clip=None)
        trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
        samples = _two_samples()
        _with_mismatch(trainer, samples, [[1.0, 1.0], [5.0, 1.0]])
        [rows[dual_clip]] = trainer.train(samples)
    assert rows[3.0]["policy_loss"] == pytest.approx(2.0, abs=1e-5)
    assert rows[3.0]["clip_frac_dual"] == pytest.approx(0.25)
    assert rows[None]["policy_loss"] == pytest.approx(3.5, abs=1e-5)


@pytest.mark.parametrize("bypass", [True, False])
def test_reinforce_weighs_log_pi_by_the_truncated_weight(bypass):
    # reinforce, token IS truncated at 1.2: w = min(r, 1.2) = [1.2, 0.9], [0.5, 1.1], r = pi_theta / pi_sampler
    # under bypass, pi_old / pi_sampler otherwise (equal before the first update).
    # L = -A w log pi_theta per token, token-mean; log pi_theta: the model's own logprobs of the tokens.
    # The old -A * r loss (times w without bypass) gave a loss that does not involve log pi at all.
    model = make_tiny_model()
    cfg = TrainConfig(lr=1e-9, bypass_old_logprobs=bypass, policy_loss="reinforce", is_level="token",
                      is_threshold=1.2)
    trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    samples = _two_samples()
    logp = [lp.double() for lp in trainer.sequence_logprobs(trainer.policy, samples)]
    _with_mismatch(trainer, samples, MISMATCH_R)
    [row] = trainer.train(samples)
    (a, b), (c, d) = logp[0].tolist(), logp[1].tolist()
    expected = (-2 * 1.2 * a - 2 * 0.9 * b + 3 * 0.5 * c + 3 * 1.1 * d) / 4
    assert row["policy_loss"] == pytest.approx(expected, abs=1e-5)


def test_step_totals_weigh_micro_batches_and_count_each_ratio_once():
    # Two micro-batches, then a repeat of the first with loss weight 0 (a rank with fewer micro-batches than
    # the others runs one again): it adds nothing, and its importance ratios are not counted twice.
    # a: 3 loss tokens of 4 (1 rejected), ratios [0.5, 1, 2, 1]; b: 1 token, ratio 1.5.
    a = {"loss": 0.5, "policy_loss": 0.4, "kl_ref_sum": 0.3, "entropy_sum": 6.0, "approx_kl_sum": 0.2,
         "clip_low": 1.0, "clip_high": 0.0, "clip_dual": 0.0, "loss_tokens": 3.0, "response_tokens": 4.0,
         "rejected": 1.0, "tokens": 14.0, "forwarded_tokens": 10.0, "padded_tokens": 12.0,
         "w_sum": 4.5, "w_sq_sum": 6.25, "w_count": 4.0, "w_min": 0.5, "w_max": 2.0}
    b = {"loss": -0.25, "policy_loss": -0.3, "kl_ref_sum": 0.1, "entropy_sum": 2.0, "approx_kl_sum": 0.6,
         "clip_low": 0.0, "clip_high": 1.0, "clip_dual": 0.0, "loss_tokens": 1.0, "response_tokens": 1.0,
         "rejected": 0.0, "tokens": 5.0, "forwarded_tokens": 5.0, "padded_tokens": 6.0,
         "w_sum": 1.5, "w_sq_sum": 2.25, "w_count": 1.0, "w_min": 1.5, "w_max": 1.5}
    totals = StepTotals()
    for stats, weight in ((a, 1.0), (b, 1.0), (a, 0.0)):
        totals.add(stats, weight)
    linear = torch.nn.Linear(1, 1)
    one_rank = TorchStepper(linear, torch.optim.SGD(linear.parameters()), max_grad_norm=1.0)
    row = metrics_row(totals.all_reduce(one_rank), kl_ref_on=True)
    # 4 loss tokens, 5 response tokens; ratios [0.5, 1, 2, 1, 1.5]: mean 6 / 5, ESS 6^2 / (5 * 8.5); a shares a
    # prompt (14 sample tokens in 10 forwarded): padding is over the forwarded 15 of 18
    expected = {
        "loss": 0.25, "policy_loss": 0.1, "approx_kl": 0.8 / 4, "kl_ref": 0.4 / 4, "entropy": 8.0 / 4,
        "clip_frac_low": 1 / 4, "clip_frac_high": 1 / 4, "clip_frac_dual": 0.0, "rejected_frac": 1 / 5,
        "is_ratio_mean": 1.2, "is_ratio_min": 0.5, "is_ratio_max": 2.0, "is_ess": 36 / 42.5,
        "tokens": 19, "loss_tokens": 4, "padding_frac": 1 - 15 / 18,
    }  # fmt: skip
    assert row == pytest.approx(expected)
    assert metrics_row(totals.all_reduce(one_rank), kl_ref_on=False)["kl_ref"] == 0.0


def test_train_sample_refuses_a_non_finite_advantage():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match=rf"advantage {bad} is not finite"):
            TrainSample([1], [3], [-1.0], bad)
    with pytest.raises(ValueError, match="2 response tokens but 1 sampler logprobs"):
        TrainSample([1], [3, 4], [-1.0], 0.0)

def test_kl_penalty_pulls_toward_reference():
    # zero advantages, kl_coef 1: the only force is the KL term, so KL to the reference must fall
    ref = make_tiny_model(seed=0)
    model = make_tiny_model(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    samples = [TrainSample(s.prompt_ids, s.response_ids, s.behaviour_logprobs, 0.0) for s in _samples(model)]
    cfg = TrainConfig(kl_coef=1.0, kl_estimator="k3", lr=2e-2, epochs=8, max_grad_norm=100.0)
    trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 100.0), ref_model=ref)
    rows = trainer.train(samples)
    assert rows[-1]["kl_ref"] < 0.5 * rows[0]["kl_ref"]


# ------------------------------------------------------------------------------------------------------------
# Toy problem with a known optimum: prompt [1, p], a one-token answer in 3..15; reward 1 for token 7, 0.5 for
# token 9, else 0. The optimal policy puts all mass on 7. Each iteration samples 8 answers per prompt from
# the current policy, scores them, computes advantages and takes one step.

PROMPTS = [[1, 3], [1, 4], [1, 5], [1, 6]]
REWARD = {7: 1.0, 9: 0.5}


def _answer_probs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPTS)).logits[:, -1, :]
        logits[:, :3] = -1e9  # answers are tokens 3..15
        return torch.softmax(logits, -1)


@pytest.mark.parametrize("estimator", [name for name, record in ESTIMATORS.items() if record.from_rewards])
def test_toy_problem_moves_policy_toward_reward(estimator):
    model = make_tiny_model(seed=1)
    cfg = TrainConfig(lr=3e-2, max_grad_norm=10.0, seed=0)
    trainer = PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), cfg.max_grad_norm))
    generator = torch.Generator().manual_seed(0)
    start = _answer_probs(model)[:, 7].mean().item()
    for iteration in range(12):
        probs = _answer_probs(model)
        samples, rewards, groups = [], [], []
        for g, prompt in enumerate(PROMPTS):
            answers = torch.multinomial(probs[g], 8, replacement=True, generator=generator).tolist()
            for token in answers:
                samples.append(TrainSample(prompt, [token], [float(torch.log(probs[g, token]))], 0.0))
                rewards.append(REWARD.get(token, 0.0))
                groups.append(g)
        advantages = compute_advantages(
            estimator, np.array(rewards), np.array(groups), lengths_N=np.ones(len(rewards))
        )
        for sample, advantage in zip(samples, advantages, strict=True):
            sample.advantage = float(advantage)
        if np.any(advantages != 0):
            trainer.train(samples, iteration)
    end = _answer_probs(model)[:, 7].mean().item()
    # uniform-ish start (~1/13); the policy must now put clearly more mass on the best answer
    assert start < 0.15
    assert end > 0.5, (estimator, start, end)


@pytest.mark.parametrize(
    "overrides",
    [
        {"policy_loss": "reinforce"},
        {"epochs": 2, "minibatches": 2, "clip_high": 0.28, "dual_clip": 3.0},
        {"is_level": "token", "is_threshold": 2.0, "rejection": ["seq_max_k2"]},
        {"bypass_old_logprobs": True, "loss_aggregation": "seq-mean-token-sum-norm"},
        {"dtype": "bfloat16", "entropy_coef": 1e-3},
        {"policy_loss": "reinforce", "bypass_old_logprobs": True, "is_level": "token"},
        {"policy_loss": "cispo", "epochs": 2, "clip_high": 4.0},
        {"policy_loss": "sapo", "epochs": 2},
        {"policy_loss": "gspo", "epochs": 2, "minibatches": 2},
        {"m2po_threshold": 0.04, "skip_threshold": 2.0, "epochs": 2},
        {"bypass_old_logprobs": True, "policy_loss": "reinforce", "is_level": "sequence", "is_batch_normalize": True,
         "rejection": ["token_k1", "seq_max_k2"], "rejection_thresholds": ["0.6_1.6", "2.5"]},
    ],
)
def test_toy_problem_loss_variants(overrides):
    model = make_tiny_model(seed=1)
    cfg = TrainConfig(lr=3e-2, max_grad_norm=10.0, **overrides)
    trainer = PolicyTrainer(
        model, cfg, TorchStepper(model, make_adamw(model, cfg), cfg.max_grad_norm), norm_length=1
    )
    generator = torch.Generator().manual_seed(0)
    for iteration in range(12):
        probs = _answer_probs(model)
        samples, rewards, groups = [], [], []
        for g, prompt in enumerate(PROMPTS):
            for token in torch.multinomial(probs[g], 8, replacement=True, generator=generator).tolist():
                samples.append(TrainSample(prompt, [token], [float(torch.log(probs[g, token]))], 0.0))
                rewards.append(REWARD.get(token, 0.0))
                groups.append(g)
        advantages = compute_advantages("grpo", np.array(rewards), np.array(groups))
        for sample, advantage in zip(samples, advantages, strict=True):
            sample.advantage = float(advantage)
        if np.any(advantages != 0):
            trainer.train(samples, iteration)
    assert _answer_probs(model)[:, 7].mean().item() > 0.5


def test_reference_model_required_for_kl():
    model = make_tiny_model()
    cfg = TrainConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="reference model"):
        PolicyTrainer(model, cfg, TorchStepper(model, make_adamw(model, cfg), 1.0))
    _ = copy
