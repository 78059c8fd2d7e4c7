"""Start a sandboxed child and talk to it under a deadline: the call channel and the stdin/stdout run.

The worker forks, the child applies the isolation layers (isolation.py) and execs the runner
(_runner.py). Every read and write here goes through poll() with the job's deadline, so a child that
stops reading, never answers, or prints without end cannot stall the worker; when the deadline passes
or the output cap is crossed the worker ends the job, which kills every process in it.
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass

from . import _runner
from .isolation import Isolation, SpawnError
from .judge import CandidateGone, Channel, JobTimeout, NotPlainValue, rebuild_exception
from .view import interpreter_candidates

# Largest single reply we accept (a return value); bigger ones end the job as an error.
MAX_FRAME = 16 << 20


def probe_interpreter(isolation: Isolation, configured: str | None) -> str:
    """The first interpreter that starts the runner inside the sandbox (by fork+exec, as a job would
    without the fork server); this also proves, once per worker, that every isolation layer can be
    applied. Raises SpawnError naming each failure."""
    failures = []
    for python in interpreter_candidates(configured):
        isolation.python = python
        status, message = run_probe(isolation, exec_=True)
        if status == 0:
            return python
        failures.append(f"{python}: exit {status} {message}")
    raise SpawnError("no interpreter runs inside the sandbox: " + "; ".join(failures))


def run_probe(isolation: Isolation, exec_: bool) -> tuple[int | None, str]:
    """Run the runner's `probe` mode as a job; (exit code, last line of stderr)."""
    workdir = isolation.begin_job()
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    err_read, err_write = os.pipe2(os.O_CLOEXEC)
    pid = None
    try:
        try:
            pid = isolation.spawn("probe", [null, null, err_write], 10.0, workdir, exec_=exec_)
        except SpawnError as error:
            return None, str(error)
        finally:
            os.close(err_write)
        status = isolation.wait_exit(pid, time.monotonic() + 30.0)
        lines = _read_all(err_read).decode(errors="replace").strip().splitlines()
        return status, lines[-1] if lines else ""
    finally:
        os.close(null)
        os.close(err_read)
        if pid is not None:
            isolation.end_job(pid)
        else:
            isolation.discard_job()


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


class ChildExited(Exception):
    """The job's main process exited while we waited on a pipe that something else still holds open."""


def _wait_fd(fd: int, events: int, deadline: float, pidfd: int | None = None) -> bool:
    """Wait until fd is ready for `events`; False when the deadline passed first.

    With `pidfd`, a main process that exits while the pipe stays open (a background grandchild holds
    it) raises ChildExited instead of waiting for the deadline."""
    poller = select.poll()
    poller.register(fd, events)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while True:
        left = _remaining(deadline)
        if left <= 0:
            return False
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if fd in ready:
            return True
        if pidfd is not None and pidfd in ready:
            raise ChildExited()


