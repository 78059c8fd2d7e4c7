"""Lineage: the chain of outputs behind an iteration, from the base model and the dataset, verified.

Every manifest names the content hashes of its inputs. `trace` follows them back from one iteration's outputs
to the base model and the prompts table, resolving each hash to the output of the same run that has it: the
manifests are the graph, so the chain is what happened, resumes and reruns included. `verify` re-hashes every
file on the chain against its manifest (a checkpoint file by file, the base model directory when it is on
this machine). Problems, each naming the file: missing (a manifest whose file is gone), modified (bytes that
no longer hash to the manifest), unresolved input (an input hash no output of the run has any more: the
input was rewritten since, so this output is stale and the flow would redo it). A fork's shared output is its
own file (a hard link), or on S3 the origin's file its manifest refers to, and its manifest names the run it is
shared from (`shared_from`), which lineage reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from schemas.config import ConfigError
from storage.catalog import CatalogEntry, list_outputs
from storage.checkpoints import digest_of_files, verify_checkpoint
from storage.fs import filesystem, join, normalize_root
from storage.layout import BASE, RunLayout
from storage.manifest import Manifest, sha256_file
from storage.run import read_run_config

# Display order of stages within an iteration (run-level first).
STAGE_ORDER = ("prompts", "base_model", "evaluate_base", "generate", "score", "advantage", "train", "evaluate")
Verify = Literal["hash", "size", "none"]


@dataclass
class Node:
    entry: CatalogEntry
    inputs: dict[str, str | None] = field(default_factory=dict)  # input name -> label of the node, None unresolved
    check: str = "not checked"  # ok | missing | modified | unverified | pruned | not checked
    details: list[str] = field(default_factory=list)
    hashed_bytes: int = 0

    @property
    def manifest(self) -> Manifest:
        return self.entry.manifest

    @property
    def label(self) -> str:
        name = self.entry.name if self.entry.name != "checkpoint" else "checkpoint"
        if self.entry.name == "checkpoint" and self.entry.iteration == BASE:
            return "base model"
        return f"{self.entry.where}/{name}" if self.entry.iteration is not None else name

    def sort_key(self) -> tuple[int, int, str]:
        iteration = -2 if self.entry.iteration is None else self.entry.iteration
        stage = STAGE_ORDER.index(self.manifest.stage) if self.manifest.stage in STAGE_ORDER else len(STAGE_ORDER)
        return iteration, stage, self.entry.name


@dataclass
class Lineage:
    root: str
    run_id: str
    iteration: int
    nodes: list[Node]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # the run config's data section (where the prompts came from)

    @property
    def ok(self) -> bool:
        return not self.problems

    def node(self, label: str) -> Node:
        return next(n for n in self.nodes if n.label == label)


def _resolve(index: dict[str, list[CatalogEntry]], name: str, sha: str, iteration: int | None) -> CatalogEntry | None:
    """The output with content hash `sha` that input `name` of an output at `iteration` refers to.

    The same bytes can be two outputs (two identical tables): prefer the one whose kind matches the input's
    name ("policy" is a checkpoint), then the latest one not after the consumer.
    """
    candidates = index.get(sha, [])
    if not candidates:
        return None

    def rank(entry: CatalogEntry) -> tuple[int, int, int]:
        matches = entry.name == name or (name == "policy" and entry.name == "checkpoint")
        position = -2 if entry.iteration is None else entry.iteration
        not_after = iteration is None or position <= iteration
        return int(matches), int(not_after), position

    return max(candidates, key=rank)


def trace(root: str, run_id: str, iteration: int) -> Lineage:
    """Every output the outputs of `iteration` were made from, transitively (no file contents read)."""
    root = normalize_root(root)
    listing = list_outputs(root, [run_id])
    entries = listing.all_entries() + listing.damaged
    if not entries:
        raise FileNotFoundError(f"run {run_id} has no outputs under {join(root, 'runs', run_id)}")
    index: dict[str, list[CatalogEntry]] = {}
    for entry in entries:
        index.setdefault(entry.manifest.sha256, []).append(entry)
    leaves = [e for e in entries if e.iteration == iteration]
    if not leaves:
        have = sorted({e.iteration for e in entries if e.iteration is not None and e.iteration >= 0})
        raise FileNotFoundError(
            f"run {run_id} has no outputs for iteration {iteration} (iterations with outputs: {have})"
        )
    lineage = Lineage(root, run_id, iteration, nodes=[])
    seen: dict[str, Node] = {}  # by entry url
    stack = list(leaves)
    while stack:
        entry = stack.pop()
        if entry.url in seen:
            continue
        node = Node(entry)
        seen[entry.url] = node
        for name, sha in sorted(entry.manifest.inputs.items()):
            source = _resolve(index, name, sha, entry.iteration)
            if source is None:
                node.inputs[name] = None
                lineage.problems.append(
                    f"unresolved input: {node.label} was made from {name} {sha[:12]}, which no output of run "
                    f"{run_id} has any more ({name} was rewritten after it: {node.label} is stale)"
                )
                continue
            node.inputs[name] = Node(source).label
            stack.append(source)
    lineage.nodes = sorted(seen.values(), key=Node.sort_key)
    lineage.data = _data_section(root, run_id)
    return lineage


def _data_section(root: str, run_id: str) -> dict:
    """The run's data sources as its config names them; empty when it has no config that parses."""
    try:
        return read_run_config(RunLayout.create(root, run_id)).data.model_dump(mode="json")
    except ConfigError:
        return {}


