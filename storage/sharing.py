"""Outputs one run shares with another (`rlpipe fork`): the origin's files, under a manifest of the fork's own.

The fork's manifest for a shared output is the origin's with `shared_from` (the run that computed it and the file
there; a share of a share keeps the first origin) and with `path` where the bytes are (storage/manifest.py: every
reader reads an output at its manifest's `path`). On a local root they are hard links in the fork's own paths (a
link is no copy: one set of blocks, two names), so the origin's files may later be deleted or pruned and the fork
keeps the data. On an object store, which has no links, nothing is written but the manifest: its `path` is the
origin's file or checkpoint directory (`Manifest.by_reference`), so the stages, checkpoint downloads, the catalog,
lineage, status and retention all read the origin's objects without a copy. What neither survives: a change of the
shared bytes in place, a lost name in the fork, and on S3 the origin's files deleted or pruned (the origin's
retention does not know its forks). So a fork's shared outputs are re-hashed when the fork is driven
(`verify_shared`), and a stage whose shared output is damaged refuses to redo it (`refuse_lost_share`): rerunning
it would silently replace the origin's data with other data; the refusal names the missing file.
"""

from __future__ import annotations

import os
from dataclasses import replace

import fsspec

from schemas.errors import InputError
from storage.checkpoints import verify_checkpoint
from storage.fs import is_remote
from storage.layout import RunLayout, manifest_path_for
from storage.manifest import Manifest, output_damage, read_manifest, sha256_file, write_manifest


def share_output(fs: fsspec.AbstractFileSystem, source: Manifest, source_run: str, destination: str) -> Manifest:
    """Share the output `source` describes (its `path` where its bytes are now) at `destination`, the fork's place
    for it, and write the fork's manifest there; returns that manifest. Locally the table file, or every file of a
    checkpoint directory but its manifest, is hard-linked to `destination`; on an object store the manifest refers
    to `source.path`. A share of a share keeps the first origin: the run whose stage computed the bytes."""
    origin = source.shared_from or {"run": source_run, "path": source.path}
    if is_remote(destination):  # by reference: the bytes stay where they are
        shared = replace(source, shared_from=origin)
    else:
        _link_output(source, destination)
        shared = replace(source, path=destination, shared_from=origin)
    write_manifest(fs, manifest_path_for(destination, source.kind), shared)
    return shared


def _link_output(source: Manifest, destination: str) -> None:
    """Hard-link a table file, or every file of a checkpoint directory but its manifest, to `destination`."""
    if source.kind != "checkpoint":
        _link(source.path, destination)
        return
    os.makedirs(destination, exist_ok=True)
    for parent, _, names in os.walk(source.path):
        for name in names:
            relative = os.path.relpath(os.path.join(parent, name), source.path)
            if relative != "manifest.json":
                _link(os.path.join(source.path, relative), os.path.join(destination, relative))


def _link(source: str, destination: str) -> None:
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    if os.path.lexists(destination):  # a fork killed mid-way and started again
        os.unlink(destination)
    os.link(source, destination)


def shared_damage(fs: fsspec.AbstractFileSystem, manifest: Manifest, hashes: bool = True) -> str | None:
    """What is wrong with a shared output (missing, another size, with `hashes` other bytes), or None."""
    if (damage := output_damage(fs, manifest)) is not None or not hashes:
        return damage
    if manifest.kind == "checkpoint":
        return next(iter(verify_checkpoint(fs, manifest)), None)
    if sha256_file(fs, manifest.path) != manifest.sha256:
        return f"{manifest.path}: content differs from its manifest (sha256 {manifest.sha256[:12]})"
    return None


def describe_lost(run_id: str, manifest: Manifest, damage: str) -> str:
    """The one line a lost or changed shared output gets."""
    origin = manifest.shared_from or {}
    return (f"run {run_id} shares {manifest.stage}'s output with run {origin.get('run')} "
            f"({origin.get('path')}), and it is lost or changed: {damage}; the fork cannot go on without "
            "those bytes (rerunning the stage would give other data): fork again from a run that has them")


def refuse_lost_share(fs: fsspec.AbstractFileSystem, run_id: str, manifest_paths: list[str]) -> None:
    """An InputError when one of these manifests (a stage instance's outputs) is a damaged share."""
    for path in manifest_paths:
        manifest = read_manifest(fs, path)
        if manifest is not None and manifest.shared_from and (damage := output_damage(fs, manifest)):
            raise InputError(describe_lost(run_id, manifest, damage))


def verify_shared(fs: fsspec.AbstractFileSystem, run_id: str, manifests: list[Manifest]) -> None:
    """Re-hash every shared output among `manifests` (a run's, before it is driven); an InputError naming the
    first one that is missing or whose bytes changed."""
    for manifest in manifests:
        if manifest.shared_from and (damage := shared_damage(fs, manifest)):
            raise InputError(describe_lost(run_id, manifest, damage))


def verify_run_shares(layout: RunLayout) -> None:
    """`verify_shared` over every output manifest of the run at `layout` (none shared: nothing is hashed)."""
    from storage.catalog import list_outputs  # DuckDB: not imported by every stage process that imports this

    listing = list_outputs(layout.root, [layout.run_id])
    verify_shared(layout.fs, layout.run_id, [entry.manifest for entry in listing.all_entries() + listing.damaged])
