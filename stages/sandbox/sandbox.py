"""The sandbox's front door: `Sandbox.from_config(cfg)` and `score(jobs)`, over a pool of warm workers.

The local backend keeps `cfg.workers` worker processes alive for the sandbox's lifetime (starting an
interpreter per job would cost more than most jobs). A thread pool of the same size feeds them, each
thread checking out an idle worker per job; threads only shuttle JSON frames and wait on pipes, so the
GIL is not the limit: the workers and their children do the work. A worker that overruns a job's hard
limit (the job's budget plus a grace period, e.g. a math expression that never finishes parsing) is
killed with every process of its job and replaced; the job is scored as a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from schemas.config import ConfigError, ScoreConfig

from ._runner import HEADER
from .isolation import job_descendants, release_slot, slot_processes
from .jobs import ScoreJob, ScoreResult
from .scoring import MAX_RUN_TIMEOUT_S
from .view import CLEAN_ENV

_T = TypeVar("_T")

log = logging.getLogger("rlpipe.sandbox")

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# Beyond the job's own budget: process start, judge overhead, a loaded machine.
GRACE_S = 20.0


# What the native mode gives as root with cgroups; anything less is logged as a warning at start. The
# bwrap mode gives netns and mountns per job (and a pid namespace), but as a non-root user no uid of
# its own and, without a delegated cgroup, no cgroups: its warning names uid, cgroup_pids and cgroup_memory.
FULL_LAYERS = (
    "uid",
    "rlimits",
    "netns",
    "mountns",
    "cgroup_pids",
    "cgroup_memory",
    "clean_env",
    "wall_timeout",
    "seccomp",
    "scratch_tmpfs",
)

# The protections `score.require` can ask for, and the layers (Isolation.layers) that give each: any one does.
# RLIMIT_NPROC and RLIMIT_AS are always set ("rlimits"): weaker than a cgroup (NPROC counts a shared uid's
# every task, AS is per process), so a missing cgroup is in the start warning, not a refusal.
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "separate_uid": ("uid", "userns"),
    "no_network": ("netns", "seccomp"),
    "process_limit": ("cgroup_pids", "rlimits"),
    "memory_limit": ("cgroup_memory", "rlimits"),
    "wall_timeout": ("wall_timeout",),
    "read_only_system": ("mountns", "landlock"),
    "scratch_limit": ("scratch_tmpfs",),
}


def missing_layers(layers: dict[str, str]) -> list[str]:
    """The layers of a full setup (FULL_LAYERS) that `layers` lacks, in that order: the start warning."""
    return [layer for layer in FULL_LAYERS if layer not in layers]


def unmet_requirements(layers: dict[str, str], required: list[str]) -> list[str]:
    """The protections of `required` that no layer of `layers` gives, in that order."""
    return [name for name in required if not any(layer in layers for layer in REQUIREMENTS[name])]


class SandboxError(RuntimeError):
    """The sandbox could not start (a worker failed to set up its isolation)."""


class IsolationRefused(SandboxError, ConfigError):
    """The sandbox will not start with the isolation this machine gives and the config asks for: a config
    matter (stage exit code 2); the message names what is missing and the setting that allows it."""


# Worker slots name a job uid and cgroups (isolation.job_uid, cgroups.group_name), so two live workers of this
# process, even of different Sandbox objects, must never share one: a closing sandbox would kill the
# other's jobs and remove its groups.
_SLOTS_IN_USE: set[int] = set()
_SLOTS_LOCK = threading.Lock()
MAX_SLOTS = 64


def _claim_slot() -> int:
    with _SLOTS_LOCK:
        for slot in range(MAX_SLOTS):
            if slot not in _SLOTS_IN_USE:
                _SLOTS_IN_USE.add(slot)
                return slot
    raise SandboxError(f"more than {MAX_SLOTS} sandbox workers in one process")


def _release_slot_id(slot: int) -> None:
    with _SLOTS_LOCK:
        _SLOTS_IN_USE.discard(slot)


def _failure(status: str, message: str, seconds: float) -> ScoreResult:
    test = {"name": "job", "passed": False, "status": status, "message": message}
    return ScoreResult(reward=0.0, passed=0, total=0, status=status, tests=[test], code=None, seconds=seconds)


class _Worker:
    """One worker process and the frames to and from it."""

    def __init__(self, cfg: ScoreConfig, slot: int) -> None:
        self.cfg = cfg
        self.slot = slot
        self.layers: dict[str, str] = {}
        self.isolation = ""
        self.passed_over: list[str] = []  # the modes `auto` tried before this one, and why each failed
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        env = dict(CLEAN_ENV, PYTHONPATH=PROJECT_ROOT, HOME=os.environ.get("HOME", "/tmp"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stages.sandbox.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=PROJECT_ROOT,
        )
        hello = {"config": self.cfg.model_dump(mode="json"), "slot": self.slot, "owner_pid": os.getpid()}
        self._send(hello)
        reply = self._receive(60.0)
        if reply is None or "fatal" in reply:
            self.stop()
            if reply is not None and reply.get("refused"):
                raise IsolationRefused(refusal_without_mode(self.cfg, reply["fatal"]))
            reason = "no answer" if reply is None else reply["fatal"]
            raise SandboxError(f"sandbox worker {self.slot} failed to start: {reason}")
        self.isolation = reply["isolation"]
        self.layers = reply["layers"]
        self.passed_over = reply["passed_over"]

    def _send(self, message: dict) -> None:
        assert self.process is not None and self.process.stdin is not None
        payload = json.dumps(message).encode()
        self.process.stdin.write(HEADER.pack(len(payload)) + payload)
        self.process.stdin.flush()

    def _receive(self, timeout_s: float) -> dict | None:
        """The next frame, or None when the worker died or stayed silent for `timeout_s`."""
        assert self.process is not None and self.process.stdout is not None
        stream = self.process.stdout
        deadline = time.monotonic() + timeout_s
        data = b""
        need = HEADER.size
        header_done = False
        while True:
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([stream], [], [], left)[0]:
                    return None
                chunk = os.read(stream.fileno(), need - len(data))
                if not chunk:
                    return None
                data += chunk
            if header_done:
                return json.loads(data)
            (need,) = HEADER.unpack(data)
            data = b""
            header_done = True
            if need == 0:
                return {}

    def call(self, payload: dict, hard_timeout_s: float) -> tuple[dict | None, str]:
        """One request to the worker: (reply, "") or (None, why). A worker found dead before the
        request is replaced and the request sent to the new one; a worker that dies during it or
        overruns `hard_timeout_s` is killed with every process of its job, and replaced."""
        if self.process is None or self.process.poll() is not None:
            self.stop(graceful=False)
            self.start()
        try:
            self._send(payload)
            reply = self._receive(hard_timeout_s)
        except (OSError, ValueError):
            reply = None
        if reply is not None:
            return reply, ""
        assert self.process is not None
        died = self.process.poll() is not None
        self.stop(graceful=False)
        self.start()
        if died:
            return None, "sandbox worker died during the job"
        return None, f"worker exceeded the hard limit of {hard_timeout_s:.0f} s"

    def run(self, job: ScoreJob, hard_timeout_s: float) -> ScoreResult:
        started = time.monotonic()
        reply, why = self.call(job.as_dict(), hard_timeout_s)
        seconds = time.monotonic() - started
        if reply is None:
            return _failure("error" if "died" in why else "timeout", why, seconds)
        if "harness_error" in reply:
            log.error("sandbox harness error: %s", reply["harness_error"])
            return _failure("error", "sandbox harness error: " + reply["harness_error"][-300:], seconds)
        return ScoreResult.from_dict(reply)

    def stop(self, graceful: bool = True) -> None:
        """Stop the worker (closing its input lets it remove its cgroups itself), then end whatever its
        job left behind: a killed worker cannot clean up after itself."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if graceful and process.poll() is None and process.stdin is not None:
            try:
                process.stdin.close()
                process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # As a non-root user the job processes share our uid, so release_slot cannot find them by uid
        # once their worker is gone (they are reparented away from it): note them while it lives.
        orphans = job_descendants(process.pid) if os.geteuid() != 0 and process.poll() is None else []
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        release_slot(os.getpid(), self.slot)


