"""Crash drills: SIGKILL of a stage process, and of the flow process, at random points; then resume.

Real processes on a real run directory. `prompts`, `score` and `advantage` are the real stages; the model
stages run stand-in work through the real stage entry point (`stages.common.main`), pausing between their
steps so that a kill can land between two writes (tests/reliability/helpers.py). The model stages' own code
is drilled in test_model_stages.py.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stages.common import read_run_config, run_stage
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, MissingInput, expected_key, stage_state
from storage.layout import BASE, RunLayout
from storage.lock import StageLocked, stage_lock

from . import helpers as h

ALL_STAGES = [*RUN_STAGES, *ITERATION_STAGES]
SEEDS = {"prompts": 2, "score": 2, "advantage": 2}  # stand-in stages: 1 seed each (+ the checkpoint point)
PAUSE = {"RLPIPE_DRILL_PAUSE_S": "0.4"}


@pytest.fixture(scope="module")
def crash_run(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    base = tmp_path_factory.mktemp("crash")
    layout = h.start(str(base / "root"), base / "sources")
    h.build_run(layout)
    return layout


def consumers(stage: str) -> list[str]:
    """Stages that read an output of `stage`."""
    produced = {o.name for o in STAGES[stage].outputs(0)}
    return [s for s in ALL_STAGES if s != stage and any(o.name in produced for o in STAGES[s].inputs(0).values())]


def assert_sound_after_kill(layout: RunLayout, stage: str, killed_pid: int | None = None) -> None:
    """What must hold right after a SIGKILL, whatever the point: every manifest vouches for a complete output
    (full content hash), and when the killed stage is not done, no consumer accepts its outputs as input."""
    layout.fs.invalidate_cache()
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    config = read_run_config(layout)
    iteration = BASE if STAGES[stage].run_level else 0
    if not stage_state(layout.fs, layout, config, STAGES[stage], iteration).done:
        for consumer in consumers(stage):
            consumer_iteration = BASE if STAGES[consumer].run_level else 0
            missing = [o for o in STAGES[stage].outputs(iteration)
                       if not layout.fs.exists(o.manifest_path(layout))]
            if any(o in STAGES[consumer].inputs(0).values() for o in missing):
                with pytest.raises(MissingInput):
                    expected_key(layout.fs, layout, config, STAGES[consumer], consumer_iteration)
    if killed_pid is not None:
        h.wait_for(lambda: not h.job_uid_processes(killed_pid), 10, what="the killed stage's sandbox jobs to end")


def assert_complete(layout: RunLayout, stage: str, reference: dict, old_temporaries: set[Path]) -> None:
    """After the resume: the stage is done, its outputs equal a clean run's (timing columns aside), every
    table holds exactly the expected keys, every manifest vouches for its output, no temporary is left."""
    layout.fs.invalidate_cache()
    config = read_run_config(layout)
    iteration = BASE if STAGES[stage].run_level else 0
    assert stage_state(layout.fs, layout, config, STAGES[stage], iteration).done
    assert h.output_contents(layout, stage) == reference
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    present = [t for t in ("rollouts", "scores", "batch") if Path(layout.table_path(t, 0)).exists()]
    h.assert_exact_keys(layout, present)
    left = sorted(set(h.temporary_files(Path(layout.run_dir))) - old_temporaries)
    assert left == [], f"temporaries of the killed {stage} were left behind after it completed: {left}"


def kill_when(command: list[str], root: str, log: Path, ready, timeout_s: float = 120) -> bool:  # noqa: ANN001
    """Start `command` and SIGKILL its group as soon as `ready()` holds; False if it finished first."""
    process = h.spawn(command, root, log, **PAUSE)
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        if ready():
            h.kill_group(process)
            return True
        time.sleep(0.01)
    h.finish(process)
    return False


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_sigkill_of_a_stage_process_at_random_points_then_resume(
    crash_run: RunLayout, stage: str, tmp_path: Path
) -> None:
    """Proves, for every stage: a stage process SIGKILLed at a random point (several seeds, uniform over a clean
    run's duration) never leaves a manifest that vouches for a partial or missing output, its consumers refuse
    its unfinished outputs, its sandbox jobs die with it, and running it again completes with exactly the
    expected keys and the same content as a clean run, leaving no temporary file behind. Stages that build a
    checkpoint are also killed at the worst point: while the checkpoint is being built."""
    layout = crash_run
    h.ensure_upstream_done(layout, stage)
    old_temporaries = set(h.temporary_files(Path(layout.run_dir)))  # an earlier drill's leftovers are not ours
    command = h.command_for(layout, stage)
    started = time.monotonic()
    clean = h.run(command, layout.root, **PAUSE)
    clean_seconds = time.monotonic() - started
    assert clean.returncode == 0, clean.stderr[-3000:]
    reference = h.output_contents(layout, stage)

    for seed in range(SEEDS.get(stage, 1)):
        delay = random.Random(f"{stage}:{seed}").uniform(0.0, clean_seconds)
        process = h.spawn(command, layout.root, tmp_path / f"kill-{seed}.log", **PAUSE)
        try:
            process.wait(timeout=delay)
            h.finish(process)
        except subprocess.TimeoutExpired:
            h.kill_group(process)
        assert_sound_after_kill(layout, stage, killed_pid=process.pid)
        resumed = h.run(command, layout.root, **PAUSE)
        assert resumed.returncode == 0, f"seed {seed} (kill at {delay:.2f}s): {resumed.stderr[-3000:]}"
        assert_complete(layout, stage, reference, old_temporaries)

    if any(o.kind == "checkpoint" for o in STAGES[stage].outputs(0)):
        checkpoints = Path(layout.run_dir) / "checkpoints"
        killed = kill_when(command, layout.root, tmp_path / "kill-scratch.log",
                           lambda: any(p.name.startswith(".tmp") for p in checkpoints.iterdir()))
        assert killed, "the stage finished before its scratch checkpoint was seen"
        assert_sound_after_kill(layout, stage)
        resumed = h.run(command, layout.root, **PAUSE)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_complete(layout, stage, reference, old_temporaries)


# ---------------------------------------------------------------------------------------------------------
# The flow process


def stage_processes(layout: RunLayout) -> list[int]:
    return h.processes_matching("stages.", layout.root)


@pytest.fixture
def flow_run(tmp_path: Path) -> RunLayout:
    layout = h.start(str(tmp_path / "root"), tmp_path / "sources")
    h.build_run(layout)
    return layout


def test_sigkill_of_the_flow_process_group_at_random_points_then_resume(flow_run: RunLayout, tmp_path: Path) -> None:
    """Proves: `rlpipe resume` (flow process and its stage children, killed together as a cluster kills a job)
    SIGKILLed at a random point while it reruns score and advantage (2 seeds, uniform over 0-6 s after its
    first stage process starts) leaves only manifests that vouch for complete outputs; a final `rlpipe resume`
    completes the run with exactly the expected keys, and redoes nothing upstream of score."""
    layout = flow_run
    before = h.manifests_of(layout)
    for seed in range(2):
        # A changed score section makes score and everything downstream of it stale (train and evaluate stay
        # done: advantage reproduces the same batch bytes from the same rewards).
        command = h.rlpipe_command("resume", layout.run_id, "--set", f"score.timeout_s={3 + seed}")
        process = h.spawn(command, layout.root, tmp_path / f"flow-{seed}.log")
        try:
            h.wait_for(lambda p=process: bool(stage_processes(layout)) or p.poll() is not None, 600,
                       what="the flow's first stage process")
            time.sleep(random.Random(seed).uniform(0.0, 6.0))
        finally:
            h.kill_group(process)
        h.wait_for(lambda: not stage_processes(layout), 10, what="the stage processes to die with their group")
        assert_sound_after_kill(layout, "score")
    final = h.run(h.rlpipe_command("resume", layout.run_id), layout.root, timeout=900)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    h.assert_run_done(layout)
    h.assert_exact_keys(layout)
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    after = h.manifests_of(layout)
    for name in ("prompts.parquet.manifest.json", "iter=0000/rollouts.parquet.manifest.json",
                 "checkpoints/base/manifest.json"):
        assert after[name].ended_at == before[name].ended_at, f"{name} was redone"
    assert h.temporary_files(Path(layout.run_dir)) == []


def test_sigkill_of_the_flow_process_alone_leaves_no_stage_running_unguarded(
    flow_run: RunLayout, tmp_path: Path
) -> None:
    """Proves: when only the flow process dies (SIGKILL of its pid: the OOM killer, a lost node agent), the stage
    it was running does not go on unguarded: either the stage process dies with it, or the stage's lease stays
    held while it runs, so a resume cannot start the same stage a second time beside it. Then a resume
    completes the run with exactly the expected keys."""
    layout = flow_run
    # Slow answers (1.5 s each, 8 on 2 workers) keep the score stage busy after its driver died.
    run_stage("generate", layout, 0, functools.partial(h.standin_generate, sleep_s=1.5))
    command = h.rlpipe_command("resume", layout.run_id, "--set", "score.timeout_s=4")
    process = h.spawn(command, layout.root, tmp_path / "flow.log")
    orphans: list[int] = []
    try:
        h.wait_for(lambda: bool(h.processes_matching("stages.score", layout.root)) or process.poll() is not None,
                   600, what="the score stage process")
        assert process.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        process.kill()  # the flow process only, not its group
        process.wait()
        time.sleep(1.0)
        orphans = h.processes_matching("stages.score", layout.root)
        if orphans:
            # The stage outlived its driver: it must still hold its lease.
            with pytest.raises(StageLocked):
                with stage_lock(layout, "score", 0, wait_s=0):
                    pass
    finally:
        h.kill_group(process)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        h.wait_for(lambda: not stage_processes(layout), 30, what="the orphaned stage to end")
    final = h.run(h.rlpipe_command("resume", layout.run_id), layout.root, timeout=900)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    h.assert_run_done(layout)
    h.assert_exact_keys(layout)
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
