"""The Prefect flows: `iteration` runs the five stages of one iteration, `loop` runs a whole run.

Flows are thin composition. Each task launches a stage process (flows/execute.py) unless the stage's
manifests say it is done for the current config and inputs; Prefect's own result caching is not used for
that, because it cannot see a deleted file or a changed upstream table. A resumed run therefore starts at
the first stage that is not done, and a stage that crashed is redone alone.
"""

from __future__ import annotations

from flows.prefect_env import configure_prefect

configure_prefect()

from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from flows.execute import StageOutcome, ensure_stage  # noqa: E402
from stages.common import read_run_config  # noqa: E402
from stages.registry import ITERATION_STAGES, RUN_STAGES  # noqa: E402
from storage.layout import BASE, RunLayout  # noqa: E402


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{stage}[{iteration}]")
def stage_task(root: str, run_id: str, stage: str, iteration: int) -> StageOutcome:
    layout = RunLayout.create(root, run_id)
    return ensure_stage(layout, read_run_config(layout), stage, iteration)


@flow(name="iteration", flow_run_name="{run_id}-iter{iteration}")
def iteration_flow(root: str, run_id: str, iteration: int) -> list[StageOutcome]:
    return [stage_task(root, run_id, stage, iteration) for stage in ITERATION_STAGES]


@flow(name="loop", flow_run_name="{run_id}")
def loop_flow(root: str, run_id: str, iterations: int | None = None) -> list[StageOutcome]:
    """Run-level stages, then iterations 0..N-1 (N from the run's config unless given)."""
    layout = RunLayout.create(root, run_id)
    config = read_run_config(layout)
    outcomes = [stage_task(root, run_id, stage, BASE) for stage in RUN_STAGES]
    for k in range(iterations if iterations is not None else config.iterations):
        outcomes += iteration_flow(root, run_id, k)
    return outcomes
