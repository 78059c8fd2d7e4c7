"""Crash drills: SIGKILL of a stage process, and of the flow process, at random points; then resume.

Real processes on a real run directory. `prompts`, `score` and `advantage` run their real code; the model
stages run stand-in work through the real stage entry point (`stages.harness.main`), pausing between their
steps so that a kill can land between two writes (tests/reliability/helpers.py). Stage processes are forked
from the test process (helpers.fork_stage) so that dozens of them cost seconds, not minutes; the flow drills
run the real `rlpipe` command, whose stages are `python -m stages.<name>` processes. The model stages' own
code is drilled in test_model_stages.py.
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

from schemas.config import RunConfig
from stages.registry import (
    ITERATION_STAGES,
    RUN_STAGES,
    STAGES,
    MissingInput,
    declared_inputs,
    instance,
    resolve_inputs,
    stage_state,
)
from storage.layout import BASE, RunLayout
from storage.lock import StageLocked, stage_lock
from storage.run import Run, read_run_config
from tests.support.stages import run_stage_at

from . import helpers as h

ALL_STAGES = [*RUN_STAGES, *ITERATION_STAGES]
SEEDS = 3
PAUSE = {"RLPIPE_DRILL_PAUSE_S": "0.3"}


@pytest.fixture(scope="module")
def crash_run(pristine_run: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    return h.clone_run(pristine_run, tmp_path_factory.mktemp("crash") / "root")


def consumers(stage: str) -> list[str]:
    """Stages that read an output of `stage`."""
    produced = set(STAGES[stage].outputs(0))
    read = {s: set(declared_inputs(RunConfig(), instance(s, 0)).values()) for s in ALL_STAGES}
    return [s for s in ALL_STAGES if s != stage and produced & read[s]]


def assert_sound_after_kill(layout: RunLayout, stage: str, killed_pid: int | None = None) -> None:
    """What must hold right after a SIGKILL, whatever the point: every manifest vouches for a complete output
    (full content hash), neither the catalog nor any consumer stage reads an output the killed stage did not
    finish, no rollout key is seen twice, and the killed stage's sandbox jobs are gone."""
    layout.fs.invalidate_cache()
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    config = read_run_config(layout)
    iteration = BASE if STAGES[stage].run_level else 0
    unfinished = [o for o in STAGES[stage].outputs(iteration) if not layout.fs.exists(o.manifest_path(layout))]
    h.assert_readers_see_only_finished_outputs(layout, unfinished)
    for consumer in consumers(stage):
        if set(unfinished) & set(declared_inputs(config, instance(consumer, 0)).values()):
            with pytest.raises(MissingInput):
                resolve_inputs(Run(layout, config), instance(consumer, 0))
    if killed_pid is not None:
        h.wait_for(lambda: not h.job_uid_processes(killed_pid), 10, what="the killed stage's sandbox jobs to end")


