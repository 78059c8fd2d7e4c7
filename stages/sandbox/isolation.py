"""Isolation layers for one scoring worker, and the modes that combine them.

A worker runs one job at a time; each job's processes start from the worker's fork server (zygote.py) or by
fork+exec (bubblewrap, and the probe that checks a mode works). The job's own process applies its layers
before the candidate's code runs (_runner.isolate): cgroup membership, its file view, rlimits, its uid,
Landlock, and the seccomp filter of seccomp.py. Modes, strongest first (each class says what it gives):

- `native` (root): the worker's own network, mount, IPC and UTS namespaces; each job chrooted into a tree
  of read-only binds of the system's and the interpreter's directories, with a fresh tmpfs /tmp.
- `bwrap`: each job under bubblewrap (user, pid, network, mount, IPC, UTS namespaces); works unprivileged.
- `uid` (root, no namespaces: a container whose seccomp profile refuses them): a uid of the job's own, and
  Landlock for the file view.
- `minimal`: as `uid`, but a non-root sandbox's jobs share its uid. Only when named.

Every mode adds rlimits, a clean environment, the seccomp filter, and a cgroup (cgroups.py, v1 or v2) where
one can be had. `layers()` names what is in force; sandbox.py refuses to start when a required one is not.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from schemas.config import ScoreConfig

from . import _runner, cgroups
from .cgroups import JobGroup, reap_children
from .kernel import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    mount,
    set_mount_attr,
    umount,
    unshare,
)
from .seccomp import SeccompUnsupported, job_filter
from .view import (
    CLEAN_ENV,
    DEVICES,
    SYSTEM_DIRS,
    bind_into,
    build_job_root,
    interpreter_candidates,
    job_file_system,
    job_root_dir,
    sweep_stale_roots,
    under_tmp,
    view_dirs,
)
from .zygote import Zygote, ZygoteError

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner.py")
# An exec'd job runs a copy of the runner placed in its own directory: its /tmp (a tmpfs in native mode, the
# job directory in bwrap) hides a checkout that lives under /tmp, and the project may not be readable by the
# job's uid anyway. The fork server reads RUNNER itself, before any job's /tmp exists.
JOB_RUNNER_NAME = ".rlpipe_runner.py"

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
    scratch_bytes: int

    @classmethod
    def from_config(cls, cfg: ScoreConfig) -> Limits:
        return cls(
            timeout_s=cfg.timeout_s,
            memory_bytes=cfg.memory_mb << 20,
            file_bytes=cfg.file_size_mb << 20,
            open_files=cfg.open_files,
            processes=cfg.max_processes,
            output_bytes=cfg.output_limit_kb << 10,
            scratch_bytes=cfg.scratch_mb << 20,
        )


def job_uid(owner_pid: int, slot: int) -> int:
    """A uid no account uses, distinct per (sandbox process, worker slot): the job-wide kill and
    RLIMIT_NPROC are per uid, so two sandboxes on one machine must never share one."""
    return (1 << 30) + ((owner_pid & 0x3FFFFF) << 6) + (slot & 0x3F)


def set_subreaper() -> None:
    """Orphans of a job (a daemonized grandchild) become the worker's children, so it can reap them."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


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


def uid_tasks(uid: int, userns: str | None = None) -> int:
    """Tasks (threads included) whose real uid is `uid`, only those in user namespace `userns` (the link
    /proc/PID/ns/user reads) when given: what RLIMIT_NPROC counts against the limit."""
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
            if owner == uid and threads and (userns is None or os.readlink(f"/proc/{entry}/ns/user") == userns):
                total += threads
        except (OSError, ValueError):
            continue
    return total


