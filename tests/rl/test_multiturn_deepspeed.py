"""Multi-turn loss masks through the DeepSpeed backend (issue 19): the ranks see the same masked samples (the job
file carries each sample's loss_mask) and train exactly what the plain torch backend trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.rl.deepspeed_backend import launch
from stages.rl.session import run_job

from .pipeline_helpers import save_tiny_model
from .test_deepspeed import make_job

pytestmark = pytest.mark.slow


def _with_masks(job):  # noqa: ANN001, ANN202 - a TrainJob
    """Every other sample becomes a multi-turn one: tokens 1..2 an observation (mask 0, sampler logprob 0.0)."""
    for i, sample in enumerate(job.samples):
        if i % 2 == 0 and len(sample["response_ids"]) >= 4:
            mask = [1] * len(sample["response_ids"])
            mask[1:3] = [0, 0]
            sample["loss_mask"] = mask
            sample["behaviour_logprobs"] = [lp if m else 0.0 for lp, m in zip(sample["behaviour_logprobs"], mask,
                                                                                strict=True)]
    return job


@pytest.mark.timeout(900)
def test_two_processes_with_loss_masks_match_plain_torch(tmp_path: Path) -> None:
    """ZeRO-2, two processes, two steps: the same losses, loss tokens (the model tokens: response tokens minus two
    per masked sample) and weights as one torch process."""
    policy = save_tiny_model(tmp_path / "policy")
    train = {"zero_stage": 2, "minibatches": 2, "is_level": "token"}
    torch_job = _with_masks(make_job(tmp_path, "torch", policy, **train))
    masked = sum(1 for s in torch_job.samples if "loss_mask" in s)
    assert masked >= 2
    torch_rows, _ = run_job(torch_job)
    job = _with_masks(make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2, **train))
    ds_rows, _ = launch(job, tmp_path / "job.json", processes=2, timeout_s=500)
    total = sum(len(s["response_ids"]) for s in torch_job.samples)
    assert sum(r["loss_tokens"] for r in torch_rows) == total - 2 * masked
    for a, b in zip(torch_rows, ds_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["loss_tokens"] == a["loss_tokens"] and b["is_ratio_min"] == pytest.approx(a["is_ratio_min"], rel=1e-4)
    expected = load_file(tmp_path / "torch" / "model.safetensors")
    got = load_file(tmp_path / "ds" / "model.safetensors")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
