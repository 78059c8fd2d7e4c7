"""Running stages as child processes, and deciding which ones still need to run. No Prefect here.

Each stage runs in its own Python process: a stage that holds a model frees all of its memory when it
exits, and a crash (even SIGKILL) in a stage cannot take the flow down. The child inherits the terminal, so
its progress bars and timing lines show as they happen; it never imports Prefect, so it never starts a
Prefect server of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from schemas.config import RunConfig
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, stage_state
from storage.layout import BASE, RunLayout


class StageFailed(RuntimeError):
    def __init__(self, stage: str, iteration: int, returncode: int) -> None:
        where = stage if iteration == BASE else f"{stage} (iteration {iteration})"
        why = {2: "bad input or config (see the message above)",
               3: "another process holds its lease (see the message above)"}.get(returncode, f"exit code {returncode}")
        super().__init__(f"stage {where} failed: {why}")
        self.stage, self.iteration, self.returncode = stage, iteration, returncode


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    iteration: int
    ran: bool
    seconds: float


def stage_environment(config: RunConfig) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(config.threads)
    # Thread pools are sized before Python code runs, so the limit has to be in the environment.
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stage_command(layout: RunLayout, stage: str, iteration: int, lock_wait_s: float | None = None) -> list[str]:
    """The stage's process. With `lock_wait_s` it waits that long for the stage's lease if another process
    holds it, and then does nothing if that process finished the stage (`--if-needed`)."""
    command = [sys.executable, "-m", f"stages.{stage}", "--root", layout.root, "--run", layout.run_id,
               "--iter", str(iteration)]
    if lock_wait_s is not None:
        command += ["--if-needed", "--lock-wait", str(lock_wait_s)]
    return command


def run_stage_process(
    layout: RunLayout, config: RunConfig, stage: str, iteration: int, lock_wait_s: float | None = None
) -> float:
    started = time.monotonic()
    completed = subprocess.run(stage_command(layout, stage, iteration, lock_wait_s), env=stage_environment(config))
    if completed.returncode != 0:
        raise StageFailed(stage, iteration, completed.returncode)
    return time.monotonic() - started


def pending_stages(layout: RunLayout, config: RunConfig) -> list[tuple[str, int]]:
    """Every (stage, iteration) of the run, in order, whose outputs are not valid yet.

    A stage whose inputs are missing counts as pending, since its upstream will run first.
    """
    plan = [(stage, BASE) for stage in RUN_STAGES]
    plan += [(stage, k) for k in range(config.iterations) for stage in ITERATION_STAGES]
    fs = layout.fs
    return [(s, k) for s, k in plan if not stage_state(fs, layout, config, STAGES[s], k).done]
