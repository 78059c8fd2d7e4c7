"""Leases in the storage root: one driver per run, one process per stage, on a local disk or on S3.

    <root>/runs/<run>/run.lock                          who drives the run
    <root>/runs/<run>/locks/<stage>@iter=0003.lock      who runs that stage of that iteration

Local roots use `flock`: the kernel releases it when the holder dies (even by SIGKILL), so no expiry is
needed; the file records the holder so a refusal names it. S3 roots use a lease object with an expiry, made
safe by conditional writes: acquire with `If-None-Match: *`, take over an expired lease and renew (a thread,
every ttl/3) with `If-Match: <etag>`, release with a DELETE `If-Match: <our etag>`; a failed renewal marks the
lease lost and leaving the block raises `LeaseLost`. Expiry is judged on the server's clock alone (`Date` minus
`Last-Modified`), and every body carries a random token, so a retried request whose first attempt succeeded
is recognised as ours. One process may nest the same lock (holds are counted per path). A local lock file is
emptied at release, so that `lease_state` can tell a released lock from one whose holder died holding it (the
generation server follows the run's driver that way). The guarantees this gives: docs/reliability.md, "Leases".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from functools import lru_cache
from typing import Any, Literal

from schemas import settings
from storage.fs import is_remote, join
from storage.layout import RunLayout, StageInstance

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 120.0
# What `lease_state` finds: someone holds the lock; nobody does; its holder died holding it.
LeaseState = Literal["held", "free", "abandoned"]


class RunLocked(RuntimeError):
    """The lock is held by someone else (the message names the holder and the lock)."""


class StageLocked(RunLocked):
    pass


class LeaseLost(RuntimeError):
    """Our S3 lease was taken over while we held it (we stopped renewing for longer than its ttl)."""


def stage_lock_path(layout: RunLayout, target: StageInstance) -> str:
    return join(layout.run_dir, "locks", f"{target.slug}.lock")


def _holder(ttl_s: float | None = None) -> dict[str, Any]:
    holder: dict[str, Any] = {
        "host": socket.gethostname(), "pid": os.getpid(), "since": datetime.now(UTC).isoformat(),
        "token": uuid.uuid4().hex,
    }
    if ttl_s is not None:
        holder["ttl_s"] = ttl_s
    return holder


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown holder"
    return f"{holder.get('host', '?')}:{holder.get('pid', '?')} since {holder.get('since', '?')}"


# ---------------------------------------------------------------------------------------------------------
# Nesting within one process

_held: dict[str, int] = {}
_held_guard = threading.Lock()


def _enter_nested(path: str) -> bool:
    """True when this process already holds `path` (and count one more hold)."""
    with _held_guard:
        if path in _held:
            _held[path] += 1
            return True
        return False


def _exit_nested(path: str) -> None:
    with _held_guard:
        _held[path] -= 1


def _mark_held(path: str, held: bool) -> None:
    with _held_guard:
        if held:
            _held[path] = 1
        else:
            _held.pop(path, None)


# ---------------------------------------------------------------------------------------------------------
# Local: flock


def _read_flock_holder(path: str, settle_s: float = 2.0) -> str:
    """Who holds the flock on `path`, as `describe` words it.

    The holder writes its record just after taking the lock (truncate, then write), so a refusal that looks
    in between finds an empty or half-written file. Read again until the record parses, for up to
    `settle_s`: a busy machine can pause the holder between its two steps for a while. A holder that could
    not write its record at all (a full disk) is named as unknown.
    """
    deadline = time.monotonic() + settle_s
    while True:
        with open(path) as handle:
            text = handle.read().strip()
        try:
            return describe(json.loads(text))
        except (json.JSONDecodeError, AttributeError):
            if time.monotonic() >= deadline:
                return text or describe(None)
        time.sleep(0.02)


def _try_flock(path: str) -> Any | None:
    """The open, locked handle; None when someone else holds the lock."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()
    except OSError as error:
        # The lock is held (flock needs no content); the holder's name is only for refusals. On a full disk
        # the work that follows fails with a message naming what it could not write.
        log.warning("lock %s is held but its holder could not be recorded: %s", path, error)
    return handle


@contextmanager
def _local_lock(path: str, wait_s: float, poll_s: float, refuse: Callable[[str], RunLocked]) -> Iterator[None]:
    deadline = time.monotonic() + wait_s
    while (handle := _try_flock(path)) is None:
        if time.monotonic() >= deadline:
            # Named only now, when refusing: while waiting there is no one to tell.
            raise refuse(f"another process ({_read_flock_holder(path)}); lock file {path}")
        time.sleep(poll_s)
    try:
        yield
    finally:
        # An empty file is a lock released: a record left behind names a holder that died holding it (lease_state).
        with contextlib.suppress(OSError):
            handle.seek(0)
            handle.truncate()
        handle.close()  # closing the last descriptor releases the flock


