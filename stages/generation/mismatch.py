"""How far the sampler's stored logprobs are from the trainer's forward pass on the same tokens.

Importance-sampling corrections divide the current policy's probability of a token by the behaviour
policy's (the sampler's). If the sampler and the trainer disagree on the same weights (bf16 vs fp32,
different kernels, a different top-p nucleus), that disagreement masquerades as policy change. This module
measures it: it recomputes every sampled token's logprob with a Hugging Face forward pass over
prompt + response, under the same temperature / top-k / top-p processing the sampler applied (see
`processed_logprobs`), and summarises |sampler - recomputed| per token. The generate stage's tests and the
rollouts manifest report it as a run health figure.

A token the sampler drew that falls outside the recomputed top-k / top-p set has a recomputed logprob of
-inf; such tokens are counted (`outside_filter`) and left out of the absolute-difference statistics,
which would otherwise be infinite and say nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from stages.generation.base import GenerationRequest, Sample, SamplingSpec
from stages.generation.hf_backend import TORCH_THREADS, left_pad, processed_logprobs


@torch.inference_mode()
def recompute_logprobs(
    model: torch.nn.Module,
    requests: Sequence[GenerationRequest],
    samples: Sequence[Sample],
    sampling: SamplingSpec,
    batch_size: int = 4,
    pad_id: int = 0,
) -> list[list[float]]:
    """Processed logprob of each sampled token, from one forward pass over prompt + response[:-1].

    Sequences are left-padded so that every row's response ends in the last column; only the logits of the
    last `max response length` positions are materialised (`logits_to_keep`), never the prompt's.
    """
    result: list[list[float]] = []
    for start in range(0, len(requests), batch_size):
        chunk = list(zip(requests[start:start + batch_size], samples[start:start + batch_size], strict=True))
        sequences = [list(r.prompt_token_ids) + list(s.token_ids[:-1]) for r, s in chunk]
        input_ids, mask = left_pad(sequences, pad_id)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        keep = max(len(s.token_ids) for _, s in chunk)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=keep).logits
        for row, (_, sample) in enumerate(chunk):
            n = len(sample.token_ids)
            if n == 0:
                result.append([])
                continue
            logprobs = processed_logprobs(logits[row, keep - n:], sampling.temperature, sampling.top_k,
                                          sampling.top_p)
            targets = torch.tensor(sample.token_ids, dtype=torch.long).view(-1, 1)
            result.append(logprobs.gather(-1, targets).view(-1).tolist())
    return result


def summarize(sampler: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]]) -> dict[str, float]:
    """Per-token |sampler - recomputed|: mean, p99, max; signed mean; token counts."""
    diffs: list[float] = []
    signed = 0.0
    outside = 0
    for row_sampler, row_recomputed in zip(sampler, recomputed, strict=True):
        for a, b in zip(row_sampler, row_recomputed, strict=True):
            if not math.isfinite(b) or not math.isfinite(a):
                outside += 1
                continue
            diffs.append(abs(a - b))
            signed += a - b
    if not diffs:
        return {"mean_abs": 0.0, "max_abs": 0.0, "p99_abs": 0.0, "mean_signed": 0.0, "tokens": 0,
                "outside_filter": outside}
    values = torch.tensor(diffs, dtype=torch.float64)
    return {
        "mean_abs": float(values.mean()),
        "max_abs": float(values.max()),
        "p99_abs": float(torch.quantile(values, 0.99)),
        "mean_signed": signed / len(diffs),  # > 0: the sampler is more confident than the trainer
        "tokens": len(diffs),
        "outside_filter": outside,
    }


def logprob_mismatch(
    model_dir: Path,
    requests: Sequence[GenerationRequest],
    samples: Sequence[Sample],
    sampling: SamplingSpec,
    dtype: str = "float32",
    batch_size: int = 4,
) -> dict[str, float]:
    """Load `model_dir` with Hugging Face, recompute the samples' logprobs, and compare (see `summarize`)."""
    from stages.models import load_model, load_tokenizer

    torch.set_num_threads(TORCH_THREADS)
    model = load_model(model_dir, dtype)
    pad = load_tokenizer(model_dir).pad_token_id
    recomputed = recompute_logprobs(model, requests, samples, sampling, batch_size, int(pad or 0))
    return summarize([s.logprobs for s in samples], recomputed)
