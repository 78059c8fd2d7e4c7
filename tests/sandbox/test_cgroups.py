"""cgroup v2 for real (stages/sandbox/cgroups.py), as root.

The test mounts a cgroup2 hierarchy of its own (`mount -t cgroup2`). On a hybrid host such as this one the
v1 hierarchies hold the pids and memory controllers, so v2 has neither: membership, cgroup.freeze and
cgroup.kill still work, and the limits must be reported missing. Which controllers v2 has is read from the
kernel's own cgroup.controllers file, so on a v2-only host the same tests expect the limits instead. A group of
the hierarchy chowned to an unprivileged user stands for a systemd-delegated one (Delegate=yes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob, cgroups
from stages.sandbox.kernel import mount, umount
from stages.sandbox.sandbox import PROJECT_ROOT

from .test_attacks import ATTACKS, CORRECT, SPEC, fenced, local_listener, run_contained

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a cgroup2 hierarchy needs root")


@pytest.fixture(scope="module")
def cgroup2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cgroup2 hierarchy mounted here for the tests (the one hierarchy v2 has: the same groups as any
    other mount of it); unmounted after."""
    target = tmp_path_factory.mktemp("cgroup2")
    mount("none", str(target), "cgroup2", 0)
    try:
        yield target
    finally:
        umount(str(target))


def v2_limit_controllers(cgroup2: Path) -> set[str]:
    return set((cgroup2 / "cgroup.controllers").read_text().split()) & {"pids", "memory"}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_v2_group_holds_a_process_tree_and_kills_it_at_once(cgroup2: Path) -> None:
    """A slot's v2 group: created at the top of the hierarchy (we are root), a process tree started in it is
    listed in its cgroup.procs, cgroup.kill ends all of it, and the group is removed; the limits the kernel
    cannot give (no controller) are named in `missing` and absent from the layers."""
    group = cgroups.find_group("v2", os.getpid(), 63)
    assert group is not None and group.version == 2
    group.create(processes=16, memory_bytes=256 << 20)
    name = cgroups.group_name(os.getpid(), 63)
    try:
        assert (cgroup2 / name).is_dir()  # our mount shows it: one hierarchy
        procs = str(cgroup2 / name / "cgroup.procs")
        tree = subprocess.Popen(
            ["/bin/sh", "-c", "sleep 60 & sleep 60 & sleep 60"],
            preexec_fn=lambda: Path(procs).write_text(str(os.getpid())),
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while len(group.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = group.pids()
        assert len(members) >= 3 and all(alive(pid) for pid in members)
        layers = group.layers()
        assert "cgroup_kill" in layers and "(cgroup v2)" in layers["cgroup_kill"]
        controllers = v2_limit_controllers(cgroup2)
        assert ("cgroup_pids" in layers) == ("pids" in controllers)
        assert ("cgroup_memory" in layers) == ("memory" in controllers)
        assert set(group.missing) == {"pids", "memory"} - controllers
        assert group.empty(timeout_s=10)
        tree.wait(timeout=10)
        assert not any(alive(pid) for pid in members)
    finally:
        group.remove()
    assert not (cgroup2 / name).exists()


@pytest.mark.slow
def test_the_attacks_are_contained_through_the_v2_path(cgroup2: Path) -> None:
    """A native sandbox told to use cgroup v2: each job is in the slot's v2 group (its own /proc/self/cgroup
    says so), its end is cgroup.kill, every attack program is contained with no process left, and closing
    the sandbox removes the group."""
    cfg = ScoreConfig(workers=1, timeout_s=2.0, memory_mb=512, max_processes=16, output_limit_kb=64, cgroup="v2")
    with Sandbox.from_config(cfg) as sandbox:
        assert sandbox.isolation == "native"
        assert "(cgroup v2)" in sandbox.layers["cgroup_kill"]
        controllers = v2_limit_controllers(cgroup2)
        assert ("cgroup_pids" in sandbox.layers) == ("pids" in controllers)
        assert ("cgroup_memory" in sandbox.layers) == ("memory" in controllers)
        slot = sandbox.workers[0].slot
        name = cgroups.group_name(os.getpid(), slot)
        spec = {"kind": "code_stdio", "inputs": [""], "outputs": [f"0::/{name}\n"]}
        where = "print([line for line in open('/proc/self/cgroup').read().splitlines() if line.startswith('0::')][0])"
        (member,) = sandbox.score([ScoreJob(fenced(where), spec)])
        assert member.status == "ok", member.tests
        assert (cgroup2 / name).is_dir()
        listener = local_listener()
        for attack in ATTACKS.values():
            run_contained(sandbox, attack, port=listener.getsockname()[1])
        listener.close()
        (good,) = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])
        assert good.status == "ok"
    assert not (cgroup2 / name).exists()


