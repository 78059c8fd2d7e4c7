"""The Prefect flows: `stage` runs one stage, `iteration` one iteration (or the next one), `loop` a whole run.

Flows are thin composition; the work is in plain functions below and in flows/runner/process.py. A stage is
skipped when its manifests say it is done for the current config and inputs (not Prefect's result caching,
which cannot see a deleted file or a changed upstream table). Where stages run is the dispatch mode (the
`dispatch` parameter, else `$RLPIPE_DISPATCH`, else local): `local` forks each stage from the stage server the
flow keeps while it runs (flows/runner/forkserver.py); `deployments` runs each as a flow run of `stage/<name>`
on a worker of its pool, sharing only the storage root, with parameters run (a `RunRef`), stage, iteration. A
sharded stage (pipeline.shards) is its K shards at once, then their merge: K processes here, K flow runs there.

A flow run is where a process enters a run: it opens the `Run` from its `RunRef` once, under the run lease,
and passes it down (`_driven_run`); called by `rlpipe run`, which holds both already, it takes the `Run` the
ref hands over. Two leases make overlapping triggers safe (storage/lock.py): the run lease (a scheduled
trigger that finds it held ends as `Skipped`), and one per stage instance, taken where the stage runs, with
the done-check repeated under it, so a stage never runs twice at once and a finished stage is never redone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from flows.prefect_env import configure_prefect

configure_prefect()

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.runtime import flow_run as current_flow_run  # noqa: E402
from prefect.states import Completed, State  # noqa: E402

from flows.artifacts import publish_iteration_artifacts, report_link  # noqa: E402
from flows.deploy import SKIPPED_STATE  # noqa: E402
from flows.runner.forkserver import stage_server  # noqa: E402
from flows.runner.generation_server import generation_server  # noqa: E402
from flows.runner.overlap import drive, overlap_plan  # noqa: E402
from flows.runner.process import (  # noqa: E402
    StageFailed,
    StageOutcome,
    dynamic_sampling_rounds,
    next_iteration,
    recorded_since,
    resolve_dispatch,
    run_sharded,
    run_stage_process,
    stage_environment,
)
from flows.trackers import log_iterations  # noqa: E402
from schemas import settings  # noqa: E402
from schemas.config import ConfigError, load_config, parse_config  # noqa: E402
from stages.registry import RUN_STAGES, instance, is_done_now, iteration_stages, shards_of  # noqa: E402
from stages.retention import prune_checkpoints  # noqa: E402
from stages.rl.advantages import check_estimator_fits  # noqa: E402
from storage.failure import record_failure  # noqa: E402
from storage.fs import filesystem, is_remote  # noqa: E402
from storage.layout import BASE, Shard, StageInstance, iteration_name  # noqa: E402
from storage.lock import RunLocked, lease_holder, run_lock, stage_lock_path  # noqa: E402
from storage.run import Run, RunRef  # noqa: E402

STAGE_FLOW = "stage"


class DispatchedStageFailed(StageFailed):
    def __init__(self, target: StageInstance, flow_run_name: str, state: str) -> None:
        super().__init__(target, 1, f"ran as flow run {flow_run_name!r} and ended {state}")


def stage_deployment(stage: str) -> str:
    """The deployment that runs `stage` on its pool: flow `stage`, deployment named after the stage."""
    return f"{STAGE_FLOW}/{stage}"


def run_stage_here(run: Run, target: StageInstance, merge: bool = False) -> StageOutcome:
    """Run a stage as a child process of this one unless its outputs are valid; a sharded one (pipeline.shards)
    as its K shard processes at once, then the merge. A shard, or with `merge` the merge alone: that one process
    (a worker given it by `dispatch_stage`).

    The child takes the stage's lease itself (waiting for it if another trigger holds it, then skipping the
    work if that one finished it), so the lease lives exactly as long as the stage: a flow process that is
    killed cannot leave its stage running unguarded.
    """
    if is_done_now(run, target):
        return StageOutcome(target, ran=False, seconds=0.0)
    started, wait = time.monotonic(), settings.seconds(settings.STAGE_LOCK_WAIT_S)
    if target.shard is None and not merge and shards_of(run.config, target):
        run_sharded(run, target, lambda part: run_stage_process(run, part, wait),
                    lambda whole: run_stage_process(run, whole, wait, merge=True))
    else:
        run_stage_process(run, target, wait, merge)
    return StageOutcome(target, ran=True, seconds=time.monotonic() - started)


def dispatch_stage(run: Run, target: StageInstance) -> StageOutcome:
    """Run a stage as a flow run of its deployment (on a worker of its pool) and wait for it; a sharded one as one
    flow run per shard, all at once (K workers of the pool take one each), then one that merges."""
    # Checked here too (the stage flow checks again under its lease) to spare a worker round trip.
    if is_done_now(run, target):
        return StageOutcome(target, ran=False, seconds=0.0)
    started = time.monotonic()
    if shards_of(run.config, target):
        # A shard with a valid part (a rerun after a failed shard) gets no flow run at all.
        run_sharded(run, target, lambda part: is_done_now(run, part) or _stage_flow_run(run, part),
                    lambda whole: _stage_flow_run(run, whole, merge=True))
    else:
        _stage_flow_run(run, target)
    return StageOutcome(target, ran=True, seconds=time.monotonic() - started)


def _stage_flow_run(run: Run, target: StageInstance, merge: bool = False) -> None:
    """One flow run of the stage's deployment (a shard, or with `merge` the merge), waited for until it ends.

    A flow run whose process died with its machine or worker stays Running in Prefect for good. It is known dead
    once the stage lease its process took is abandoned (storage/lock.py: a dead process of this host at once, on
    S3 after the lease's ttl): the flow run is then set Crashed and the stage fails, so that the dispatching flow
    ends and a rerun (a retry, the next trigger) takes the stage again. A holder that died before this flow run
    started (the attempt a rerun replaces) is not its process. One that died before taking the lease stops sending
    heartbeats, and `rlpipe deploy`'s automation sets it Crashed: a final state, so this returns too."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Crashed

    parameters: dict[str, Any] = {"run": RunRef(root=run.root, run_id=run.run_id), "stage": target.stage,
                                  "iteration": target.iteration}
    if target.round_idx:
        parameters["round_idx"] = target.round_idx
    if target.shard:
        parameters["shard"] = f"{target.shard.index}/{target.shard.count}"
    if merge:
        parameters["merge"] = True
    lease = stage_lock_path(run.layout, target)  # a shard's own; the merge's is the instance's
    earlier, dispatched_at = lease_holder(lease)[1], time.time()
    flow_run = run_deployment(stage_deployment(target.stage), parameters=parameters, timeout=0)
    poll_s = settings.seconds(settings.DISPATCH_POLL_S)
    with get_client(sync_client=True) as client:
        while (flow_run := client.read_flow_run(flow_run.id)).state is None or not flow_run.state.is_final():
            if flow_run.state is not None and flow_run.state.is_running() and _died_holding(lease, earlier):
                why = f"its process died holding the lease {lease}"
                client.set_flow_run_state(flow_run.id, Crashed(message=why), force=True)
                if not recorded_since(run.layout, target.whole, dispatched_at):  # the stage's own record says more
                    record_failure(run.layout, target.whole, 1, f"{target.shard.name}: {why}" if target.shard else why)
                raise DispatchedStageFailed(target, flow_run.name, f"Crashed ({why})")
            time.sleep(poll_s)
    if not flow_run.state.is_completed():  # e.g. Crashed by the automation for silent flow runs (flows/deploy.py)
        message = f" ({flow_run.state.message})" if flow_run.state.message else ""
        raise DispatchedStageFailed(target, flow_run.name, flow_run.state.name + message)


def _died_holding(lease: str, earlier: dict[str, Any] | None) -> bool:
    """Whether the lease at `lease` was taken since `earlier` (its holder record then) and its holder died."""
    try:
        state, holder = lease_holder(lease)
    except Exception:  # noqa: BLE001 - storage unreachable for now: judged at the next poll, never a failure
        return False
    return state == "abandoned" and holder is not None and holder.get("token") != (earlier or {}).get("token")


def start_from_config(config_path: str, root: str | None, run_id: str | None, iterations: int | None) -> Run:
    """Write a run's config.yaml from a config file (a local path or a URL), as `rlpipe run --config` does."""
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
    check_estimator_fits(config)  # what the config's own validators cannot ask (stages/rl/advantages.py)
    return Run.start(config, root)


@contextlib.contextmanager
def _driven_run(ref: RunRef) -> Iterator[Run]:
    """The run a flow drives, under the run lease, each taken once per process: the `Run` that `rlpipe run`
    hands over (it holds the lease already), else opened here under a lease taken here (a flow run on a
    worker, or a scheduled trigger: a process of its own). Raises RunLocked when another process drives it."""
    if ref.driven is not None:
        yield ref.driven
        return
    with run_lock(ref.layout):
        yield Run.at(ref.layout)  # read once, by the run's one driver


def _run_name(kind: str) -> str:
    parameters: dict[str, Any] = current_flow_run.parameters
    ref: RunRef | None = parameters.get("run")
    run_id = ref.run_id if ref else os.path.basename(str(parameters.get("config") or "run")).split(".")[0]
    if kind == "loop":
        return run_id
    if kind == "stage":
        shard = parameters.get("shard")
        target = instance(parameters["stage"], parameters.get("iteration", BASE), parameters.get("round_idx", 0),
                          Shard.parse(shard) if shard else None)
        return f"{run_id}-{target.slug}" + ("-merge" if parameters.get("merge") else "")
    iteration = parameters.get("iteration")
    return f"{run_id}-{'next' if iteration is None else iteration_name(iteration)}"


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{target.label}")
def stage_task(run: Run, target: StageInstance, dispatch: str = "local") -> StageOutcome:
    if dispatch == "deployments":
        return dispatch_stage(run, target)
    return run_stage_here(run, target)


@flow(name=STAGE_FLOW, flow_run_name=lambda: _run_name("stage"))
def stage_flow(
    run: RunRef, stage: str, iteration: int = BASE, round_idx: int = 0, shard: str | None = None, merge: bool = False,
) -> StageOutcome:
    """One stage on this machine (a worker of the stage's pool), unless its outputs are valid already; with `shard`
    ("k/K") one shard of it, with `merge` the merge of its shards' parts (pipeline.shards). No run lease: the
    dispatching flow holds it; the stage's own lease (a shard's own) is taken by its process."""
    target = instance(stage, iteration, round_idx, Shard.parse(shard) if shard else None)
    return run_stage_here(Run.at(run.layout), target, merge)


def _run_iteration(run: Run, iteration: int | None, mode: str) -> list[StageOutcome]:
    outcomes: list[StageOutcome] = []
    if iteration is None:  # a trigger: finish the run-level stages, then advance by the next iteration
        outcomes += [stage_task(run, instance(stage), mode) for stage in RUN_STAGES]
        iteration = next_iteration(run)
        if iteration is None:
            get_run_logger().info("run %s: all %d iterations are done", run.run_id, run.config.iterations)
            return outcomes
    for stage in iteration_stages(run.config, iteration):
        outcomes.append(stage_task(run, instance(stage, iteration), mode))
        if stage == "advantage" and run.config.advantage.target_groups is not None:
            outcomes += dynamic_sampling_rounds(
                run, iteration, execute=lambda target: stage_task(run, target, mode), log=get_run_logger().info
            )
    _finish_iteration(run, iteration)
    return outcomes


def _finish_iteration(run: Run, iteration: int) -> None:
    # After the iteration's train and evaluation: the checkpoints train.keep_* no longer keep (stages/retention.py).
    # Run on every pass, resumes included, so a pass a kill cut short is finished by the next.
    for k, level in prune_checkpoints(run).items():
        get_run_logger().info("run %s: pruned the %s of iteration %d", run.run_id,
                              "optimizer state" if level == "optimizer" else "checkpoint", k)
    publish_iteration_artifacts(run, iteration)
    log_iterations(run, warn=get_run_logger().warning)  # log.trackers: each finished iteration once (step = k)


def _run_overlapped(run: Run, count: int, mode: str) -> list[StageOutcome]:
    """Iterations 0..count-1 overlapped (pipeline.max_staleness > 0): the rollout lane and the train lane each
    run one stage at a time, both at once, as Prefect task futures (flows/runner/overlap.py decides which)."""
    plan = overlap_plan(run.config, count)
    return drive(plan, lambda target: stage_task.submit(run, target, mode),
                 iteration_done=lambda k: _finish_iteration(run, k))


def quiet_stage_failures() -> None:
    """Leave a failed stage's records out of Prefect's console log (the task's and the flow's traceback of the
    StageFailed raise, which say nothing the stage's own one line and `failed.json` do not): `rlpipe run` without
    `--debug`. Prefect's API log (its UI) keeps them."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(_not_a_stage_failure)


def _not_a_stage_failure(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, StageFailed) and "StageFailed" not in record.getMessage()


@contextlib.contextmanager
def report_on_failure(run: Run) -> Iterator[None]:
    """When a stage fails, rewrite the run's report before the failure goes on up, so that it opens with where the
    run stopped and why (its failure record, storage/failure.py), not with the last finished iteration."""
    try:
        yield
    except StageFailed:
        report_link(run)  # never raises: a report that cannot be written is only logged, and here not even that
        raise


def _local_stage_server(run: Run, mode: str) -> contextlib.AbstractContextManager:
    """Stages run here fork from one warm server (flows/runner/forkserver.py) while a flow runs several of
    them; a stage dispatched to a worker runs in that worker's own flow-run process instead."""
    if mode != "local":
        return contextlib.nullcontext()
    return stage_server(stage_environment(run.config))


@flow(name="iteration", flow_run_name=lambda: _run_name("iteration"))
def iteration_flow(
    run: RunRef, iteration: int | None = None, dispatch: str | None = None
) -> list[StageOutcome] | State:
    """The five stages of `iteration`; with no iteration (a scheduled trigger): the next unfinished one.
    Always in strict order, whatever pipeline.max_staleness: one iteration per trigger has nothing to overlap.

    A trigger that finds the run driven by another flow ends at once in state `Skipped`.
    """
    mode = resolve_dispatch(dispatch)
    try:
        with _driven_run(run) as opened, _local_stage_server(opened, mode), report_on_failure(opened):
            return _run_iteration(opened, iteration, mode)
    except RunLocked as error:
        if iteration is not None:
            raise
        get_run_logger().warning("skipped: %s", error)
        return Completed(name=SKIPPED_STATE, message=str(error))


@flow(name="loop", flow_run_name=lambda: _run_name("loop"))
def loop_flow(
    run: RunRef | None = None, iterations: int | None = None, config: str | None = None, dispatch: str | None = None,
) -> list[StageOutcome]:
    """A whole run: run-level stages, then iterations 0..N-1 (overlapped with pipeline.max_staleness > 0).

    With `config` (a YAML path or URL) the run is started from it, as `run` if given (else under the config's
    run id in `$RLPIPE_ROOT`; `iterations` overrides the file); without, `run` must exist and `iterations` (at
    most the configured number) caps how far to go.
    """
    mode = resolve_dispatch(dispatch)
    if config is not None:  # the run is the one just written from `config`, driven from here
        started = start_from_config(config, run.root if run else None, run.run_id if run else None, iterations)
        with run_lock(started.layout):
            return _run_loop(started, iterations, mode)
    if run is None:
        raise ConfigError("loop needs a run (root and run_id), or a config to start a run from")
    with _driven_run(run) as opened:
        return _run_loop(opened, iterations, mode)


def _run_loop(run: Run, iterations: int | None, mode: str) -> list[StageOutcome]:
    count = iterations if iterations is not None else run.config.iterations
    if count > run.config.iterations:
        raise ConfigError(f"run {run.run_id} has {run.config.iterations} iterations; raise it with "
                          f"`rlpipe resume {run.run_id} --set iterations={count}`")
    # The run's warm generation engine, if a stage started one, ends with the run (generation_server.py).
    with _local_stage_server(run, mode), generation_server(run), report_on_failure(run):
        outcomes = [stage_task(run, instance(stage), mode) for stage in RUN_STAGES]
        # Iterations run inline, their stages as tasks of this flow run (named `generate iter=3`): a
        # subflow per iteration costs ~1.3 s of Prefect bookkeeping each (most of it joining its
        # heartbeat thread), more than all of an iteration's stage launches. A trigger runs `iteration`.
        if run.config.pipeline.max_staleness > 0:
            outcomes += _run_overlapped(run, count, mode)
        else:
            for k in range(count):
                outcomes += _run_iteration(run, k, mode)
    return outcomes
