"""A worker slot's control group: the job's process limit, memory limit, freezer and kill, on cgroup v1 or v2.

One group per worker slot (`rlpipe-sandbox-<sandbox pid>-<slot>`), reused by each of its jobs: the job's process
joins it before anything else (_runner.isolate), so every process of the job is in it wherever it moves.

- v1 (root; a hierarchy per controller): nested in our own group of `pids`, `memory`, `freezer`. Limits pids.max,
  memory.limit_in_bytes (+ memsw: no swap beyond it); the final kill freezes the group first.
- v2 (one hierarchy, every recent distribution's default): at the top of the hierarchy as root; as another user
  in our own group when it is delegated to us (systemd Delegate=yes: writable by our uid), moving its processes
  into a leaf first when the kernel refuses to hand controllers down ("no internal processes"). Limits pids.max,
  memory.max, memory.swap.max=0; the kill is one write to cgroup.kill (5.14+), else freeze and SIGKILL.
  Membership, freeze and kill need no controller: a controller v2 lacks (v1 holds it on a hybrid host) leaves
  its limit out, and `layers()` says so.

`score.cgroup` picks: "auto" takes v2 where its hierarchy has the pids or memory controller, else v1 where those
are mounted and writable, else v2 for membership, freeze and kill alone.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

V1_ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("pids", "memory", "freezer")
LIMIT_CONTROLLERS = ("pids", "memory")
PREFIX = "rlpipe-sandbox-"


def group_name(owner_pid: int, slot: int) -> str:
    return f"{PREFIX}{owner_pid}-{slot}"


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def read_pids(directory: str) -> list[int]:
    return [int(line) for line in _read(os.path.join(directory, "cgroup.procs")).split() if line.isdigit()]


def reap_children() -> None:
    """Collect every exited child of this process (the worker is a subreaper: orphans land here)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# -- where the hierarchies are ----------------------------------------------------------------------


def v1_own_group(controller: str) -> str | None:
    """This process's group in a v1 hierarchy (from /proc/self/cgroup), or None."""
    for line in _read("/proc/self/cgroup").splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    return None


def v2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (its root, from /proc/self/mountinfo), or None."""
    for line in _read("/proc/self/mountinfo").splitlines():
        before, _, after = line.partition(" - ")
        fields = before.split()
        if after.split()[:1] == ["cgroup2"] and len(fields) > 4 and fields[3] == "/":
            return fields[4]
    return None


def v2_own_group() -> str | None:
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def v2_base(mount: str) -> str | None:
    """The group the job groups go under: the hierarchy's root as root, else our own group if it is
    delegated to us (we may create groups in it and move processes within it)."""
    if os.geteuid() == 0:
        return mount
    own = v2_own_group()
    if own is None:
        return None
    base = os.path.join(mount, own.lstrip("/"))
    writable = all(os.access(os.path.join(base, name), os.W_OK) for name in ("", "cgroup.procs"))
    return base if writable else None


def v1_parents() -> dict[str, str]:
    """controller -> our own group's directory, for each v1 controller mounted and writable here."""
    parents = {}
    for controller in V1_CONTROLLERS:
        mounted = os.path.join(V1_ROOT, controller)
        own = v1_own_group(controller)
        if own is None or not os.path.exists(os.path.join(mounted, "cgroup.procs")):
            continue
        parent = os.path.join(mounted, own.lstrip("/"))
        if os.access(parent, os.W_OK):
            parents[controller] = parent
    return parents


# -- one slot's group --------------------------------------------------------------------------------


