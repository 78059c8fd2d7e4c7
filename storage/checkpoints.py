"""Checkpoint directories: content hashes, upload with per-file hashes, verified download.

A checkpoint's content hash (the `policy_version` stamped on every rollout it generates) is the sha256 of
the sorted list of (relative path, file sha256) of the files that define what the model does: weights,
config, tokenizer. Optimizer state is left out, so saving it (or not) does not change the policy's identity.
Every file, optimizer state included, goes into the manifest's `files` with its own hash, so a download is
verified file by file and a tampered or truncated file is named.

The per-file hashes are cached in a sidecar keyed on (size, mtime_ns), so hashing an unchanged directory
again is free. The trainer fills that cache as it saves (`HashWhileWriting`): each finished file is hashed in a
background thread while the next one is written, and the optimizer state is read back and hashed as it grows,
so the hashes of a 1.6 GB checkpoint overlap its save (which waits on the disk) instead of following it
(~0.9 s). A skipped step's copy keeps its source's hashes. Uncached files are hashed in parallel threads
(hashlib lets go of the GIL).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from storage.fs import atomic_put_file
from storage.manifest import Manifest, sha256_file

HASH_CACHE_NAME = ".rlpipe-hashes.json"
EXCLUDED = {"manifest.json", HASH_CACHE_NAME}
# The files that define what a model does (the policy identity).
POLICY_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "config.json", "generation_config.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
)
# The optimizer state a train stage resumes from (stages/rl/checkpoint.py, critic.py, deepspeed_backend.py): only
# the next train stage reads it, so retention may delete it from a checkpoint whose weights it keeps.
OPTIMIZER_PATTERNS = ("optimizer.pt", "critic/optimizer.pt", "deepspeed/*")


def sha256_local_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _read_cache(local_dir: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((local_dir / HASH_CACHE_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_cache(local_dir: Path, cache: dict[str, dict[str, Any]]) -> None:
    try:
        (local_dir / HASH_CACHE_NAME).write_text(json.dumps(cache))
    except OSError:
        pass  # a read-only model directory is fine: we just hash again next time


def _checkpoint_file(local_dir: Path, path: Path) -> str | None:
    """The relative name of a file that belongs to the checkpoint, or None (manifest, hash cache, dot-files)."""
    relative = path.relative_to(local_dir).as_posix()
    if relative in EXCLUDED or relative.startswith(".") or "/." in relative:
        return None
    return relative


def directory_files(local_dir: Path) -> dict[str, dict[str, Any]]:
    """Relative path -> {"bytes", "sha256"} for every checkpoint file, using the sidecar cache."""
    cache = _read_cache(local_dir)
    files: dict[str, dict[str, Any]] = {}
    to_hash: dict[str, tuple[Path, os.stat_result]] = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        if (relative := _checkpoint_file(local_dir, path)) is None:
            continue
        stat = path.stat()
        cached = cache.get(relative)
        if cached and cached["bytes"] == stat.st_size and cached["mtime_ns"] == stat.st_mtime_ns:
            files[relative] = {"bytes": stat.st_size, "sha256": cached["sha256"]}
        else:
            to_hash[relative] = (path, stat)
    if not to_hash:  # all cached: no threads to start
        return files
    # Largest first, one thread per core: the directory takes about as long as its largest file.
    order = sorted(to_hash, key=lambda relative: -to_hash[relative][1].st_size)
    with ThreadPoolExecutor(max_workers=min(len(order), os.cpu_count() or 1)) as pool:
        digests = dict(zip(order, pool.map(lambda name: sha256_local_file(to_hash[name][0]), order), strict=True))
    for relative, (_, stat) in to_hash.items():
        files[relative] = {"bytes": stat.st_size, "sha256": digests[relative]}
        cache[relative] = {**files[relative], "mtime_ns": stat.st_mtime_ns}
    _write_cache(local_dir, cache)
    return dict(sorted(files.items()))


def _stat_key(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _hash_unchanged(path: Path) -> tuple[os.stat_result, str] | None:
    """(stat, sha256) of a finished file, or None if it changed while it was read."""
    before = path.stat()
    digest = sha256_local_file(path)
    after = path.stat()
    return (after, digest) if _stat_key(before) == _stat_key(after) else None


class _SequentialWriter(io.RawIOBase):
    """A file opened for writing that only appends (no seek, no truncate), so a reader that follows it from
    its start sees every byte exactly once."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__()
        self.handle = handle

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # noqa: ANN401 - any buffer (bytes, memoryview)
        self.handle.write(data)  # a buffered file: writes all of it or raises
        return memoryview(data).nbytes


