"""`rlpipe fork RUN NEW --at K`: a new run that shares RUN's stored outputs up to iteration K wherever NEW's config
computes the same thing, and leaves the rest to an ordinary resume of NEW.

A stage key hashes the config sections a stage reads and its inputs' content hashes, so "the same thing" is "the
same key": each of RUN's stage instances up to K, in pipeline order (run-level stages, then per iteration,
generation rounds included), gets the key NEW's config gives it over NEW's inputs (those shared just before it),
and is shared when every output RUN has for it carries that key: at no copy, by hard links on a local root and
by a manifest that refers to RUN's files on S3 (storage/sharing.py). An instance whose key differs is not shared,
and so neither is anything that reads its output: GRPO vs RLOO on the same rollouts shares prompts, base model,
generate and score, and computes advantage onward. A shared output that RUN has lost is refused by name (the key
says it would be shared; the bytes are gone). Checkpoints retention pruned before the newest one shared are shared
as RUN has them, pruned (tables and manifest kept, any later use refused by name), so a run with
`train.keep_checkpoints` can be forked at its kept checkpoint; that newest one, which NEW continues from, must have
its weights, and its optimizer state when NEW trains again. NEW's config.yaml is written last, so a fork killed
while sharing leaves a directory without one, which the next fork replaces; a refused fork leaves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.config import RunConfig
from schemas.errors import InputError
from stages.registry import (
    RUN_STAGES,
    STAGES,
    MissingInput,
    Output,
    instance,
    iteration_stages,
    outputs_of,
    resolve_inputs,
)
from storage.layout import RunLayout, StageInstance
from storage.manifest import Manifest, output_damage, read_manifest
from storage.retention import require_unpruned
from storage.run import Run
from storage.sharing import share_output


@dataclass(frozen=True)
class Fork:
    run: Run  # the new run, its config.yaml written
    shared: list[StageInstance]  # what it shares, in pipeline order


def check_fork_point(source: Run, config: RunConfig, at: int) -> None:
    """K is an iteration RUN has reached and NEW has; InputError otherwise."""
    if not 0 <= at < source.config.iterations:
        raise InputError(f"run {source.run_id} has iterations 0 to {source.config.iterations - 1}: "
                         f"there is no iteration {at} to fork at")
    if read_manifest(source.fs, Output("rollouts", at).manifest_path(source.layout)) is None:
        raise InputError(f"run {source.run_id} has not reached iteration {at}: it has no rollouts there "
                         f"({Output('rollouts', at).path(source.layout)}); fork at an iteration it has")
    if at >= config.iterations:
        raise InputError(f"run {config.run_id} would have {config.iterations} iterations, so no iteration {at} "
                         f"to share: give it more with --set iterations={source.config.iterations}")


def fork_instances(source: Run, config: RunConfig, at: int) -> list[StageInstance]:
    """RUN's stage instances up to iteration `at` that NEW schedules, in pipeline order: the run-level stages,
    then each iteration's, with every generation round RUN has of the per-round stages."""
    targets = [instance(stage) for stage in RUN_STAGES]
    for k in range(at + 1):
        for stage in iteration_stages(config, k):
            targets.append(instance(stage, k))
            round_idx = 1
            while STAGES[stage].per_round and _manifests(source, instance(stage, k, round_idx)):
                targets.append(instance(stage, k, round_idx))
                round_idx += 1
    return targets


def _manifests(run: Run, target: StageInstance) -> list[Manifest] | None:
    """The manifests of every output of `target` in `run`, or None when one is missing."""
    manifests = [read_manifest(run.fs, output.manifest_path(run.layout)) for output in outputs_of(target)]
    return None if any(m is None for m in manifests) else manifests


def _share(source: Run, new: Run, target: StageInstance) -> bool:
    """Share `target`'s outputs from `source` into `new` when NEW's key for it is the one they carry."""
    originals = _manifests(source, target)
    if originals is None:
        return False
    try:
        key = resolve_inputs(new, target).key
    except MissingInput:  # an input was not shared: NEW computes it, and this after it
        return False
    if any(manifest.key != key for manifest in originals):
        return False
    outputs = outputs_of(target)
    # where each output's bytes are now: its place in RUN (a run moved to another root keeps its manifests'
    # recorded paths), or, for RUN's own share by reference, the origin's files its manifest names
    located = [manifest if manifest.by_reference else replace(manifest, path=output.path(source.layout))
               for output, manifest in zip(outputs, originals, strict=True)]
    for manifest in located:  # a pruned checkpoint's manifest lists only the files it kept
        if (damage := output_damage(source.fs, manifest)) is not None:
            raise InputError(f"run {source.run_id}'s {target.label} output is lost or pruned ({damage}): it "
                             f"cannot be shared; fork at an earlier iteration than {target.iteration}")
    for output, manifest in zip(outputs, located, strict=True):
        share_output(new.fs, manifest, source.run_id, output.path(new.layout))
    return True


def check_fork(source: Run, config: RunConfig, at: int) -> RunLayout:
    """Where the new run goes, once the storage, the new run id and the iteration are checked; InputError naming
    the one that is wrong."""
    layout = RunLayout.create(source.root, config.run_id)
    if layout.fs.exists(layout.config_path):
        raise InputError(f"run {config.run_id} already exists at {layout.run_dir}: fork into a new run id")
    check_fork_point(source, config, at)
    return layout


def fork(source: Run, config: RunConfig, at: int) -> Fork:
    """Make run `config.run_id` from `source` at iteration `at` (module docstring); nothing is computed here."""
    layout = check_fork(source, config, at)
    if layout.fs.exists(layout.run_dir):  # a fork killed before its config.yaml: start it over
        layout.fs.rm(layout.run_dir, recursive=True)
    new = Run(layout, config)
    try:
        shared = [target for target in fork_instances(source, config, at) if _share(source, new, target)]
        require_continuable(new, shared)
    except InputError:  # refused: nothing of NEW stays (its shares are links or manifests of its own)
        if layout.fs.exists(layout.run_dir):
            layout.fs.rm(layout.run_dir, recursive=True)
        raise
    return Fork(Run.start(config, source.root), shared)


def require_continuable(new: Run, shared: list[StageInstance]) -> None:
    """CheckpointPruned, naming the iteration, when the newest checkpoint NEW shares (the one it samples from and
    trains on next) lost its weights to RUN's retention, or its optimizer state while NEW has iterations to train."""
    trained = [target.iteration for target in shared if target.stage == "train"]
    if not trained:  # NEW continues from the base model, which is never pruned
        return
    newest = read_manifest(new.fs, Output("checkpoint", max(trained)).manifest_path(new.layout))
    require_unpruned(newest, optimizer=max(trained) + 1 < new.config.iterations)
