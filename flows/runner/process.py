"""Running stages as child processes, and deciding which ones still need to run. No Prefect here.

Each stage runs in its own Python process: a stage that holds a model frees all of its memory when it
exits, and a crash (even SIGKILL) in a stage cannot take the flow down. Inside `forkserver.stage_server`
(local runs) the process is forked from a server that has imported torch, Great Expectations and vLLM
already (flows/runner/forkserver.py); elsewhere it is a fresh interpreter. The child inherits the terminal, so
its progress bars and timing lines show as they happen; it never imports Prefect, so it never starts a
Prefect server of its own. A failing stage writes the run's failure record itself (storage/failure.py); for
one that died without writing it (a signal) the driver writes what it knows. A sharded instance
(pipeline.shards) is K shard processes at once, then a merge process (`run_sharded`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

from flows.runner import forkserver
from schemas import settings
from schemas.config import ConfigError, RunConfig
from stages.registry import RUN_STAGES, instance, iteration_stages, shards_of, stage_state
from storage.failure import read_failure, record_failure
from storage.layout import BASE, RunLayout, StageInstance, manifest_path_for
from storage.manifest import read_manifest
from storage.run import Run

# Where stages run (flows/pipeline.py): child processes here, or flow runs of the stage deployments.
DISPATCH_MODES = ("local", "deployments")


def resolve_dispatch(dispatch: str | None) -> str:
    mode = dispatch or settings.DISPATCH.get()
    if mode not in DISPATCH_MODES:
        choices = ", ".join(DISPATCH_MODES)
        raise ConfigError(f"dispatch {mode!r} must be one of {choices} (the flow parameter or $RLPIPE_DISPATCH)")
    return mode


class StageFailed(RuntimeError):
    def __init__(self, target: StageInstance, returncode: int, why: str | None = None) -> None:
        why = why or {2: "bad input or config (see the message above)",
                      3: "another process holds its lease (see the message above)"}.get(
            returncode, f"exit code {returncode}")
        super().__init__(f"stage {target.label} failed: {why}")
        self.target, self.returncode = target, returncode


@dataclass(frozen=True)
class StageOutcome:
    target: StageInstance
    ran: bool
    seconds: float


def stage_environment(config: RunConfig) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(config.threads)
    # Thread pools are sized before Python code runs, so the limit has to be in the environment.
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stage_command(
    layout: RunLayout, target: StageInstance, lock_wait_s: float | None = None, merge: bool = False,
) -> list[str]:
    """The stage's process (one shard's, or with `merge` the merge of a sharded instance's parts). With
    `lock_wait_s` it waits that long for its lease if another process holds it, and then does nothing if that
    process finished the work (`--if-needed`)."""
    command = [sys.executable, "-m", f"stages.{target.stage}", "--root", layout.root, "--run", layout.run_id,
               "--iter", str(target.iteration)]
    if target.round_idx:
        command += ["--round", str(target.round_idx)]
    if target.shard:
        command += ["--shard", f"{target.shard.index}/{target.shard.count}"]
    if merge:
        command += ["--merge"]
    if lock_wait_s is not None:
        command += ["--if-needed", "--lock-wait", str(lock_wait_s)]
    return command


def run_stage_process(run: Run, target: StageInstance, lock_wait_s: float | None = None, merge: bool = False) -> float:
    started, started_at = time.monotonic(), time.time()
    command = stage_command(run.layout, target, lock_wait_s, merge)
    returncode = forkserver.run(command, stage_environment(run.config))
    if returncode != 0:
        if returncode != 3 and not recorded_since(run.layout, target.whole, started_at):
            # the stage died before it could say why (a signal: killed, out of memory): record what is known
            why = f"ended by signal {signal.Signals(-returncode).name}" if returncode < 0 else "no reason recorded"
            record_failure(run.layout, target.whole, returncode, f"{target.shard.name}: {why}" if target.shard else why)
        raise StageFailed(target, returncode)
    return time.monotonic() - started


def run_sharded(
    run: Run, target: StageInstance, run_part: Callable[[StageInstance], object],
    run_merge: Callable[[StageInstance], object],
) -> None:
    """A sharded instance (pipeline.shards): `run_part(shard)` for all its shards at once (each a process here, or
    a flow run on a worker), then `run_merge(target)` once every shard succeeded. A failed shard fails the instance
    after the others have finished, so a rerun redoes only the shards without a valid part."""
    parts = shards_of(run.config, target)
    with ThreadPoolExecutor(len(parts), thread_name_prefix=target.slug) as pool:
        futures = [pool.submit(run_part, part) for part in parts]
    if failures := [error for future in futures if (error := future.exception()) is not None]:
        raise failures[0]
    run_merge(target)


def recorded_since(layout: RunLayout, target: StageInstance, since: float) -> bool:
    """Whether the stage instance wrote its failure record at or after `since` (seconds since the epoch)."""
    failure = read_failure(layout)
    return (failure is not None and failure.label == target.label
            and datetime.fromisoformat(failure.at).timestamp() >= since - 1.0)


def run_plan(config: RunConfig) -> list[StageInstance]:
    """Every scheduled stage instance of the run (round 0), in order."""
    plan = [instance(stage) for stage in RUN_STAGES]
    return plan + [instance(stage, k) for k in range(config.iterations) for stage in iteration_stages(config, k)]


def pending_stages(run: Run) -> list[StageInstance]:
    """Every scheduled stage instance of the run, in order, whose outputs are not valid yet.

    A stage whose inputs are missing counts as pending, since its upstream will run first.
    """
    return [target for target in run_plan(run.config) if not stage_state(run, target).done]


def next_iteration(run: Run) -> int | None:
    """The first iteration with a stage that is not done, or None when the run is complete."""
    run.fs.invalidate_cache()
    pending = sorted({target.iteration for target in pending_stages(run) if target.iteration != BASE})
    return pending[0] if pending else None


def batch_groups_needed(run: Run, iteration: int) -> tuple[int, int]:
    """(kept groups the batch of `iteration` still lacks, generation rounds it was built from), read fresh
    from its manifest."""
    run.fs.invalidate_cache()
    path = run.layout.table_path("batch", iteration)
    manifest = read_manifest(run.fs, manifest_path_for(path, "table"))
    if manifest is None:
        raise RuntimeError(f"{path} has no manifest after stage advantage ran")
    return int(manifest.metrics.get("groups_needed", 0)), int(manifest.metrics.get("rounds", 1))


def dynamic_sampling_rounds(
    run: Run, iteration: int, execute: Callable[[StageInstance], StageOutcome], log: Callable[..., None],
) -> list[StageOutcome]:
    """DAPO dynamic sampling: while the batch holds fewer kept groups than advantage.target_groups, generate
    and score one more round (its own tables, iter=k/round=RR/) and rebuild the batch over every round.

    `execute(instance)` runs one stage instance (a child process, or a flow run on a worker). The advantage
    stage fails, naming the cap, when advantage.max_generation_rounds rounds are not enough, so the loop ends.
    A resumed iteration picks up at the round after the last one its batch was built from.
    """
    outcomes: list[StageOutcome] = []
    while True:
        needed, rounds = batch_groups_needed(run, iteration)
        if needed == 0:
            return outcomes
        cap = run.config.advantage.round_cap
        if cap is not None and rounds >= cap:  # the advantage stage refuses this; never loop
            raise RuntimeError(f"batch of iteration {iteration} lacks {needed} groups after {rounds} rounds (the cap)")
        log("iteration %d: the batch needs %d more kept groups: generation round %d", iteration, needed, rounds)
        outcomes += [execute(instance("generate", iteration, rounds)), execute(instance("score", iteration, rounds)),
                     execute(instance("advantage", iteration))]
