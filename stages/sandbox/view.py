"""What a job sees of the host: its environment, the system's directories and its interpreter's, and nothing else.

A job under bubblewrap or in minimal mode has the sandbox user's uid, which can read that user's keys and
credentials (~/.ssh, ~/.aws), the checkout and the storage root; as root, a job's own uid still reads every
world-readable file. So each mode shows a job only SYSTEM_DIRS and the directories its interpreter runs and
imports from (`interpreter_dirs`), read-only, besides its own scratch: bubblewrap by binding them
(`job_file_system`), native mode by a chroot into a tree of binds (`build_job_root`), the others by Landlock
rules over the same directories (isolation.py).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .cgroups import PREFIX
from .kernel import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_REC, mount

# A job's fixed environment: nothing from the parent (tokens, cloud credentials) reaches it.
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONHASHSEED": "0"}

# The operating system's own directories: with its interpreter's, all a job sees of the host, read-only. Not the
# home directories, the checkout, the storage root or other users' files: a job under bubblewrap or in minimal
# mode has the sandbox user's uid, which can read that user's keys and credentials (~/.ssh, ~/.aws).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Device files a job may read and write.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_INTERPRETER_PATHS = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.executable, *sys.path]))"


def interpreter_candidates(configured: str | None) -> list[str]:
    """Interpreters to try for candidate code, best first. The one running rlpipe may live where the
    sandbox uid cannot read it (pyenv under /root); the system's python3 is the usual fallback."""
    if configured:
        return [configured]
    found = [sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    return [path for index, path in enumerate(found) if path not in found[:index] and os.path.exists(path)]


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
    return _outside_system_dirs(wanted, ())


def _outside_system_dirs(paths: set[str], kept: tuple[str, ...]) -> tuple[str, ...]:
    """`paths` that exist and are not already visible (SYSTEM_DIRS, `kept`, or each other), parents first."""
    dirs: list[str] = list(kept)
    for entry in sorted(os.path.abspath(entry) for entry in paths):
        if not os.path.exists(entry) or entry == "/":
            continue
        entry = entry if os.path.isdir(entry) else os.path.dirname(entry)  # a zip on sys.path: its directory
        if any(entry == seen or entry.startswith(seen.rstrip("/") + "/") for seen in (*SYSTEM_DIRS, *dirs)):
            continue
        dirs.append(entry)
    return tuple(dirs[len(kept):])


def view_dirs(interpreters: list[list[str]]) -> tuple[str, ...]:
    """The interpreter directories a job's view needs for any of `interpreters` (argv with flags; one that does
    not start is left out: the probe will not pick it)."""
    dirs: tuple[str, ...] = ()
    for argv in interpreters:
        try:
            found = interpreter_dirs(tuple(argv))
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        dirs += _outside_system_dirs(set(found), dirs)
    return dirs


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


def build_job_root(root: str, interpreter: tuple[str, ...]) -> bool:
    """In the native worker's own mount namespace: at `root`, a small tmpfs holding SYSTEM_DIRS (links kept as
    links) and the `interpreter` directories as binds, DEVICES, an empty /tmp (each job's scratch tmpfs goes
    there) and a /proc; a job chroots into it. The caller makes it read-only. True when /proc hides other
    users' processes (hidepid=2)."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in SYSTEM_DIRS:
        target = root + path
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target)
            mount(path, target, None, MS_BIND | MS_REC)
    for path in interpreter:  # not nested in each other nor in SYSTEM_DIRS (_outside_system_dirs)
        if not under_tmp(path):  # those are bound into each job's /tmp (NativeIsolation.begin_job)
            bind_into(root, path)
    os.makedirs(root + "/dev")
    for device in DEVICES:
        if os.path.exists(device):
            Path(root + device).touch()
            mount(device, root + device, None, MS_BIND)
    os.makedirs(root + "/tmp", exist_ok=True)
    os.makedirs(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        return True
    except OSError:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return False


def bind_into(root: str, path: str) -> str:
    """Bind host directory `path` at the same path below `root`, returning the target. The directories leading
    to it are made with the host's modes and owners, so the tree lets a job's uid reach no more than the host
    does (an interpreter under /root, mode 0700, stays out of its reach, as it is outside the tree)."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts) + 1):
        host = "/" + "/".join(parts[:depth])
        target = root + host
        if not os.path.isdir(target):
            os.mkdir(target)
            status = os.stat(host)
            os.chown(target, status.st_uid, status.st_gid)
            os.chmod(target, status.st_mode & 0o7777)
    mount(path, root + path, None, MS_BIND | MS_REC)
    return root + path


def under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def job_root_dir(owner_pid: int, slot: int) -> str:
    """The empty host directory a native worker mounts its jobs' root tree on (in its own namespace only)."""
    return os.path.join(tempfile.gettempdir(), f"{PREFIX}root-{owner_pid}-{slot}")


def sweep_stale_roots() -> None:
    """Remove the root directories of native workers whose sandbox process is gone."""
    parent = tempfile.gettempdir()
    for name in os.listdir(parent):
        parts = name.split("-")
        if name.startswith(f"{PREFIX}root-") and len(parts) == 5 and not os.path.exists(f"/proc/{parts[3]}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass
