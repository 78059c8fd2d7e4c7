"""A warm parent for stage processes: one process that has imported the heavy libraries every stage imports
(torch, transformers, pyarrow, Great Expectations, vLLM) and rlpipe's stage modules, and forks a child per stage.

A stage started as `python -m stages.<name>` spends 2-4 s on the interpreter, torch and transformers, 3.5-4 s
importing Great Expectations and, for generate or evaluate, 6-8 s importing vLLM: a fifth of the default
iteration (benchmarks/overhead.py). A forked child starts in milliseconds and is otherwise what it was: its
own process (own memory, own crash, own stage lease), the caller's stdin/stdout/stderr (passed over the
socket), working directory and environment, `python -m` semantics (`__main__`, exit code, atexit) and command
line. It keeps the preloaded rlpipe modules only while their sources, working directory, environment and
streams are as the server saw them; otherwise it imports the code as on disk. It skips the server's
finalizers at exit. Variables read at import (`IMPORT_TIME_VARIABLES`) fix thread pools, so other values get a
new server; the server runs no thread (a fork copies no held lock). It ends with the flow (EOF on its stdin,
also when the flow was killed), and so do the stages still running: SIGTERM, SIGKILL 5 s later. Details:
docs/architecture.md.

Used by `rlpipe run` and the `loop`/`iteration` flows in local dispatch (`stage_server`); plain
`subprocess.run` elsewhere (dispatched stages, `RLPIPE_STAGE_FORK=0`, not Linux). Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging.config
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import Any

from schemas import settings
from storage.process import die_with_parent, end_process

# Loaded once by the server; each is skipped when it is not installed (vLLM is an extra).
PRELOAD = (
    "pyarrow", "pyarrow.parquet", "pyarrow.compute", "numpy", "pydantic", "yaml", "rich", "fsspec", "s3fs",
    "torch", "transformers", "great_expectations", "great_expectations.expectations", "vllm", "vllm.entrypoints.llm",
)
# rlpipe's own top-level packages: preloaded as the stages import them, dropped by a child when stale.
PROJECT_PACKAGES = ("stages", "schemas", "storage", "reports", "flows")
# Read by libraries when they load (thread pools, import path): a server serves one set of values.
IMPORT_TIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
                         "VLLM_TARGET_DEVICE")
MAX_REQUEST_BYTES = 1 << 20
# Once the flow is gone, a stage still running has this long after SIGTERM before SIGKILL (issue 29: 10 s in all).
STAGE_STOP_GRACE_S = 5.0


def fork_enabled() -> bool:
    """Stages fork from a warm server unless `RLPIPE_STAGE_FORK=0`; only on Linux (macOS forbids fork after
    some system libraries load, and Windows has no fork)."""
    return sys.platform.startswith("linux") and settings.stage_fork_enabled()


class ForkServerDied(RuntimeError):
    pass


class ForkServer:
    """The client side, in the flow process: starts the server and asks it to run `python -m ...` commands."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="rlpipe-forkserver-")
        self.socket_path = os.path.join(self._dir, "socket")
        # The listening socket is made here and handed over, so a request can be sent at once: it waits in
        # the backlog while the server is still importing.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.socket_path)
        listener.listen(64)
        self.started = time.monotonic()
        # stdin is a pipe that only the server reads: when this process ends (even killed), it sees EOF, ends
        # the stages still running (SIGTERM, SIGKILL after STAGE_STOP_GRACE_S) and leaves.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flows.runner.forkserver", str(listener.fileno())],
            stdin=subprocess.PIPE, pass_fds=(listener.fileno(),), env=self.env,
        )
        listener.close()

    def serves(self, env: dict[str, str]) -> bool:
        return self.alive() and all(env.get(k) == self.env.get(k) for k in IMPORT_TIME_VARIABLES)

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, command: list[str], env: dict[str, str]) -> int:
        """Run `command` ([python, "-m", module, *args]) as a forked child; its exit status as
        `subprocess.run` reports it (negative: the signal that ended it)."""
        request = json.dumps({"command": command, "env": env, "cwd": os.getcwd()}).encode()
        if len(request) > MAX_REQUEST_BYTES:
            raise ValueError(f"stage request of {len(request)} bytes (environment too large for the fork server)")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(self.socket_path)
            socket.send_fds(connection, [request], [0, 1, 2])
            pid = self._receive(connection, "pid")
            try:
                return self._receive(connection, "returncode")
            except BaseException:
                # As subprocess.run does when the caller is interrupted: the child goes too.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise

    def wait_ready(self) -> float:
        """Block until the server has finished its imports; the seconds since it was started."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(self.socket_path)
            connection.send(json.dumps({"ping": True}).encode())
            self._receive(connection, "ready")
        return time.monotonic() - self.started

    def _receive(self, connection: socket.socket, field: str) -> int:
        message = connection.recv(4096)
        if not message:
            raise ForkServerDied(f"the stage fork server (pid {self.process.pid}) ended while running a stage")
        return int(json.loads(message)[field])

    def close(self) -> None:
        """Let the server go: it stops accepting, ends the stages still running and exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
            os.rmdir(self._dir)


_server: ForkServer | None = None


def start(env: dict[str, str]) -> ForkServer | None:
    """The server for `env`, started now if none serves it (None when forking is off): starting it early
    lets its imports overlap other start-up work."""
    global _server
    if not fork_enabled():
        return None
    if _server is not None and _server.serves(env):
        return _server
    if _server is not None:
        _server.close()
    else:
        atexit.register(stop)  # the socket's directory goes with the process
    _server = ForkServer(env)
    return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


@contextlib.contextmanager
def stage_server(env: dict[str, str]) -> Iterator[ForkServer | None]:
    """Stages started inside this block fork from a warm server; it ends with the block unless it was
    running before (a caller further out started it and stops it)."""
    running_before = _server is not None and _server.serves(env)
    server = start(env)
    try:
        yield server
    finally:
        if not running_before:
            stop()


def run(command: list[str], env: dict[str, str]) -> int:
    """Run a stage command: forked from the active server when one serves `env`, else `subprocess.run`."""
    if _server is not None and _server.serves(env) and command[1:2] == ["-m"]:
        return _server.run(command, env)
    return subprocess.run(command, env=env, preexec_fn=die_with_parent(os.getpid())).returncode  # dies with the flow


# ---------------------------------------------------------------------------------------------------------
# The server process.


# What the server's imports of rlpipe modules depended on (`_preload_project`); a child reuses them only
# while all of it still holds (`_project_modules_current`).
_project: dict[str, Any] = {}


def _preload() -> None:
    with contextlib.suppress(ImportError):
        import setproctitle  # set up here, while the environment is the original one (children rename)

        setproctitle.setproctitle(f"{sys.executable} -m flows.runner.forkserver (rlpipe stage server)")
    environment = dict(os.environ)  # as the caller gave it, before any library sets its own variables
    _apply_vllm_logging_config()
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    _preload_project(environment)


def _apply_vllm_logging_config() -> None:
    """Apply the logging config VLLM_LOGGING_CONFIG_PATH names before vLLM is imported: vLLM (0.32) applies it
    only when it starts an engine, so what it logs while being imported (Triton without a CPU backend) reached
    the console through logging's last-resort handler; with it, it goes where the caller sends vLLM's lines
    (`rlpipe run`: the run's logs/stage-server.log)."""
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        with contextlib.suppress(OSError, ValueError, TypeError):  # a bad config: vLLM names it when it applies it
            with open(path, encoding="utf-8") as handle:
                logging.config.dictConfig(json.load(handle))


def _preload_project(environment: dict[str, str]) -> None:
    """Import what every stage imports of rlpipe (not the stage entry modules: each runs as `__main__`, and
    runpy wants it not imported yet), and record what those imports depended on."""
    try:
        from stages.registry import STAGES
    except Exception:  # noqa: BLE001 - a broken tree: every child imports it afresh and reports the error
        return
    for name in STAGES:
        with contextlib.suppress(Exception):  # the stage reports its own import error when it runs
            importlib.import_module(f"stages.{name}")
        sys.modules.pop(f"stages.{name}", None)
        with contextlib.suppress(AttributeError):
            delattr(sys.modules["stages"], name)
    with contextlib.suppress(Exception):  # what each stage's first table validation would pay (GX's context...)
        from schemas.contracts import warm_up

        warm_up()
    _project.update(sources=_project_sources(), cwd=os.getcwd(), env=environment, streams=_stream_ids())


def _project_sources() -> dict[str, tuple[int, int]]:
    """Source file -> (mtime_ns, size) of every rlpipe module imported in this process."""
    sources = {}
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in PROJECT_PACKAGES and (path := getattr(module, "__file__", None)):
            with contextlib.suppress(OSError):
                stat = os.stat(path)
                sources[path] = (stat.st_mtime_ns, stat.st_size)
    return sources


