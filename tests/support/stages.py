"""Tests' short forms: start a run at a root, run a stage instance in the test process from a run's location
(`stages.harness.run_stage(Run.open(...), instance(...), work)`), which stage instances of a run are done, and a
copy of a run under another root (`clone`)."""

from __future__ import annotations

from collections.abc import Callable

from schemas.config import RunConfig
from stages.harness import StageContext, run_stage
from stages.registry import RUN_STAGES, instance, iteration_stages, stage_state
from storage.checkpoints import HASH_CACHE_NAME
from storage.fs import join
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


def clone(source: RunLayout, root: str) -> RunLayout:
    """A copy of a run under another root on any file system: manifests record full paths, which are moved.
    Local hash caches are left out (S3 checkpoints have none; they are rebuilt where needed)."""
    fs = source.fs
    prefix = fs._strip_protocol(source.run_dir) + "/"
    target = RunLayout.create(root, source.run_id)
    for path in fs.find(source.run_dir):
        relative = path.removeprefix(prefix)
        if relative.endswith((".lock", HASH_CACHE_NAME)):
            continue
        data = fs.cat_file(path)
        if relative.endswith("manifest.json"):
            data = data.replace(f"{source.root}/".encode(), f"{target.root}/".encode())
        target.fs.pipe_file(join(target.run_dir, relative), data)
    return target
