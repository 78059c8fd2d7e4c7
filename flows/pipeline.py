"""The Prefect flows: `stage` runs one stage, `iteration` one iteration (or the next one), `loop` a whole run.

Flows are thin composition; the work is in plain functions below and in flows/execute.py. A stage is skipped
when its manifests say it is done for the current config and inputs; Prefect's own result caching is not
used for that, because it cannot see a deleted file or a changed upstream table.

Where stages run is the dispatch mode (the flows' `dispatch` parameter, else `$RLPIPE_DISPATCH`, else local):

- `local`: each stage is a child process on this machine, forked from the stage server the `loop` and
  `iteration` flows keep while they run (stages/forkserver.py: torch, Great Expectations and vLLM imported once);
- `deployments`: each stage is a flow run of the deployment `stage/<name>` (deployments/prefect.yaml), picked
  up by a worker of that stage's pool (gpu for generate/train/evaluate, cpu for scoring), which runs the very
  same child process there. Stages exchange data only through the storage root (an `s3://` URL when the
  workers are on different machines); the parameters of a stage run are just root, run id, stage, iteration.

Two guards make overlapping triggers safe (storage/lock.py): the run lease (one flow drives a run at a time;
a scheduled trigger that finds it held ends at once as `Skipped`), and a lease per (stage, iteration) taken
where the stage runs, with the done-check repeated after taking it, so a stage never runs twice at once
and a finished stage is never redone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

from flows.prefect_env import configure_prefect

configure_prefect()

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.runtime import flow_run as current_flow_run  # noqa: E402
from prefect.states import Completed, State  # noqa: E402

from flows.artifacts import publish_iteration_artifacts  # noqa: E402
from flows.execute import (  # noqa: E402
    StageFailed,
    StageOutcome,
    dynamic_sampling_rounds,
    pending_stages,
    resolve_dispatch,
    run_stage_process,
    stage_environment,
)
from schemas.config import ConfigError, RunConfig, load_config, parse_config, read_run_config  # noqa: E402
from stages.forkserver import stage_server  # noqa: E402
from stages.registry import RUN_STAGES, STAGES, is_done_now, iteration_stages  # noqa: E402
from storage.fs import filesystem, is_remote  # noqa: E402
from storage.layout import BASE, RunLayout, instance_name, iteration_name  # noqa: E402
from storage.lock import RunLocked, run_lock  # noqa: E402

STAGE_FLOW = "stage"
# How long a stage waits for another process that runs the same stage (then it finds it done and skips it).
STAGE_LOCK_WAIT_S = float(os.environ.get("RLPIPE_STAGE_LOCK_WAIT_S", 6 * 3600))
# How often the dispatching flow polls a stage's flow run; the stages take minutes, a poll is one request.
DISPATCH_POLL_S = float(os.environ.get("RLPIPE_DISPATCH_POLL_S", 2))


class DispatchedStageFailed(StageFailed):
    def __init__(self, stage: str, iteration: int, flow_run_name: str, state: str) -> None:
        RuntimeError.__init__(
            self, f"stage {stage} ({iteration_name(iteration)}) ran as flow run {flow_run_name!r} and ended {state}"
        )
        self.stage, self.iteration, self.returncode = stage, iteration, 1


def stage_deployment(stage: str) -> str:
    """The deployment that runs `stage` on its pool: flow `stage`, deployment named after the stage."""
    return f"{STAGE_FLOW}/{stage}"


def _stage_iteration(stage: str, iteration: int) -> int:
    return BASE if STAGES[stage].run_level else iteration


def run_stage_here(root: str, run_id: str, stage: str, iteration: int, round_idx: int = 0) -> StageOutcome:
    """Run a stage as a child process of this one unless its outputs are valid.

    The child takes the stage's lease itself (waiting for it if another trigger holds it, then skipping the
    work if that one finished it), so the lease lives exactly as long as the stage: a flow process that is
    killed cannot leave its stage running unguarded.
    """
    layout = RunLayout.create(root, run_id)
    config = read_run_config(layout)
    iteration = _stage_iteration(stage, iteration)
    if is_done_now(layout, config, stage, iteration, round_idx):
        return StageOutcome(stage, iteration, ran=False, seconds=0.0, round_idx=round_idx)
    seconds = run_stage_process(layout, config, stage, iteration, STAGE_LOCK_WAIT_S, round_idx)
    return StageOutcome(stage, iteration, ran=True, seconds=seconds, round_idx=round_idx)


def dispatch_stage(root: str, run_id: str, stage: str, iteration: int, round_idx: int = 0) -> StageOutcome:
    """Run a stage as a flow run of its deployment (on a worker of its pool) and wait for it."""
    from prefect.deployments import run_deployment

    layout = RunLayout.create(root, run_id)
    iteration = _stage_iteration(stage, iteration)
    # Checked here too (the stage flow checks again under its lease) to spare a worker round trip.
    if is_done_now(layout, read_run_config(layout), stage, iteration, round_idx):
        return StageOutcome(stage, iteration, ran=False, seconds=0.0, round_idx=round_idx)
    started = time.monotonic()
    parameters = {"root": layout.root, "run_id": run_id, "stage": stage, "iteration": iteration}
    if round_idx:
        parameters["round_idx"] = round_idx
    flow_run = run_deployment(stage_deployment(stage), parameters=parameters, timeout=None,
                              poll_interval=DISPATCH_POLL_S)
    if flow_run.state is None or not flow_run.state.is_completed():
        raise DispatchedStageFailed(stage, iteration, flow_run.name, flow_run.state.name if flow_run.state else "?")
    return StageOutcome(stage, iteration, ran=True, seconds=time.monotonic() - started, round_idx=round_idx)


def next_iteration(layout: RunLayout, config: RunConfig) -> int | None:
    """The first iteration with a stage that is not done, or None when the run is complete."""
    layout.fs.invalidate_cache()
    pending = sorted({k for _, k in pending_stages(layout, config) if k != BASE})
    return pending[0] if pending else None


def start_from_config(config_path: str, root: str | None, run_id: str | None, iterations: int | None) -> RunLayout:
    """Write a run's config.yaml from a config file (a local path or a URL), as `rlpipe run --config` does."""
    from flows.cli import start_run

    if is_remote(config_path):  # a worker on another machine reads the config from shared storage
        with tempfile.NamedTemporaryFile("wb", suffix=".yaml") as local:
            local.write(filesystem(config_path).cat_file(config_path))
            local.flush()
            config = load_config(local.name)
    else:
        config = load_config(config_path)
    overrides = {"run_id": run_id, "iterations": iterations}
    values = config.model_dump(mode="json") | {k: v for k, v in overrides.items() if v is not None}
    config = parse_config(values, config_path)
    return start_run(config, root or os.environ.get("RLPIPE_ROOT") or config.root)


