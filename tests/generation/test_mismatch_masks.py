"""The sampler/trainer mismatch figure counts model tokens only in a multi-turn rollout (issue 19).

Observation tokens (loss mask 0) carry a sampler logprob of 0.0 that means nothing; counting them would report
the model's own logprob of the tool output as a "mismatch".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.generation.base import GenerationRequest, Sample, SamplingSpec
from stages.generation.mismatch import logprob_mismatch, summarize
from tests.support.logprobs import recompute_logprobs


def test_summarize_counts_masked_tokens_out_by_hand() -> None:
    """Row 1, mask [1,1,0,0,1]: diffs over the 3 model tokens are |-1.0+1.1|=0.1, 0, |-0.5+0.2|=0.3 (signed
    0.1, 0, -0.3); the observation tokens (diff 9 and 7, one -inf) are skipped, not counted as outside_filter.
    Row 2 has no mask (all model): its one token's diff is 0.2 (signed +0.2). Over 4 tokens: mean_abs 0.6/4 =
    0.15, max 0.3, mean_signed 0.0/4 = 0.0."""
    sampler = [[-1.0, -2.0, 0.0, 0.0, -0.5], [-0.3]]
    recomputed = [[-1.1, -2.0, -9.0, float("-inf"), -0.2], [-0.5]]
    stats = summarize(sampler, recomputed, [[1, 1, 0, 0, 1], None])
    assert stats["tokens"] == 4 and stats["outside_filter"] == 0
    assert stats["mean_abs"] == pytest.approx(0.15)
    assert stats["max_abs"] == pytest.approx(0.3)
    assert stats["mean_signed"] == pytest.approx(0.0, abs=1e-12)
    unmasked = summarize(sampler, recomputed)
    assert unmasked["tokens"] == 5 and unmasked["outside_filter"] == 1 and unmasked["max_abs"] == pytest.approx(9.0)


def test_logprob_mismatch_with_loss_masks_ignores_observation_tokens(model_dir: Path) -> None:
    """A hand-built two-turn response on the real model: model tokens carry their true logprobs (recomputed by an
    unpadded forward pass, tests/support/logprobs.py), observation tokens the loop's placeholder 0.0. With the
    mask the figure is ~0 over the model tokens alone; without it the observations' |0 - logprob| dominates."""
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8)
    prompt = [1, 9690, 198, 2683, 314, 253]
    response = [17, 1169, 216, 28, 7, 905, 13, 42]
    mask = [1, 1, 1, 0, 0, 0, 1, 1]
    request = GenerationRequest(prompt, 0)
    true_logprobs = recompute_logprobs_for(model_dir, request, response, spec)
    stored = [lp if m else 0.0 for lp, m in zip(true_logprobs, mask, strict=True)]
    sample = Sample(response, stored, "", "stop")

    masked = logprob_mismatch(model_dir, [request], [sample], spec, loss_masks=[mask])
    assert masked["tokens"] == 5 and masked["max_abs"] < 1e-4, masked
    unmasked = logprob_mismatch(model_dir, [request], [sample], spec)
    assert unmasked["tokens"] == 8
    assert unmasked["max_abs"] == pytest.approx(max(-true_logprobs[i] for i in (3, 4, 5)), abs=1e-4)


def recompute_logprobs_for(model_dir: Path, request: GenerationRequest, response: list[int],
                           spec: SamplingSpec) -> list[float]:
    from stages.generation.models import load_model

    model = load_model(model_dir, "float32", "cpu")
    return recompute_logprobs(model, [request], [Sample(response, [0.0] * len(response), "", "stop")], spec)[0]