def _follow(path: Path, finished: threading.Event) -> str:
    """sha256 of a file that another thread is still appending to: read what is there, wait a little when
    caught up, until the writer has closed it (`finished`) and the end is reached. No hand-off per write: on
    a loaded machine each one could cost the writer a scheduler time slice."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            closed = finished.is_set()  # asked before reading: an empty read after it is the true end
            if chunk := handle.read(8 << 20):
                digest.update(chunk)
            elif closed:
                return digest.hexdigest()
            else:
                time.sleep(0.005)


class HashWhileWriting:
    """Hashes a checkpoint directory's files while its writer is still writing others, and leaves the
    hashes in the directory's sidecar cache, keyed on each file's size and mtime as it was hashed, so that
    `checkpoint_digest` (the harness) reads none of them again.

        with HashWhileWriting(out_dir) as hashes:
            model.save_pretrained(out_dir)
            hashes.hash_written()                          # what is on disk now, in a background thread
            with hashes.open("optimizer.pt") as handle:   # hashed as it grows
                torch.save(state, handle)

    A file left unhashed, or changed after it was hashed, is simply hashed by `checkpoint_digest`.
    `waited_seconds`: the wall time the writer spent waiting for hashes, i.e. what hashing still cost it.
    """

    def __init__(self, local_dir: Path) -> None:
        self.local_dir = Path(local_dir)
        self._files = ThreadPoolExecutor(max_workers=1)  # finished files, one after another
        self._stream = ThreadPoolExecutor(max_workers=1)  # the file being written, as it grows
        self._pending: dict[str, Future[tuple[os.stat_result, str] | None]] = {}
        self._done: dict[str, tuple[os.stat_result, str]] = {}
        self._following: dict[str, tuple[os.stat_result, Future[str]]] = {}
        self.waited_seconds = 0.0

    def hash_written(self) -> None:
        """Start hashing every file of the directory that is there now and not hashed yet; they must be
        finished (a file that changes while it is read is left to `checkpoint_digest`)."""
        for path in sorted(p for p in self.local_dir.rglob("*") if p.is_file()):
            relative = _checkpoint_file(self.local_dir, path)
            if relative is not None and relative not in self._pending and relative not in self._done:
                self._pending[relative] = self._files.submit(_hash_unchanged, path)

    def copied(self, source: Path, relative: str) -> None:
        """`relative` was just copied from `source` with its mtime (shutil.copy2): it takes the source's cached
        hash when that still fits the source and the copy has the source's size and mtime, else it is hashed
        in the background."""
        source_stat, path = source.stat(), self.local_dir / relative
        stat = path.stat()
        cached = _read_cache(source.parent).get(source.name)
        if (cached and (cached["bytes"], cached["mtime_ns"]) == _stat_key(source_stat) == _stat_key(stat)):
            self._done[relative] = (stat, cached["sha256"])
        elif relative not in self._pending:
            self._pending[relative] = self._files.submit(_hash_unchanged, path)

    @contextlib.contextmanager
    def open(self, relative: str) -> Iterator[io.RawIOBase]:
        """`relative` in the directory, opened for appending only; a background thread hashes it as it grows."""
        path = self.local_dir / relative
        finished = threading.Event()
        try:
            with open(path, "wb") as handle:
                following = self._stream.submit(_follow, path, finished)
                yield _SequentialWriter(handle)
        finally:
            finished.set()
        self._following[relative] = (path.stat(), following)

    def close(self) -> None:
        """Wait for the hashes under way and record them all in the sidecar cache."""
        started = time.monotonic()
        for relative, pending in self._pending.items():
            if (result := pending.result()) is not None:
                self._done[relative] = result
        for relative, (stat, following) in self._following.items():
            self._done[relative] = (stat, following.result())
        self._pending.clear()
        self._following.clear()
        self.waited_seconds += time.monotonic() - started
        self._files.shutdown()
        self._stream.shutdown()
        cache = _read_cache(self.local_dir)
        for relative, (stat, digest) in self._done.items():
            cache[relative] = {"bytes": stat.st_size, "sha256": digest, "mtime_ns": stat.st_mtime_ns}
        _write_cache(self.local_dir, cache)

    def __enter__(self) -> HashWhileWriting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_policy_file(relative: str) -> bool:
    return "/" not in relative and any(fnmatch.fnmatch(relative, pattern) for pattern in POLICY_PATTERNS)


def is_optimizer_file(relative: str) -> bool:
    return any(fnmatch.fnmatch(relative, pattern) for pattern in OPTIMIZER_PATTERNS)


def digest_of_files(files: dict[str, dict[str, Any]]) -> str:
    """sha256 over the sorted (path, file sha256) lines of the policy-defining files among `files`."""
    lines = "".join(
        f"{relative}\t{info['sha256']}\n" for relative, info in sorted(files.items()) if is_policy_file(relative)
    )
    if not lines:
        raise ValueError("checkpoint holds none of the files that define a model (weights, config, tokenizer)")
    return hashlib.sha256(lines.encode()).hexdigest()


def checkpoint_digest(local_dir: Path) -> tuple[str, dict[str, dict[str, Any]], int]:
    """(content hash, per-file hashes, total bytes) of a local checkpoint directory."""
    files = directory_files(local_dir)
    return digest_of_files(files), files, sum(info["bytes"] for info in files.values())


def publish_checkpoint(fs: fsspec.AbstractFileSystem, local_dir: Path, destination: str) -> None:
    """Put a local checkpoint directory at `destination` (local path or URL), file by file, atomically each.

    The manifest is not written here: the caller writes it last, after every file is in place.
    """
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(local_dir).as_posix()
        if relative in EXCLUDED:
            continue
        atomic_put_file(fs, path, f"{destination}/{relative}")


class CheckpointIntegrityError(RuntimeError):
    pass


def verify_checkpoint(fs: fsspec.AbstractFileSystem, manifest: Manifest) -> list[str]:
    """Names of files that are missing or whose content no longer matches the manifest."""
    problems = []
    for relative, info in sorted(manifest.files.items()):
        path = f"{manifest.path}/{relative}"
        try:
            if fs.size(path) != info["bytes"] or sha256_file(fs, path) != info["sha256"]:
                problems.append(f"{path}: content differs from its manifest")
        except FileNotFoundError:
            problems.append(f"{path}: missing")
    return problems


def fetch_checkpoint(fs: fsspec.AbstractFileSystem, manifest: Manifest, cache_root: Path) -> Path:
    """A local, verified copy of a remote checkpoint, cached by content hash."""
    target = cache_root / manifest.sha256
    if target.is_dir() and directory_files(target) == manifest.files:
        return target
    staging = cache_root / f".{manifest.sha256}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        for relative in manifest.files:
            local = staging / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{manifest.path}/{relative}", str(local))
        files = directory_files(staging)
        bad = [r for r, info in manifest.files.items() if files.get(r, {}).get("sha256") != info["sha256"]]
        if bad:
            raise CheckpointIntegrityError(f"checkpoint {manifest.path}: files differ from manifest: {bad}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target
