"""The train stage's memory savings change nothing in the update (issue 22): activation checkpointing gives the loss
and gradients of an independent full-logits reference, the gradient-freeing optimizer step gives AdamW's own
update, and `gradient_checkpointing: auto` turns on where the hand-computed activation estimate says it pays."""

from __future__ import annotations

import copy

import pytest
import torch

from schemas.config import TrainConfig
from stages.rl.checkpoint import activation_checkpointing
from stages.rl.logprobs import build_micro_batch
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw, step_freeing_grads
from tests.support.logprobs import full_softmax_logprobs

from .conftest import make_tiny_model

PROMPTS = [[1, 5, 6], [1, 10], [1, 4, 4, 9]]
RESPONSES = [[3, 4, 7, 8, 9], [11, 12], [5, 6, 13]]
ADVANTAGES = [1.5, -0.5, 0.7]


class Recording(TorchStepper):
    def step(self, lr: float) -> float:
        self.grads = [p.grad.clone() for p in self.params]
        return super().step(lr)


def _reference_loss_and_grads(model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    """One step's token-mean PPO-clip loss on the fast path (pi_old = sg(pi_theta): r = exp(logp - sg(logp)) = 1,
    loss = sum_t -A_t r_t / N), through full logits and a plain backward."""
    model = copy.deepcopy(model)
    micro = build_micro_batch([0, 1, 2], PROMPTS, RESPONSES)
    logp_BT, _ = full_softmax_logprobs(model, micro)
    ratio_BT = torch.exp(logp_BT - logp_BT.detach())
    advantages_BT = torch.tensor(ADVANTAGES)[:, None]
    loss = (-advantages_BT * ratio_BT * micro.response_mask_BT()).sum() / sum(len(r) for r in RESPONSES)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_checkpointing_on_and_off_match_the_full_logits_reference(checkpointing: bool) -> None:
    model = make_tiny_model(seed=3)
    expected_loss, expected_grads = _reference_loss_and_grads(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    samples = [TrainSample(p, r, [-2.0] * len(r), a) for p, r, a in zip(PROMPTS, RESPONSES, ADVANTAGES, strict=True)]
    cfg = TrainConfig(lr=1e-9, micro_batch_tokens=16)  # two micro-batches: accumulation under checkpointing too
    stepper = Recording(model, make_adamw(model, cfg), max_grad_norm=1e9)
    row = PolicyTrainer(model, cfg, stepper).train(samples)[0]
    assert model.is_gradient_checkpointing == checkpointing
    assert row["loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert len(stepper.grads) == len(expected_grads)
    for got, want in zip(stepper.grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_step_freeing_grads_is_adamws_own_step() -> None:
    """Two AdamW steps (the second with state), weight decay on: parameters and optimizer state equal torch's
    whole-model `step()`, and every gradient is freed."""
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    ours, theirs = make_tiny_model(seed=4), make_tiny_model(seed=4)
    opt_ours, opt_theirs = make_adamw(ours, cfg), make_adamw(theirs, cfg)
    for step in range(2):
        for model in (ours, theirs):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
        step_freeing_grads(opt_ours, list(ours.parameters()))
        opt_theirs.step()
        assert all(p.grad is None for p in ours.parameters())
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_ours.state[a][key], opt_theirs.state[b][key], rtol=0, atol=0)


def test_auto_checkpointing_where_activations_exceed_weights_and_grads() -> None:
    """SmolLM2-135M's shape (30 layers, hidden 576, 134,515,008 parameters), built on the meta device:
    activations per token 30 x 576 x 108 B = 1,866,240 B; weights + grads 8 x 134,515,008 B = 1,076,120,064 B,
    so auto turns on above 576.6 tokens per micro-batch (on at 2048, off at 512). Explicit settings win."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert activation_checkpointing(model, TrainConfig(micro_batch_tokens=2048))
    assert activation_checkpointing(model, TrainConfig(micro_batch_tokens=577))
    assert not activation_checkpointing(model, TrainConfig(micro_batch_tokens=576))
    assert not activation_checkpointing(model, TrainConfig(micro_batch_tokens=2048, gradient_checkpointing=False))
    assert activation_checkpointing(model, TrainConfig(micro_batch_tokens=512, gradient_checkpointing=True))