def assert_complete(layout: RunLayout, stage: str, reference: dict, old_temporaries: set[Path]) -> None:
    """After the resume: the stage is done, its outputs equal a clean run's (timing columns aside), every
    table holds exactly the expected keys, every manifest vouches for its output, no temporary is left."""
    layout.fs.invalidate_cache()
    config = read_run_config(layout)
    iteration = BASE if STAGES[stage].run_level else 0
    assert stage_state(Run(layout, config), instance(stage, iteration)).done
    assert h.output_contents(layout, stage) == reference
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    present = [t for t in ("rollouts", "scores", "batch") if Path(layout.table_path(t, 0)).exists()]
    h.assert_exact_keys(layout, present)
    left = sorted(set(h.temporary_files(Path(layout.run_dir))) - old_temporaries)
    assert left == [], f"temporaries of the killed {stage} were left behind after it completed: {left}"


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_sigkill_of_a_stage_process_at_random_points_then_resume(
    crash_run: RunLayout, stage: str, tmp_path: Path
) -> None:
    """Proves, for every stage: a stage process SIGKILLed at a random point (3 seeds, uniform over a clean run's
    duration) never leaves a manifest that vouches for a partial or missing output, its consumers refuse its
    unfinished outputs, its sandbox jobs die with it, and running it again completes with exactly the expected
    keys and the same content as a clean run, leaving no temporary file behind. Stages that build a checkpoint
    are also killed at the worst point: while the checkpoint is being built."""
    layout = crash_run
    h.ensure_upstream_done(layout, stage)
    old_temporaries = set(h.temporary_files(Path(layout.run_dir)))  # an earlier drill's leftovers are not ours
    work = h.work_for(stage)
    started = time.monotonic()
    clean = h.fork_stage(layout, stage, work, tmp_path / "clean.log", **PAUSE)
    assert clean.wait(300) == 0, clean.output()[-3000:]
    clean_seconds = time.monotonic() - started
    reference = h.output_contents(layout, stage)

    for seed in range(SEEDS):
        delay = random.Random(f"{stage}:{seed}").uniform(0.0, clean_seconds)
        process = h.fork_stage(layout, stage, work, tmp_path / f"kill-{seed}.log", **PAUSE)
        try:
            process.wait(delay)
        except subprocess.TimeoutExpired:
            process.kill()
        assert_sound_after_kill(layout, stage, killed_pid=process.pid)
        resumed = h.fork_stage(layout, stage, work, tmp_path / f"resume-{seed}.log", **PAUSE)
        assert resumed.wait(300) == 0, f"seed {seed} (kill at {delay:.2f}s): {resumed.output()[-3000:]}"
        assert_complete(layout, stage, reference, old_temporaries)

    if any(o.kind == "checkpoint" for o in STAGES[stage].outputs(0)):
        checkpoints = Path(layout.run_dir) / "checkpoints"
        process = h.fork_stage(layout, stage, work, tmp_path / "kill-scratch.log", **PAUSE)
        h.wait_for(lambda: process.poll() is not None
                   or any(".tmp-" in p.name and p not in old_temporaries for p in checkpoints.iterdir()),
                   120, poll_s=0.005, what="the scratch checkpoint")
        assert process.poll() is None, "the stage finished before its scratch checkpoint was seen"
        process.kill()
        assert_sound_after_kill(layout, stage)
        resumed = h.fork_stage(layout, stage, work, tmp_path / "resume-scratch.log", **PAUSE)
        assert resumed.wait(300) == 0, resumed.output()[-3000:]
        assert_complete(layout, stage, reference, old_temporaries)


# ---------------------------------------------------------------------------------------------------------
# The flow process. One run goes through these drills in order (each test leaves it for the next): two
# SIGKILLs of the whole flow at random points, one SIGKILL of the flow process alone, then two resumes at once
# that must finish it. Every `rlpipe` process here is a real flow with real stage processes.


FLOW_BEFORE: dict = {}  # the flow drills' run, finished, before the first kill: manifest path -> manifest


def stage_processes(layout: RunLayout) -> list[int]:
    return h.processes_matching("stages.", layout.root)


