"""Reference log-probabilities for the tests: the plain, slow way, to check the product's fast ways against.

`full_softmax_logprobs` materialises every logit and the full log-softmax (the trainer's `ResponseLogprobs`
chunks the vocabulary projection and never does); `recompute_logprobs` runs one unpadded forward pass per
sample (the sampler and the mismatch figure batch, left-pad and keep only the response's logits).
`response_logprobs` is the trainer's module called once, as the trainer calls it through `micro_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.generation.base import GenerationRequest, Sample, SamplingSpec
from stages.generation.hf_backend import processed_logprobs
from stages.rl.logprobs import MicroBatch, ResponseLogprobs, micro_logprobs


def response_logprobs(
    model: torch.nn.Module, micro: MicroBatch, temperature: float = 1.0, chunk_tokens: int = 512,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT) of the response tokens of `micro` through the trainer's `ResponseLogprobs`."""
    return micro_logprobs(ResponseLogprobs(model, temperature, chunk_tokens), micro, entropy_grad)


def full_softmax_logprobs(
    model: torch.nn.Module, micro: MicroBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT) from full logits and a full log_softmax: the model's own forward, so a micro-batch of
    plain rows (one per sequence) only."""
    if micro.segments_RL is not None:
        raise ValueError("the full-softmax reference takes plain rows (build the micro-batch without sharing)")
    logits_RLV = model(input_ids=micro.input_ids_RL, attention_mask=micro.attention_mask_RL).logits.float()
    if temperature > 0:
        logits_RLV = logits_RLV / temperature
    logp_RLV = torch.log_softmax(logits_RLV, dim=-1)
    logp_N = logp_RLV[micro.hidden_rows_N, micro.positions_N].gather(-1, micro.targets_N[:, None]).squeeze(-1)
    entropy_N = -(logp_RLV.exp() * logp_RLV)[micro.hidden_rows_N, micro.positions_N].sum(-1)
    return micro.to_BT(logp_N), micro.to_BT(entropy_N)


@torch.inference_mode()
def recompute_logprobs(
    model: torch.nn.Module, requests: Sequence[GenerationRequest], samples: Sequence[Sample], sampling: SamplingSpec
) -> list[list[float]]:
    """The logprob of each sampled token under the sampler's processing (`processed_logprobs`: temperature,
    top-k, top-p), from one forward pass over prompt + response[:-1] per sample, with no padding."""
    recomputed = []
    for request, sample in zip(requests, samples, strict=True):
        if not sample.token_ids:
            recomputed.append([])
            continue
        prompt = list(request.prompt_token_ids)
        input_ids = torch.tensor([prompt + list(sample.token_ids[:-1])], device=model.device)
        logits_TV = model(input_ids=input_ids).logits[0, len(prompt) - 1:]  # the logits that predicted each token
        logprobs_TV = processed_logprobs(logits_TV, sampling.temperature, sampling.top_k, sampling.top_p)
        token_ids_T1 = torch.tensor(sample.token_ids, device=logprobs_TV.device)[:, None]
        recomputed.append(logprobs_TV.gather(-1, token_ids_T1).squeeze(-1).tolist())
    return recomputed
