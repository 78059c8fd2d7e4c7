"""Isolation layers for one scoring worker, and the choice among them on this machine.

A worker runs one job at a time; each job's processes run in a fresh child of the worker. Layers, from
the always-available ones up:

- `rlimits`: address space, CPU seconds, file size, open files, no core dumps, and (for a non-root uid)
  a process count. `clean_env`: the child gets a fixed environment, never the parent's. `output_cap` and
  `wall_timeout` are enforced by the worker that reads the child's pipes (process.py).
- `uid`: the job runs as a uid of its own (one per worker, unused by anything else), so it cannot
  signal or ptrace the worker, read root's files, and `kill(-1)` as that uid reaches every process the
  job left behind, whatever session or process group it moved to.
- `netns`: the worker enters an empty network namespace once at start; its children inherit it, so a
  job has no interface but a loopback that is down, and creating the namespace costs nothing per job.
- `mountns`: the worker's private mount namespace where every mount is read-only, /tmp is a fresh
  size-limited tmpfs for each job (mounted before the job, detached after it: nothing to delete), and
  /proc is a procfs that hides other users' processes.
- `cgroup_pids`, `cgroup_memory`, `cgroup_freezer` (cgroup v1, one group per worker): a process limit
  that a fork bomb cannot outrun (RLIMIT_NPROC does nothing for root and counts zombies), a memory limit
  covering the job's tmpfs too, and a freezer so that the end-of-job kill sees a process tree that can no
  longer fork.
- `bwrap`: when the worker is not root, each job runs under bubblewrap (user, pid, net, ipc and mount
  namespaces, read-only root, tmpfs /tmp), which Debian's bubblewrap can do unprivileged.

`choose_isolation` takes the strongest mode the machine gives and reports its layers; the sandbox logs
them at start. A mode named explicitly in the config that cannot be had is an error, never a fallback.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

from schemas.config import ScoreConfig

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner.py")

# A job's fixed environment: nothing from the parent (tokens, cloud credentials) reaches it.
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONHASHSEED": "0"}

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Limits:
    """Per-job resource limits derived from ScoreConfig."""

    timeout_s: float
    memory_bytes: int
    file_bytes: int
    open_files: int
    processes: int
    output_bytes: int

    @classmethod
    def from_config(cls, cfg: ScoreConfig) -> Limits:
        return cls(
            timeout_s=cfg.timeout_s,
            memory_bytes=cfg.memory_mb << 20,
            file_bytes=cfg.file_size_mb << 20,
            open_files=cfg.open_files,
            processes=cfg.max_processes,
            output_bytes=cfg.output_limit_kb << 10,
        )


def job_uid(owner_pid: int, slot: int) -> int:
    """A uid no account uses, distinct per (sandbox process, worker slot): the job-wide kill and
    RLIMIT_NPROC are per uid, so two sandboxes on one machine must never share one."""
    return (1 << 30) + ((owner_pid & 0x3FFFFF) << 6) + (slot & 0x3F)


def set_subreaper() -> None:
    """Orphans of a job (a daemonized grandchild) become the worker's children, so it can reap them."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def apply_rlimits(limits: Limits, cpu_budget_s: float) -> None:
    cpu = max(1, math.ceil(cpu_budget_s)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Counted per uid and including zombies, so only a backstop; the pids cgroup is the real limit.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def kill_uid(uid: int) -> None:
    """SIGKILL every process running as `uid`: a helper drops to that uid and calls kill(-1) until no
    process is left to signal (a fork bomb's children die before they can fork again)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            for _ in range(1000):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    os._exit(0)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)


class Isolation:
    """The minimal mode: rlimits, a process group, clean environment, a temporary directory, and, when
    the worker is root, a uid of its own. Subclasses add namespaces, cgroups or bubblewrap."""

    name = "minimal"

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        self.cfg = cfg
        self.limits = limits
        self.is_root = os.geteuid() == 0
        self.uid = job_uid(owner_pid, slot) if self.is_root else os.geteuid()
        self.python = cfg.python or sys.executable
        self.workdir: str | None = None

    # -- what the sandbox reports at start -------------------------------------------------------
    def layers(self) -> dict[str, str]:
        layers = {
            "rlimits": "AS, CPU, FSIZE, NOFILE, CORE=0" + (", NPROC" if self.is_root else ""),
            "clean_env": "fixed environment",
            "output_cap": f"{self.limits.output_bytes} bytes",
            "wall_timeout": f"{self.limits.timeout_s} s, every process of the job killed",
            "workdir": "fresh temporary directory per job",
        }
        if self.is_root:
            layers["uid"] = f"unprivileged uid {self.uid}"
        return layers

    # -- worker lifetime -------------------------------------------------------------------------
    def start_worker(self) -> None:
        set_subreaper()

    def close(self) -> None:
        pass

    # -- job lifetime ----------------------------------------------------------------------------
    def begin_job(self) -> str:
        """Create the job's working directory; returns it as the child will see it."""
        self.workdir = tempfile.mkdtemp(prefix="rlpipe-job-")
        if self.is_root:
            os.chown(self.workdir, self.uid, self.uid)
        return self.workdir

    def argv(self, mode: str, workdir: str) -> list[str]:
        flags = ["-I"] if self.cfg.site_packages else ["-I", "-S"]
        return [self.python, *flags, RUNNER, mode]

    def child_setup(self, cpu_budget_s: float) -> None:
        """Runs in the forked child, as root when the worker is root, right before exec."""
        os.setsid()
        apply_rlimits(self.limits, cpu_budget_s)
        if self.is_root:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)

    def end_job(self, pid: int) -> None:
        """Kill every process of the job (the main one included), reap them, drop the workdir."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.is_root:
            kill_uid(self.uid)
        reap_children()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def survivors(self) -> int:
        """How many processes of this worker's jobs are alive (0 after end_job); for tests."""
        return count_uid_processes(self.uid) if self.is_root else 0


def count_uid_processes(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                for line in status:
                    if line.startswith("Uid:"):
                        count += int(line.split()[1]) == uid
                        break
        except OSError:
            continue
    return count


def choose_isolation(cfg: ScoreConfig, slot: int, owner_pid: int) -> Isolation:
    limits = Limits.from_config(cfg)
    return Isolation(cfg, limits, slot, owner_pid)
