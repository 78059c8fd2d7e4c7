"""Isolation layers for one scoring worker, and the choice among them on this machine.

A worker runs one job at a time; a job's processes start from the worker's fork server (zygote.py) or, under
bubblewrap, by fork+exec of a read-only copy of the runner in the job's own directory (`place_runner`, so a
checkout under /tmp, hidden by the job's /tmp, still works). Layers: `rlimits` (address space, CPU, file
size, open files, no core dumps, RLIMIT_NPROC sized per job by `nproc_limit`), `clean_env`, `output_cap` and
`wall_timeout` always; as root (mode "native") a `uid` per worker slot, empty `netns`, read-only `mountns` with
a fresh tmpfs /tmp per job, `ipc_uts_ns`, and cgroup v1 `pids` / `memory` / `freezer` groups per slot;
unprivileged (mode "bwrap") bubblewrap per job with its own net, mount (system and interpreter directories
only, read-only; not the home directories, the checkout or the storage root: `job_file_system`), pid, ipc/uts
and user namespaces. Why each layer and its limits: docs/architecture.md, "The sandbox".

`choose_isolation` takes the strongest mode the machine gives ("native" as root, else "bwrap", else
"minimal") and the sandbox logs the active layers, warning about the missing ones. A mode named in the config
that cannot be had is an error, never a silent fallback.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from schemas.config import ScoreConfig

from . import _runner
from .zygote import Zygote, ZygoteError

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner.py")
# An exec'd job runs a copy of the runner placed in its own directory: its /tmp (a tmpfs in native mode, the
# job directory in bwrap) hides a checkout that lives under /tmp, and the project may not be readable by the
# job's uid anyway. The fork server reads RUNNER itself, before any job's /tmp exists.
JOB_RUNNER_NAME = ".rlpipe_runner.py"

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


def _signal_uid(uid: int) -> None:
    """kill(-1, SIGKILL) from a helper running as `uid`: it reaches every process whose real or saved
    uid is `uid`, whatever session or process group it moved to, in one pass over the process table.
    (Its return value cannot tell whether anything matched: the kernel reports success whenever any
    other process exists, so the caller checks /proc instead.)"""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def uid_processes(uid: int, include_zombies: bool = True) -> list[int]:
    """Pids whose real uid is `uid` (from /proc/PID/status: the directory's owner can be faked by a
    process that makes itself non-dumpable)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                zombie = False
                for line in status:
                    if line.startswith(b"State:"):
                        zombie = b"zombie" in line
                    elif line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid and (include_zombies or not zombie):
                            found.append(int(entry))
                        break
        except (OSError, ValueError):
            continue
    return found


def kill_until_gone(
    find: Callable[[], list[int]], kill: Callable[[list[int]], None], timeout_s: float = 10.0
) -> bool:
    """Kill what `find` returns and reap what became ours, until it returns nothing (True) or `timeout_s`
    passes (False). A SIGKILLed process needs a moment to exit, longer on a loaded machine, so the pause
    between rounds grows from 0.5 ms to 10 ms (a fixed number of 1 ms rounds let a daemonized sleeper
    outlive its job under load); with nothing to kill it returns after one `find`. A fork bomb converges:
    a killed process cannot fork again, and the process limits cap it."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while True:
        reap_children()
        left = find()
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        kill(left)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def kill_uid(uid: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL every process running as `uid` (one kill(-1) as that uid per round); True when none is left."""
    return kill_until_gone(lambda: uid_processes(uid), lambda _: _signal_uid(uid), timeout_s)


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, state letter) of every process, from /proc/PID/stat (pids of
    processes in nested pid namespaces as this process's /proc sees them)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                data = handle.read()
            fields = data[data.rindex(b")") + 2 :].split()
            table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0].decode())
        except (OSError, ValueError, IndexError):
            continue
    return table


