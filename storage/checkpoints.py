"""Checkpoint directories: content hashes, upload with per-file hashes, verified download.

A checkpoint's content hash (the `policy_version` stamped on every rollout it generates) is the sha256 of
the sorted list of (relative path, file sha256) of the files that define what the model does: weights,
config, tokenizer. Optimizer state is left out, so saving it (or not) does not change the policy's identity.
Every file, optimizer state included, goes into the manifest's `files` with its own hash, so a download is
verified file by file and a tampered or truncated file is named.

sha256 runs at ~1.1 GB/s a core here (SHA-NI): the files of a directory are hashed in parallel threads
(hashlib lets go of the GIL), so a trainer checkpoint of 0.54 GB weights and 1.08 GB optimizer state takes as
long as its largest file, ~0.95 s instead of 1.45 s. The per-file hashes are cached in a sidecar keyed on
(size, mtime_ns), so hashing the same unchanged directory again is free.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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


def sha256_local_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def directory_files(local_dir: Path) -> dict[str, dict[str, Any]]:
    """Relative path -> {"bytes", "sha256"} for every checkpoint file, using the sidecar cache."""
    cache_path = local_dir / HASH_CACHE_NAME
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    files: dict[str, dict[str, Any]] = {}
    to_hash: dict[str, tuple[Path, os.stat_result]] = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(local_dir).as_posix()
        if relative in EXCLUDED or relative.startswith(".") or "/." in relative:
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
    try:
        cache_path.write_text(json.dumps(cache))
    except OSError:
        pass  # a read-only model directory is fine: we just hash again next time
    return dict(sorted(files.items()))


def is_policy_file(relative: str) -> bool:
    return "/" not in relative and any(fnmatch.fnmatch(relative, pattern) for pattern in POLICY_PATTERNS)


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