@dataclass
class JobGroup:
    """The groups of one worker slot: `dirs` maps a v1 controller (or "unified" for v2) to a directory,
    `mount` is where their hierarchies are mounted; `limits` holds what was set ("pids.max": "16", ...),
    `missing` the limits that could not be had."""

    version: int
    dirs: dict[str, str]
    mount: str
    limits: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def procs_dir(self) -> str:
        return self.dirs.get("unified") or self.dirs.get("pids") or self.dirs.get("memory") or self.dirs["freezer"]

    def procs_files(self) -> list[str]:
        return [os.path.join(directory, "cgroup.procs") for directory in self.dirs.values()]

    def pids(self) -> list[int]:
        return read_pids(self.procs_dir)

    @property
    def has_pids_limit(self) -> bool:
        return "pids.max" in self.limits

    @property
    def has_memory_limit(self) -> bool:
        return any(key in self.limits for key in ("memory.max", "memory.limit_in_bytes"))

    @property
    def can_freeze(self) -> bool:
        return self.version == 2 or "freezer" in self.dirs

    @property
    def can_kill(self) -> bool:
        return self.version == 2 and os.path.exists(os.path.join(self.dirs["unified"], "cgroup.kill"))

    def layers(self) -> dict[str, str]:
        """What the group gives, under the names the sandbox reports (see Isolation.layers)."""
        version = f"cgroup v{self.version}"
        layers = {}
        if self.has_pids_limit:
            layers["cgroup_pids"] = f"pids.max={self.limits['pids.max']} ({version})"
        if self.has_memory_limit:
            memory = {k: v for k, v in self.limits.items() if k.startswith("memory")}
            layers["cgroup_memory"] = ", ".join(f"{k}={v}" for k, v in memory.items()) + f" ({version})"
        ending = []
        if self.can_kill:
            ending.append("cgroup.kill ends every process of the job at once")
        elif self.can_freeze:
            ending.append("the job is frozen before the final kill")
        layers["cgroup_kill" if self.can_kill else "cgroup_freezer"] = (
            f"{'; '.join(ending) or 'membership only'} ({version})"
        )
        return layers

    # -- lifetime ----------------------------------------------------------------------------------
    def create(self, processes: int, memory_bytes: int) -> None:
        """Make the groups (replacing leftovers of the same name) and set the limits that exist here."""
        for directory in self.dirs.values():
            sweep_stale(os.path.dirname(directory))
            if os.path.isdir(directory):
                remove({"old": directory})
            os.mkdir(directory)
        wanted: dict[str, str]
        if self.version == 1:
            wanted = {"pids.max": str(processes), "memory.limit_in_bytes": str(memory_bytes),
                      "memory.memsw.limit_in_bytes": str(memory_bytes)}
            places = {"pids.max": "pids", "memory.limit_in_bytes": "memory", "memory.memsw.limit_in_bytes": "memory"}
            for key, value in wanted.items():
                directory = self.dirs.get(places[key])
                if directory is not None and os.path.exists(os.path.join(directory, key)):
                    _write(os.path.join(directory, key), value)
                    self.limits[key] = value
        else:
            directory = self.dirs["unified"]
            wanted = {"pids.max": str(processes), "memory.max": str(memory_bytes), "memory.swap.max": "0",
                      "memory.oom.group": "1"}
            for key, value in wanted.items():
                if os.path.exists(os.path.join(directory, key)):
                    _write(os.path.join(directory, key), value)
                    self.limits[key] = value
        self.missing = [
            name for name, present in (("pids", self.has_pids_limit), ("memory", self.has_memory_limit)) if not present
        ]

    def empty(self, timeout_s: float = 10.0) -> bool:
        """Kill every process in the group and reap what became ours; True once none is left."""
        deadline = time.monotonic() + timeout_s
        if self.can_kill:
            _write(os.path.join(self.dirs["unified"], "cgroup.kill"), "1")
        freeze = None
        if self.version == 2 and not self.can_kill:
            freeze = (os.path.join(self.dirs["unified"], "cgroup.freeze"), "1", "0")
        elif self.version == 1 and "freezer" in self.dirs:
            freeze = (os.path.join(self.dirs["freezer"], "freezer.state"), "FROZEN", "THAWED")
        frozen = False
        pause = 0.0005
        try:
            while True:
                reap_children()
                pids = self.pids()
                if not pids:
                    return True
                if time.monotonic() > deadline:
                    return False
                if freeze is not None and not frozen:
                    _write(freeze[0], freeze[1])
                    frozen = True
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if frozen:
                    # SIGKILL reaches frozen tasks once they thaw; thaw so that they can die.
                    _write(freeze[0], freeze[2])
                    frozen = False
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        finally:
            if frozen:
                _write(freeze[0], freeze[2])

    def remove(self) -> None:
        remove(self.dirs)


