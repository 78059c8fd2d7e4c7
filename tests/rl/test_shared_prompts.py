"""Shared-prompt rows (train.share_prompts): the layout and 4D mask by hand, and logprobs, losses and gradients
equal to one row per sample (itself checked against the full-softmax reference) to fp32 rounding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from schemas.config import TrainConfig
from stages.rl.critic import CriticSample, CriticTrainer, ValueModel, predict_values
from stages.rl.logprobs import (
    all_response_logprobs,
    build_micro_batch,
    plan_micro_batches,
    shared_attention_mask,
    takes_shared_prompts,
)
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw
from tests.support.logprobs import full_softmax_logprobs, response_logprobs

from .conftest import make_tiny_model


def test_a_shared_row_by_hand():
    # sequences 0 and 1 share prompt [5, 6] (one row), sequence 2 has its own
    micro = build_micro_batch([[0, 1], 2], prompts=[[5, 6], [5, 6], [7, 7, 7, 7, 7]],
                              responses=[[8, 9], [10], [11]])
    assert micro.input_ids_RL.tolist() == [[5, 6, 8, 9, 10, 0], [7, 7, 7, 7, 7, 11]]
    assert micro.attention_mask_RL.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    # each response continues from the prompt's length: 10 sits where it was sampled, at position 2
    assert micro.position_ids_RL.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert micro.segments_RL.tolist() == [[0, 0, 1, 1, 2, -1], [0, 0, 0, 0, 0, 1]]
    # 8 and 10 are both predicted by the prompt's last position (1); 9 by 8's (2); 11 by position 4 of row 1
    assert micro.hidden_rows_N.tolist() == [0, 0, 0, 1]
    assert micro.positions_N.tolist() == [1, 2, 1, 4]
    assert micro.rows_N.tolist() == [0, 0, 1, 2] and micro.columns_N.tolist() == [0, 1, 0, 0]
    assert micro.targets_N.tolist() == [8, 9, 10, 11]
    assert micro.response_mask_BT().tolist() == [[1, 1], [1, 0], [1, 0]]
    assert (micro.indices, micro.tokens, micro.padded_tokens) == ([0, 1, 2], 11, 12)


def test_the_4d_mask_of_a_two_response_row_element_by_element():
    segments_RL = torch.tensor([[0, 0, 1, 1, 2, -1]])
    expected = [
        [1, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # response 1: the prompt and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # response 2: the prompt and itself, never response 1
        [0, 0, 0, 0, 0, 1],  # padding: itself only (no all-masked row, no NaN)
    ]
    sdpa = shared_attention_mask(segments_RL, "sdpa")
    assert sdpa.dtype == torch.bool and sdpa.shape == (1, 1, 6, 6)
    assert sdpa[0, 0].int().tolist() == expected
    eager = shared_attention_mask(segments_RL, "eager")
    blocked = torch.finfo(torch.float32).min
    assert eager.dtype == torch.float32
    assert eager[0, 0].tolist() == [[0.0 if e else blocked for e in row] for row in expected]


def test_groups_split_into_sub_rows_and_micro_batches():
    prompts = [[1, 2, 3]] * 3 + [[4, 5]]
    responses = [[6] * 4, [7] * 2, [8] * 5, [9] * 3]
    # budget 12: [3 + 4 + 2] = 9, + 5 would be 14: sequence 2 starts a sub-row repeating the prompt (3 + 5 = 8);
    # rows of 9, 8 and 5 tokens: no two fit 12 padded to the longer one (2 x 8 = 16)
    assert plan_micro_batches(range(4), prompts, responses, 12, share=True) == [[[0, 1]], [[2]], [[3]]]
    # budget 16: the whole group fits one row (3 + 4 + 2 + 5 = 14)
    assert plan_micro_batches(range(4), prompts, responses, 16, share=True) == [[[0, 1, 2]], [[3]]]
    # without sharing: one row per sequence, packed as pack_by_tokens packs the lengths [7, 5, 8, 5]
    assert plan_micro_batches(range(4), prompts, responses, 12, share=False) == [[[2]], [[0]], [[1], [3]]]
    with pytest.raises(ValueError, match="prompt token ids differ"):
        build_micro_batch([[0, 3]], prompts, responses)


def _groups(seed: int = 0, groups: int = 3, size: int = 3, vocab: int = 16) -> tuple[list, list]:
    """Groups of `size` samples sharing a prompt, responses of mixed lengths (1 to 7 tokens)."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [1] + rng.integers(3, vocab, size=int(rng.integers(2, 6))).tolist()
        for _ in range(size):
            prompts.append(list(prompt))
            responses.append(rng.integers(3, vocab, size=int(rng.integers(1, 8))).tolist())
    return prompts, responses


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_logprobs_entropy_and_gradients_equal_the_full_softmax_reference(attention):
    model = make_tiny_model()
    model.set_attn_implementation(attention)
    assert takes_shared_prompts(model, "auto")
    prompts, responses = _groups()
    rows = plan_micro_batches(range(len(prompts)), prompts, responses, 4096, share=True)
    assert len(rows) == 1 and sorted(rows[0]) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # longest row first
    shared = build_micro_batch(rows[0], prompts, responses)
    plain = build_micro_batch(shared.indices, prompts, responses)
    weights_BT = torch.linspace(0.5, 2.0, plain.width)[None, :] * torch.tensor([1.0, -2.0, 0.5] * 3)[:, None]
    logp, entropy = response_logprobs(model, shared, temperature=0.7, chunk_tokens=5)
    mask = shared.response_mask_BT()
    (logp * mask * weights_BT).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_logp, ref_entropy = full_softmax_logprobs(model, plain, temperature=0.7)
    (ref_logp * mask * weights_BT).sum().backward()
    torch.testing.assert_close(logp * mask, ref_logp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy * mask, ref_entropy * mask, rtol=1e-5, atol=1e-6)
    for grad, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6)
    # 3 rows of prompt + 3 responses instead of 9 of prompt + response: each prompt forwarded once
    assert shared.tokens == plain.tokens - 2 * sum(len(prompts[3 * g]) for g in range(3))