# ---------------------------------------------------------------------------------------------------------
# S3: a lease object written with conditional requests


@lru_cache(maxsize=4)
def _s3_client(endpoint_url: str | None) -> Any:
    # botocore directly (s3fs depends on it), not s3fs: conditional-request failures must be told apart by
    # their error code, which s3fs folds into generic OSErrors.
    import botocore.session
    from botocore.config import Config

    config = Config(retries={"max_attempts": 8, "mode": "standard"})
    return botocore.session.get_session().create_client("s3", endpoint_url=endpoint_url, config=config)


def _bucket_key(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _error_code(error: Exception) -> str:
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


# PreconditionFailed (412): the condition did not hold. ConditionalRequestConflict (409): AWS's answer
# when another conditional write on the same key is in flight. NoSuchKey (404 on If-Match): it is gone.
CONFLICT_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}


@dataclass
class Observed:
    """The lease object as read: holder, etag, and its age on the server's clock."""

    holder: dict[str, Any]
    etag: str
    age_s: float

    @property
    def expired(self) -> bool:
        return self.age_s > float(self.holder.get("ttl_s", DEFAULT_TTL_S))


@dataclass
class S3Lease:
    url: str
    ttl_s: float
    me: dict[str, Any] = field(default_factory=dict)
    etag: str | None = None
    seq: int = 0
    lost: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.me = self.me or _holder(self.ttl_s)
        self.client = _s3_client(settings.S3_ENDPOINT_URL.get())
        self.bucket, self.key = _bucket_key(self.url)

    def _body(self) -> bytes:
        self.seq += 1
        # `expires` is for people reading the object; expiry itself is judged on the server's clock.
        return json.dumps({**self.me, "seq": self.seq, "expires": time.time() + self.ttl_s}).encode()

    def _put(self, **condition: str) -> str:
        response = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)
        return response["ETag"]

    def read(self) -> Observed | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as error:
            if _error_code(error) in {"NoSuchKey", "404"}:
                return None
            raise
        body = response["Body"].read()
        try:
            holder = json.loads(body)
        except json.JSONDecodeError:
            holder = {}  # unreadable: treated as held by nobody we know, expiring after the default ttl
        date = response["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        # The server's clock when it has a Date header (every S3 has); ours, skew and all, otherwise.
        server_now = parsedate_to_datetime(date) if date else datetime.now(UTC)
        age_s = (server_now - response["LastModified"]).total_seconds()
        return Observed(holder=holder, etag=response["ETag"], age_s=age_s)

    def _ours_after_conflict(self) -> bool:
        """After a conflict: is the object ours anyway (a retried request whose first attempt succeeded)?"""
        observed = self.read()
        if observed and observed.holder.get("token") == self.me["token"] and observed.holder.get("seq") == self.seq:
            self.etag = observed.etag
            return True
        return False

    def try_acquire(self) -> Observed | None:
        """Take the lease if free or expired. None when taken; otherwise what holds it."""
        from botocore.exceptions import ClientError

        for _ in range(5):  # the object can vanish or change between our steps; look again a few times
            try:
                self.etag = self._put(IfNoneMatch="*")
                return None
            except ClientError as error:
                if _error_code(error) not in CONFLICT_CODES:
                    raise
                if self._ours_after_conflict():
                    return None
            observed = self.read()
            if observed is None:
                continue  # released between our PUT and our GET
            if not observed.expired:
                return observed
            try:
                self.etag = self._put(IfMatch=observed.etag)
                log.warning("took over expired lease %s from %s", self.url, describe(observed.holder))
                return None
            except ClientError as error:
                if _error_code(error) not in CONFLICT_CODES:
                    raise
                if self._ours_after_conflict():
                    return None
        # Still contended after several rounds (it keeps vanishing and reappearing): report it as held.
        return self.read() or Observed(holder={}, etag="", age_s=0.0)

    def renew(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.etag = self._put(IfMatch=self.etag)
            return True
        except ClientError as error:
            if _error_code(error) in CONFLICT_CODES:
                if self._ours_after_conflict():
                    return True
                self.lost.set()
                current = self.read()
                log.error("lease %s was taken over by %s", self.url, describe(current.holder if current else None))
                return False
            raise

    def release(self) -> None:
        from botocore.exceptions import ClientError

        if self.etag is None or self.lost.is_set():
            return
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        except ClientError as error:
            code = _error_code(error)
            if code in CONFLICT_CODES:
                return  # not ours any more (or already gone): leave it alone
            if code not in {"NotImplemented", "501"}:
                raise
            # A server without conditional deletes: check, then delete (a window of one round trip).
            observed = self.read()
            if observed and observed.holder.get("token") == self.me["token"]:
                self.client.delete_object(Bucket=self.bucket, Key=self.key)


def _renew_until(lease: S3Lease, stop: threading.Event) -> None:
    interval = lease.ttl_s / 3
    while not stop.wait(interval):
        try:
            if not lease.renew():
                return
        except Exception as error:  # noqa: BLE001 - a flaky network must not kill the renewer: retry next tick
            log.warning("renewing lease %s failed (%s); retrying", lease.url, error)


@contextmanager
def _s3_lease(
    url: str, ttl_s: float, wait_s: float, poll_s: float, refuse: Callable[[str], RunLocked]
) -> Iterator[S3Lease]:
    lease = S3Lease(url, ttl_s)
    deadline = time.monotonic() + wait_s
    while (observed := lease.try_acquire()) is not None:
        if time.monotonic() >= deadline:
            raise refuse(f"{describe(observed.holder)} (lease {url}, renewed {observed.age_s:.0f}s ago)")
        time.sleep(poll_s)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew_until, args=(lease, stop), daemon=True, name=f"lease {url}")
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        lease.release()
    if lease.lost.is_set():
        raise LeaseLost(f"lease {url} was taken over while held: another process may have done the same work")


# ---------------------------------------------------------------------------------------------------------
# Public API


@contextmanager
def lease(
    root: str, path: str, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0, poll_s: float | None = None,
    refuse: Callable[[str], RunLocked] = lambda holder: RunLocked(f"held by {holder}"),
) -> Iterator[None]:
    """Hold the lock at `path` (under storage root `root`) for the block, waiting up to `wait_s` for it.

    When it stays held, raises `refuse(description of the holder)`.
    """
    if _enter_nested(path):
        try:
            yield
        finally:
            _exit_nested(path)
        return
    poll_s = poll_s if poll_s is not None else min(2.0, max(ttl_s / 8, 0.05))
    if is_remote(root):
        if not root.startswith("s3://"):
            raise NotImplementedError(f"leases on {root.split('://')[0]}:// roots are not implemented (S3 only)")
        manager = _s3_lease(path, ttl_s, wait_s, poll_s, refuse)
    else:
        manager = _local_lock(path, wait_s, poll_s, refuse)
    with manager:
        _mark_held(path, True)
        try:
            yield
        finally:
            _mark_held(path, False)


@contextmanager
def run_lock(layout: RunLayout, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0) -> Iterator[None]:
    """One driver per run; raises RunLocked naming the holder when another process drives it."""

    def refuse(holder: str) -> RunLocked:
        return RunLocked(f"run {layout.run_id} is being driven by {holder}")

    with lease(layout.root, layout.lock_path(), ttl_s=ttl_s, wait_s=wait_s, refuse=refuse):
        yield


def lease_state(path: str) -> LeaseState:
    """Whether anyone holds the lock at `path` (a local lock file or an S3 lease URL), read without touching it:
    "held", "free" (released, or never taken), or "abandoned": its holder died holding it (a record names a
    process of this host that is gone, or an S3 lease expired). A holder on another host holds a local lock
    as far as this host can tell. For a process that follows a run's driver (the generation server)."""
    return lease_holder(path)[0]


def lease_holder(path: str) -> tuple[LeaseState, dict[str, Any] | None]:
    """`lease_state` and the record of the holder it judged (None when free): its `token` tells one holder from
    the next (a dispatcher follows the process its flow run started, not one that died before)."""
    if is_remote(path):
        observed = S3Lease(path, DEFAULT_TTL_S).read()
        if observed is None:
            return "free", None
        holder = observed.holder
        if observed.expired:
            return "abandoned", holder
    else:
        try:
            with open(path) as handle:
                holder = json.loads(handle.read() or "null")
        except (FileNotFoundError, json.JSONDecodeError):
            return "free", None  # none, released, or a record being written this instant
        if not isinstance(holder, dict):
            return "free", None
    if holder.get("host") != socket.gethostname():
        return "held", holder
    alive = _process_alive_since(int(holder.get("pid", 0)), str(holder.get("since", "")))
    return ("held" if alive else "abandoned"), holder


def _process_alive_since(pid: int, since: str) -> bool:
    """Whether process `pid` of this host runs (not a zombie) and started no later than `since` (ISO time it took
    a lock), so a pid reused by a later process does not count."""
    import psutil

    if pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        started = process.create_time()
    except (psutil.NoSuchProcess, ValueError):
        return False
    try:
        return started <= datetime.fromisoformat(since).timestamp() + 1.0  # create_time's rounding
    except ValueError:
        return True


@contextmanager
def stage_lock(
    layout: RunLayout, target: StageInstance, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0
) -> Iterator[None]:
    """One process per (stage, iteration, round) of a run; raises StageLocked naming the holder after `wait_s`."""

    def refuse(holder: str) -> RunLocked:
        return StageLocked(f"stage {target.stage} ({target.where}) of run {layout.run_id} is run by {holder}")

    path = stage_lock_path(layout, target)
    with lease(layout.root, path, ttl_s=ttl_s, wait_s=wait_s, refuse=refuse):
        yield
