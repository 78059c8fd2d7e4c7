"""The DeepSpeed backend for real: the launcher, 1 and 2 CPU processes (gloo), ZeRO stages 1-3.

With the same batch, the data-parallel ZeRO update must produce the same loss and (to float rounding) the
same weights as one plain torch process: each rank holds part of the minibatch's loss sum. Through the
train stage, a second iteration resumes DeepSpeed's optimizer state from the first one's checkpoint, and
two processes write the torch backend's checkpoint format with the torch backend's losses.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from schemas.config import TrainConfig
from stages.rl.deepspeed_backend import READY, REPO_ROOT, SHM_DIR, DeepSpeedLaunchError, launch
from stages.rl.session import TrainJob, run_job
from storage.layout import RunLayout
from tests.reliability import helpers as h
from tests.support.processes import spawn_tied

from .pipeline_helpers import run_iteration, save_tiny_model

pytestmark = pytest.mark.slow


def make_job(tmp_path: Path, name: str, policy_dir: Path, **train) -> TrainJob:  # noqa: ANN003
    rng = np.random.default_rng(0)
    samples = []
    for i in range(10):
        response = rng.integers(3, 16, size=int(rng.integers(2, 9))).tolist()
        prompt = [1] + rng.integers(3, 16, size=4).tolist()
        samples.append(
            {
                # pairs of samples share a prompt (a GRPO group of 2): the micro-batches have shared rows
                "prompt_ids": prompt if i % 2 == 0 else samples[-1]["prompt_ids"],
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


def _shm_buffers() -> set[Path]:
    """DeepSpeed's CPU all-reduce files in /dev/shm (one per rank and job, 69 MB each; remove_shm_buffers)."""
    return set(SHM_DIR.glob("deepspeed_allreduce_buffer_*"))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_processes_match_plain_torch(tmp_path: Path, zero_stage: int):
    policy = save_tiny_model(tmp_path / "policy")
    shm_before = _shm_buffers()
    # two steps: the second is off-policy and uses the first step's updated weights and optimizer state
    train = {"zero_stage": zero_stage, "minibatches": 2}
    torch_rows, _ = run_job(make_job(tmp_path, "torch", policy, **train))
    job = make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2, **train)
    ds_rows, metrics = launch(job, tmp_path / "job.json", processes=2, timeout_s=500)
    assert metrics["processes"] == 2 and metrics["zero_stage"] == zero_stage and len(ds_rows) == 2
    assert _shm_buffers() <= shm_before  # the job's shared-memory buffers went with it
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


