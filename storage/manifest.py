"""Manifests: the record that makes an output count, and the mechanism behind resume and audit.

A stage writes its output (temporary name, then move) and writes the manifest last. The manifest names
the stage, its key, the output's size and content hash, its schema version, the content hashes of the
inputs it read, the hash of the config it ran with, the code version, the host and the timings.

The stage key is sha256(stage, config payload, code version, input hashes). A stage is done exactly
when every output's manifest exists, carries the expected key, and the output it describes is still
there with the recorded size. Anything else (no manifest, other key, output deleted) means: run it again.
Because keys are built from the *content* hashes of inputs, rerunning an upstream stage that reproduces
the same bytes does not invalidate anything downstream; one that changes them invalidates everything
downstream. A fork (`rlpipe fork`) shares outputs by a manifest of its own with `shared_from`
(storage/sharing.py).

A manifest's `path` is where its output's bytes are: every reader reads them there. It is the output's own
place in its run, except for a fork's output shared by reference (an object store, where there are no hard
links): the files of the run that computed it (`Manifest.by_reference`); `located` gives a reader that starts
from a run's layout the place to read.

The code version in the key is the package version (not the git commit), so that resuming a run after a
bug-fix commit does not redo finished iterations; the git commit is still recorded for audit.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import fsspec

from storage.fs import atomic_write_bytes
from storage.layout import manifest_path_for

MANIFEST_VERSION = 1


@lru_cache(maxsize=1)
def code_version() -> str:
    try:
        return metadata.version("rlpipe")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def stage_key(stage: str, config_payload: dict[str, Any], input_hashes: dict[str, str]) -> str:
    payload = json.dumps(
        {"stage": stage, "config": config_payload, "code": code_version(), "inputs": input_hashes},
        sort_keys=True, separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def config_hash(config_payload: dict[str, Any]) -> str:
    payload = json.dumps(config_payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Manifest:
    stage: str
    key: str
    kind: str  # table | checkpoint
    path: str  # the output's full path (local path or URL)
    sha256: str
    bytes: int
    rows: int | None = None
    schema: str | None = None  # e.g. "rollouts/v1"
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> content sha256
    config_hash: str = ""
    code_version: str = field(default_factory=code_version)
    git_commit: str | None = field(default_factory=git_commit)
    host: str = field(default_factory=socket.gethostname)
    started_at: str = ""
    ended_at: str = ""
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # checkpoints: relative path -> bytes, sha256
    # A fork's output shared with the run that computed it: {"run", "path"} there (storage/sharing.py)
    shared_from: dict[str, str] | None = None
    # Retention (storage/retention.py): "" whole, "optimizer" its optimizer state deleted, "checkpoint" every file
    # deleted; the deleted files move from `files` to `pruned_files`, so the size check vouches only for the rest.
    pruned: str = ""
    pruned_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    manifest_version: int = MANIFEST_VERSION

    @property
    def by_reference(self) -> bool:
        """A fork's output shared by reference (storage/sharing.py): `path` is the origin's file or directory,
        and the fork's own place holds nothing but this manifest."""
        return self.shared_from is not None and self.shared_from.get("path") == self.path

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> Manifest:
        try:
            values = json.loads(data)
            return cls(**values)
        except (json.JSONDecodeError, TypeError) as error:
            raise ValueError(f"manifest {source} is unreadable: {error}") from None


def write_manifest(fs: fsspec.AbstractFileSystem, manifest_path: str, manifest: Manifest) -> None:
    atomic_write_bytes(fs, manifest_path, manifest.to_json())


def read_manifest(fs: fsspec.AbstractFileSystem, manifest_path: str) -> Manifest | None:
    """The manifest at `manifest_path`, or None when there is none (or it is unreadable: then the stage reruns)."""
    try:
        data = fs.cat_file(manifest_path)
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_json(data, manifest_path)
    except ValueError:
        return None


def located(fs: fsspec.AbstractFileSystem, path: str, kind: str = "table") -> str:
    """Where to read the output whose place in its run is `path` (a layout path): its manifest's `path` when that
    is another run's file (a fork's share by reference), else `path` itself."""
    manifest = read_manifest(fs, manifest_path_for(path, kind))
    return manifest.path if manifest is not None and manifest.by_reference else path


def output_damage(fs: fsspec.AbstractFileSystem, manifest: Manifest) -> str | None:
    """What is wrong with the output a manifest describes (a missing file, a size that changed), or None.

    A cheap check (sizes, not hashes): it runs for every input of every stage.
    """
    files = (
        {f"{manifest.path}/{relative}": info["bytes"] for relative, info in manifest.files.items()}
        if manifest.kind == "checkpoint"
        else {manifest.path: manifest.bytes}
    )
    for path, size in files.items():
        try:
            actual = fs.size(path)
        except FileNotFoundError:
            return f"{path} is missing"
        if actual != size:
            return f"{path} has {actual} bytes, its manifest says {size}"
    return None


def output_intact(fs: fsspec.AbstractFileSystem, manifest: Manifest) -> bool:
    return output_damage(fs, manifest) is None


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
