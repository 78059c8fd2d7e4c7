"""File systems behind a storage root: a local folder or `s3://bucket/prefix`, through fsspec.

Everything rlpipe writes goes through `atomic_write_bytes` / `atomic_put_file`: the data is written under a
temporary name beside its destination and then moved into place, so a reader never sees half a file. On
a local disk the move is a rename (atomic). On S3 a "move" is copy + delete, and a PUT is atomic by itself,
so there the object is written directly; what makes S3 safe is that readers trust only outputs whose
manifest exists, and the manifest is written last (see storage/manifest.py).

S3 settings come from the usual environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) plus
`RLPIPE_S3_ENDPOINT_URL` for S3-compatible servers (MinIO, moto).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from schemas import settings


def is_remote(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


@lru_cache(maxsize=8)
def _s3_filesystem(endpoint_url: str | None) -> fsspec.AbstractFileSystem:
    import s3fs

    client_kwargs = {"endpoint_url": endpoint_url} if endpoint_url else {}
    # Retries with backoff on connection errors and 5xx: a briefly unavailable S3 server is not a crash.
    config_kwargs = {"retries": {"max_attempts": 8, "mode": "standard"}}
    return s3fs.S3FileSystem(client_kwargs=client_kwargs, config_kwargs=config_kwargs, skip_instance_cache=True)


def filesystem(root: str) -> fsspec.AbstractFileSystem:
    if root.startswith("s3://"):
        return _s3_filesystem(settings.S3_ENDPOINT_URL.get())
    if is_remote(root):
        return fsspec.filesystem(root.split("://", 1)[0])
    return LocalFileSystem(auto_mkdir=True)


def normalize_root(root: str) -> str:
    """Absolute local path, or the URL unchanged; no trailing slash."""
    if is_remote(root):
        return root.rstrip("/")
    return str(Path(root.removeprefix("file://")).expanduser().resolve())


def join(*parts: str) -> str:
    return "/".join(part.strip("/") if i else part.rstrip("/") for i, part in enumerate(parts))


def listing_prefix(fs: fsspec.AbstractFileSystem, folder: str) -> str:
    """How `fs.find(folder)` names what is under `folder`, up to the relative path: without the URL's protocol
    (`bucket/key/` on S3), with a trailing slash."""
    return fs._strip_protocol(folder).rstrip("/") + "/"


def temporary_prefix(path: str) -> str:
    """Name prefix of the temporaries written on the way to `path` (`.<name>.tmp-`): the next attempt of the
    stage that owns `path` recognises what a killed attempt left behind by it."""
    return f".{path.rstrip('/').rpartition('/')[2]}.tmp-"


def _temporary_sibling(path: str) -> str:
    directory = path.rstrip("/").rpartition("/")[0]
    return f"{directory}/{temporary_prefix(path)}{uuid.uuid4().hex[:12]}"


class StorageWriteError(OSError):
    """A write to the storage root failed (disk full, read-only, no permission); names the destination."""


def describe_os_error(error: OSError) -> str:
    """One line: what failed and where (`StorageWriteError` names its destination in its message)."""
    reason = error.strerror or str(error) or type(error).__name__
    return f"{reason}: {error.filename}" if error.filename else reason


@contextmanager
def _local_temporary(fs: LocalFileSystem, path: str) -> Iterator[str]:
    """A temporary name beside `path` to write to; moved onto `path` when the block succeeds, removed when it
    fails. A failing write is raised as StorageWriteError naming `path` (an ENOSPC from `write` names nothing)."""
    temporary = _temporary_sibling(path)
    try:
        fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        yield temporary
        os.replace(temporary, path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, OSError) and not isinstance(error, StorageWriteError):
            raise StorageWriteError(error.errno, f"cannot write {path}: {describe_os_error(error)}") from error
        raise


def atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    if isinstance(fs, LocalFileSystem):
        with _local_temporary(fs, path) as temporary, open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    else:
        fs.pipe_file(path, data)


def atomic_put_file(fs: fsspec.AbstractFileSystem, local_path: str | Path, path: str) -> None:
    """Copy a local file to `path` on `fs` without ever exposing a partial file under `path`."""
    if isinstance(fs, LocalFileSystem):
        with _local_temporary(fs, path) as temporary:
            fs.put_file(str(local_path), temporary)
    else:
        fs.put_file(str(local_path), path)
