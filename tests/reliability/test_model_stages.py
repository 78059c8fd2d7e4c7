"""Model-stage drills with the real model: SmolLM2-135M-Instruct, HF backend, 1 prompt x 2 samples, 16 tokens.

generate and train run as real stage processes (`python -m stages.<name>`) and are SIGKILLed at random points
(2 seeds each, uniform over a clean run's time in the harness), then run again: the resumed
output must be the clean run's (same content hash: the HF backend on CPU with fixed seeds promises it, and its
manifest says so), the checkpoint must load (weights, optimizer state, trainer state) and match its manifest
file by file. Scoring uses a stand-in with fixed rewards (even samples right), so that the group has variance
and train takes a real optimizer step whatever the model answers.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from stages.harness import StageContext
from stages.registry import STAGES, instance, stage_state
from storage.checkpoints import verify_checkpoint
from storage.layout import BASE, RunLayout
from storage.manifest import read_manifest
from storage.run import Run, read_run_config
from tests.support.scratch import scratch_dir
from tests.support.stages import run_stage_at

from . import helpers as h

pytestmark = pytest.mark.slow
SEEDS = 2


def parity_score(ctx: StageContext) -> None:
    rows = []
    for r in ctx.read_input("rollouts").to_pylist():
        reward = float(r["sample_idx"] % 2 == 0)
        rows.append({**{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")},
                     "reward": reward, "passed": int(reward), "total": 1, "status": "ok" if reward else "fail",
                     "tests": "[]", "code": None, "sandbox_seconds": 0.0})
    ctx.write_table("scores", pa.Table.from_pylist(rows))


@pytest.fixture(scope="module")
def model_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunLayout]:
    from schemas.config import load_config
    from stages import base_model, prompts
    from tests.support.stages import start_run

    with scratch_dir(tmp_path_factory, "model") as base:
        overrides = h.run_overrides(
            base / "sources", "threads=2", "generate.backend=hf", "generate.prompts_per_iteration=1",
            "generate.n_samples=2", "generate.max_new_tokens=16", "train.micro_batch_tokens=1024",
        )
        layout = start_run(load_config(None, overrides), str(base / "root"))
        run_stage_at("prompts", layout, BASE, prompts.run)
        run_stage_at("base_model", layout, BASE, base_model.run)
        h.ensure_upstream_done(layout, "generate")  # evaluate_base: a stand-in (the model's evaluation is not drilled)

        yield layout


def done(layout: RunLayout, stage: str) -> bool:
    layout.fs.invalidate_cache()
    return stage_state(Run(layout, read_run_config(layout)), instance(stage, 0)).done


def started_work(log: Path) -> bool:
    """Whether the stage process has got past its imports into the harness (it prints `▶ <stage>`)."""
    return log.exists() and "▶" in log.read_text(errors="replace")


def kill_and_resume(layout: RunLayout, stage: str, tmp_path: Path) -> tuple[dict, list[str]]:
    """A clean run, then SEEDS runs killed at random points, each followed by a run to completion. Every run is
    a fresh `python -m stages.<stage>`: a child forked from this process (which has run torch's thread pool in
    earlier tests) can deadlock in OpenMP. The kill point is uniform over the clean run's time in the harness
    (after the imports, which are not worth killing at). Returns the clean run's manifests by output name,
    and what each kill found."""
    command = h.stage_command(layout, stage)
    outputs = {o.name: o for o in STAGES[stage].outputs(0)}
    clean_log = tmp_path / f"{stage}-clean.log"
    clean = h.spawn(command, layout.root, clean_log)
    h.wait_for(lambda: started_work(clean_log) or clean.poll() is not None, 600, what=f"{stage} to start")
    started = time.monotonic()
    assert h.finish(clean, 900) == 0, clean_log.read_text()[-3000:]
    clean_seconds = time.monotonic() - started
    reference = {name: read_manifest(layout.fs, o.manifest_path(layout)) for name, o in outputs.items()}
    found = []
    for seed in range(SEEDS):
        delay = random.Random(f"model:{stage}:{seed}").uniform(0.0, clean_seconds)
        log = tmp_path / f"{stage}-{seed}.log"
        process = h.spawn(command, layout.root, log)
        h.wait_for(lambda log=log, process=process: started_work(log) or process.poll() is not None, 600,
                   what=f"{stage} to start")
        try:
            process.wait(delay)
            h.finish(process)
            found.append(f"seed {seed}: finished before the kill at {delay:.1f}s")
        except subprocess.TimeoutExpired:
            h.kill_group(process)
            found.append(f"seed {seed}: killed at {delay:.1f}s of {clean_seconds:.1f}s, done={done(layout, stage)}")
        h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
        result = h.run(command, layout.root, timeout=900)
        assert result.returncode == 0, f"{found[-1]}: {result.stderr[-3000:]}"
        assert done(layout, stage)
        for name, manifest in reference.items():
            again = read_manifest(layout.fs, outputs[name].manifest_path(layout))
            if name != "train_metrics":  # train_metrics records the seconds of each step
                assert again.sha256 == manifest.sha256, f"{stage} {name} differs after {found[-1]}"
            assert again.rows == manifest.rows
    return reference, found


def test_generate_killed_at_random_points_resumes_to_the_same_table(model_run: RunLayout, tmp_path: Path) -> None:
    """Proves: generate (SmolLM2, HF backend) SIGKILLed at random points never leaves a manifest vouching for a
    partial table, and the run that follows writes exactly the clean run's table (same sha256: deterministic,
    as its manifest declares), with one row per (prompt, sample)."""
    reference, found = kill_and_resume(model_run, "generate", tmp_path)
    assert reference["rollouts"].metrics["deterministic"] is True
    # The sampler (HF, fp32) against the trainer's forward pass (HF, fp32) on the same tokens: only padding
    # and batch shapes differ, so the recorded mismatch is rounding noise.
    mismatch = reference["rollouts"].metrics["logprob_mismatch"]
    assert mismatch["samples"] == 2 and mismatch["tokens"] + mismatch["outside_filter"] == sum(
        r["num_tokens"] for r in h.table_rows(model_run, "rollouts"))
    assert mismatch["max_abs"] < 1e-3, mismatch
    rows = h.table_rows(model_run, "rollouts")
    [prompt_id] = {r["prompt_id"] for r in rows}
    assert prompt_id in h.TRAIN_IDS and sorted(r["sample_idx"] for r in rows) == [0, 1], found
    assert all(r["num_tokens"] == len(r["response_token_ids"]) <= 16 for r in rows)


def test_train_killed_at_random_points_resumes_and_the_checkpoint_loads(model_run: RunLayout, tmp_path: Path) -> None:
    """Proves: train (SmolLM2, one real optimizer step) SIGKILLed at random points never leaves a checkpoint
    manifest vouching for a partial directory; the run that follows writes a checkpoint equal to the clean
    run's (same content hash) that loads: weights into a causal LM, the AdamW state, the trainer state, every
    file matching its manifest's sha256; and no partial checkpoint of a killed attempt is left on disk."""
    import torch
    from transformers import AutoModelForCausalLM

    layout = model_run
    run_dir = Path(layout.run_dir)
    old_temporaries = set(h.temporary_files(run_dir))
    h.ensure_upstream_done(layout, "score")
    if not done(layout, "score"):
        run_stage_at("score", layout, 0, parity_score)
    if not done(layout, "advantage"):
        run_stage_at("advantage", layout, 0, h.real_stage("advantage"))
    reference, found = kill_and_resume(layout, "train", tmp_path)
    assert reference["train_metrics"].metrics["skipped"] is False
    assert reference["train_metrics"].metrics["nondeterministic_columns"] == ["seconds"]  # a step's wall time

    checkpoint = Path(layout.checkpoint_dir(0))
    manifest = read_manifest(layout.fs, str(checkpoint / "manifest.json"))
    assert verify_checkpoint(layout.fs, manifest) == []
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    optimizer = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    assert optimizer["state"], "optimizer state is empty"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1

    left = sorted(set(h.temporary_files(run_dir)) - old_temporaries)
    size = sum(f.stat().st_size for p in left for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    assert left == [], f"killed attempts left {size / 1e6:.0f} MB of partial checkpoints: {left} ({found})"