def nproc_limit(processes: int, is_root: bool, userns: str | None = None) -> int:
    """RLIMIT_NPROC for a job. As root the job gets a uid of its own, so the limit is `processes`. As a
    non-root user the job shares the sandbox's uid, whose other tasks count too (a trainer's threads
    alone can exceed `processes`, and bubblewrap could not even start): the limit is what the uid runs
    now plus `processes`, never above the hard limit this process already has. "Now" is where
    setup_params runs: each job's start under fork+exec (bwrap), the fork server's start otherwise.

    In a user namespace of the worker's own (`userns`), the kernel checks the count of each namespace up
    the chain against the limit in force when the namespace below it was made: the job's (bubblewrap's)
    namespace is made under this limit, so the binding count is the worker namespace's, which holds only
    the worker and its jobs: then "what the uid runs now" is counted in that namespace alone."""
    if is_root:
        return processes
    import resource

    limit = uid_tasks(os.getuid(), userns) + processes
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    return limit if hard == resource.RLIM_INFINITY else min(limit, hard)


# -- the modes --------------------------------------------------------------------------------------

SECCOMP_LAYER = (
    "job filter: sockets AF_UNIX only; no ptrace, mount, bpf, perf_event_open, keyctl, unshare/setns/clone "
    "of namespaces, kexec, module loading or io_uring"
)