def remove(dirs: dict[str, str]) -> None:
    """Empty and remove groups (directories that do not exist are skipped)."""
    present = {name: path for name, path in dirs.items() if os.path.isdir(path)}
    for directory in present.values():
        for pid in read_pids(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10.0
    for directory in present.values():
        while read_pids(directory) and time.monotonic() < deadline:
            reap_children()
            time.sleep(0.001)
        try:
            os.rmdir(directory)
        except OSError:
            pass


def sweep_stale(parent: str) -> None:
    """Remove job groups left by sandboxes whose process is gone (killed before it could clean up)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                remove({"stale": os.path.join(parent, name)})


def _enable_v2_controllers(base: str) -> None:
    """Hand pids and memory down from `base` to its children where the kernel lets us. A delegated group
    that holds processes cannot: they move to a leaf of their own first."""
    available = set(_read(os.path.join(base, "cgroup.controllers")).split()) & set(LIMIT_CONTROLLERS)
    enabled = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
    todo = available - enabled
    if not todo:
        return
    control = os.path.join(base, "cgroup.subtree_control")
    try:
        _write(control, " ".join(f"+{name}" for name in sorted(todo)))
        return
    except OSError:
        if os.geteuid() == 0:
            return  # a container's root group with processes in it: not ours to rearrange
    leaf = os.path.join(base, "rlpipe-supervisor")
    try:
        os.makedirs(leaf, exist_ok=True)
        for pid in read_pids(base):
            try:
                _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                pass
        _write(control, " ".join(f"+{name}" for name in sorted(todo)))
    except OSError:
        pass  # the limits are then reported missing


def find_group(version: str, owner_pid: int, slot: int) -> JobGroup | None:
    """The slot's group for `score.cgroup` = version ("auto", "v1", "v2"), not created yet; None where
    this machine gives none (no hierarchy mounted, or none writable by us)."""
    name = group_name(owner_pid, slot)
    mount = v2_mount()
    base = v2_base(mount) if mount is not None else None
    v2_limits = set(_read(os.path.join(base, "cgroup.controllers")).split()) & set(LIMIT_CONTROLLERS) if base else set()
    v1 = v1_parents() if os.geteuid() == 0 else {}
    v1_limits = set(v1) & set(LIMIT_CONTROLLERS)
    if version == "v1" or (version == "auto" and v1_limits and not v2_limits):
        if not v1:
            return None
        return JobGroup(1, {controller: os.path.join(parent, name) for controller, parent in v1.items()}, V1_ROOT)
    if base is None:
        return None
    _enable_v2_controllers(base)
    return JobGroup(2, {"unified": os.path.join(base, name)}, mount)


def release(owner_pid: int, slot: int) -> None:
    """After a worker died or was killed: end what is left in its slot's groups (any version) and remove them."""
    name = group_name(owner_pid, slot)
    dirs = {controller: os.path.join(parent, name) for controller, parent in v1_parents().items()}
    mount = v2_mount()
    base = v2_base(mount) if mount is not None else None
    if base is not None:
        dirs["unified"] = os.path.join(base, name)
    remove(dirs)


def slot_pids(owner_pid: int, slot: int) -> set[int]:
    """Live members of a slot's groups, in any hierarchy (a test's or a benchmark's view)."""
    name = group_name(owner_pid, slot)
    dirs = [os.path.join(parent, name) for parent in v1_parents().values()]
    mount = v2_mount()
    base = v2_base(mount) if mount is not None else None
    if base is not None:
        dirs.append(os.path.join(base, name))
    return {pid for directory in dirs for pid in read_pids(directory)}
