"""One driver per run: a lock that a second `rlpipe run/resume` on the same run cannot take.

Local roots use `flock` on `runs/<run>/run.lock`: the kernel releases it when the holder dies, even by
SIGKILL, so a crashed driver never blocks a resume. The file records who holds it, so the refusal names
the holder. Remote (S3) roots use a lease object with an expiry that the holder renews; a lease whose
holder stopped renewing is taken over after it expires.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from storage.fs import atomic_write_bytes, is_remote
from storage.layout import RunLayout


class RunLocked(RuntimeError):
    pass


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": datetime.now(UTC).isoformat()}


@contextmanager
def _local_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunLocked(f"run is being driven by another process ({holder}); lock file {path}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()
        yield
    finally:
        handle.close()


@contextmanager
def _lease_lock(layout: RunLayout, ttl_s: float) -> Iterator[None]:
    fs, path = layout.fs, layout.lock_path()
    try:
        current = json.loads(fs.cat_file(path))
        if current.get("expires", 0) > time.time():
            raise RunLocked(f"run is being driven by {current.get('host')}:{current.get('pid')} (lease {path})")
    except FileNotFoundError:
        pass
    me = _holder()
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 3):
            atomic_write_bytes(fs, path, json.dumps({**me, "expires": time.time() + ttl_s}).encode())

    atomic_write_bytes(fs, path, json.dumps({**me, "expires": time.time() + ttl_s}).encode())
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        fs.rm_file(path)


@contextmanager
def run_lock(layout: RunLayout, ttl_s: float = 120.0) -> Iterator[None]:
    if is_remote(layout.root):
        with _lease_lock(layout, ttl_s):
            yield
    else:
        with _local_lock(layout.lock_path()):
            yield
