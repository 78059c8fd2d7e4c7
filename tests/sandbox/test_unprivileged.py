"""The real sandbox started by a non-root user: "auto" must fall back to bubblewrap (not to nothing),
say which layers are active, and contain every attack of test_attacks.py, each scored as a failure
with no process of the job left.

The suite runs as root, so the test starts a child Python as uid/gid 65534 (nobody), with no
supplementary groups, which starts a Sandbox and runs the attacks; the child reports back as JSON and
the checks are made here. When the interpreter that runs the tests lives where that user cannot
reach it (a pyenv under /root), the child uses the system Python of the same version, with a
throwaway venv outside the repository (in /tmp, removed afterwards) whose .pth names this venv's
site-packages. Nothing is copied into the checkout.

"No process survives" is checked twice after every attack: by the sandbox's own count
(`leftover_processes`, a /proc scan of each worker's process subtree when jobs share the sandbox's uid)
and, independently, by a /proc scan for any live process of the sandbox user that started after the
child and is neither the child nor a current worker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob
from stages.sandbox.isolation import uid_processes
from stages.sandbox.sandbox import PROJECT_ROOT

from .conftest import SECRET
from .test_attacks import ATTACKS, CORRECT, SCRATCH_FILL, SPEC, WRITE_TARGETS, fenced, local_listener

NOBODY = 65534
MAX_PROCESSES = 16
# Forks as many children as it can (each sleeps) and prints how many it got: the process-count limit.
FORK_COUNT = (
    "import os, time\n"
    "count = 0\n"
    "for _ in range(200):\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(60)\n"
    "            os._exit(0)\n"
    "    except OSError:\n"
    "        break\n"
    "    count += 1\n"
    "print(count)\n"
)


# -- the unprivileged child ------------------------------------------------------------------------


def _start_tick(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        data = handle.read()
    return int(data[data.rindex(b")") + 2 :].split()[19])


def _strays(sandbox: Sandbox, since: int) -> list[str]:
    """Live processes of this user started after `since` (clock ticks since boot), other than this
    process and the sandbox's current workers: whatever a job left running, seen without the sandbox."""
    mine = {os.getpid()} | {worker.process.pid for worker in sandbox.workers if worker.process is not None}
    found = []
    for pid in uid_processes(os.getuid(), include_zombies=False):
        try:
            if pid not in mine and _start_tick(pid) >= since:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    command = handle.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {command[:120]}")
        except OSError:
            continue
    return found


def child_main() -> None:
    """Run in the unprivileged child: start a Sandbox with isolation "auto", run every attack, and
    print one JSON report on stdout."""
    logs: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(record.getMessage())

    logging.getLogger("rlpipe.sandbox").addHandler(Collect())
    since = _start_tick(os.getpid())
    report: dict = {"euid": os.geteuid(), "attacks": {}}
    cfg = ScoreConfig(workers=2, timeout_s=2.0, memory_mb=512, max_processes=MAX_PROCESSES, output_limit_kb=64,
                      scratch_mb=16)
    listener = local_listener()
    with Sandbox.from_config(cfg) as sandbox:
        report["isolation"], report["layers"], report["start_log"] = sandbox.isolation, sandbox.layers, logs[:]
        for name, attack in ATTACKS.items():
            started = time.monotonic()
            (result,) = sandbox.score([attack.job(port=listener.getsockname()[1])])
            report["attacks"][name] = {
                "status": result.status,
                "reward": result.reward,
                "seconds": time.monotonic() - started,
                "message": result.tests[0]["message"] if result.tests else "",
                "leftover": sandbox.leftover_processes(),
                "strays": _strays(sandbox, since),
                "workers_alive": all(w.process is not None and w.process.poll() is None for w in sandbox.workers),
            }
        (correct,) = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])
        report["correct_after_attacks"] = correct.status
        spec = {"kind": "code_stdio", "inputs": [""], "outputs": ["never\n"]}
        (forks,) = sandbox.score([ScoreJob(fenced(FORK_COUNT), spec)])
        report["fork_count"] = forks.tests[0]["message"]
        report["fork_count_leftover"] = sandbox.leftover_processes()
        scratch = "scratch_tmpfs" in sandbox.layers  # else the fill would reach the disk
    report["strays_after_close"] = _strays(sandbox, since)
    if scratch:  # a sandbox of its own with a longer budget: bubblewrap's start is slow on a loaded machine
        with Sandbox.from_config(cfg.model_copy(update={"workers": 1, "timeout_s": 20.0})) as filling:
            (fill,) = filling.score([SCRATCH_FILL.job()])
        report["scratch_fill"] = fill.tests[0]["message"]
    try:
        listener.accept()
        report["listener_accepted"] = True
    except TimeoutError:
        report["listener_accepted"] = False
    listener.close()
    print(json.dumps(report))


# -- the test, as root -----------------------------------------------------------------------------