def _stream_ids() -> tuple[tuple[int, int] | None, ...]:
    """The files behind stdout and stderr (device, inode)."""
    ids = []
    for fd in (1, 2):
        try:
            stat = os.fstat(fd)
            ids.append((stat.st_dev, stat.st_ino))
        except OSError:
            ids.append(None)
    return tuple(ids)


def _project_modules_current(request: dict) -> bool:
    """Whether the preloaded rlpipe modules are what the child would import now: same source files, working
    directory (import path), environment and stdout/stderr. Checked in the child, after it took the caller's
    descriptors; a stat per source file, well under a millisecond."""
    if not _project or request["cwd"] != _project["cwd"] or request["env"] != _project["env"]:
        return False
    if _stream_ids() != _project["streams"]:
        return False
    for path, (mtime_ns, size) in _project["sources"].items():
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if (stat.st_mtime_ns, stat.st_size) != (mtime_ns, size):
            return False
    return True


def _forget_project_modules() -> None:
    """Drop every rlpipe module, so the stage imports the code as it is on disk."""
    for name in [name for name in sys.modules if name.partition(".")[0] in PROJECT_PACKAGES]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _become_stage(request: dict, fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: take the caller's descriptors, directory and environment, run the module as
    `python -m` would, and exit with its status. Never returns."""
    import runpy
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in keep_closed:
            os.close(fd)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        command = request["command"]
        module, *args = command[2:]
        sys.argv = [module, *args]
        with contextlib.suppress(ImportError):  # `ps` and /proc/<pid>/cmdline show the stage, not the server
            import setproctitle

            setproctitle.setproctitle(" ".join(command))
        sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
        if not _project_modules_current(request):
            _forget_project_modules()
        # The server's objects are the server's to clean up: their finalizers do not run at the child's exit.
        # weakref.finalize keeps no public list of them; its registry has been there since Python 3.4.
        for finalizer in list(getattr(weakref.finalize, "_registry", {})):
            finalizer.atexit = False
        if "numpy" in sys.modules:  # a fork copies the global RNG state; `random` reseeds itself at fork
            sys.modules["numpy"].random.seed()
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
    except BaseException:  # noqa: BLE001 - everything ends here: the child must never return into the server
        traceback.print_exc()
    end_process(code)


def _send(connection: socket.socket, **message: int) -> None:
    with contextlib.suppress(OSError):  # the caller may be gone; the child runs on regardless
        connection.send(json.dumps(message).encode())


def serve(listener: socket.socket) -> None:
    # Ctrl-C in the terminal reaches the whole process group: it is for the flow and the stages; the server
    # ends when its caller does (EOF on stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    _preload()

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "caller")
    children: dict[int, socket.socket] = {}
    accepting = True
    kill_at: float | None = None  # once the caller is gone: when what is still running gets SIGKILL
    while accepting or children:
        timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
        events = selector.select(timeout)
        if kill_at is not None and time.monotonic() >= kill_at:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_at = time.monotonic() + STAGE_STOP_GRACE_S  # reaped through the SIGCHLD wakeup
        for key, _ in events:
            if key.data == "request":
                connection, _ = listener.accept()
                try:
                    message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST_BYTES, 3)
                    request = json.loads(message)
                except (OSError, ValueError):
                    connection.close()
                    continue
                if request.get("ping"):  # answered only once the imports are done (they come before the loop)
                    _send(connection, ready=1)
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _become_stage(request, fds, [listener.fileno(), wake_read, wake_write, connection.fileno(),
                                                 sys.stdin.fileno(), selector.fileno()])
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                _send(connection, pid=pid)
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_read, 512):
                        pass
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    if (connection := children.pop(pid, None)) is not None:
                        _send(connection, returncode=os.waitstatus_to_exitcode(status))
                        connection.close()
            elif key.data == "caller" and not os.read(sys.stdin.fileno(), 4096):
                selector.unregister(listener)
                selector.unregister(sys.stdin.fileno())
                listener.close()
                accepting = False
                # The flow is done or gone (killed: nobody waits for these stages' outcome): a stage still
                # running gets SIGTERM, then SIGKILL after STAGE_STOP_GRACE_S, so none outlives its flow.
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                kill_at = time.monotonic() + STAGE_STOP_GRACE_S


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
    end_process(0)  # no module teardown of torch, vLLM, GX: the server is gone at once, as its stages are