def _check_table(node: Node, mode: Verify) -> None:
    entry, manifest = node.entry, node.manifest
    if entry.problem:
        check, why = entry.problem.split(": ", 1)
        node.check, node.details = check, [f"{entry.url}: {why}"]
        return
    fs = filesystem(entry.url)
    if mode == "size":
        node.check = "ok" if fs.size(entry.url) == manifest.bytes else "modified"
    else:
        node.hashed_bytes = manifest.bytes
        node.check = "ok" if sha256_file(fs, entry.url) == manifest.sha256 else "modified"
    if node.check == "modified":
        node.details.append(f"{entry.url}: content differs from its manifest (sha256 {manifest.sha256[:12]})")


def _check_files(node: Node, directory: str, files: dict[str, dict], mode: Verify, local: bool) -> None:
    """Check a checkpoint directory file by file against `files` (relative path -> bytes, sha256)."""
    fs = filesystem("/" if local else directory)
    manifest = replace(node.manifest, path=directory, files=files)
    if digest_of_files(files) != manifest.sha256:
        node.details.append(f"{directory}: the manifest's file list does not hash to its sha256 (manifest edited?)")
    if mode == "size":
        for relative, info in sorted(files.items()):
            path = f"{directory}/{relative}"
            if not fs.exists(path):
                node.details.append(f"{path}: missing")
            elif fs.size(path) != info["bytes"]:
                node.details.append(f"{path}: content differs from its manifest")
    else:
        node.details += verify_checkpoint(fs, manifest)
        node.hashed_bytes = sum(info["bytes"] for info in files.values())
    if not node.details:
        node.check = "ok"
    else:
        node.check = "missing" if all(d.endswith(": missing") for d in node.details) else "modified"


def _check_checkpoint(node: Node, mode: Verify, warnings: list[str]) -> None:
    entry, manifest = node.entry, node.manifest
    local_path = manifest.metrics.get("local_path")
    if local_path:
        # The base model lives outside the run, on the machine that resolved it: verify it where it is here.
        files = manifest.metrics.get("files") or {}
        if not Path(local_path).is_dir():
            node.check = "unverified"
            warnings.append(f"base model directory {local_path} is not on this machine: its files were not checked")
            return
        _check_files(node, local_path, files, mode, local=True)
        return
    if manifest.pruned == "checkpoint":  # retention deleted its files on purpose; its manifest is the record
        node.check = "pruned"
        warnings.append(f"{node.label} was pruned (train.keep_checkpoints): its files were not checked")
        return
    directory = entry.files_url
    _check_files(node, directory, manifest.files, mode, local=False)  # an optimizer-pruned one: what is left


def verify(lineage: Lineage, mode: Verify = "hash") -> Lineage:
    """Check every node's files against its manifest; problems name each bad file."""
    if mode == "none":
        return lineage
    for node in lineage.nodes:
        if node.entry.name == "checkpoint":
            _check_checkpoint(node, mode, lineage.warnings)
        else:
            _check_table(node, mode)
        lineage.problems += [f"{node.check}: {detail}" for detail in node.details]
    return lineage


def lineage(root: str, run_id: str, iteration: int, mode: Verify = "hash") -> Lineage:
    """`trace` then `verify`: what `rlpipe lineage RUN ITER` prints."""
    return verify(trace(root, run_id, iteration), mode)


def describe(node: Node) -> str:
    """One line about what the output is: rows, files, or where the base model lives."""
    manifest = node.manifest
    if manifest.rows is not None:
        return f"{manifest.rows} rows"
    if manifest.metrics.get("local_path"):
        return f"{manifest.metrics.get('name_or_path', '')} at {manifest.metrics['local_path']}"
    return f"{len(manifest.files)} files, {manifest.bytes / 1e6:.1f} MB"


def to_dict(result: Lineage) -> dict:
    """A JSON-able form of the lineage (for `--json` and for scripts)."""
    return {
        "run_id": result.run_id, "iteration": result.iteration, "ok": result.ok, "data": result.data,
        "problems": result.problems, "warnings": result.warnings,
        "nodes": [
            {"label": n.label, "stage": n.manifest.stage, "url": n.entry.url, "sha256": n.manifest.sha256,
             "rows": n.manifest.rows, "bytes": n.manifest.bytes, "inputs": n.inputs, "check": n.check,
             "details": n.details, "shared_from": n.manifest.shared_from}
            for n in result.nodes
        ],
    }


def to_json(result: Lineage) -> str:
    return json.dumps(to_dict(result), indent=2, sort_keys=True)