def _others_can_reach(path: str) -> bool:
    """Whether a user outside the owner and group can read `path` (and traverse every directory to it)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for depth in range(1, len(parts)):
        directory = os.sep.join(parts[:depth]) or os.sep
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _python_for_nobody(scratch: str) -> str | None:
    """An interpreter the unprivileged user can run with this venv's packages importable, or None.
    The running one if it is reachable; else the system Python of the same version, through a venv in
    `scratch` (outside the repository) whose .pth file adds this venv's site-packages."""
    site_packages = sysconfig.get_paths()["purelib"]
    if not _others_can_reach(site_packages):
        return None
    if _others_can_reach(sys.executable):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(f"python{version}", path="/usr/bin:/usr/local/bin")
    if system is None or not _others_can_reach(system):
        return None
    os.makedirs(os.path.join(scratch, "bin"))
    own_site = os.path.join(scratch, "lib", f"python{version}", "site-packages")
    os.makedirs(own_site)
    with open(os.path.join(scratch, "pyvenv.cfg"), "w") as handle:
        handle.write(f"home = {os.path.dirname(system)}\ninclude-system-site-packages = false\nversion = {version}\n")
    with open(os.path.join(own_site, "rlpipe-tests.pth"), "w") as handle:
        handle.write(site_packages + "\n")
    python = os.path.join(scratch, "bin", "python")
    os.symlink(system, python)
    for root, _dirs, files in os.walk(scratch):
        os.chmod(root, 0o755)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o644)
    return python


@pytest.fixture(scope="module")
def report() -> dict:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed (the Makefile's system-deps installs it)")
    if not _others_can_reach(PROJECT_ROOT):
        pytest.skip(f"{PROJECT_ROOT} is not readable by an unprivileged user")
    scratch = tempfile.mkdtemp(prefix="rlpipe-unprivileged-")
    try:
        python = _python_for_nobody(scratch)
        if python is None:
            pytest.skip("no Python with rlpipe's dependencies that an unprivileged user can run")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": PROJECT_ROOT,
            "PYTHONDONTWRITEBYTECODE": "1",
            "RLPIPE_SANDBOX_TEST_SECRET": SECRET,
        }
        as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        code = "from tests.sandbox.test_unprivileged import child_main; child_main()"
        done = subprocess.run(
            [python, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, timeout=300, **as_nobody
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def test_auto_falls_back_to_bwrap_and_says_what_is_active(report: dict):
    """As a non-root user "auto" picks bubblewrap and reports its namespaces as active layers; the
    start warning names as NOT active only what is really missing (no job uid of its own, no cgroups)."""
    assert report["euid"] != 0
    assert report["isolation"] == "bwrap"
    layers = report["layers"]
    for layer in ("netns", "mountns", "pidns", "ipc_uts_ns", "userns", "rlimits", "clean_env", "wall_timeout"):
        assert layer in layers
    assert {"seccomp", "scratch_tmpfs"} <= set(layers)  # the job filter; the tmpfs in the worker's user namespace
    assert f"NPROC=tasks of uid {NOBODY} at job start in the worker's user namespace + {MAX_PROCESSES}" in (
        layers["rlimits"]
    )
    (line,) = [line for line in report["start_log"] if "active layers" in line]
    assert "isolation 'bwrap' (not available here: native: isolation 'native' needs root)" in line
    assert "netns (" in line and "pidns (" in line
    assert line.endswith("NOT active on this machine: uid, cgroup_pids, cgroup_memory")


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained_without_root(report: dict, name: str):
    """Each attack of test_attacks.py, run by a non-root sandbox under bubblewrap, is scored as a
    failure within its limit, the workers live on, and no process of the job is left: neither by the
    sandbox's count nor by an independent /proc scan of the sandbox user's processes."""
    outcome = report["attacks"][name]
    assert outcome["status"] != "ok" and outcome["reward"] == 0.0
    assert outcome["seconds"] < 8.0
    assert outcome["leftover"] == 0
    assert outcome["strays"] == []
    assert outcome["workers_alive"]


def test_attacks_were_blocked_not_just_scored_low(report: dict):
    """Beyond the score: nothing was written outside the job directory, the listener saw no connection,
    the secret in the sandbox's environment never reached a job, and a correct answer still passes."""
    attacks = report["attacks"]
    assert "wrote" not in attacks["writes outside the job directory"]["message"]
    for path in WRITE_TARGETS:
        assert not os.path.exists(path)
    assert "got 'blocked" in attacks["network connect to a local listener"]["message"]
    assert report["listener_accepted"] is False
    environment = attacks["reading the parent's environment"]["message"]
    assert "clean [" in environment and "leaked" not in environment.split("got")[1]
    assert SECRET not in environment
    assert report["correct_after_attacks"] == "ok"
    assert report["strays_after_close"] == []
    for name, outcome in attacks.items():
        if name.startswith("seccomp "):
            assert "errno 1\\n'" in outcome["message"], (name, outcome["message"])
    assert "No space left on device" in report["scratch_fill"], report["scratch_fill"]


def test_rlimit_nproc_bounds_the_job_in_bwrap_mode(report: dict):
    """Without cgroups the process count is RLIMIT_NPROC on the shared uid, set to what the uid runs at
    job start plus max_processes: a job gets some processes, never more than max_processes."""
    message = report["fork_count"]
    forks = int(message.split("got '")[1].split("\\n")[0])
    assert 1 <= forks <= MAX_PROCESSES
    assert report["fork_count_leftover"] == 0


def test_the_worker_starts_single_threaded():
    """A sandbox worker enters the user namespace of its scratch tmpfs itself, which the kernel refuses a
    process with more than one thread (EINVAL): its imports must start none. pyarrow's import starts OpenBLAS's
    threads; a one-line import of schemas.tables into the worker's modules once cost bubblewrap its tmpfs."""
    code = (
        "import sys, stages.sandbox.worker\n"
        "threads = open('/proc/self/status').read().split('Threads:')[1].split()[0]\n"
        "print(threads, sorted(m for m in ('numpy', 'pyarrow', 'polars', 'torch') if m in sys.modules))\n"
    )
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": PROJECT_ROOT}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(maxsplit=1) == ["1", "[]\n"]