def _run_name(kind: str) -> str:
    parameters: dict[str, Any] = current_flow_run.parameters
    run_id = parameters.get("run_id") or os.path.basename(str(parameters.get("config") or "run")).split(".")[0]
    if kind == "loop":
        return run_id
    if kind == "stage":
        where = instance_name(parameters.get("iteration", BASE), parameters.get("round_idx", 0)).replace("/", "-")
        return f"{run_id}-{parameters.get('stage')}-{where}"
    iteration = parameters.get("iteration")
    return f"{run_id}-{'next' if iteration is None else iteration_name(iteration)}"


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{stage}[{iteration}.{round_idx}]")
def stage_task(
    root: str, run_id: str, stage: str, iteration: int, dispatch: str = "local", round_idx: int = 0
) -> StageOutcome:
    if dispatch == "deployments":
        return dispatch_stage(root, run_id, stage, iteration, round_idx)
    return run_stage_here(root, run_id, stage, iteration, round_idx)


@flow(name=STAGE_FLOW, flow_run_name=lambda: _run_name("stage"))
def stage_flow(root: str, run_id: str, stage: str, iteration: int = BASE, round_idx: int = 0) -> StageOutcome:
    """One stage on this machine (a worker of the stage's pool), unless its outputs are valid already."""
    return run_stage_here(root, run_id, stage, iteration, round_idx)