class Isolation:
    """The `minimal` mode, and what every mode has: rlimits, a clean environment, a fresh directory per job, the
    seccomp filter, a cgroup where one can be had, and, without a mount namespace, Landlock: the job may read
    and execute only below SYSTEM_DIRS and its interpreter's directories, and write only its own directory.
    As root each job has a uid of its own; as another user the jobs share its uid (hence: only when named).

    Jobs start from the worker's fork server (zygote.py) when `use_zygote` is set, else by fork+exec."""

    name = "minimal"
    use_zygote = True
    needs_root = False
    uses_landlock = True  # modes with a mount namespace of their own show the job its files another way
    needs_view = True  # the interpreters' directories, for Landlock or a chroot (bubblewrap binds its own)

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        self.is_root = os.geteuid() == 0
        if self.needs_root and not self.is_root:
            raise OSError(f"isolation {self.name!r} needs root")
        self.cfg = cfg
        self.limits = limits
        self.slot = slot
        self.owner_pid = owner_pid
        self.uid = job_uid(owner_pid, slot) if self.is_root else os.geteuid()
        self.gid = self.uid if self.is_root else os.getegid()
        self.python = cfg.python or sys.executable
        self.workdir: str | None = None
        self.zygote: Zygote | None = None
        self.finished: dict[int, int] = {}  # exit codes of reaped job processes, until end_job
        self.runner_source = Path(RUNNER).read_bytes()  # read while the project is in view (JOB_RUNNER_NAME)
        self.group: JobGroup | None = None
        self.view: tuple[str, ...] = ()  # interpreter directories a job sees (besides SYSTEM_DIRS)
        self.landlock_abi = 0
        self.userns: str | None = None  # the worker's own user namespace, where it made one (BwrapIsolation)
        try:
            self.seccomp: bytes | None = job_filter()
        except SeccompUnsupported:
            self.seccomp = None  # reported: no "seccomp" layer

    # -- what the sandbox reports at start -------------------------------------------------------
    def layers(self) -> dict[str, str]:
        """What each active layer gives, by name; sandbox.py's FULL_LAYERS names those a full setup has and
        REQUIREMENTS which layers give each protection `score.require` can ask for."""
        if self.is_root:
            nproc = f"NPROC={self.limits.processes} (the job's own uid: counts only its tasks)"
        else:
            when = "worker start" if self.use_zygote else "job start"
            when += " in the worker's user namespace" if self.userns else ""
            nproc = (
                f"NPROC=tasks of uid {self.uid} at {when} + {self.limits.processes} (shared with "
                "everything else this uid runs; the only process-count limit without a pids cgroup)"
            )
        layers = {
            "rlimits": f"AS, CPU, FSIZE, NOFILE, CORE=0, {nproc}",
            "clean_env": "fixed environment",
            "output_cap": f"{self.limits.output_bytes} bytes",
            "wall_timeout": f"{self.limits.timeout_s} s, every process of the job killed",
            "workdir": "fresh directory per job on the host's disk (each file bounded by FSIZE, not their total)",
        }
        if self.is_root:
            layers["uid"] = f"unprivileged uid {self.uid}"
        else:
            layers["user"] = f"the sandbox's own non-root uid {self.uid} (no uid of its own per job)"
        if self.seccomp is not None:
            layers["seccomp"] = SECCOMP_LAYER
        if self.landlock_abi:
            extra = ", TCP bind/connect refused" if self.landlock_abi >= 4 else ""
            extra += ", signals and abstract UNIX sockets only within the job" if self.landlock_abi >= 6 else ""
            layers["landlock"] = (
                f"Landlock ABI {self.landlock_abi}: reads only the system's and the interpreter's directories, "
                f"writes only its own directory{extra}"
            )
        if self.group is not None:
            layers.update(self.group.layers())
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
            "RLIMIT_NPROC": nproc_limit(self.limits.processes, self.is_root, self.userns),
        }
        landlock = None
        if self.landlock_abi:
            read = [path for path in SYSTEM_DIRS if os.path.exists(path)] + list(self.view)
            landlock = {"abi": self.landlock_abi, "read": read, "devices": list(DEVICES)}
        return {
            "limits": limits,
            "uid": self.uid if self.is_root else None,
            "setsid": True,
            "procs_files": self.group.procs_files() if self.group is not None else [],
            "root": None,
            "landlock": landlock,
            "seccomp": self.seccomp,
        }

    # -- worker lifetime -------------------------------------------------------------------------
    def start_worker(self) -> None:
        """Once per worker, before any job: what its jobs will need (the probe then runs one)."""
        set_subreaper()
        self.group = cgroups.find_group(self.cfg.cgroup, self.owner_pid, self.slot)
        if self.group is not None:
            try:
                self.group.create(self.limits.processes, self.limits.memory_bytes)
            except OSError:
                self.group = None  # reported: no cgroup layer
        if self.needs_view:
            candidates = interpreter_candidates(self.cfg.python)
            self.view = view_dirs([self.interpreter_for(python) for python in candidates])
        if self.uses_landlock:
            self.landlock_abi = _runner.landlock_abi()

    def start_zygote(self) -> None:
        """Start the fork server with the interpreter chosen by the probe (one the job uid can run)."""
        if self.use_zygote:
            argv = self.interpreter_argv("zygote")
            self.zygote = Zygote(argv, CLEAN_ENV, self.setup_params())

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self.group is not None:
            self.group.remove()
            self.group = None

    # -- job lifetime ----------------------------------------------------------------------------
    def begin_job(self) -> str:
        """Create the job's working directory; returns it as this worker sees it."""
        self.workdir = tempfile.mkdtemp(prefix="rlpipe-job-")
        if self.is_root:
            os.chown(self.workdir, self.uid, self.gid)
        return self.workdir

    def interpreter_for(self, python: str) -> list[str]:
        """An interpreter with the jobs' flags: isolated mode, and no site-packages unless configured."""
        return [python, "-I"] if self.cfg.site_packages else [python, "-I", "-S"]

    def interpreter(self) -> list[str]:
        return self.interpreter_for(self.python)

    def interpreter_argv(self, mode: str, runner: str = RUNNER) -> list[str]:
        return [*self.interpreter(), runner, mode]

    def job_view(self, workdir: str) -> str:
        """The job's directory as the job sees it (a chroot or bubblewrap shows it as /tmp)."""
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
            view = self.job_view(workdir)
            try:
                return self.zygote.fork(mode, fds, cpu_budget_s, view)
            except ZygoteError:
                # A dead fork server is replaced once; a second failure is a harness fault.
                self.zygote.close()
                self.zygote = None
                self.start_zygote()
                assert self.zygote is not None
                return self.zygote.fork(mode, fds, cpu_budget_s, view)
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
        """Kill every process of the job (the main one included), reap them, drop the workdir. As root the
        cgroup holds every process of the job (the job cannot write a root-owned cgroup.procs); without one,
        or as a user whose jobs share its uid, the uid or the worker's process subtree finds them too; so it
        does under bubblewrap, whose processes die asynchronously with their pid namespace (one that has left
        the cgroup may still be exiting)."""
        self._kill_main(pid)
        if self.group is not None:
            self.group.empty()
        if self.group is None or not self.is_root or not self.use_zygote:
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

    def child_setup(self, cpu_budget_s: float, workdir: str) -> None:
        """fork+exec path: runs in the forked child, right before exec."""
        _runner.isolate(self.setup_params(), cpu_budget_s, self.job_view(workdir))

