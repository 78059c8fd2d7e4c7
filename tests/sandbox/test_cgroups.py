"""cgroup v2 for real (stages/sandbox/cgroups.py), as root.

The test mounts a cgroup2 hierarchy of its own (`mount -t cgroup2`). On a hybrid host such as this one the
v1 hierarchies hold the pids and memory controllers, so v2 has neither: membership, cgroup.freeze and
cgroup.kill still work, and the limits must be reported missing. Which controllers v2 has is read from the
kernel's own cgroup.controllers file, so on a v2-only host the same tests expect the limits instead.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob, cgroups
from stages.sandbox.isolation import mount, umount

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