@pytest.fixture(scope="module")
def flow_run(pristine_run: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    layout = h.clone_run(pristine_run, tmp_path_factory.mktemp("flow") / "root")
    # Slow answers (1 s each, 8 on 2 workers) keep the score stage busy for seconds: room for the kills.
    run_stage_at("generate", layout, 0, functools.partial(h.standin_generate, sleep_s=1.0))
    h.ensure_upstream_done(layout, "the end")
    FLOW_BEFORE.update(h.manifests_of(layout))
    return layout


def delete_scores(layout: RunLayout) -> None:
    """Make score and advantage pending (a deleted output; score's config section is also an input of evaluate,
    whose real work needs a model, so changing it is not an option here). Its manifest goes too: the drills
    assert that every manifest vouches for its output at any kill point, including before score starts."""
    Path(layout.table_path("scores", 0)).unlink(missing_ok=True)
    Path(layout.table_path("scores", 0) + ".manifest.json").unlink(missing_ok=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_of_the_flow_process_group_at_a_random_point(flow_run: RunLayout, seed: int, tmp_path: Path) -> None:
    """Proves: `rlpipe resume` killed with its stage processes (SIGKILL of the process group, as a cluster
    kills a job) at a random point while it reruns score and advantage (uniform over 0-8 s after its first
    stage process starts) takes every stage process down with it and leaves only manifests that vouch for
    complete outputs; consumers refuse what it did not finish. (The resume that completes the run is
    test_two_resumes_at_once_one_drives_and_finishes_the_run.) The seed picks the kill point."""
    layout = flow_run
    delete_scores(layout)
    process = h.spawn(h.rlpipe_command("resume", layout.run_id), layout.root, tmp_path / "flow.log")
    try:
        h.wait_for(lambda: bool(stage_processes(layout)) or process.poll() is not None, 600,
                   what="the flow's first stage process")
        assert process.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        time.sleep(random.Random(seed).uniform(0.0, 8.0))
    finally:
        h.kill_group(process)
    h.wait_for(lambda: not stage_processes(layout), 10, what="the stage processes to die with their group")
    for stage in ("score", "advantage"):
        assert_sound_after_kill(layout, stage)


def test_sigkill_of_the_flow_process_alone_leaves_no_stage_running_unguarded(
    flow_run: RunLayout, tmp_path: Path
) -> None:
    """Proves: when only the flow process dies (SIGKILL of its pid: the OOM killer, a lost node agent), the stage
    it was running does not go on unguarded: either the stage process dies with it, or the stage's lease stays
    held while it runs, so that a resume cannot start the same stage a second time beside it."""
    layout = flow_run
    delete_scores(layout)
    process = h.spawn(h.rlpipe_command("resume", layout.run_id), layout.root, tmp_path / "flow.log")
    orphans: list[int] = []
    try:
        h.wait_for(lambda: bool(h.processes_matching("stages.score", layout.root)) or process.poll() is not None,
                   600, what="the score stage process")
        assert process.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        process.kill()  # the flow process only, not its group
        process.wait()
        time.sleep(1.0)
        orphans = h.processes_matching("stages.score", layout.root)
        if orphans:  # the stage outlived its driver: it must still hold its lease
            with pytest.raises(StageLocked), stage_lock(layout, instance("score", 0), wait_s=0):
                pass
    finally:
        h.kill_group(process)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        h.wait_for(lambda: not stage_processes(layout), 30, what="the orphaned stage to end")
    assert_sound_after_kill(layout, "score")


def test_two_resumes_at_once_one_drives_and_finishes_the_run(flow_run: RunLayout, tmp_path: Path) -> None:
    """Proves: after the SIGKILLs above, two `rlpipe resume` of the run started at the same moment end with one
    driving the run to the end and the other exiting 3 with a message naming the driver's host and pid; score
    and advantage ran exactly once; the run is complete with exactly the expected keys, every manifest
    vouches for its output, nothing upstream of score was redone, and no temporary file is left."""
    layout = flow_run
    command = h.rlpipe_command("resume", layout.run_id)
    first = h.spawn(command, layout.root, tmp_path / "a.log")
    second = h.spawn(command, layout.root, tmp_path / "b.log")
    (code_a, code_b) = (h.finish(first, 900), h.finish(second, 900))
    logs = {"a": (tmp_path / "a.log").read_text(), "b": (tmp_path / "b.log").read_text()}
    assert sorted([code_a, code_b]) == [0, 3], logs
    winner, loser = (first, "b") if code_a == 0 else (second, "a")
    assert f'"pid": {winner.pid}' in logs[loser].replace("\n", "") or f":{winner.pid}" in logs[loser], logs[loser]
    both = logs["a"] + logs["b"]
    assert both.count("▶ score") == 1 and both.count("▶ advantage") == 1, both
    h.assert_run_done(layout)
    h.assert_exact_keys(layout)
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    after = h.manifests_of(layout)
    for name in ("prompts.parquet.manifest.json", "iter=0000/rollouts.parquet.manifest.json",
                 "checkpoints/base/manifest.json"):
        assert after[name].ended_at == FLOW_BEFORE[name].ended_at, f"{name} was redone"
    assert h.temporary_files(Path(layout.run_dir)) == []