def job_descendants(worker_pid: int) -> list[int]:
    """Live (not zombie) processes below `worker_pid` outside its session: what its jobs left running.

    The non-root counterpart of `uid_processes`, where jobs share the worker's uid. It finds every
    process of a job because none can leave the worker's subtree: every job process starts in a session
    of its own (setsid before any candidate code), an orphan is reparented to the worker (a subreaper)
    or, under bubblewrap, to the job's pid-namespace init, itself below the worker. What stays in the
    worker's session (the fork server) is the worker's own."""
    table = _process_table()
    if worker_pid not in table:
        return []
    session = table[worker_pid][1]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, seen = [], {worker_pid}
    stack = list(children.get(worker_pid, ()))
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        _, sid, state = table[pid]
        stack.extend(children.get(pid, ()))
        if sid != session and state not in ("Z", "X"):
            found.append(pid)
    return found


def kill_descendants(timeout_s: float = 10.0) -> bool:
    """SIGKILL what this worker's jobs left running (`job_descendants` of this process) and reap what
    became ours; True when none is left. Under bubblewrap the job's pid namespace dies with its init,
    but asynchronously (the init gets its SIGKILL from --die-with-parent, and a namespace's teardown
    takes a while on a loaded machine), so this waits for it, up to `timeout_s`."""
    me = os.getpid()

    def kill(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    return kill_until_gone(lambda: job_descendants(me), kill, timeout_s)


def uid_tasks(uid: int) -> int:
    """Tasks (threads included) whose real uid is `uid`: what RLIMIT_NPROC counts against the limit."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                owner = threads = None
                for line in status:
                    if line.startswith(b"Uid:"):
                        owner = int(line.split()[1])
                    elif line.startswith(b"Threads:"):
                        threads = int(line.split()[1])
                        break
            if owner == uid and threads:
                total += threads
        except (OSError, ValueError):
            continue
    return total


def nproc_limit(processes: int, is_root: bool) -> int:
    """RLIMIT_NPROC for a job. As root the job gets a uid of its own, so the limit is `processes`. As a
    non-root user the job shares the sandbox's uid, whose other tasks count too (a trainer's threads
    alone can exceed `processes`, and bubblewrap could not even start): the limit is what the uid runs
    now plus `processes`, never above the hard limit this process already has. "Now" is where
    setup_params runs: each job's start under fork+exec (bwrap), the fork server's start otherwise."""
    if is_root:
        return processes
    import resource

    limit = uid_tasks(os.getuid()) + processes
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    return limit if hard == resource.RLIM_INFINITY else min(limit, hard)


class Isolation:
    """The minimal mode: rlimits, a session of its own, clean environment, a temporary directory, and,
    when the worker is root, a uid of its own. Subclasses add namespaces, cgroups or bubblewrap.

    Jobs start from the worker's fork server (zygote.py) when `use_zygote` is set, else by fork+exec."""

    name = "minimal"
    use_zygote = True

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        self.cfg = cfg
        self.limits = limits
        self.is_root = os.geteuid() == 0
        self.uid = job_uid(owner_pid, slot) if self.is_root else os.geteuid()
        self.python = cfg.python or sys.executable
        self.workdir: str | None = None
        self.zygote: Zygote | None = None
        self.finished: dict[int, int] = {}  # exit codes of reaped job processes, until end_job
        self.runner_source = Path(RUNNER).read_bytes()  # read while the project is in view (JOB_RUNNER_NAME)

    # -- what the sandbox reports at start -------------------------------------------------------
    def layers(self) -> dict[str, str]:
        """What each active layer gives, by name; FULL_LAYERS (sandbox.py) names those a full setup has."""
        if self.is_root:
            nproc = f"NPROC={self.limits.processes} (the job's own uid: counts only its tasks)"
        else:
            when = "worker start" if self.use_zygote else "job start"
            nproc = (
                f"NPROC=tasks of uid {self.uid} at {when} + {self.limits.processes} (shared with "
                "everything else this uid runs; the only process-count limit without root)"
            )
        layers = {
            "rlimits": f"AS, CPU, FSIZE, NOFILE, CORE=0, {nproc}",
            "clean_env": "fixed environment",
            "output_cap": f"{self.limits.output_bytes} bytes",
            "wall_timeout": f"{self.limits.timeout_s} s, every process of the job killed",
            "workdir": "fresh temporary directory per job",
        }
        if self.is_root:
            layers["uid"] = f"unprivileged uid {self.uid}"
        else:
            layers["user"] = f"the sandbox's own non-root uid {self.uid} (no uid of its own per job)"
        return layers

    def setup_params(self) -> dict:
        """What a job's process applies to itself before running anything (see _runner.isolate)."""
        limits = {
            "RLIMIT_AS": self.limits.memory_bytes,
            "RLIMIT_FSIZE": self.limits.file_bytes,
            "RLIMIT_NOFILE": self.limits.open_files,
            "RLIMIT_CORE": 0,
            # Per real uid, machine-wide, threads and zombies counted (see nproc_limit); always set,
            # the only process-count limit where there is no pids cgroup.
            "RLIMIT_NPROC": nproc_limit(self.limits.processes, self.is_root),
        }
        return {
            "limits": limits,
            "uid": self.uid if self.is_root else None,
            "setsid": True,
            "procs_files": [],
        }

    # -- worker lifetime -------------------------------------------------------------------------
    def start_worker(self) -> None:
        set_subreaper()

    def start_zygote(self) -> None:
        """Start the fork server with the interpreter chosen by the probe (one the job uid can run)."""
        if self.use_zygote:
            argv = self.interpreter_argv("zygote")
            self.zygote = Zygote(argv, CLEAN_ENV, self.setup_params())

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    # -- job lifetime ----------------------------------------------------------------------------
    def begin_job(self) -> str:
        """Create the job's working directory; returns it as the child will see it."""
        self.workdir = tempfile.mkdtemp(prefix="rlpipe-job-")
        if self.is_root:
            os.chown(self.workdir, self.uid, self.uid)
        return self.workdir

    def interpreter(self) -> list[str]:
        """The jobs' interpreter with its flags: isolated mode, and no site-packages unless configured."""
        return [self.python, "-I"] if self.cfg.site_packages else [self.python, "-I", "-S"]

    def interpreter_argv(self, mode: str, runner: str = RUNNER) -> list[str]:
        return [*self.interpreter(), runner, mode]

    def job_view(self, workdir: str) -> str:
        """The job's directory as the job sees it (bubblewrap shows it as /tmp)."""
        return workdir

    def argv(self, mode: str, workdir: str) -> list[str]:
        return self.interpreter_argv(mode, os.path.join(self.job_view(workdir), JOB_RUNNER_NAME))

    def place_runner(self, workdir: str) -> None:
        """Put the exec'd job's read-only copy of the runner in its directory (see JOB_RUNNER_NAME)."""
        path = os.path.join(workdir, JOB_RUNNER_NAME)
        with open(path, "wb") as handle:
            handle.write(self.runner_source)
        os.chmod(path, 0o444)

    def spawn(self, mode: str, fds: list[int], cpu_budget_s: float, workdir: str, exec_: bool = False) -> int:
        """Start the job's process with `fds` as its 0..n; returns its pid. Raises SpawnError."""
        if self.zygote is not None and not exec_:
            try:
                return self.zygote.fork(mode, fds, cpu_budget_s, workdir)
            except ZygoteError:
                # A dead fork server is replaced once; a second failure is a harness fault.
                self.zygote.close()
                self.zygote = None
                self.start_zygote()
                assert self.zygote is not None
                return self.zygote.fork(mode, fds, cpu_budget_s, workdir)
        self.place_runner(workdir)
        return fork_exec(self, mode, fds, cpu_budget_s, workdir)

    def wait_exit(self, pid: int, deadline: float) -> int | None:
        """Exit code of the job's main process (negative: the signal that killed it), None if it is
        still running at `deadline`. Reaps it; asking again returns the same code."""
        if pid in self.finished:
            return self.finished[pid]
        if self.zygote is not None and self.zygote.owns(pid):
            code = self.zygote.wait(pid, deadline)
        else:
            code = None
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.0005)
        if code is not None:
            self.finished[pid] = code
        return code

    def _kill_main(self, pid: int) -> None:
        if pid not in self.finished:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait_exit(pid, time.monotonic() + 10.0)
        self.finished.pop(pid, None)

    def end_job(self, pid: int) -> None:
        """Kill every process of the job (the main one included), reap them, drop the workdir."""
        self._kill_main(pid)
        if self.is_root:
            kill_uid(self.uid)
        else:
            kill_descendants()
        reap_children()
        self.discard_job()

    def discard_job(self) -> None:
        """Drop the job's working directory (also when its child never started)."""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def child_setup(self, cpu_budget_s: float) -> None:
        """fork+exec path: runs in the forked child, right before exec."""
        _runner.isolate(self.setup_params(), cpu_budget_s)

    def survivors(self) -> int:
        """How many processes of this worker's jobs are alive (0 after end_job); for tests. Called in
        the worker: by the job uid as root, else by the worker's process subtree."""
        return len(uid_processes(self.uid)) if self.is_root else len(job_descendants(os.getpid()))


