"""Chunked sampled-token logprobs equal the full log_softmax (values and gradients); packing by tokens."""

from __future__ import annotations

import torch

from stages.rl.logprobs import build_micro_batch, pack_by_tokens
from tests.support.logprobs import full_softmax_logprobs, response_logprobs


def test_pack_by_tokens_hand_example():
    # lengths [5, 3, 8, 2], budget 10; sorted longest first: 8 (#2), 5 (#0), 3 (#1), 2 (#3)
    # [#2] alone (2 x 8 = 16 > 10); [#0, #1] = 2 x 5 = 10 fits; adding #3 gives 3 x 5 = 15: new micro-batch
    assert pack_by_tokens([5, 3, 8, 2], 10) == [[2], [0, 1], [3]]
    # a sequence longer than the budget still gets a micro-batch of its own
    assert pack_by_tokens([30, 4], 10) == [[0], [1]]


def test_build_micro_batch_positions():
    micro = build_micro_batch([0, 1], prompts=[[5, 6], [7]], responses=[[8, 9, 10], [11]])
    assert micro.input_ids_RL.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert micro.attention_mask_RL.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # response token j of sequence b is predicted at position len(prompt) - 1 + j
    assert micro.positions_N.tolist() == [1, 2, 3, 0]
    assert micro.targets_N.tolist() == [8, 9, 10, 11]
    assert micro.response_mask_BT().tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (micro.tokens, micro.padded_tokens, micro.width) == (7, 10, 3)


def test_chunked_logprobs_match_full_softmax(tiny_model):
    micro = build_micro_batch([0, 1], prompts=[[1, 4, 5], [1, 6]], responses=[[7, 8, 9, 3], [10, 2]])
    mask = micro.response_mask_BT()
    # chunk of 3 tokens: 6 response tokens -> 2 chunks, both checkpointed
    logp, entropy = response_logprobs(tiny_model, micro, temperature=0.7, chunk_tokens=3, entropy_grad=True)
    (logp * mask).sum().backward(retain_graph=True)
    grads = [p.grad.clone() for p in tiny_model.parameters()]
    tiny_model.zero_grad()
    ref_logp, ref_entropy = full_softmax_logprobs(tiny_model, micro, temperature=0.7)
    (ref_logp * mask).sum().backward()
    torch.testing.assert_close(logp * mask, ref_logp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy * mask, ref_entropy * mask, rtol=1e-5, atol=1e-6)
    for grad, p in zip(grads, tiny_model.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-6)
    # padding entries are exactly 0; logprobs of a 16-token vocabulary are below 0
    assert logp[1, 2:].tolist() == [0.0, 0.0]
    assert (logp[mask > 0] < 0).all()