def test_no_grad_passes_share_too():
    model = make_tiny_model()
    prompts, responses = _groups(seed=1)
    shared = all_response_logprobs(model, prompts, responses, 1.0, 24, share=True)
    plain = all_response_logprobs(model, prompts, responses, 1.0, 24, share=False)
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _train_samples(model, loss_masks: bool = False) -> list[TrainSample]:
    prompts, responses = _groups(seed=2, groups=3, size=4)
    rng = np.random.default_rng(3)
    samples = []
    for k, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        mask = None
        if loss_masks and k % 2 == 0:  # multi-turn: observation tokens (0) between model tokens
            mask = [1] + rng.integers(0, 2, size=len(response) - 1).tolist()
        samples.append(TrainSample(prompt, response, [-2.0] * len(response), advantage=float(k % 3) - 0.8,
                                   loss_mask=mask))
    # behaviour logprobs near the model's own (from plain rows)
    helper = PolicyTrainer(model, TrainConfig(share_prompts=False),
                           TorchStepper(model, make_adamw(model, TrainConfig()), 1.0))
    for sample, logp in zip(samples, helper.sequence_logprobs(helper.policy, samples), strict=True):
        sample.behaviour_logprobs = (logp + 0.05 * torch.randn(logp.shape)).tolist()
    return samples


def _train_grads(share: bool, budget: int, loss_masks: bool = False, **overrides) -> tuple[list, list[dict]]:
    torch.manual_seed(0)
    model = make_tiny_model()
    ref_model = copy.deepcopy(make_tiny_model(seed=1)) if overrides.get("kl_coef", 0) > 0 else None
    samples = _train_samples(model, loss_masks)
    cfg = TrainConfig(micro_batch_tokens=budget, lr=1e-9, share_prompts=share, **overrides)

    class Recording(TorchStepper):
        grads: list[list[torch.Tensor]] = []

        def step(self, lr: float) -> float:
            self.grads.append([p.grad.clone() for p in self.params])
            return super().step(lr)

    stepper = Recording(model, make_adamw(model, cfg), max_grad_norm=1e9)
    stepper.grads = []
    trainer = PolicyTrainer(model, cfg, stepper, norm_length=8, ref_model=ref_model)
    assert trainer.share is share
    rows = trainer.train(samples)
    return stepper.grads, rows