def _checkpoint_files(directory: Path) -> set[str]:
    """Every file of a checkpoint directory as a relative path, without the hash cache (hidden files)."""
    return {
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


@pytest.mark.timeout(900)
def test_train_stage_with_two_deepspeed_processes_matches_the_torch_backend(
    run_layout: tuple[Callable[..., RunLayout], Path],
):
    """Proves: the train stage with `train.backend=deepspeed`, `train.processes=2`, ZeRO-2 (the launcher, two
    gloo ranks) publishes a checkpoint in the torch backend's format (same files, except that the optimizer
    state is DeepSpeed's per-rank checkpoint in `deepspeed/` instead of `optimizer.pt`), listed file by file
    in its manifest, which transformers loads; its weights moved away from the base model, and its
    train_metrics rows (one per step, finite) match the torch backend's on the same batch to float rounding
    (the tolerances of test_two_processes_match_plain_torch: each rank holds part of the loss sum).
    """
    make, model_dir = run_layout
    # Two off-policy minibatches, packed into several micro-batches so that both ranks have real work.
    common = ("train.minibatches=2", "train.micro_batch_tokens=32")
    torch_layout = make("run_id=torch", *common)
    ds_layout = make("run_id=ds", "train.backend=deepspeed", "train.processes=2", "train.zero_stage=2", *common)
    # fake_generate draws from the iteration's seed: both runs train on the same samples and advantages
    _, torch_checkpoint, torch_manifest = run_iteration(torch_layout, 0)
    _, checkpoint, manifest = run_iteration(ds_layout, 0)
    assert torch_manifest.metrics["backend"] == "torch"
    assert manifest.metrics["backend"] == "deepspeed"
    assert (manifest.metrics["processes"], manifest.metrics["zero_stage"], manifest.metrics["steps"]) == (2, 2, 2)
    assert manifest.metrics["optimizer_resumed"] is False and manifest.metrics["skipped"] is False

    # The same checkpoint format: only the optimizer state is the backend's own.
    torch_dir, ds_dir = Path(torch_checkpoint.path), Path(checkpoint.path)
    torch_files, ds_files = _checkpoint_files(torch_dir), _checkpoint_files(ds_dir)
    optimizer_files = {f for f in ds_files if f.startswith("deepspeed/")}
    assert {"model.safetensors", "config.json", "tokenizer_config.json", "trainer_state.json", "manifest.json"} <= (
        ds_files
    )
    assert torch_files - {"optimizer.pt"} == ds_files - optimizer_files
    assert "deepspeed/deepspeed_meta.json" in optimizer_files
    # ZeRO-2 partitions the optimizer state: one shard per rank
    assert len([f for f in optimizer_files if f.endswith("optim_states.pt")]) == 2
    assert set(checkpoint.files) == ds_files - {"manifest.json"}  # every file is hashed in the manifest
    state = (ds_dir / "trainer_state.json").read_text()
    assert state == (torch_dir / "trainer_state.json").read_text()

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(ds_dir).state_dict()
    weights = load_file(ds_dir / "model.safetensors")
    for key, value in weights.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    before = load_file(model_dir / "model.safetensors")
    assert before.keys() == weights.keys()
    assert any(not torch.equal(before[k], weights[k]) for k in before)
    expected = load_file(torch_dir / "model.safetensors")
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-4, atol=1e-5)

    torch_rows = pq.read_table(Path(torch_layout.table_path("train_metrics", 0))).to_pylist()
    rows = pq.read_table(Path(ds_layout.table_path("train_metrics", 0))).to_pylist()
    assert [r["step"] for r in rows] == [0, 1] and not any(r["skipped"] for r in rows)
    for row in rows:
        numbers = {k: v for k, v in row.items() if isinstance(v, float)}
        assert all(math.isfinite(v) for v in numbers.values()), numbers
        assert row["grad_norm"] > 0 and row["loss_tokens"] > 0
    for a, b in zip(torch_rows, rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert (b["tokens"], b["loss_tokens"], b["sequences"]) == (a["tokens"], a["loss_tokens"], a["sequences"])


# The two drills below kill ranks, so they wait for the ranks' "ready" line first: a rank killed while it
# loads DeepSpeed's shm op holds torch's extension build lock, and a lock left behind stalls every later
# launch on the machine (torch waits for it forever). They also come after the tests above, which build it.

# A train stage in a process of its own: it only launches the job (its pid is what the ranks watch).
STAGE = """
import sys
from pathlib import Path
from stages.rl.deepspeed_backend import launch
from stages.rl.session import TrainJob
job_path = Path(sys.argv[1])
launch(TrainJob.load(job_path), job_path, processes=2)
"""


def _job_processes(job_path: Path) -> list[psutil.Process]:
    """The launcher, DeepSpeed's per-node launcher and the ranks of one job (all name its job file); zombies
    (dead, waiting for a parent to reap them) are not counted."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if str(job_path) in " ".join(process.info["cmdline"] or []) and process.info["status"] != "zombie":
            found.append(process)
    return found


def _ranks_ready(log_path: Path, world: int = 2) -> bool:
    return log_path.is_file() and log_path.read_text(errors="replace").count(READY) >= world


@pytest.mark.timeout(600)
def test_ranks_end_when_the_train_stage_is_killed_alone(tmp_path: Path) -> None:
    """Proves: when the process that launched a DeepSpeed job is SIGKILLed alone (the OOM killer, `kill -9`
    of its pid), the launcher and both ranks, left running without the stage's lease, end within seconds."""
    policy = save_tiny_model(tmp_path / "policy")
    job_path = tmp_path / "job.json"
    make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2).dump(job_path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    shm_before = _shm_buffers()
    stage = spawn_tied([sys.executable, "-c", STAGE, str(job_path)], cwd=REPO_ROOT, env=env)
    try:
        h.wait_for(lambda: _ranks_ready(Path(f"{job_path}.log")) or stage.poll() is not None, 300, what="the ranks")
        assert stage.poll() is None, Path(f"{job_path}.log").read_text()[-3000:]
        # the ranks' all-reduce buffers (two files, mapped by both) are unlinked once both ranks have mapped them
        assert _shm_buffers() <= shm_before
        launched = [p for p in _job_processes(job_path) if p.pid != stage.pid]
        assert len(launched) == 4, [p.info["cmdline"] for p in launched]  # runner, launch, rank 0, rank 1
        stage.kill()
        stage.wait()
        h.wait_for(lambda: not _job_processes(job_path), 30, what="the launcher and ranks to end")
        assert _shm_buffers() <= shm_before  # nothing left by a job whose stage was killed
    finally:
        stage.kill()
        for process in _job_processes(job_path):
            process.kill()


@pytest.mark.timeout(600)
def test_a_hung_job_is_killed_at_its_timeout_launcher_and_ranks(tmp_path: Path) -> None:
    """Proves: a job that stops making progress (one rank frozen with SIGSTOP: the launcher waits for it, and
    the other rank too if it is still in a collective) ends at `launch`'s timeout with DeepSpeedLaunchError
    naming the timeout and the processes it killed, and no process of the job is left."""
    policy = save_tiny_model(tmp_path / "policy")
    job_path = tmp_path / "job.json"
    job = make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2)
    timeout_s = 60.0
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            launch(job, job_path, processes=2, timeout_s=timeout_s)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    launching = threading.Thread(target=run)
    started = time.monotonic()
    launching.start()
    h.wait_for(lambda: _ranks_ready(Path(f"{job_path}.log")) or not launching.is_alive(), 300, what="the ranks")
    ranks = [p for p in _job_processes(job_path) if "--local_rank=1" in " ".join(p.info["cmdline"])]
    assert len(ranks) == 1, Path(f"{job_path}.log").read_text()[-3000:]
    ranks[0].suspend()  # SIGSTOP: rank 1 hangs, rank 0 blocks on it
    launching.join(timeout=timeout_s + 120)
    assert not launching.is_alive()
    error = outcome.get("error")
    assert isinstance(error, DeepSpeedLaunchError), error
    assert time.monotonic() - started >= timeout_s
    # The launcher, DeepSpeed's per-node launcher and the frozen rank; rank 0 too if it still waited.
    killed = re.search(rf"did not finish in {timeout_s:g}s: killed its (\d) processes \(launcher and ranks\)",
                       str(error))
    assert killed and int(killed.group(1)) in (3, 4), str(error)[:300]
    assert _job_processes(job_path) == []