def _run_iteration(layout: RunLayout, iteration: int | None, mode: str) -> list[StageOutcome]:
    config = read_run_config(layout)
    outcomes: list[StageOutcome] = []
    if iteration is None:  # a trigger: finish the run-level stages, then advance by the next iteration
        outcomes += [stage_task(layout.root, layout.run_id, stage, BASE, mode) for stage in RUN_STAGES]
        iteration = next_iteration(layout, config)
        if iteration is None:
            get_run_logger().info("run %s: all %d iterations are done", layout.run_id, config.iterations)
            return outcomes
    for stage in iteration_stages(config, iteration):
        outcomes.append(stage_task(layout.root, layout.run_id, stage, iteration, mode))
        if stage == "advantage" and config.advantage.target_groups is not None:
            outcomes += dynamic_sampling_rounds(
                layout, config, iteration,
                run=lambda name, r: stage_task(layout.root, layout.run_id, name, iteration, mode, r),
                log=get_run_logger().info,
            )
    publish_iteration_artifacts(layout, config, iteration)
    return outcomes


def _local_stage_server(layout: RunLayout, mode: str) -> contextlib.AbstractContextManager:
    """Stages run here fork from one warm server (stages/forkserver.py) while a flow runs several of them;
    a stage dispatched to a worker runs in that worker's own flow-run process instead."""
    if mode != "local":
        return contextlib.nullcontext()
    return stage_server(stage_environment(read_run_config(layout)))


@flow(name="iteration", flow_run_name=lambda: _run_name("iteration"))
def iteration_flow(
    root: str, run_id: str, iteration: int | None = None, dispatch: str | None = None
) -> list[StageOutcome] | State:
    """The five stages of `iteration`; with no iteration (a scheduled trigger): the next unfinished one.

    A trigger that finds the run driven by another flow ends at once in state `Skipped`.
    """
    layout = RunLayout.create(root, run_id)
    mode = resolve_dispatch(dispatch)
    try:
        with run_lock(layout), _local_stage_server(layout, mode):
            return _run_iteration(layout, iteration, mode)
    except RunLocked as error:
        if iteration is not None:
            raise
        get_run_logger().warning("skipped: %s", error)
        return Completed(name="Skipped", message=str(error))


@flow(name="loop", flow_run_name=lambda: _run_name("loop"))
def loop_flow(
    root: str | None = None, run_id: str | None = None, iterations: int | None = None, config: str | None = None,
    dispatch: str | None = None,
) -> list[StageOutcome]:
    """A whole run: run-level stages, then iterations 0..N-1.

    With `config` (a YAML path or URL) the run is started from it (`run_id`, `iterations` override the file);
    without, the run must exist and `iterations` (at most the configured number) caps how far to go.
    """
    if config is not None:
        layout = start_from_config(config, root, run_id, iterations)
    elif run_id is None:
        raise ConfigError("loop needs a run id, or a config to start a run from")
    else:
        layout = RunLayout.create(root or os.environ.get("RLPIPE_ROOT") or "./rlpipe-data", run_id)
    mode = resolve_dispatch(dispatch)
    with run_lock(layout), _local_stage_server(layout, mode):
        run_config = read_run_config(layout)
        count = iterations if iterations is not None else run_config.iterations
        if count > run_config.iterations:
            raise ConfigError(f"run {layout.run_id} has {run_config.iterations} iterations; raise it with "
                              f"`rlpipe resume {layout.run_id} --set iterations={count}`")
        outcomes = [stage_task(layout.root, layout.run_id, stage, BASE, mode) for stage in RUN_STAGES]
        # Iterations run inline, their stages as tasks of this flow run (named stage[iteration.round]): a
        # subflow per iteration costs ~1.3 s of Prefect bookkeeping each (most of it joining its heartbeat
        # thread), more than all of an iteration's stage launches. A scheduled trigger runs `iteration`.
        for k in range(count):
            outcomes += _run_iteration(layout, k, mode)
    return outcomes
