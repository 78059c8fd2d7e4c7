"""PolicyTrainer's gradient against an independent reference: full logits, a full log-softmax and every loss
written out in plain torch below (nothing of stages/rl/losses.py), one sequence at a time, no micro-batching.

Each case is one optimizer step on six sequences of a tiny Llama, packed into several micro-batches. The sampler's
logprobs are the model's own plus noise, so the ratios to the sampler are not 1; under bypass they are the PPO
ratio itself. The formulas follow verl's core_algos.py / rollout_corr_helper.py and TRL's grpo_trainer.py as
docs/algorithms.md states them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.config import TrainConfig
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw

from .conftest import make_tiny_model

TEMPERATURE = 0.7


def _samples(seed: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(6):
        prompt = [1] + rng.integers(3, 16, size=int(rng.integers(1, 5))).tolist()
        response = rng.integers(3, 16, size=int(rng.integers(1, 7))).tolist()
        samples.append(TrainSample(prompt, response, [0.0] * len(response), advantage=[1.5, -0.5, -2.0][i % 3]))
    return samples


def _full_logprobs(model: torch.nn.Module, sample: TrainSample) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token) of the response tokens and the entropies, from the model's full logits."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    logits = model(input_ids=ids).logits[0].float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    start = len(sample.prompt_ids) - 1
    rows = logp_all[start : start + len(sample.response_ids)]
    logp = rows.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
    return logp, -(rows.exp() * rows).sum(-1)


def _token_loss(cfg: dict, logp: torch.Tensor, old: torch.Tensor, sampler: torch.Tensor, a: float) -> torch.Tensor:
    """Per-token policy loss of one sequence, before importance weights and masks."""
    r = torch.exp(logp - old)
    if cfg["policy_loss"] == "ppo_clip":
        loss = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28))
        return torch.minimum(loss, torch.full_like(loss, -a * 3.0)) if a < 0 else loss
    if cfg["policy_loss"] == "reinforce":
        w = torch.clamp(torch.exp(logp.detach() - sampler), max=2.0) if cfg.get("is_level") else 1.0
        return -a * w * logp
    if cfg["policy_loss"] == "cispo":
        return -torch.clamp(r.detach(), max=1.28) * a * logp
    if cfg["policy_loss"] == "sapo":
        tau = 1.0 if a > 0 else 1.05
        return -(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
    if cfg["policy_loss"] == "gspo":
        s = torch.exp(logp - logp.detach() + (logp.detach() - old).mean())
        return torch.maximum(-a * s, -a * torch.clamp(s, 0.8, 1.28))
    raise AssertionError(cfg)


def _reference_grads(model: torch.nn.Module, samples: list[TrainSample], cfg: dict) -> list[torch.Tensor]:
    model.zero_grad()
    with torch.no_grad():
        old = [_full_logprobs(model, s)[0] for s in samples]
    sampler = [torch.tensor(s.behaviour_logprobs) for s in samples]
    if cfg.get("bypass_old_logprobs"):
        old = sampler
    terms, keeps, weights = [], [], []
    for sample, old_i, sampler_i in zip(samples, old, sampler, strict=True):
        logp, entropy = _full_logprobs(model, sample)
        keep = torch.ones_like(logp)
        # verl's token_k1: -log(pi_old / pi_sampler) within [log 0.7, log 1.3]
        if cfg.get("rejection"):
            neg_log_rho = -(old_i - sampler_i)
            keep = ((neg_log_rho >= np.log(0.7)) & (neg_log_rho <= np.log(1.3))).float()
        w = torch.ones_like(logp)
        if cfg.get("is_level") == "sequence" and not cfg.get("bypass_old_logprobs"):
            w = torch.clamp(torch.exp((old_i - sampler_i).sum()), max=2.0) * w  # over every response token
        loss = _token_loss(cfg, logp, old_i, sampler_i, sample.advantage) * w
        loss = loss + cfg.get("kl_coef", 0.0) * 0.0  # no reference model in these cases
        loss = loss - cfg.get("entropy_coef", 0.0) * entropy
        terms.append(loss)
        keeps.append(keep)
        weights.append(w)
    mode = cfg.get("loss_aggregation", "token-mean")
    tokens = sum(float(k.sum()) for k in keeps)
    sequences = sum(1.0 for k in keeps if k.sum() > 0)
    if mode == "token-mean":
        total = sum((t * k).sum() for t, k in zip(terms, keeps, strict=True)) / tokens
    elif mode == "seq-mean-token-mean":
        total = sum((t * k).sum() / k.sum() for t, k in zip(terms, keeps, strict=True) if k.sum() > 0) / sequences
    else:  # seq-mean-token-sum-norm with norm_length 8
        total = sum((t * k).sum() for t, k in zip(terms, keeps, strict=True)) / 8.0
    total.backward()
    return [p.grad.clone() for p in model.parameters()]


CASES = [
    {"policy_loss": "ppo_clip", "bypass_old_logprobs": True},
    {"policy_loss": "ppo_clip", "bypass_old_logprobs": True, "loss_aggregation": "seq-mean-token-mean"},
    {"policy_loss": "ppo_clip", "rejection": ["token_k1"], "is_level": "sequence"},
    {"policy_loss": "reinforce", "bypass_old_logprobs": True, "is_level": "token"},
    {"policy_loss": "reinforce", "loss_aggregation": "seq-mean-token-sum-norm"},
    {"policy_loss": "cispo", "bypass_old_logprobs": True},
    {"policy_loss": "sapo", "bypass_old_logprobs": True, "entropy_coef": 0.01},
    {"policy_loss": "gspo", "bypass_old_logprobs": True},
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(f"{v}" for v in case.values()))
def test_trainer_gradient_equals_the_full_logits_reference(case):
    torch.manual_seed(0)
    samples = _samples()
    model = make_tiny_model(seed=2)
    with torch.no_grad():
        for sample in samples:
            own, _ = _full_logprobs(model, sample)
            sample.behaviour_logprobs = (own + 0.3 * torch.randn(own.shape)).tolist()
    settings = {k: v for k, v in case.items() if k in TrainConfig.model_fields}
    if "rejection" in settings:
        settings["rejection_thresholds"] = ["0.7_1.3"]
    cfg = TrainConfig(lr=1e-9, micro_batch_tokens=24, clip_low=0.2, clip_high=0.28, is_threshold=2.0, **settings)

    class Recording(TorchStepper):
        def step(self, lr: float) -> float:
            self.grads = [p.grad.clone() for p in self.params]
            return super().step(lr)

    stepper = Recording(model, make_adamw(model, cfg), max_grad_norm=1e9)
    reference = _reference_grads(make_tiny_model(seed=2), samples, case)
    PolicyTrainer(model, cfg, stepper, temperature=TEMPERATURE, norm_length=8).train(samples)
    assert any(float(g.abs().max()) > 0 for g in reference)
    for ours, theirs in zip(stepper.grads, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-4, atol=2e-7)