# Run as an unprivileged user inside a group delegated to it: a bwrap sandbox told to use cgroup v2.
DELEGATED_CHILD = """
import json, os, sys, threading, time
sys.stdin.readline()  # the test moves this process into the delegated group first
from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob, cgroups
from tests.sandbox.test_attacks import ATTACKS, CORRECT, SPEC, fenced
cfg = ScoreConfig(workers=1, timeout_s=2.0, memory_mb=512, max_processes=16, output_limit_kb=64, isolation="bwrap",
                  cgroup="v2")
report = {"attacks": {}}
with Sandbox.from_config(cfg) as sandbox:
    report["layers"], report["slot"] = sandbox.layers, sandbox.workers[0].slot
    # A job's processes seen in the slot's group while it runs (bubblewrap gives the job a cgroup namespace of
    # its own, so it cannot tell from inside).
    mount = cgroups.v2_mount()
    report["group"] = os.path.join(cgroups.v2_base(mount), cgroups.group_name(os.getpid(), report["slot"]))
    sleeper = ScoreJob("```python\\nimport time\\ntime.sleep(1.5)\\n```", {"kind": "code_stdio", "inputs": [""],
                                                                           "outputs": [""]})
    running = threading.Thread(target=sandbox.score, args=([sleeper],))
    running.start()
    seen = []
    while running.is_alive():
        seen.append(len(cgroups.read_pids(report["group"])))
        time.sleep(0.05)
    report["members_during_job"] = max(seen)
    for name, attack in ATTACKS.items():
        (result,) = sandbox.score([attack.job()])
        report["attacks"][name] = [result.status, sandbox.leftover_processes()]
    report["correct"] = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])[0].status
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_user_sandbox_uses_its_delegated_v2_group(cgroup2: Path) -> None:
    """An unprivileged user whose own cgroup is delegated to it (as systemd's Delegate=yes does: the group's
    directory and its cgroup.procs, cgroup.subtree_control and cgroup.threads owned by the user): the sandbox puts
    each bubblewrap job in a group below its own, ends jobs with cgroup.kill, contains every attack, and removes
    its groups at close."""
    from .test_unprivileged import NOBODY, _others_can_reach, _python_for_nobody

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    if not _others_can_reach(PROJECT_ROOT):
        pytest.skip(f"{PROJECT_ROOT} is not readable by an unprivileged user")
    scratch = tempfile.mkdtemp(prefix="rlpipe-delegated-")  # outside the repository, reachable by the user
    python = _python_for_nobody(scratch)
    if python is None:
        shutil.rmtree(scratch, ignore_errors=True)
        pytest.skip("no Python with rlpipe's dependencies that an unprivileged user can run")
    delegated = cgroup2 / f"rlpipe-test-delegated-{os.getpid()}"
    delegated.mkdir()
    for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
        os.chown(delegated / name, NOBODY, NOBODY)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": PROJECT_ROOT,
           "PYTHONDONTWRITEBYTECODE": "1"}
    child = subprocess.Popen([python, "-c", DELEGATED_CHILD], env=env, cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, user=NOBODY, group=NOBODY, extra_groups=[])
    try:
        (delegated / "cgroup.procs").write_text(str(child.pid))
        out, err = child.communicate(b"go\n", timeout=300)
        assert child.returncode == 0, err.decode(errors="replace")[-3000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert "(cgroup v2)" in report["layers"]["cgroup_kill"]
        name = cgroups.group_name(child.pid, report["slot"])
        assert report["group"].endswith(f"/{delegated.name}/{name}")  # below its own group, not at the top
        assert report["members_during_job"] >= 2, report["members_during_job"]  # bubblewrap and the job at least
        for attack, (status, leftover) in report["attacks"].items():
            assert status != "ok" and leftover == 0, attack
        assert report["correct"] == "ok"
        assert [path.name for path in delegated.iterdir() if path.is_dir()] == []  # the sandbox removed its groups
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        cgroups.remove({"delegated": str(delegated)})
        shutil.rmtree(scratch, ignore_errors=True)
