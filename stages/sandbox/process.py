"""Start a sandboxed child and talk to it under a deadline: the call channel and the stdin/stdout run.

The worker forks, the child applies the isolation layers (isolation.py) and execs the runner
(_runner.py). Every read and write here goes through poll() with the job's deadline, so a child that
stops reading, never answers, or prints without end cannot stall the worker; when the deadline passes
or the output cap is crossed the worker ends the job, which kills every process in it.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass

from . import _runner
from .isolation import CLEAN_ENV, Isolation
from .judge import CandidateGone, Channel, JobTimeout, NotPlainValue, rebuild_exception

# Largest single reply we accept (a return value); bigger ones end the job as an error.
MAX_FRAME = 16 << 20


class SpawnError(RuntimeError):
    """The child could not be set up (a layer failed to apply); a harness fault, not the candidate's."""


def spawn(isolation: Isolation, mode: str, fds: dict[int, int], cpu_budget_s: float, workdir: str) -> int:
    """Fork a child whose fds 0..n are `fds` (target -> source), isolate it, and exec the runner.

    Returns the pid once the exec has happened; a failure before exec raises SpawnError with the
    child's reason (read from a close-on-exec pipe, as subprocess does)."""
    error_read, error_write = os.pipe2(os.O_CLOEXEC)
    argv = isolation.argv(mode, workdir)
    pid = os.fork()
    if pid == 0:  # child: no Python-level cleanup, no return
        try:
            os.close(error_read)
            isolation.child_setup(cpu_budget_s)
            # Move sources out of the target range first, so that dup2 never clobbers a pending one.
            high = {target: os.dup(source) for target, source in fds.items()}
            for target, source in high.items():
                os.dup2(source, target, inheritable=True)
            os.closerange(max(fds) + 1, error_write)
            os.closerange(error_write + 1, 65536)
            os.chdir(workdir)
            os.execve(argv[0], argv, CLEAN_ENV)
        except BaseException as error:  # noqa: B036 - anything here must reach the parent
            try:
                os.write(error_write, f"{type(error).__name__}: {error}".encode()[:4000])
            finally:
                os._exit(127)
    os.close(error_write)
    try:
        reason = _read_all(error_read)
    finally:
        os.close(error_read)
    if reason:
        os.waitpid(pid, 0)
        raise SpawnError(reason.decode(errors="replace"))
    return pid


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _wait_fd(fd: int, events: int, deadline: float) -> bool:
    """Wait until fd is ready for `events`; False when the deadline passed first."""
    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = _remaining(deadline)
        if left <= 0:
            return False
        if poller.poll(max(1, int(left * 1000))):
            return True


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


def read_exact(fd: int, size: int, deadline: float) -> bytes | None:
    """Read exactly `size` bytes; None at end of file; raises JobTimeout on deadline."""
    chunks = []
    while size:
        if not _wait_fd(fd, select.POLLIN, deadline):
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


def frame(message: dict) -> bytes:
    payload = json.dumps(message).encode()
    return _runner.HEADER.pack(len(payload)) + payload


class PipeChannel(Channel):
    """Calls into a child in `serve` mode. Any protocol breach, death or overlong reply makes the
    channel `gone`; the deadline makes it `timeout`. Either state is final for the job."""

    def __init__(self, requests: int, replies: int, deadline: float) -> None:
        self.requests = requests
        self.replies = replies
        self.deadline = deadline
        self.state = "ok"
        self.detail = ""
        self.calls = 0

    def _fail(self, state: str, detail: str) -> BaseException:
        self.state, self.detail = state, detail
        return JobTimeout(detail) if state == "timeout" else CandidateGone(detail)

    def send(self, message: dict) -> None:
        try:
            if not write_all(self.requests, frame(message), self.deadline):
                raise self._fail("timeout", "wall-clock limit reached")
        except (BrokenPipeError, ValueFormatErrorTypes) as error:
            raise self._fail("gone", f"candidate process stopped reading ({type(error).__name__})") from None

    def receive(self) -> dict:
        try:
            header = read_exact(self.replies, _runner.HEADER.size, self.deadline)
            if header is None:
                raise self._fail("gone", "candidate process exited")
            (length,) = _runner.HEADER.unpack(header)
            if length > MAX_FRAME:
                raise self._fail("gone", f"reply of {length} bytes exceeds the {MAX_FRAME}-byte limit")
            body = read_exact(self.replies, length, self.deadline)
        except JobTimeout:
            raise self._fail("timeout", "wall-clock limit reached") from None
        if body is None:
            raise self._fail("gone", "candidate process exited mid-reply")
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            raise self._fail("gone", "candidate process sent a malformed reply") from None
        if not isinstance(message, dict):
            raise self._fail("gone", "candidate process sent a malformed reply")
        return message

    def call(self, args: tuple, kwargs: dict) -> object:
        if self.state != "ok":
            raise self._fail(self.state, self.detail)
        try:
            request = {"args": _runner.encode_value(list(args)), "kwargs": _runner.encode_value(kwargs)}
        except _runner.ValueFormatError as error:
            # Test code passing a lambda or an object: the harness cannot ship it, the candidate is not
            # at fault, but the test cannot pass either.
            raise NotPlainValue(f"argument cannot be sent to the sandbox: {error}") from None
        self.calls += 1
        self.send(request)
        reply = self.receive()
        if "value" in reply:
            try:
                return _runner.decode_value(reply["value"])
            except _runner.ValueFormatError as error:
                raise NotPlainValue(f"candidate returned an unusable value: {error}") from None
        if "raised" in reply and isinstance(reply["raised"], list) and len(reply["raised"]) == 2:
            type_name, message = (str(part) for part in reply["raised"])
            raise rebuild_exception(type_name, message)
        if "unencodable" in reply:
            raise NotPlainValue(f"candidate returned a non-plain object: {str(reply['unencodable'])[:300]}")
        raise self._fail("gone", "candidate process sent an unknown reply")


ValueFormatErrorTypes = (ValueError,)


@dataclass
class ScriptRun:
    exit_code: int | None  # None when killed by the worker (timeout, output cap)
    stdout: bytes
    stderr: bytes
    timed_out: bool
    overflow: bool
    seconds: float


def pump(
    writes: dict[int, bytes], reads: list[int], cap: int, deadline: float
) -> tuple[dict[int, bytes], bool, bool]:
    """Feed `writes` and drain `reads` (all non-blocking) until every read fd is at EOF.

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
    for fd, view in list(pending.items()):
        if not view:  # nothing to send: close now so the child sees end of input
            poller.unregister(fd)
            os.close(fd)
            del pending[fd]
    while open_reads:
        left = _remaining(deadline)
        if left <= 0:
            return _joined(buffers), True, False
        for fd, event in poller.poll(max(1, int(left * 1000))):
            if fd in pending:
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


def nonblocking_pipe() -> tuple[int, int]:
    """A pipe whose parent end will be made non-blocking by the caller (the child's end stays blocking)."""
    return os.pipe2(os.O_CLOEXEC)


def wait_exit(pid: int, deadline: float) -> int | None:
    """Exit status of the child (negative signal number if killed), or None if it outlives `deadline`."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if _remaining(deadline) <= 0:
            return None
        time.sleep(0.001)
