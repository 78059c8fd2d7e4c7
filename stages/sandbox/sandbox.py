"""The sandbox's front door: `Sandbox.from_config(cfg)` and `score(jobs)`, over a pool of warm workers.

The local backend keeps `cfg.workers` worker processes alive for the sandbox's lifetime (starting an
interpreter per job would cost more than most jobs). Each worker has one feeding thread here; threads
only shuttle JSON frames and wait on pipes, so the GIL is not the limit: the workers and their children
do the work. A worker that overruns a job's hard limit (the job's budget plus a grace period, e.g. a
math expression that never finishes parsing) is killed with every process of its job and replaced; the
job is scored as a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from schemas.config import ScoreConfig

from ._runner import HEADER
from .isolation import CLEAN_ENV, release_slot
from .jobs import ScoreJob, ScoreResult

log = logging.getLogger("rlpipe.sandbox")

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# Beyond the job's own budget: process start, judge overhead, a loaded machine.
GRACE_S = 20.0


class SandboxError(RuntimeError):
    """The sandbox could not start (a worker failed to set up its isolation)."""


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
            reason = "no answer" if reply is None else reply["fatal"]
            raise SandboxError(f"sandbox worker {self.slot} failed to start: {reason}")
        self.isolation = reply["isolation"]
        self.layers = reply["layers"]

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

    def run(self, job: ScoreJob, hard_timeout_s: float) -> ScoreResult:
        started = time.monotonic()
        try:
            self._send(job.as_dict())
            reply = self._receive(hard_timeout_s)
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if reply is None:
            # Overran its hard limit or died: kill it and everything its job started, then replace it.
            self.stop(graceful=False)
            self.start()
            return _failure(
                "timeout",
                f"worker exceeded the hard limit of {hard_timeout_s:.0f} s",
                time.monotonic() - started,
            )
        if "harness_error" in reply:
            log.error("sandbox harness error: %s", reply["harness_error"])
            return _failure(
                "error", "sandbox harness error: " + reply["harness_error"][-300:], time.monotonic() - started
            )
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
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        release_slot(os.getpid(), self.slot)


def hard_timeout(cfg: ScoreConfig, job: ScoreJob) -> float:
    spec = job.reward_spec or {}
    runs = len(spec.get("inputs") or []) if spec.get("kind") == "code_stdio" else 1
    # math-verify's parse and verify each get timeout_s; keep room for both.
    budget = cfg.timeout_s * (3 if spec.get("kind") == "math" else max(1, runs))
    return budget + GRACE_S


class Sandbox:
    """Scores model responses; use as a context manager so workers are stopped."""

    def __init__(self, cfg: ScoreConfig) -> None:
        self.cfg = cfg
        self.workers: list[_Worker] = []

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
            for slot in range(self.cfg.workers):
                self.workers.append(_Worker(self.cfg, slot))
        except BaseException:
            self.close()
            raise
        log.info(
            "sandbox: %d workers, isolation %r, active layers: %s",
            len(self.workers),
            self.isolation,
            "; ".join(f"{name} ({detail})" for name, detail in self.layers.items()),
        )
        return self

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def score(
        self, jobs: Iterable[ScoreJob], progress: Callable[[int], None] | None = None
    ) -> list[ScoreResult]:
        """Score every job; results come back in the order of `jobs`."""
        jobs = list(jobs)
        if not self.workers:
            raise SandboxError("the sandbox is not started; use `with Sandbox.from_config(cfg) as sandbox:`")
        pending: queue.Queue[int] = queue.Queue()
        for index in range(len(jobs)):
            pending.put(index)
        finished: queue.Queue[int] = queue.Queue()
        results: list[ScoreResult | None] = [None] * len(jobs)

        def feed(worker: _Worker) -> None:
            while True:
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[index] = worker.run(jobs[index], hard_timeout(self.cfg, jobs[index]))
                except Exception as error:  # a worker that cannot be restarted: score the job, go on
                    log.exception("sandbox worker %d failed", worker.slot)
                    results[index] = _failure("error", f"sandbox worker failed: {error}", 0.0)
                finished.put(index)

        threads = [threading.Thread(target=feed, args=(worker,), daemon=True) for worker in self.workers]
        for thread in threads:
            thread.start()
        for _ in range(len(jobs)):
            finished.get()
            if progress is not None:
                progress(1)
        for thread in threads:
            thread.join()
        return [result for result in results if result is not None]
