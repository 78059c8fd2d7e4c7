"""End to end, overlapped: `rlpipe run` of the tiny config with `pipeline.max_staleness: 1` (the `loop` flow's
overlapped schedule, Prefect task futures, stage processes, SmolLM2, the sandbox, training), SIGKILLed while a
stage of each lane runs (which proves two stages really ran at once), then `rlpipe resume`: the run completes
with exactly the outputs a strict run writes (the same manifests), every rollout key once, the stages that had
finished before the kill not redone, and iteration 1 sampled by the base model (checkpoint k-1-N).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.runner.process import run_plan
from schemas.config import load_config
from stages.registry import LANES, outputs_of
from storage.layout import RunLayout
from tests.support.processes import spawn_tied

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]

CONFIG = Path(__file__).with_name("tiny.yaml")
OVERRIDES = ["run_id=overlap", "pipeline.max_staleness=1", "train.is_level=token", "log.trackers=[]"]
PROMPTS_PER_ITERATION, N_SAMPLES, ITERATIONS = 2, 4, 2


def rlpipe_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def stage_processes(root: Path) -> dict[str, str]:
    """Stage -> lane of every stage process of the run under `root` now."""
    running = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in text:
            for lane, stages in LANES.items():
                running.update({stage: lane for stage in stages if f"stages.{stage} " in text})
    return running


def manifests(run_dir: Path) -> dict[str, dict]:
    return {str(path.relative_to(run_dir)): json.loads(path.read_text()) for path in run_dir.rglob("*manifest.json")}


def test_an_overlapped_run_killed_while_both_lanes_run_resumes_to_a_strict_runs_outputs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = {**os.environ, "RLPIPE_ROOT": str(root), "COLUMNS": "200"}
    sets = [arg for override in OVERRIDES for arg in ("--set", override)]
    log = tmp_path / "run.log"
    with open(log, "wb") as handle:
        driver = spawn_tied(rlpipe_command("run", "--config", str(CONFIG), *sets), env=env, stdout=handle,
                            stderr=subprocess.STDOUT)
        try:
            deadline, lanes = time.monotonic() + 1500, set()
            while lanes != set(LANES) and driver.poll() is None and time.monotonic() < deadline:
                lanes = set(stage_processes(root).values())
                time.sleep(0.1)
            assert lanes == set(LANES), f"never saw both lanes run at once: {log.read_text()[-3000:]}"
        finally:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    run_dir = root / "runs" / "overlap"
    before = manifests(run_dir)

    result = subprocess.run(rlpipe_command("resume", "overlap"), env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    after = manifests(run_dir)
    # The manifests a strict run of the same config writes: every output of every scheduled stage.
    layout = RunLayout.create(str(root), "overlap")
    config = load_config(str(CONFIG), OVERRIDES)
    expected = {str(Path(output.manifest_path(layout)).relative_to(run_dir))
                for target in run_plan(config) for output in outputs_of(target)}
    assert set(after) == expected
    assert [name for name, m in before.items() if after[name]["ended_at"] != m["ended_at"]] == []
    for k in range(ITERATIONS):
        iteration_dir = run_dir / f"iter={k:04d}"
        keys = sorted((r["prompt_id"], r["sample_idx"])
                      for r in pq.read_table(iteration_dir / "rollouts.parquet").to_pylist())
        assert len(keys) == len(set(keys)) == PROMPTS_PER_ITERATION * N_SAMPLES
        for table in ("scores", "batch"):
            rows = pq.read_table(iteration_dir / f"{table}.parquet").to_pylist()
            assert sorted((r["prompt_id"], r["sample_idx"]) for r in rows) == keys, table
    base = after["checkpoints/base/manifest.json"]["sha256"]
    rollouts_1 = pq.read_table(run_dir / "iter=0001" / "rollouts.parquet").to_pylist()
    assert {r["policy_version"] for r in rollouts_1} == {base}  # k-1-N = -1: the base model
