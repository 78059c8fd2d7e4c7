"""Multi-turn training (issue 19): observation tokens (loss mask 0) are context, never loss.

A tiny real Llama, two samples in one micro-batch: A = prompt [1, 5, 6], response [3, 4, 7, 8, 9] with loss mask
[1, 1, 0, 0, 1] (tokens 7, 8 are a tool's output), advantage 1.5; B = prompt [1, 10], response [11, 12], single
turn (no mask), advantage -0.5. The expected numbers come from a full-logits forward (`full_softmax_logprobs`,
not the trainer's chunked path) and the formulas written out here over the 3 + 2 model tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from schemas.config import TrainConfig
from stages.rl.logprobs import build_micro_batch
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw
from stages.train import training_samples
from tests.support.logprobs import full_softmax_logprobs

from .conftest import make_tiny_model

MASK_A = [1, 1, 0, 0, 1]
PROMPTS = [[1, 5, 6], [1, 10]]
RESPONSES = [[3, 4, 7, 8, 9], [11, 12]]
ADVANTAGES = [1.5, -0.5]
# sampler logprob = trainer logprob + offset at model tokens (ratio exp(-offset), inside the clip range except
# A's last token, 1.35 > 1.2, high-clipped); the loop's placeholder 0.0 at the observation tokens
OFFSETS = [[0.1, -0.05, None, None, -0.3], [0.02, -0.1]]
AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_LENGTH = 8


def _reference_logprobs(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    micro = build_micro_batch([0, 1], PROMPTS, RESPONSES)
    with torch.no_grad():
        logp_BT, entropy_BT = full_softmax_logprobs(model, micro)
    return ([logp_BT[b, : len(r)].double() for b, r in enumerate(RESPONSES)],
            [entropy_BT[b, : len(r)].double() for b, r in enumerate(RESPONSES)])


def _samples(model: torch.nn.Module, mask_a: list[int] | None = MASK_A) -> list[TrainSample]:
    logp, _ = _reference_logprobs(model)
    samples = []
    for b, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        behaviour = [0.0 if off is None else float(lp) + off for lp, off in zip(logp[b], OFFSETS[b], strict=True)]
        samples.append(TrainSample(prompt, response, behaviour, ADVANTAGES[b], loss_mask=mask_a if b == 0 else None))
    return samples


class Recording(TorchStepper):
    def step(self, lr: float) -> float:
        self.grads = [p.grad.clone() for p in self.params]
        return super().step(lr)


def _train(model: torch.nn.Module, samples: list[TrainSample], cfg: TrainConfig,
           ref: torch.nn.Module | None) -> tuple[dict, list[torch.Tensor]]:
    stepper = Recording(model, make_adamw(model, cfg), max_grad_norm=1e9)
    rows = PolicyTrainer(model, cfg, stepper, norm_length=NORM_LENGTH, ref_model=ref).train(samples)
    return rows[0], stepper.grads


def _aggregate(per_token: list[torch.Tensor], masks: list[torch.Tensor], mode: str) -> float:
    """verl's agg_loss written out for two sequences (stages/rl/losses.aggregate's formulas)."""
    sums = [float((v * m).sum()) for v, m in zip(per_token, masks, strict=True)]
    counts = [float(m.sum()) for m in masks]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-sum":
        return sum(sums) / 2
    if mode == "seq-mean-token-mean":
        return (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    return sum(sums) / NORM_LENGTH


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_loss_kl_entropy_and_ratios_count_model_tokens_only(mode: str) -> None:
    """Bypass mode (pi_old = the sampler's), ppo_clip 0.2 / 0.2, k3 KL to a second tiny model with beta 0.1,
    entropy bonus 0.01. Per model token t, with r_t = exp(logp_t - b_t), d_t = logp_t - ref_t:
      policy_t = max(-A r_t, -A clip(r_t, 0.8, 1.2)) (dual clip 3 inactive: r < 3);  kl_t = exp(-d_t) - 1 + d_t
      loss = agg(policy) + 0.1 agg(kl) - 0.01 agg(H) over m = [1,1,0,0,1] and [1,1] (agg: the mode's formula,
      e.g. seq-mean-token-mean = (sum_A / 3 + sum_B / 2) / 2);  kl_ref = sum kl / 5;  entropy = sum H / 5;
      approx_kl = sum (r - 1 - log r) / 5;  is_ratio_mean / min / max over the 5 values r_t;  loss_tokens = 5;
      clip_frac_high = 1 / 5 (A's last token, r = e^0.3 = 1.35 with A > 0).
    The observation tokens' sampler logprob 0.0 would give r = pi(t) ~ 1/16 there: any leak moves is_ratio_min
    (and the loss)."""
    model, ref = make_tiny_model(seed=0), make_tiny_model(seed=1)
    samples = _samples(model)
    logp, entropy = _reference_logprobs(model)
    ref_logp, _ = _reference_logprobs(ref)
    masks = [torch.tensor(MASK_A, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    ratios = [torch.exp(lp - torch.tensor(s.behaviour_logprobs, dtype=torch.float64)) for lp, s in
              zip(logp, samples, strict=True)]
    policy = [torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)) for a, r in zip(ADVANTAGES, ratios, strict=True)]
    kl = [torch.exp(-(lp - rf)) - 1 + (lp - rf) for lp, rf in zip(logp, ref_logp, strict=True)]
    expected_loss = (_aggregate(policy, masks, mode) + 0.1 * _aggregate(kl, masks, mode)
                     - 0.01 * _aggregate(entropy, masks, mode))
    model_ratios = torch.cat([r[m > 0] for r, m in zip(ratios, masks, strict=True)])

    cfg = TrainConfig(lr=1e-9, loss_aggregation=mode, bypass_old_logprobs=True, kl_coef=0.1, entropy_coef=0.01)
    row, _ = _train(model, samples, cfg, ref)
    assert row["loss_tokens"] == 5
    assert row["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert row["kl_ref"] == pytest.approx(sum(float((k * m).sum()) for k, m in zip(kl, masks, strict=True)) / 5,
                                          abs=1e-6)
    assert row["entropy"] == pytest.approx(sum(float((h * m).sum()) for h, m in zip(entropy, masks, strict=True)) / 5,
                                           abs=1e-5)
    assert row["approx_kl"] == pytest.approx(float((model_ratios - 1 - model_ratios.log()).sum()) / 5, abs=1e-6)
    assert row["is_ratio_mean"] == pytest.approx(float(model_ratios.mean()), abs=1e-5)
    assert row["is_ratio_min"] == pytest.approx(float(model_ratios.min()), abs=1e-5)
    assert row["is_ratio_max"] == pytest.approx(math.exp(0.3), abs=1e-5)
    assert row["clip_frac_high"] == pytest.approx(1 / 5)
    assert row["rejected_frac"] == 0.0


class PerturbedHead(torch.nn.Module):
    """The LM head plus a fixed offset on chosen rows of the flattened response positions: changes the logits
    that predict exactly those tokens and nothing else."""

    def __init__(self, head: torch.nn.Module, offset_NV: torch.Tensor):
        super().__init__()
        self.head = head
        self.offset_NV = offset_NV

    def forward(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_NH) + self.offset_NV[: hidden_NH.shape[0]]


def _perturbed(model: torch.nn.Module, rows: list[int], seed: int = 7) -> torch.nn.Module:
    """`model` whose logits at flattened response rows `rows` (A's tokens 0-4, then B's 5-6: the packing puts
    the longer A first) get a large random offset."""
    vocab = model.config.vocab_size
    offset_NV = torch.zeros(7, vocab)
    offset_NV[rows] = 8.0 * torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
    model.lm_head = PerturbedHead(model.lm_head, offset_NV)
    return model


CONFIGS = {
    **{mode: {"loss_aggregation": mode, "bypass_old_logprobs": True, "kl_coef": 0.1, "entropy_coef": 0.01}
       for mode in AGGREGATIONS},
    # the minibatch correction: recomputed pi_old, sequence IS weights normalised, k1 and k3 rejection, M2PO
    "correction": {"is_level": "sequence", "is_batch_normalize": True, "rejection": ["token_k1", "seq_mean_k3"],
                   "rejection_thresholds": ["0.2_5", "5"], "m2po_threshold": 1.0, "kl_coef": 0.1,
                   "loss_aggregation": "seq-mean-token-mean"},
    "reinforce_token_is": {"policy_loss": "reinforce", "is_level": "token", "bypass_old_logprobs": True,
                           "entropy_coef": 0.01},
    "gspo": {"policy_loss": "gspo", "kl_coef": 0.1, "epochs": 2},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_at_observation_tokens_change_neither_loss_nor_gradients(name: str) -> None:
    """Adding a large random offset to the logits at A's observation positions (flattened rows 2, 3) leaves the
    loss, every statistic and every gradient as they were, under each aggregation and correction; the same
    offset at a model token (row 1), or with A unmasked, changes the loss (the check can fail)."""
    cfg = TrainConfig(lr=1e-9, **CONFIGS[name])
    ref = make_tiny_model(seed=1)
    base = make_tiny_model(seed=0)
    samples = _samples(base)
    row, grads = _train(base, samples, cfg, ref)
    row_p, grads_p = _train(_perturbed(make_tiny_model(seed=0), [2, 3]), samples, cfg, ref)
    for key in ("loss", "policy_loss", "approx_kl", "kl_ref", "entropy", "is_ratio_mean", "is_ratio_min",
                "is_ratio_max", "rejected_frac", "loss_tokens"):
        assert row_p[key] == pytest.approx(row[key], rel=1e-6, abs=1e-7), key
    for g, g_p in zip(grads, grads_p, strict=True):
        torch.testing.assert_close(g_p, g, rtol=1e-5, atol=1e-7)

    row_model_token, _ = _train(_perturbed(make_tiny_model(seed=0), [1]), samples, cfg, ref)
    assert abs(row_model_token["loss"] - row["loss"]) > 1e-4
    unmasked = _samples(make_tiny_model(seed=0), mask_a=None)
    row_u, _ = _train(make_tiny_model(seed=0), unmasked, cfg, ref)
    row_u_p, _ = _train(_perturbed(make_tiny_model(seed=0), [2, 3]), unmasked, cfg, ref)
    assert abs(row_u_p["loss"] - row_u["loss"]) > 1e-4


def test_a_mask_of_all_ones_equals_no_mask() -> None:
    """A loss mask of ones is the single-turn sample: same loss and gradients, bit for bit."""
    cfg = TrainConfig(lr=1e-9, kl_coef=0.1, entropy_coef=0.01, epochs=2)
    ref = make_tiny_model(seed=1)
    row, grads = _train(make_tiny_model(seed=0), _samples(make_tiny_model(seed=0), mask_a=None), cfg, ref)
    row_1, grads_1 = _train(make_tiny_model(seed=0), _samples(make_tiny_model(seed=0), mask_a=[1] * 5), cfg, ref)
    assert row_1["loss"] == row["loss"] and row_1["loss_tokens"] == row["loss_tokens"] == 7
    for g, g_1 in zip(grads, grads_1, strict=True):
        assert torch.equal(g, g_1)


def test_bad_loss_masks_are_refused() -> None:
    with pytest.raises(ValueError, match="2 response tokens but 3 loss mask values"):
        TrainSample([1], [3, 4], [-1.0, -1.0], 0.0, loss_mask=[1, 0, 1])
    with pytest.raises(ValueError, match="0 \\(observation\\) or 1"):
        TrainSample([1], [3, 4], [-1.0, -1.0], 0.0, loss_mask=[1, 2])


def test_training_samples_carry_the_rollouts_loss_mask() -> None:
    """The train stage's join: a multi-turn rollout's mask goes with its sample, a single-turn one (null) adds
    no field (so the sample is what it was before rollouts v2)."""
    key = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "p", "sample_idx": 0}
    rollouts = [
        {**key, "prompt_token_ids": [1], "response_token_ids": [3, 4, 5], "response_logprobs": [-1.0, 0.0, -1.0],
         "loss_mask": [1, 0, 1]},
        {**key, "sample_idx": 1, "prompt_token_ids": [1], "response_token_ids": [3], "response_logprobs": [-1.0],
         "loss_mask": None},
    ]
    batch = [{**key, "kept": True, "advantage": 1.0}, {**key, "sample_idx": 1, "kept": True, "advantage": -1.0}]
    samples, empty = training_samples(batch, rollouts)
    assert empty == 0
    assert samples[0]["loss_mask"] == [1, 0, 1] and "loss_mask" not in samples[1]
    assert TrainSample(**samples[0]).model_tokens == 2


def test_the_critic_value_loss_counts_model_tokens_only(tmp_path) -> None:  # noqa: ANN001
    """A new critic predicts V = 0. Returns [1, 100, 1] with loss mask [1, 0, 1] and [2] single-turn, no value
    clip: value_loss = 0.5 * mean over the 3 model tokens of (0 - R)^2 = 0.5 * (1 + 1 + 4) / 3 = 1.0 (the
    observation's 100 would make it ~1668)."""
    from stages.rl.critic import CriticSample, CriticTrainer, load_value_model

    model_dir = tmp_path / "policy"
    make_tiny_model(seed=4).save_pretrained(model_dir)
    critic, _ = load_value_model(None, model_dir)
    cfg = TrainConfig(value_clip=None)
    trainer = CriticTrainer(critic, cfg, torch.optim.AdamW(critic.parameters(), lr=1e-9))
    samples = [CriticSample([1, 5], [3, 7, 4], [0.0] * 3, [1.0, 100.0, 1.0], [1, 0, 1]),
               CriticSample([1, 6], [8], [0.0], [2.0])]
    row = trainer.step(samples, [0, 1])
    assert row["value_loss"] == pytest.approx(1.0, abs=1e-6)