class SpawnError(RuntimeError):
    """The child could not be set up (a layer failed to apply); a harness fault, not the candidate's."""


def fork_exec(isolation: Isolation, mode: str, fds: list[int], cpu_budget_s: float, workdir: str) -> int:
    """Fork a child whose fds 0..n are `fds`, isolate it, and exec the runner (or bubblewrap).

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
            high = [os.dup(fd) for fd in fds]
            for target, fd in enumerate(high):
                os.dup2(fd, target, inheritable=True)
            os.closerange(len(fds), error_write)
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
        chunks = []
        while chunk := os.read(error_read, 65536):
            chunks.append(chunk)
    finally:
        os.close(error_read)
    if chunks:
        os.waitpid(pid, 0)
        raise SpawnError(b"".join(chunks).decode(errors="replace"))
    return pid


# -- kernel interfaces (ctypes: Python 3.11 has no os.unshare / mount) -------------------------------

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share this number


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    result = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(result, f"mount {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def set_mount_attr(path: str, attr_set: int, attr_clr: int) -> None:
    """mount_setattr(2) on `path` and every mount below it, in one system call."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")


# -- cgroup v1 -------------------------------------------------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("pids", "memory", "freezer")


def _own_cgroup(controller: str) -> str | None:
    """This process's group in a v1 hierarchy; job groups nest below it, so the limits of whatever
    contains us (a container's memory group) still apply to the jobs."""
    try:
        with open("/proc/self/cgroup") as lines:
            for line in lines:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path
    except OSError:
        return None
    return None


