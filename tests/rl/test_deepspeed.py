"""The DeepSpeed backend for real: the launcher, 1 and 2 CPU processes (gloo), ZeRO stages 1-3.

With the same batch, the data-parallel ZeRO update must produce the same loss and (to float rounding) the
same weights as one plain torch process: each rank holds part of the minibatch's loss sum. Through the
train stage, a second iteration resumes DeepSpeed's optimizer state from the first one's checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from schemas.config import TrainConfig
from stages.rl.deepspeed_backend import launch
from stages.rl.session import TrainJob, run_job

from .pipeline_helpers import run_iteration, save_tiny_model

pytestmark = pytest.mark.slow


def make_job(tmp_path: Path, name: str, policy_dir: Path, **train) -> TrainJob:  # noqa: ANN003
    rng = np.random.default_rng(0)
    samples = []
    for i in range(10):
        response = rng.integers(3, 16, size=int(rng.integers(2, 9))).tolist()
        samples.append(
            {
                "prompt_ids": [1] + rng.integers(3, 16, size=4).tolist(),
                "response_ids": response,
                "behaviour_logprobs": (-2.5 + 0.1 * rng.standard_normal(len(response))).tolist(),
                "advantage": float(i % 3) - 0.9,
            }
        )
    cfg = TrainConfig(lr=1e-2, micro_batch_tokens=32, max_grad_norm=100.0, **train)
    out = tmp_path / name
    out.mkdir()
    return TrainJob(
        policy_dir=str(policy_dir),
        out_dir=str(out),
        train=cfg.model_dump(mode="json"),
        iteration=0,
        threads=2,
        samples=samples,
    )


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_processes_match_plain_torch(tmp_path: Path, zero_stage: int):
    policy = save_tiny_model(tmp_path / "policy")
    # two steps: the second is off-policy and uses the first step's updated weights and optimizer state
    train = {"zero_stage": zero_stage, "minibatches": 2}
    torch_rows, _ = run_job(make_job(tmp_path, "torch", policy, **train))
    job = make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2, **train)
    ds_rows, metrics = launch(job, tmp_path / "job.json", processes=2, timeout_s=500)
    assert metrics["processes"] == 2 and metrics["zero_stage"] == zero_stage and len(ds_rows) == 2
    for a, b in zip(torch_rows, ds_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert (b["tokens"], b["loss_tokens"], b["sequences"]) == (
            a["tokens"],
            a["loss_tokens"],
            a["sequences"],
        )
    expected = load_file(tmp_path / "torch" / "model.safetensors")
    got = load_file(tmp_path / "ds" / "model.safetensors")
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "ds" / "deepspeed").is_dir()  # the optimizer state, for the next iteration


def test_train_stage_with_deepspeed_backend_resumes(run_layout):
    make, _ = run_layout
    layout = make("train.backend=deepspeed", "train.processes=1", "train.zero_stage=1")
    _, checkpoint_0, manifest_0 = run_iteration(layout, 0)
    assert manifest_0.metrics["backend"] == "deepspeed" and manifest_0.metrics["optimizer_resumed"] is False
    assert (Path(checkpoint_0.path) / "deepspeed" / "deepspeed_meta.json").is_file()
    _, _, manifest_1 = run_iteration(layout, 1)
    assert manifest_1.metrics["optimizer_resumed"] is True
    rows = pq.read_table(Path(layout.table_path("train_metrics", 1))).to_pylist()
    assert rows[0]["step"] == 1 and rows[0]["grad_norm"] > 0
