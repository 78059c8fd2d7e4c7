"""Tests' short forms: start a run at a root, and run a stage instance in the test process from a run's
location (`stages.harness.run_stage(Run.open(...), instance(...), work)`)."""

from __future__ import annotations

from collections.abc import Callable

from schemas.config import RunConfig
from stages.harness import StageContext, run_stage
from stages.registry import instance
from storage.layout import RunLayout
from storage.manifest import Manifest
from storage.run import Run


def run_stage_at(
    stage: str, layout: RunLayout, iteration: int, work: Callable[[StageContext], None], round_idx: int = 0
) -> list[Manifest]:
    return run_stage(Run.open(layout.root, layout.run_id), instance(stage, iteration, round_idx), work)


def start_run(config: RunConfig, root: str) -> RunLayout:
    """Start a run (write its config.yaml) and return where it lives."""
    return Run.start(config, root).layout