@pytest.mark.parametrize(
    ("budget", "loss_masks", "overrides"),
    [
        (4096, False, {}),  # every group in one row, one micro-batch
        (16, False, {}),  # groups split into sub-rows and across micro-batches
        (4096, True, {"entropy_coef": 0.01}),  # multi-turn loss masks, entropy bonus
        # two steps (the old-logprob pass), the reference pass, a minibatch correction
        (30, False, {"minibatches": 2, "kl_coef": 0.1, "rejection": ["token_k1"], "rejection_ratio_low": 0.9,
                     "rejection_ratio_high": 1.1, "loss_aggregation": "seq-mean-token-mean"}),
    ],
)
def test_training_with_shared_prompts_equals_one_row_per_sample(budget, loss_masks, overrides):
    prompts, responses = _groups(seed=2, groups=3, size=4)  # the samples _train_samples makes
    plan = plan_micro_batches(range(len(prompts)), prompts, responses, budget, share=True)
    micro_batches_of_group_0 = {k for k, rows in enumerate(plan) for row in rows if set(row) & {0, 1, 2, 3}}
    if budget == 16:  # group 0 (6 + 4 + 6 + 2 + 4 tokens) is cut into sub-rows in different micro-batches
        assert len(micro_batches_of_group_0) >= 2
    shared_grads, shared_rows = _train_grads(True, budget, loss_masks, **overrides)
    plain_grads, plain_rows = _train_grads(False, budget, loss_masks, **overrides)
    assert len(shared_grads) == len(plain_grads) == len(shared_rows)
    for shared_step, plain_step in zip(shared_grads, plain_grads, strict=True):
        for a, b in zip(shared_step, plain_step, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(shared_rows, plain_rows, strict=True):
        for name in ("loss", "policy_loss", "entropy", "approx_kl", "kl_ref", "is_ratio_mean", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
        assert (a["loss_tokens"], a["sequences"], a["tokens"]) == (b["loss_tokens"], b["sequences"], b["tokens"])
        # padding is over the forward rows, which hold each shared prompt once per row
        assert a["padding_frac"] != b["padding_frac"]
    # tokens count every sample's prompt + response, shared or not (tokens/s compares across the two layouts)
    batch_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    assert sum(row["tokens"] for row in shared_rows) == batch_tokens


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients it was stepped with."""

    grads: list[torch.Tensor]

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None]
        return super().step(closure)


def test_the_critic_with_shared_prompts_equals_one_row_per_sample():
    prompts, responses = _groups(seed=4, groups=2, size=3)
    rng = np.random.default_rng(5)
    values = [rng.normal(size=len(r)).tolist() for r in responses]
    returns = [rng.normal(size=len(r)).tolist() for r in responses]
    samples = [CriticSample(p, r, v, g, [1] * len(r) if k % 2 else None)
               for k, (p, r, v, g) in enumerate(zip(prompts, responses, values, returns, strict=True))]
    results = {}
    for share in (True, False):
        backbone = make_tiny_model()
        head = torch.nn.Linear(backbone.config.hidden_size, 1)
        torch.nn.init.normal_(head.weight, std=0.5)
        model = ValueModel(backbone, head)
        cfg = TrainConfig(share_prompts=share, micro_batch_tokens=20, critic_lr=1e-9, value_clip=0.1)
        optimizer = RecordingSGD(model.parameters(), lr=0.0)
        trainer = CriticTrainer(model, cfg, optimizer)
        assert trainer.share is share
        row = trainer.step(samples, list(range(len(samples))))
        predicted = predict_values(model, prompts, responses, 20, share=share)
        results[share] = (optimizer.grads, row, predicted)
    (shared_grads, shared_row, shared_values), (plain_grads, plain_row, plain_values) = results[True], results[False]
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for name in ("value_loss", "vf_clip_frac", "vf_explained_var"):
        assert shared_row[name] == pytest.approx(plain_row[name], rel=1e-5, abs=1e-7)
    for a, b in zip(shared_values, plain_values, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_models_whose_attention_takes_no_4d_mask_fall_back_to_one_row_per_sample():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    llama = make_tiny_model()
    assert takes_shared_prompts(llama, "auto") and takes_shared_prompts(llama, True)
    assert not takes_shared_prompts(llama, False)
    llama.config._attn_implementation = "flash_attention_2"  # varlen kernels take no 4D mask
    assert not takes_shared_prompts(llama, "auto") and not takes_shared_prompts(llama, True)
    # an architecture the layout was not tested on: auto falls back; training runs on plain rows and its logprobs
    # are the full-softmax reference's
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    prompts, responses = _groups(seed=6)
    samples = [TrainSample(p, r, [-2.0] * len(r), 1.0) for p, r in zip(prompts, responses, strict=True)]
    trainer = PolicyTrainer(qwen, TrainConfig(), TorchStepper(qwen, make_adamw(qwen, TrainConfig()), 1.0))
    assert trainer.share is False
    logps = trainer.sequence_logprobs(trainer.policy, samples)
    reference_BT, _ = full_softmax_logprobs(qwen.eval(), build_micro_batch(list(range(len(samples))), prompts,
                                                                           responses))
    for b, logp in enumerate(logps):
        torch.testing.assert_close(logp, reference_BT[b, : len(responses[b])], rtol=1e-5, atol=1e-6)
