"""How far the sampler's stored logprobs are from the trainer's forward pass on the same tokens.

Importance-sampling corrections divide the current policy's probability of a token by the sampler's; if the
two disagree on the same weights (bf16 vs fp32, other kernels), the disagreement masquerades as policy
change. This recomputes every sampled token's logprob with a Hugging Face forward pass over prompt + response
under the sampler's temperature / top-k / top-p (`processed_logprobs`) and summarises |sampler - recomputed|
per token: the rollouts manifest's `logprob_mismatch` health figure. Tokens outside the recomputed top-k /
top-p set (logprob -inf) are counted (`outside_filter`) and left out of the statistics.

The trainer recomputes under temperature alone, so with a filter on every stored logprob exceeds the
trainer's by -log(the filtered mass) at that step; the summary then also holds `as_trained`, the same
statistics against the temperature-only logprobs (its `mean_signed` is that gap).

In a multi-turn rollout the response holds tool / environment observation tokens too (loss mask 0, sampler
logprob 0.0, meaningless); with `loss_masks` only model tokens (mask 1) are counted, observations being context.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stages.generation.base import GenerationRequest, Sample, SamplingSpec
from stages.generation.hf_backend import TORCH_THREADS, left_pad, processed_logprobs


def _response_logits(
    model: torch.nn.Module, requests: Sequence[GenerationRequest], samples: Sequence[Sample], batch_size: int,
    pad_id: int,
) -> Iterator[tuple[Sample, torch.Tensor]]:
    """Each sample with the logits that predicted its tokens (one row per token), from one forward pass over
    prompt + response[:-1] per batch.

    Sequences are left-padded so that every row's response ends in the last column; only the logits of the
    last `max response length` positions are materialised (`logits_to_keep`), never the prompt's.
    """
    for start in range(0, len(requests), batch_size):
        chunk = list(zip(requests[start:start + batch_size], samples[start:start + batch_size], strict=True))
        sequences = [list(r.prompt_token_ids) + list(s.token_ids[:-1]) for r, s in chunk]
        input_ids, mask = (t.to(model.device) for t in left_pad(sequences, pad_id))
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        keep = max(len(s.token_ids) for _, s in chunk)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=keep).logits
        for row, (_, sample) in enumerate(chunk):
            yield sample, logits[row, keep - len(sample.token_ids):]


def _token_logprobs(logits_T: torch.Tensor, token_ids: Sequence[int], sampling: SamplingSpec) -> list[float]:
    if not token_ids:
        return []
    logprobs_TV = processed_logprobs(logits_T, sampling.temperature, sampling.top_k, sampling.top_p)
    ids_T1 = torch.tensor(token_ids, dtype=torch.long, device=logprobs_TV.device).view(-1, 1)
    return logprobs_TV.gather(-1, ids_T1).view(-1).tolist()


def summarize(
    sampler: Sequence[Sequence[float]],
    recomputed: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, float]:
    """Per-token |sampler - recomputed|: mean, p99, max; signed mean; token counts. With `loss_masks` (one per
    row; None = every token the model's) only tokens whose mask is 1 are counted."""
    diffs: list[float] = []
    signed = 0.0
    outside = 0
    masks = loss_masks if loss_masks is not None else [None] * len(sampler)
    for row_sampler, row_recomputed, mask in zip(sampler, recomputed, masks, strict=True):
        keep = [1] * len(row_sampler) if mask is None else mask
        for a, b, model_token in zip(row_sampler, row_recomputed, keep, strict=True):
            if not model_token:
                continue
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
    device: str = "cpu",
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, Any]:
    """Load `model_dir` with Hugging Face, recompute the samples' logprobs, and compare (see `summarize`);
    with a top-k / top-p filter, also against the trainer's temperature-only logprobs (`as_trained`).
    `loss_masks` (per sample, None = all model tokens): count model tokens only (multi-turn rollouts)."""
    from stages.generation.models import load_model, load_tokenizer

    torch.set_num_threads(TORCH_THREADS)
    model = load_model(model_dir, dtype, device)
    pad = int(load_tokenizer(model_dir).pad_token_id or 0)
    as_trained = replace(sampling, top_k=-1, top_p=1.0)  # what the trainer computes: temperature alone
    filtered = as_trained != sampling
    recomputed: list[list[float]] = []
    trainer: list[list[float]] = []
    with torch.inference_mode():
        for sample, logits_T in _response_logits(model, requests, samples, batch_size, pad):
            recomputed.append(_token_logprobs(logits_T, sample.token_ids, sampling))
            if filtered:
                trainer.append(_token_logprobs(logits_T, sample.token_ids, as_trained))
    sampler = [s.logprobs for s in samples]
    stats: dict[str, Any] = summarize(sampler, recomputed, loss_masks)
    if filtered:
        stats["as_trained"] = summarize(sampler, trainer, loss_masks)
    return stats