class UidIsolation(Isolation):
    """The `uid` mode: `minimal` as root (a uid per job), what `auto` takes where namespaces are refused (a
    container under a default seccomp profile): uid, rlimits, seccomp, Landlock, and a cgroup if writable."""

    name = "uid"
    needs_root = True


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
            isolation.child_setup(cpu_budget_s, workdir)
            # Move sources out of the target range first, so that dup2 never clobbers a pending one.
            high = [os.dup(fd) for fd in fds]
            for target, fd in enumerate(high):
                os.dup2(fd, target, inheritable=True)
            os.closerange(len(fds), error_write)
            os.closerange(error_write + 1, 65536)
            os.chdir(isolation.job_view(workdir))
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


def _disable_sysv_ipc() -> bool:
    """In the worker's own IPC namespace, allow no SysV shared memory, message queues or semaphores.
    They would outlive a job (IPC objects belong to the namespace, not to a process), letting one job
    leave answers for the next job of the same worker."""
    settings = {"shmmni": "0", "msgmni": "0", "sem": "0 0 0 0"}
    try:
        for name, value in settings.items():
            with open(f"/proc/sys/kernel/{name}", "w") as handle:
                handle.write(value)
    except OSError:
        return False
    return True


def slot_processes(owner_pid: int, slot: int, worker_pid: int | None = None) -> int:
    """Live processes (zombies awaiting their reaper excluded) of a worker slot's jobs, seen from the
    sandbox's own process: in the slot's cgroups, and as root by the slot's uid, as a non-root user (jobs
    share our uid) by the worker's process subtree outside its session (`job_descendants`), which needs
    `worker_pid`. 0 between jobs."""
    pids = cgroups.slot_pids(owner_pid, slot)
    if os.geteuid() == 0:
        pids |= set(uid_processes(job_uid(owner_pid, slot), include_zombies=False))
    elif worker_pid is not None:
        pids |= set(job_descendants(worker_pid))
    return len(pids)


def release_slot(owner_pid: int, slot: int) -> None:
    """After a worker died or was killed: end whatever its job left, remove its groups and its root directory."""
    cgroups.release(owner_pid, slot)
    if os.geteuid() == 0:
        kill_uid(job_uid(owner_pid, slot))
        try:
            os.rmdir(job_root_dir(owner_pid, slot))
        except OSError:
            pass


