"""Tests' short forms: start a run at a root, run a stage instance in the test process from a run's location
(`stages.harness.run_stage(Run.open(...), instance(...), work)`), and which stage instances of a run are done."""

from __future__ import annotations

from collections.abc import Callable

from schemas.config import RunConfig
from stages.harness import StageContext, run_stage
from stages.registry import RUN_STAGES, instance, iteration_stages, stage_state
from storage.layout import BASE, RunLayout
from storage.manifest import Manifest
from storage.run import Run


def run_stage_at(
    stage: str, layout: RunLayout, iteration: int, work: Callable[[StageContext], None], round_idx: int = 0
) -> list[Manifest]:
    return run_stage(Run.open(layout.root, layout.run_id), instance(stage, iteration, round_idx), work)


def start_run(config: RunConfig, root: str) -> RunLayout:
    """Start a run (write its config.yaml) and return where it lives."""
    return Run.start(config, root).layout


def stage_states(run: Run) -> dict[tuple[str, int], bool]:
    """(stage, iteration) -> done, for every stage instance the run's config schedules."""
    states = {(stage, BASE): stage_state(run, instance(stage, BASE)).done for stage in RUN_STAGES}
    for k in range(run.config.iterations):
        for stage in iteration_stages(run.config, k):
            states[(stage, k)] = stage_state(run, instance(stage, k)).done
    return states