def refusal_without_mode(cfg: ScoreConfig, reasons: str) -> str:
    """Why no isolation mode started, and what the config could say instead."""
    asked = "auto (native, bwrap, uid)" if cfg.isolation == "auto" else repr(cfg.isolation)
    return (
        f"the sandbox cannot isolate jobs here with score.isolation={asked}: {reasons}. To run jobs with "
        "rlimits, seccomp and Landlock only, under this user's uid, set score.isolation=minimal and remove "
        "separate_uid from score.require"
    )


def refusal_for_layers(cfg: ScoreConfig, isolation: str, layers: dict[str, str]) -> str | None:
    """Why the started sandbox falls short of `cfg.require` (None when it does not), and what to set instead."""
    unmet = unmet_requirements(layers, cfg.require)
    if not unmet:
        return None
    gives = "; ".join(f"{name} needs one of {', '.join(REQUIREMENTS[name])}" for name in unmet)
    keep = [name for name in cfg.require if name not in unmet]
    return (
        f"isolation {isolation!r} on this machine lacks what score.require asks for: {', '.join(unmet)} ({gives}; "
        f"active layers: {', '.join(layers)}). To run without them, set score.require={keep}"
    )


def hard_timeout(cfg: ScoreConfig, job: ScoreJob) -> float:
    spec = job.reward_spec or {}
    runs = len(spec.get("inputs") or []) if spec.get("kind") == "code_stdio" else 1
    # math-verify's parse and verify each get timeout_s; keep room for both.
    budget = cfg.timeout_s * (3 if spec.get("kind") == "math" else max(1, runs))
    return budget + GRACE_S