class NativeIsolation(Isolation):
    """Root, with namespaces: the worker's own network (empty: loopback down), mount, IPC (no SysV objects can be
    created: they would outlive a job) and UTS namespaces, set up once; each job chrooted into a read-only tree
    of the system's and the interpreter's directories (`build_job_root`) whose /tmp is a fresh tmpfs of
    `scratch_mb` per job, mounted before it and detached after it; a uid per job; rlimits; seccomp; cgroups."""

    name = "native"
    needs_root = True
    uses_landlock = False

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        super().__init__(cfg, limits, slot, owner_pid)
        reason = _probe_native()
        if reason is not None:
            raise OSError(f"isolation 'native' is not available: {reason}")
        self.root = job_root_dir(owner_pid, slot)
        self.mounted = False
        self.hidepid = False
        self.sysv_ipc_off = False

    def layers(self) -> dict[str, str]:
        layers = super().layers()
        del layers["workdir"]
        layers["netns"] = "empty network namespace (loopback down)"
        layers["mountns"] = (
            "chroot into read-only binds of the system's and the interpreter's directories only (no home, "
            "checkout or storage root)" + (", /proc hides other users' processes" if self.hidepid else "")
        )
        layers["scratch_tmpfs"] = f"fresh tmpfs /tmp of {self.limits.scratch_bytes >> 20} MiB per job"
        layers["ipc_uts_ns"] = "private SysV IPC and hostname" + (
            ", SysV IPC objects cannot be created" if self.sysv_ipc_off else ""
        )
        return layers

    def start_worker(self) -> None:
        super().start_worker()
        sweep_stale_roots()
        os.makedirs(self.root, exist_ok=True)  # on the host, empty: the tree is mounted on it in our namespace
        unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
        mount("none", "/", None, MS_REC | MS_PRIVATE)
        self.hidepid = build_job_root(self.root, self.view)
        self.sysv_ipc_off = _disable_sysv_ipc()
        set_mount_attr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        # The worker itself writes cgroup files (limits, membership, kill); jobs do not see them.
        if self.group is not None:
            set_mount_attr(self.group.mount, 0, MOUNT_ATTR_RDONLY)

    def setup_params(self) -> dict:
        # No session of its own needed where the cgroup finds every process of the job.
        return dict(super().setup_params(), root=self.root, setsid=self.group is None)

    def begin_job(self) -> str:
        options = f"size={self.limits.scratch_bytes},mode=0700,uid={self.uid},gid={self.gid}"
        self.workdir = os.path.join(self.root, "tmp")
        mount("tmpfs", self.workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)
        self.mounted = True
        # An interpreter that lives under /tmp (a checkout's virtual environment there) is bound into the job's
        # /tmp, read-only, as bubblewrap does; the detach after the job takes these mounts with it.
        for path in filter(under_tmp, self.view):
            set_mount_attr(bind_into(self.root, path), MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        return self.workdir

    def job_view(self, workdir: str) -> str:
        return "/tmp"

    def discard_job(self) -> None:
        if self.mounted:
            umount(self.workdir or os.path.join(self.root, "tmp"))
            self.mounted = False
        self.workdir = None


class BwrapIsolation(Isolation):
    """Each job under bubblewrap: user, pid, network, IPC, UTS and cgroup namespaces, of the host's files only
    the system's and the interpreter's directories, read-only (`job_file_system`), the job directory as /tmp,
    its own /proc and read-only /dev; the seccomp filter through `--seccomp`. Works without root. When the
    job's main process ends, bubblewrap's pid namespace takes every other process of the job with it.

    The job directory is a tmpfs of `scratch_mb` mounted by the worker in a mount namespace of its own (as a
    non-root user inside a user namespace of its own, mapped to itself; bubblewrap nests in it); where that
    namespace cannot be had, it is a plain directory and the layer is reported missing."""

    name = "bwrap"
    use_zygote = False  # a new bubblewrap per job is the point; there is nothing warm to fork
    uses_landlock = False
    needs_view = False

    def __init__(self, cfg: ScoreConfig, limits: Limits, slot: int, owner_pid: int) -> None:
        super().__init__(cfg, limits, slot, owner_pid)
        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        if not os.access(self.bwrap, os.X_OK):
            raise OSError("bubblewrap (bwrap) is not installed")
        self.scratch_tmpfs = False
        self.mounted = False
        self.seccomp_fd: int | None = None

    def layers(self) -> dict[str, str]:
        """The namespaces bubblewrap gives each job, under the names native mode uses for the same protection.
        Without cgroups the process count is bounded by RLIMIT_NPROC alone (see `rlimits`), memory by
        RLIMIT_AS alone; the pid namespace bounds the job's lifetime, not its size."""
        layers = super().layers()
        layers["workdir"] = "fresh directory per job, seen as /tmp"
        if self.scratch_tmpfs:
            layers["scratch_tmpfs"] = f"the job directory is a fresh tmpfs of {self.limits.scratch_bytes >> 20} MiB"
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

    def start_worker(self) -> None:
        super().start_worker()
        self.scratch_tmpfs = _probe_scratch_namespace(self.is_root) is None and _enter_scratch_namespace(self.is_root)
        if self.scratch_tmpfs and not self.is_root:
            self.userns = os.readlink("/proc/self/ns/user")

    def setup_params(self) -> dict:
        # bubblewrap needs namespaces and mounts, which both restrictions refuse: it applies the filter itself.
        return dict(super().setup_params(), seccomp=None, landlock=None)

    def begin_job(self) -> str:
        workdir = super().begin_job()
        if self.scratch_tmpfs:
            options = f"size={self.limits.scratch_bytes},mode=0700,uid={self.uid},gid={self.gid}"
            mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)
            self.mounted = True
        return workdir

    def discard_job(self) -> None:
        if self.mounted and self.workdir is not None:
            umount(self.workdir)
            self.mounted = False
        super().discard_job()

    def job_view(self, workdir: str) -> str:
        return "/tmp"

    def spawn(self, mode: str, fds: list[int], cpu_budget_s: float, workdir: str, exec_: bool = False) -> int:
        if self.seccomp is None:
            return super().spawn(mode, fds, cpu_budget_s, workdir, exec_)
        program = os.memfd_create("rlpipe-seccomp", os.MFD_CLOEXEC)
        try:
            os.write(program, self.seccomp)
            os.lseek(program, 0, os.SEEK_SET)
            self.seccomp_fd = len(fds)  # where fork_exec puts it
            return super().spawn(mode, [*fds, program], cpu_budget_s, workdir, exec_)
        finally:
            os.close(program)
            self.seccomp_fd = None

    def argv(self, mode: str, workdir: str) -> list[str]:
        # --die-with-parent: if the worker dies, so does the job; --new-session: no terminal injection. The
        # interpreter's directories are bound after /tmp, so one under /tmp is still seen (a mount point in
        # the job directory).
        seccomp = ["--seccomp", str(self.seccomp_fd)] if self.seccomp_fd is not None else []
        return [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            *seccomp,
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


def _enter_scratch_namespace(is_root: bool) -> bool:
    """Give this process a mount namespace of its own (as a non-root user inside a user namespace of its own,
    mapped to itself), where it may mount tmpfs; True when it has one."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWNS if is_root else CLONE_NEWUSER | CLONE_NEWNS)
        if not is_root:
            for name, value in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as handle:
                    handle.write(value)
        mount("none", "/", None, MS_REC | MS_PRIVATE)
    except OSError:
        return False
    return True


def _probe_scratch_namespace(is_root: bool) -> str | None:
    """Why `_enter_scratch_namespace` would fail here, or None (tried in a throwaway child first: a user
    namespace entered but left unmapped could not be undone)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _enter_scratch_namespace(is_root) else 1)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else "no mount namespace for the job directory's tmpfs"


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


# The modes by name, and the order `auto` tries them in: `minimal` is never tried, only named.
MODES: dict[str, type[Isolation]] = {
    "native": NativeIsolation, "bwrap": BwrapIsolation, "uid": UidIsolation, "minimal": Isolation,
}
AUTO_ORDER = ("native", "bwrap", "uid")


def candidate_modes(cfg: ScoreConfig) -> tuple[str, ...]:
    return AUTO_ORDER if cfg.isolation == "auto" else (cfg.isolation,)


def make_isolation(mode: str, cfg: ScoreConfig, slot: int, owner_pid: int) -> Isolation:
    """An isolation of `mode` for a worker slot; raises OSError naming why this machine cannot give it."""
    return MODES[mode](cfg, Limits.from_config(cfg), slot, owner_pid)