def cgroup_dirs(owner_pid: int, slot: int) -> dict[str, str]:
    """The job groups of one worker slot, per controller that is mounted and writable here."""
    dirs = {}
    for controller in CONTROLLERS:
        mounted = os.path.join(CGROUP_ROOT, controller)
        own = _own_cgroup(controller)
        if own is None or not os.path.exists(os.path.join(mounted, "cgroup.procs")):
            continue
        parent = os.path.join(mounted, own.lstrip("/"))
        if os.access(parent, os.W_OK):
            dirs[controller] = os.path.join(parent, f"rlpipe-sandbox-{owner_pid}-{slot}")
    return dirs


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read_pids(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as handle:
            return [int(line) for line in handle if line.strip()]
    except OSError:
        return []


def empty_cgroup(dirs: dict[str, str], timeout_s: float = 10.0) -> bool:
    """Kill every process in the job's groups; True once none is left. With the freezer, the tree is
    frozen first so that nothing forks between reading the list and the kill."""
    procs_dir = dirs.get("pids") or dirs.get("memory") or dirs.get("freezer")
    if procs_dir is None:
        return True
    deadline = time.monotonic() + timeout_s
    frozen = False
    freezer = dirs.get("freezer")
    try:
        while True:
            reap_children()
            pids = _read_pids(procs_dir)
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            if freezer is not None and not frozen:
                _write(os.path.join(freezer, "freezer.state"), "FROZEN")
                frozen = True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if frozen:
                # SIGKILL is delivered to frozen tasks once they thaw; thaw so they can die.
                _write(os.path.join(freezer, "freezer.state"), "THAWED")
                frozen = False
            time.sleep(0.0005)
    finally:
        if frozen:
            _write(os.path.join(freezer, "freezer.state"), "THAWED")


def remove_cgroups(dirs: dict[str, str]) -> None:
    empty_cgroup(dirs)
    for directory in dirs.values():
        try:
            os.rmdir(directory)
        except OSError:
            pass


def slot_processes(owner_pid: int, slot: int, worker_pid: int | None = None) -> int:
    """Live processes (zombies awaiting their reaper excluded) of a worker slot's jobs, seen from the
    sandbox's own process: as root by the slot's uid and in the slot's cgroups; as a non-root user
    (jobs share our uid) by the worker's process subtree outside its session (`job_descendants`),
    which needs `worker_pid`. 0 between jobs."""
    if os.geteuid() != 0:
        return len(job_descendants(worker_pid)) if worker_pid is not None else 0
    pids = set(uid_processes(job_uid(owner_pid, slot), include_zombies=False))
    for directory in cgroup_dirs(owner_pid, slot).values():
        pids.update(_read_pids(directory))
    return len(pids)


def _disable_sysv_ipc() -> bool:
    """In the worker's own IPC namespace, allow no SysV shared memory, message queues or semaphores.
    They would outlive a job (IPC objects belong to the namespace, not to a process), letting one job
    leave answers for the next job of the same worker."""
    settings = {"shmmni": "0", "msgmni": "0", "sem": "0 0 0 0"}
    try:
        for name, value in settings.items():
            _write(f"/proc/sys/kernel/{name}", value)
    except OSError:
        return False
    return True


def _sweep_stale_groups(parent: str) -> None:
    """Remove job groups left by sandboxes whose process is gone (killed before it could clean up)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("rlpipe-sandbox-") and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                remove_cgroups({"stale": os.path.join(parent, name)})


def release_slot(owner_pid: int, slot: int) -> None:
    """After a worker died or was killed: end whatever its job left and remove its groups."""
    if os.geteuid() != 0:
        return
    remove_cgroups({name: path for name, path in cgroup_dirs(owner_pid, slot).items() if os.path.isdir(path)})
    kill_uid(job_uid(owner_pid, slot))


class NativeIsolation(Isolation):
    """Root without bubblewrap: the worker's own network, mount, IPC and UTS namespaces (set up once),
    a fresh tmpfs /tmp per job, a per-job uid, rlimits, and cgroup v1 pids/memory/freezer groups."""

    name = "native"

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        super().__init__(cfg, limits, slot, owner_pid)
        if not self.is_root:
            raise OSError("native isolation needs root (uid changes, namespaces, cgroups)")
        self.cgroups = cgroup_dirs(owner_pid, slot)
        self.procs_files: list[str] = []
        self.mounted = False
        self.hidepid = False
        self.sysv_ipc_off = False

    def layers(self) -> dict[str, str]:
        layers = super().layers()
        del layers["workdir"]
        layers["netns"] = "empty network namespace (loopback down)"
        layers["mountns"] = "read-only file system, fresh tmpfs /tmp per job" + (
            ", /proc hides other users' processes" if self.hidepid else ""
        )
        layers["ipc_uts_ns"] = "private SysV IPC and hostname" + (
            ", SysV IPC objects cannot be created" if self.sysv_ipc_off else ""
        )
        if "pids" in self.cgroups:
            layers["cgroup_pids"] = f"pids.max={self.limits.processes}"
        if "memory" in self.cgroups:
            layers["cgroup_memory"] = f"memory.limit_in_bytes={self.limits.memory_bytes}"
        if "freezer" in self.cgroups:
            layers["cgroup_freezer"] = "job frozen before the final kill"
        return layers

    def start_worker(self) -> None:
        super().start_worker()
        self._setup_cgroups()
        unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
        mount("none", "/", None, MS_REC | MS_PRIVATE)
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
            self.hidepid = True
        except OSError:
            pass  # keep the inherited /proc: the job's uid still cannot read other users' details
        self.sysv_ipc_off = _disable_sysv_ipc()
        set_mount_attr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        # The worker itself writes cgroup files (freezer, job membership); jobs cannot: root owns them.
        set_mount_attr(CGROUP_ROOT, 0, MOUNT_ATTR_RDONLY)

    def _setup_cgroups(self) -> None:
        for directory in self.cgroups.values():
            _sweep_stale_groups(os.path.dirname(directory))
        for controller, directory in list(self.cgroups.items()):
            try:
                if os.path.isdir(directory):
                    remove_cgroups({controller: directory})
                os.mkdir(directory)
                if controller == "pids":
                    _write(os.path.join(directory, "pids.max"), str(self.limits.processes))
                elif controller == "memory":
                    _write(os.path.join(directory, "memory.limit_in_bytes"), str(self.limits.memory_bytes))
                    swap = os.path.join(directory, "memory.memsw.limit_in_bytes")
                    if os.path.exists(swap):
                        _write(swap, str(self.limits.memory_bytes))
            except OSError:
                del self.cgroups[controller]  # reported as absent by layers()
        self.procs_files = [os.path.join(directory, "cgroup.procs") for directory in self.cgroups.values()]

    def close(self) -> None:
        remove_cgroups(self.cgroups)

    def begin_job(self) -> str:
        options = f"size={self.limits.file_bytes},mode=0700,uid={self.uid},gid={self.uid}"
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
        self.mounted = True
        self.workdir = "/tmp"
        return self.workdir

    def setup_params(self) -> dict:
        # No session of its own needed: the cgroup finds every process of the job.
        return dict(super().setup_params(), procs_files=self.procs_files, setsid=False)

    def end_job(self, pid: int) -> None:
        self._kill_main(pid)
        if self.cgroups:
            empty_cgroup(self.cgroups)
        else:
            kill_uid(self.uid)
        reap_children()
        self.discard_job()

    def discard_job(self) -> None:
        if self.mounted:
            umount("/tmp")
            self.mounted = False
        self.workdir = None

    def survivors(self) -> int:
        in_groups = len(_read_pids(self.cgroups["pids"])) if "pids" in self.cgroups else 0
        return in_groups + len(uid_processes(self.uid))


# What a bubblewrap job sees of the host besides its interpreter: the operating system's own directories.
# A job under bubblewrap runs as the sandbox's uid, which can read that user's keys and credentials (~/.ssh,
# ~/.aws), the checkout and the storage root; binding all of / read-only would show it all of them.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_INTERPRETER_PATHS = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.executable, *sys.path]))"


@functools.lru_cache(maxsize=8)
def interpreter_dirs(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The directories the interpreter `argv` (with its flags) runs and imports from, outside SYSTEM_DIRS:
    its prefixes, its real executable's directory and its sys.path, as it reports them once."""
    done = subprocess.run([*argv, "-c", _INTERPRETER_PATHS], env=CLEAN_ENV, capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise OSError(f"the sandbox's interpreter {argv[0]} could not start: {done.stderr.strip()[-500:]}")
    prefix, base_prefix, executable, *path = json.loads(done.stdout)
    wanted = {prefix, base_prefix, os.path.dirname(executable), os.path.dirname(os.path.realpath(executable))}
    wanted |= {entry for entry in path if entry}
    dirs: list[str] = []
    for entry in sorted(os.path.abspath(entry) for entry in wanted):
        if not os.path.exists(entry) or entry == "/":
            continue
        entry = entry if os.path.isdir(entry) else os.path.dirname(entry)  # a zip on sys.path: its directory
        if any(entry == kept or entry.startswith(kept.rstrip("/") + "/") for kept in (*SYSTEM_DIRS, *dirs)):
            continue  # already visible
        dirs.append(entry)
    return tuple(dirs)


def job_file_system(python_argv: list[str]) -> list[str]:
    """bubblewrap arguments for a job's view of the host: SYSTEM_DIRS (symbolic links kept as links, as on
    merged-/usr systems) and the interpreter's directories, read-only, and nothing else."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in interpreter_dirs(tuple(python_argv)):
        args += ["--ro-bind", path, path]
    return args


class BwrapIsolation(Isolation):
    """Each job under bubblewrap: user, pid, network, IPC, UTS and cgroup namespaces, of the host's files only
    the system's and the interpreter's directories, read-only (`job_file_system`), the job directory as /tmp,
    its own /proc and read-only /dev. Works without root. When the job's main process ends, bubblewrap's pid
    namespace takes every other process of the job with it."""

    name = "bwrap"
    use_zygote = False  # a new bubblewrap per job is the point; there is nothing warm to fork

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        super().__init__(cfg, limits, slot, owner_pid)
        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        if not os.access(self.bwrap, os.X_OK):
            raise OSError("bubblewrap (bwrap) is not installed")

    def layers(self) -> dict[str, str]:
        """The namespaces bubblewrap gives each job, under the names native mode uses for the same
        protection. No cgroups: the process count is bounded by RLIMIT_NPROC alone (see `rlimits`),
        memory by RLIMIT_AS alone; the pid namespace bounds the job's lifetime, not its size."""
        layers = super().layers()
        layers["workdir"] = "fresh temporary directory per job, seen as /tmp"
        layers["netns"] = "empty network namespace per job (bubblewrap)"
        layers["mountns"] = (
            "only the system's and the interpreter's directories, read-only (no home, checkout or storage "
            "root); job directory bound writable as /tmp, own /proc, own read-only /dev"
        )
        layers["pidns"] = (
            "pid namespace per job: every process of the job dies with its main process or the worker "
            "(bubblewrap --die-with-parent), checked by a /proc scan after each job; not a count limit"
        )
        layers["ipc_uts_ns"] = "SysV IPC namespace and hostname per job (bubblewrap)"
        layers["userns"] = "user namespace without capabilities (bubblewrap --cap-drop ALL)"
        return layers

    # begin_job/discard_job are the base class's: a host temporary directory, which bubblewrap binds
    # as the job's /tmp (so that /run_code's input and output files can be passed through it).

    def job_view(self, workdir: str) -> str:
        return "/tmp"

    def argv(self, mode: str, workdir: str) -> list[str]:
        # --die-with-parent: if the worker dies, so does the job; --new-session: no terminal injection. The
        # interpreter's directories are bound after /tmp, so one under /tmp is still seen (a mount point in
        # the job directory).
        return [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--bind",
            workdir,
            "/tmp",
            *job_file_system(self.interpreter()),  # of the interpreter in use: the probe may change it
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # bubblewrap's own /dev is a writable tmpfs (its /dev/shm too); nothing outside /tmp may be.
            "--remount-ro",
            "/dev",
            # The root itself is bubblewrap's tmpfs (only the binds above are in it): read-only too.
            "--remount-ro",
            "/",
            "--chdir",
            "/tmp",
            "--",
            *super().argv(mode, workdir),
        ]


def _probe_native() -> str | None:
    """Why native isolation cannot work here, or None when it can (tried in a throwaway child)."""
    if os.geteuid() != 0:
        return "not root"
    pid = os.fork()
    if pid == 0:
        try:
            unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
            mount("none", "/", None, MS_REC | MS_PRIVATE)
            set_mount_attr("/", MOUNT_ATTR_RDONLY, 0)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else "namespaces or mount_setattr unavailable"


def choose_isolation(cfg: ScoreConfig, slot: int, owner_pid: int) -> Isolation:
    """The isolation mode for a worker: the configured one (an error if impossible) or, for "auto",
    the strongest this machine gives. The caller logs what is active; nothing falls back silently."""
    limits = Limits.from_config(cfg)
    if cfg.isolation == "native":
        reason = _probe_native()
        if reason is not None:
            raise OSError(f"isolation 'native' is not available: {reason}")
        return NativeIsolation(cfg, limits, slot, owner_pid)
    if cfg.isolation == "bwrap":
        return BwrapIsolation(cfg, limits, slot, owner_pid)
    if cfg.isolation == "minimal":
        return Isolation(cfg, limits, slot, owner_pid)
    if _probe_native() is None:
        return NativeIsolation(cfg, limits, slot, owner_pid)
    try:
        return BwrapIsolation(cfg, limits, slot, owner_pid)
    except OSError:
        return Isolation(cfg, limits, slot, owner_pid)