class Sandbox:
    """Scores model responses; use as a context manager so workers are stopped. Thread-safe: calls
    from several threads (the /run_code server) share the workers, one job per worker at a time."""

    def __init__(self, cfg: ScoreConfig) -> None:
        self.cfg = cfg
        self.workers: list[_Worker] = []
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, cfg: ScoreConfig) -> Sandbox:
        if cfg.backend == "sandbox_fusion":
            from .fusion import FusionSandbox

            return FusionSandbox(cfg)
        return cls(cfg)

    @property
    def layers(self) -> dict[str, str]:
        return self.workers[0].layers if self.workers else {}

    @property
    def isolation(self) -> str:
        return self.workers[0].isolation if self.workers else ""

    def start(self) -> Sandbox:
        try:
            for _ in range(self.cfg.workers):
                slot = _claim_slot()
                try:
                    worker = _Worker(self.cfg, slot)
                except BaseException:
                    _release_slot_id(slot)
                    raise
                self.workers.append(worker)
                self._idle.put(worker)
        except BaseException:
            self.close()
            raise
        refusal = refusal_for_layers(self.cfg, self.isolation, self.layers)
        if refusal is not None:
            self.close()
            raise IsolationRefused(refusal)
        self._executor = ThreadPoolExecutor(len(self.workers), thread_name_prefix="sandbox-feed")
        missing = missing_layers(self.layers)
        passed_over = self.workers[0].passed_over
        log.log(
            logging.WARNING if missing else logging.INFO,
            "sandbox: %d workers, isolation %r%s, active layers: %s%s",
            len(self.workers),
            self.isolation,
            f" (not available here: {'; '.join(passed_over)})" if passed_over else "",
            "; ".join(f"{name} ({detail})" for name, detail in self.layers.items()),
            f"; NOT active on this machine: {', '.join(missing)}" if missing else "",
        )
        return self

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for worker in self.workers:
            worker.stop()
            _release_slot_id(worker.slot)
        self.workers = []
        self._idle = queue.Queue()

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _with_worker(self, use: Callable[[_Worker], _T]) -> _T:
        worker = self._idle.get()
        try:
            return use(worker)
        finally:
            self._idle.put(worker)

    def _score_one(self, job: ScoreJob) -> ScoreResult:
        try:
            return self._with_worker(lambda worker: worker.run(job, hard_timeout(self.cfg, job)))
        except Exception as error:  # a worker that cannot be restarted: score the job, go on
            log.exception("sandbox worker failed")
            return _failure("error", f"sandbox worker failed: {error}", 0.0)

    def score(
        self, jobs: Iterable[ScoreJob], progress: Callable[[int], None] | None = None
    ) -> list[ScoreResult]:
        """Score every job; results come back in the order of `jobs`. `progress(n)` is called on the
        calling thread with the number of jobs just finished."""
        if self._executor is None:
            raise SandboxError("the sandbox is not started; use `with Sandbox.from_config(cfg) as sandbox:`")
        futures = [self._executor.submit(self._score_one, job) for job in jobs]
        for _ in as_completed(futures):
            if progress is not None:
                progress(1)
        return [future.result() for future in futures]

    def leftover_processes(self) -> int:
        """Processes of any job still alive (as root by the workers' job uids and cgroups, else by a
        /proc scan of each worker's process subtree); 0 between jobs. Tests assert on it after every
        attack."""
        return sum(
            slot_processes(os.getpid(), worker.slot, worker.process.pid if worker.process else None)
            for worker in self.workers
        )

    def run_code(self, request: dict) -> dict:
        """SandboxFusion's /run_code for Python, on this sandbox's workers (see server.py)."""
        if self._executor is None:
            raise SandboxError("the sandbox is not started")
        timeout = min(float(request.get("run_timeout") or self.cfg.timeout_s), MAX_RUN_TIMEOUT_S) + GRACE_S

        def use(worker: _Worker) -> dict:
            reply, why = worker.call(dict(request, op="run"), timeout)
            return reply if reply is not None else {"status": "SandboxError", "message": why}

        return self._with_worker(use)
