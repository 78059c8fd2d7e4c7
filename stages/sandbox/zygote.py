"""The worker's side of the fork server (the `zygote` mode of _runner.py).

Why: exec'ing a fresh interpreter costs ~15-20 ms of CPU per job, more than a typical HumanEval program
takes to load and run; forking a warm interpreter costs well under a millisecond. The zygote is started
once per worker, as root inside the worker's namespaces, and never sees job data; each job's child
applies its own isolation right after the fork (see `isolate` in _runner.py).
"""

from __future__ import annotations

import os
import select
import socket
import time

from ._runner import decode_value, encode_value


class ZygoteError(RuntimeError):
    """The fork server died or stopped answering; the worker starts a new one."""


class Zygote:
    def __init__(self, argv: list[str], env: dict[str, str], setup: dict, timeout_s: float = 30.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                os.dup2(theirs.fileno(), 3)
                os.closerange(4, 65536)
                os.chdir("/")
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        theirs.close()
        self.pid = pid
        self.socket = ours
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.socket.send(encode_value(("setup", setup)))
        reply = self._receive(time.monotonic() + timeout_s)
        if reply != ("ready",):
            self.close()
            raise ZygoteError(f"fork server did not start: {reply!r}")

    def _receive(self, deadline: float) -> tuple:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZygoteError("fork server did not answer in time")
            if not select.select([self.socket], [], [], left)[0]:
                continue
            data = self.socket.recv(1 << 16)
            if not data:
                raise ZygoteError("fork server exited")
            message = decode_value(data)
            if type(message) is tuple and len(message) == 3 and message[0] == "exit":
                self.exits[message[1]] = message[2]
                continue
            return message

    def fork(self, mode: str, fds: list[int], cpu_budget_s: float, workdir: str) -> int:
        """A new job process with `fds` as its 0..n; returns its pid (the zygote is its parent)."""
        try:
            socket.send_fds(self.socket, [encode_value(("fork", mode, cpu_budget_s, workdir))], fds)
        except OSError as error:
            raise ZygoteError(f"fork server is gone: {error}") from None
        reply = self._receive(time.monotonic() + 30.0)
        if type(reply) is not tuple or len(reply) != 2 or reply[0] != "pid":
            raise ZygoteError(f"unexpected fork server reply {reply!r}")
        self.children.add(reply[1])
        return reply[1]

    def owns(self, pid: int) -> bool:
        return pid in self.children

    def wait(self, pid: int, deadline: float) -> int | None:
        """The job process's exit code (negative: killed by that signal), or None past `deadline`."""
        while pid not in self.exits:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.socket], [], [], left)[0]:
                data = self.socket.recv(1 << 16)
                if not data:
                    raise ZygoteError("fork server exited")
                message = decode_value(data)
                if type(message) is tuple and len(message) == 3 and message[0] == "exit":
                    self.exits[message[1]] = message[2]
        self.children.discard(pid)
        return self.exits.pop(pid)

    def close(self) -> None:
        self.socket.close()
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
