"""Checkpoint retention, the mechanics: prune a checkpoint (all its files, or only its optimizer state) so that
no manifest ever vouches for a deleted file, refuse a pruned checkpoint by its iteration, measure a run's disk.

Pruning is two steps, in this order: (1) the manifest is rewritten, atomically, with the files to delete moved
from `files` to `pruned_files` and `pruned` set ("optimizer" or "checkpoint"); (2) the files are deleted. A kill
before (1) leaves the checkpoint whole; a kill after it leaves a manifest that says pruned, so the checkpoint is
never used again, and the next pass deletes what is left (`prune_checkpoint` again, or `finish_pruning`). The
manifest keeps its content hash (`sha256`): the keys of the stages that read the checkpoint, and of the stage
that wrote it, are built from it and stay valid, so no stage reruns because a checkpoint was pruned on purpose
(`output_damage` checks only `files`). Using a pruned checkpoint is refused instead: `require_unpruned`.
Which checkpoints to prune is the pipeline's policy (stages/retention.py); tables are never pruned. A run's
retention does not know its forks: on S3, where a fork's shared checkpoint is the origin's files, the fork's next
use refuses the pruned files by name (storage/sharing.py); a local fork keeps them (hard links).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import fsspec

from schemas.errors import InputError
from storage.checkpoints import is_optimizer_file
from storage.fs import is_remote, join, listing_prefix
from storage.layout import RunLayout, manifest_path_for
from storage.manifest import Manifest, read_manifest, write_manifest

LEVELS = ("optimizer", "checkpoint")  # what a prune deletes, the lesser first


class CheckpointPruned(InputError):
    """A stage (or a person) asked for a checkpoint, or its optimizer state, that retention deleted."""


def checkpoint_name(manifest: Manifest) -> str:
    """`iteration 3` for `.../checkpoints/iter=0003`: how errors name a checkpoint."""
    name = manifest.path.rstrip("/").rpartition("/")[2]
    return f"iteration {int(name.removeprefix('iter='))}" if name.startswith("iter=") else name


def require_unpruned(manifest: Manifest, optimizer: bool = False) -> None:
    """Raise CheckpointPruned, naming the iteration, when the checkpoint's weights (or, with `optimizer`, its
    optimizer state) were pruned by train.keep_checkpoints / train.keep_optimizer_states."""
    if manifest.pruned == "checkpoint" or (optimizer and manifest.pruned == "optimizer"):
        what = "its optimizer state was" if manifest.pruned == "optimizer" else "it was"
        setting = "train.keep_optimizer_states" if manifest.pruned == "optimizer" else "train.keep_checkpoints"
        raise CheckpointPruned(
            f"the checkpoint of {checkpoint_name(manifest)} ({manifest.path}) cannot be used: {what} pruned "
            f"({setting}); its tables and manifest remain. Start from a kept checkpoint, or raise {setting} in "
            "future runs"
        )


def _to_delete(manifest: Manifest, level: str) -> dict[str, dict]:
    if level == "checkpoint":
        return dict(manifest.files)
    return {relative: info for relative, info in manifest.files.items() if is_optimizer_file(relative)}


def prune_checkpoint(fs: fsspec.AbstractFileSystem, manifest_path: str, level: str) -> dict[str, dict]:
    """Prune the checkpoint whose manifest is at `manifest_path` to `level` ("optimizer": its optimizer state;
    "checkpoint": every file), manifest first, then the files. Returns the files newly marked pruned: none when
    there is no manifest, when it was pruned that far already (its leftovers are still deleted), or when there is
    nothing at that level (no optimizer state saved: nothing is marked, so nothing is refused)."""
    if level not in LEVELS:
        raise ValueError(f"prune level {level!r} is not one of {LEVELS}")
    manifest = read_manifest(fs, manifest_path)
    if manifest is None or manifest.kind != "checkpoint":
        return {}
    marking = _to_delete(manifest, level)
    if marking:  # only ever deeper: a wholly pruned one has no files left to mark
        manifest.files = {r: info for r, info in manifest.files.items() if r not in marking}
        manifest.pruned_files = {**manifest.pruned_files, **marking}
        manifest.pruned = level
        write_manifest(fs, manifest_path, manifest)  # (1): from here on the checkpoint is refused
    finish_pruning(fs, manifest)  # (2)
    return marking


def finish_pruning(fs: fsspec.AbstractFileSystem, manifest: Manifest) -> list[str]:
    """Delete whatever a pruned checkpoint still holds of its pruned files (all of them after a kill in
    between); a wholly pruned one keeps nothing but its manifest (a local hash cache goes too). One listing, so a
    checkpoint pruned long ago costs one request a pass. Returns what was deleted (as the listing names it). A
    fork's checkpoint shared by reference deletes nothing: its files are the run's that computed them."""
    if manifest.by_reference:
        return []
    folder = listing_prefix(fs, manifest.path)
    present = sorted(fs.find(manifest.path))
    if manifest.pruned == "checkpoint":
        deleting = [path for path in present if path != folder + "manifest.json"]
    else:
        deleting = [path for path in present if path.removeprefix(folder) in manifest.pruned_files]
    for path in deleting:
        _delete(fs, path)
    return deleting


def _delete(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """One deletion step of a prune: one file."""
    fs.rm_file(path)


@dataclass(frozen=True)
class DiskUsage:
    """What a run holds on its storage root, and what retention freed. `free_bytes` is None on S3."""

    table_bytes: int  # everything outside checkpoints/: tables, manifests, reports, logs
    checkpoint_bytes: int  # what checkpoints/ holds now
    checkpoints_kept: int  # checkpoints with their weights (the base model's manifest only points at it)
    checkpoints_pruned: int
    optimizer_states_pruned: int  # checkpoints whose weights are kept but whose optimizer state was pruned
    pruned_bytes: int
    free_bytes: int | None


def disk_usage(layout: RunLayout, iterations: int) -> DiskUsage:
    """The run's files on its root (one listing), and its checkpoint manifests' pruned files."""
    fs = layout.fs
    checkpoints_dir = listing_prefix(fs, join(layout.run_dir, "checkpoints"))
    table_bytes = checkpoint_bytes = 0
    for path, info in fs.find(layout.run_dir, detail=True).items():
        if path.startswith(checkpoints_dir):
            checkpoint_bytes += int(info.get("size") or 0)
        else:
            table_bytes += int(info.get("size") or 0)
    kept = pruned = optimizer_pruned = pruned_bytes = 0
    for iteration in range(iterations):
        manifest = read_manifest(fs, manifest_path_for(layout.checkpoint_dir(iteration), "checkpoint"))
        if manifest is None:
            continue
        pruned_bytes += sum(int(info["bytes"]) for info in manifest.pruned_files.values())
        pruned += manifest.pruned == "checkpoint"
        kept += manifest.pruned != "checkpoint"
        optimizer_pruned += manifest.pruned == "optimizer"
    free = None if is_remote(layout.root) else shutil.disk_usage(layout.root).free
    return DiskUsage(table_bytes, checkpoint_bytes, kept, pruned, optimizer_pruned, pruned_bytes, free)