def write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write everything to a non-blocking fd; False on deadline. BrokenPipeError means the reader died."""
    view = memoryview(data)
    while view:
        if not _wait_fd(fd, select.POLLOUT, deadline):
            return False
        try:
            written = os.write(fd, view[:65536])
        except BlockingIOError:
            continue
        view = view[written:]
    return True


def read_exact(fd: int, size: int, deadline: float, pidfd: int | None = None) -> bytes | None:
    """Read exactly `size` bytes; None at end of file (or when the main process exited); raises
    JobTimeout on deadline."""
    chunks = []
    while size:
        try:
            ready = _wait_fd(fd, select.POLLIN, deadline, pidfd)
        except ChildExited:
            # Take what is already buffered (the last reply of a process that then exited), no more.
            ready = bool(select.select([fd], [], [], 0)[0])
            if not ready:
                return None
        if not ready:
            raise JobTimeout("wall-clock limit reached")
        try:
            chunk = os.read(fd, min(size, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def frame(*message: object) -> bytes:
    payload = _runner.encode_value(message)
    return _runner.HEADER.pack(len(payload)) + payload


class PipeChannel(Channel):
    """Calls into a child in `serve` mode. Any protocol breach, death or overlong reply makes the
    channel `gone`; the deadline makes it `timeout`. Either state is final for the job."""

    def __init__(self, requests: int, replies: int, deadline: float, pidfd: int | None = None) -> None:
        self.requests = requests
        self.replies = replies
        self.pidfd = pidfd
        self.deadline = deadline
        self.state = "ok"
        self.detail = ""
        self.calls = 0

    def _fail(self, state: str, detail: str) -> BaseException:
        self.state, self.detail = state, detail
        return JobTimeout(detail) if state == "timeout" else CandidateGone(detail)

    def send(self, data: bytes) -> None:
        try:
            if not write_all(self.requests, data, self.deadline):
                raise self._fail("timeout", "wall-clock limit reached")
        except BrokenPipeError:
            raise self._fail("gone", "candidate process stopped reading") from None

    def receive(self) -> tuple:
        try:
            header = read_exact(self.replies, _runner.HEADER.size, self.deadline, self.pidfd)
            if header is None:
                raise self._fail("gone", "candidate process exited")
            (length,) = _runner.HEADER.unpack(header)
            if length > MAX_FRAME:
                raise self._fail("gone", f"reply of {length} bytes exceeds the {MAX_FRAME}-byte limit")
            body = read_exact(self.replies, length, self.deadline, self.pidfd)
        except JobTimeout:
            raise self._fail("timeout", "wall-clock limit reached") from None
        if body is None:
            raise self._fail("gone", "candidate process exited mid-reply")
        try:
            message = _runner.decode_value(body)
        except _runner.ValueFormatError as error:
            raise self._fail("gone", f"candidate process sent a malformed reply: {error}") from None
        if type(message) is not tuple or not message or type(message[0]) is not str:
            raise self._fail("gone", "candidate process sent a malformed reply")
        return message

    def call(self, args: tuple, kwargs: dict) -> object:
        if self.state != "ok":
            raise self._fail(self.state, self.detail)
        try:
            request = frame("call", list(args), kwargs)
        except _runner.ValueFormatError as error:
            # Test code passing a lambda or an object: the harness cannot ship it, the candidate is not
            # at fault, but the test cannot pass either.
            raise NotPlainValue(f"argument cannot be sent to the sandbox: {error}") from None
        self.calls += 1
        self.send(request)
        reply = self.receive()
        kind, body = reply[0], reply[1:]
        if kind == "value" and len(body) == 1:
            return body[0]
        if kind == "raised" and len(body) == 2:
            return_error = rebuild_exception(str(body[0]), str(body[1]))
            raise return_error
        if kind == "unencodable":
            raise NotPlainValue(f"candidate returned a non-plain object: {str(body)[:300]}")
        raise self._fail("gone", f"candidate process sent an unexpected reply {kind!r}")


@dataclass
class ScriptRun:
    exit_code: int | None  # None when killed by the worker (timeout, output cap)
    stdout: bytes
    stderr: bytes
    timed_out: bool
    overflow: bool
    seconds: float


def pump(
    writes: dict[int, bytes], reads: list[int], cap: int, deadline: float, pidfd: int | None = None
) -> tuple[dict[int, bytes], bool, bool]:
    """Feed `writes` and drain `reads` (all non-blocking) until every read fd is at EOF, or the main
    process (`pidfd`) has exited and its pipes are drained.

    Returns (data read per fd, timed_out, overflow); stops early on deadline or when the total read
    crosses `cap` (the caller then kills the job)."""
    pending = {fd: memoryview(data) for fd, data in writes.items()}
    buffers: dict[int, list[bytes]] = {fd: [] for fd in reads}
    total = 0
    open_reads = set(reads)
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    for fd in open_reads:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    exited = False
    for fd, view in list(pending.items()):
        if not view:  # nothing to send: close now so the child sees end of input
            poller.unregister(fd)
            os.close(fd)
            del pending[fd]
    while open_reads:
        left = _remaining(deadline)
        if left <= 0:
            return _joined(buffers), True, False
        events = poller.poll(0 if exited else max(1, int(left * 1000)))
        if exited and not any(fd in open_reads for fd, _ in events):
            break  # the main process is gone and what it wrote is drained; leftovers are killed
        for fd, _event in events:
            if fd == pidfd:
                exited = True
                poller.unregister(pidfd)
            elif fd in pending:
                try:
                    written = os.write(fd, pending[fd][:65536])
                    pending[fd] = pending[fd][written:]
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # the child closed its stdin: it will not read the rest
                    pending[fd] = memoryview(b"")
                if not pending[fd]:
                    poller.unregister(fd)
                    os.close(fd)
                    del pending[fd]
            elif fd in open_reads:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    poller.unregister(fd)
                    open_reads.discard(fd)
                    continue
                buffers[fd].append(chunk)
                total += len(chunk)
                if total > cap:
                    return _joined(buffers), False, True
    for fd in pending:
        os.close(fd)
    return _joined(buffers), False, False


def _joined(buffers: dict[int, list[bytes]]) -> dict[int, bytes]:
    return {fd: b"".join(chunks) for fd, chunks in buffers.items()}
