"""Checkpoint retention, the policy: after each iteration, which checkpoints lose their weights or their
optimizer state (train.keep_checkpoints, train.keep_optimizer_states); storage/retention.py does the pruning.

Measured from the newest checkpoint whose train stage is done (`last`, what a resume trains from), checkpoint j
keeps its weights when any of these holds, and its optimizer state when the first or the second does:
- it is among the newest `keep_optimizer_states` (optimizer) or `keep_checkpoints` (weights), or that is null;
- the next train stage (j + 1) is not done: it starts from j, weights and optimizer state;
- the config evaluates it (evaluate.every, and always the last iteration), done or not;
- a generate (or GAE advantage) stage that samples with it, iteration j + 1 + pipeline.max_staleness, is not
  done: judged by that iteration's train stage, which is done only once every round it read is.
The base model is never pruned, nor is anything newer than `last` (stale or being written). Every rule reads
done-states, never file times, so an overlapped run (a train stage beside this pass) and a resume after a kill
decide the same. A checkpoint pruned already only has its leftovers deleted (a pass killed half-way); one that
holds nothing but its manifest costs nothing (one listing of checkpoints/ a pass, on S3 too).
"""

from __future__ import annotations

from functools import cache

from stages.registry import instance, is_scheduled, stage_state
from storage.fs import join, listing_prefix
from storage.layout import manifest_path_for
from storage.manifest import read_manifest
from storage.retention import LEVELS, prune_checkpoint
from storage.run import Run


def held_files(run: Run) -> dict[int, set[str]]:
    """Iteration -> the names its checkpoint folder holds, from one listing of checkpoints/ (the base model and
    scratch folders left out): a pass reads no manifest of a checkpoint that holds nothing but it."""
    fs, folder = run.fs, join(run.layout.run_dir, "checkpoints")
    prefix = listing_prefix(fs, folder)
    held: dict[int, set[str]] = {}
    for path in fs.find(folder):
        name, _, relative = path.removeprefix(prefix).partition("/")
        if name.startswith("iter=") and relative:
            held.setdefault(int(name.removeprefix("iter=")), set()).add(relative)
    return held


def retention_plan(run: Run) -> dict[int, str]:
    """Iteration -> how far its checkpoint is to be pruned now ("optimizer" or "checkpoint"), for each checkpoint
    below the newest trained one that is to be pruned or still holds files a pruning marked; others are absent."""
    train, iterations = run.config.train, run.config.iterations
    if train.keep_checkpoints is None and train.keep_optimizer_states is None:
        return {}

    @cache
    def done(stage: str, iteration: int) -> bool:
        return stage_state(run, instance(stage, iteration)).done

    held = held_files(run)
    # The newest checkpoint whose train stage is done for the current config: what a resume trains from.
    last = next((k for k in sorted(held, reverse=True) if k < iterations and done("train", k)), None)
    plan: dict[int, str] = {}
    for j in sorted(k for k in held if last is not None and k < last and held[k] != {"manifest.json"}):
        manifest = read_manifest(run.fs, manifest_path_for(run.layout.checkpoint_dir(j), "checkpoint"))
        if manifest is None:
            continue
        next_train_pending = not done("train", j + 1)
        sampler_of = j + 1 + run.config.pipeline.max_staleness
        keep_optimizer = (train.keep_optimizer_states is None or j > last - train.keep_optimizer_states
                          or next_train_pending)
        keep_weights = (keep_optimizer or train.keep_checkpoints is None or j > last - train.keep_checkpoints
                        or is_scheduled(run.config, "evaluate", j)
                        or (sampler_of < iterations and not done("train", sampler_of)))
        level = "checkpoint" if not keep_weights else "optimizer" if not keep_optimizer else ""
        if level or manifest.pruned:  # pruned before stays pruned (nothing comes back); the deeper level wins
            plan[j] = max(level, manifest.pruned, key=lambda name: LEVELS.index(name) if name else -1)
    return plan


def prune_checkpoints(run: Run) -> dict[int, str]:
    """Apply `retention_plan`: each checkpoint's manifest is marked first, then its files go (what a pass killed
    half-way left is deleted too). Returns the checkpoints pruned further by this pass, and how far."""
    run.fs.invalidate_cache()  # other processes wrote the manifests this pass reads
    pruned = {}
    for iteration, level in retention_plan(run).items():
        if prune_checkpoint(run.fs, manifest_path_for(run.layout.checkpoint_dir(iteration), "checkpoint"), level):
            pruned[iteration] = level
    return pruned
