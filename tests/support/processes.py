"""Processes a test starts end with the test process, whatever ends it (issue 29: no orphan, ever).

`marked_processes` finds every process carrying a test's marker in its environment (processes inherit it, so
these are all descendants of what the test started, also those that left their group), `kill_marked` ends them.
`start_run_driver` stands in for a flow process: it holds a run's lease until told to release it, or killed.

`spawn_tied` is `subprocess.Popen` in a session of its own (so the test can end the child's whole group, and a
terminal's Ctrl-C reaches only pytest) with the kernel's parent-death signal set (storage/process.py): a pytest
killed by SIGTERM or SIGKILL, whose fixtures' teardown never runs, still takes the child along. What the child
starts is the child's to end (`rlpipe server`'s reaper, the stage server's children, the generation server's
run-lease watch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from storage.process import die_with_parent


def spawn_tied(command: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` leading a session of its own, and dead with this process."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent(os.getpid()), **popen)


def marked_processes(variable: str, marker: str) -> list[int]:
    """Pids of the running processes (zombies excluded) whose environment has `variable=marker`."""
    needle = f"{variable}={marker}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                stat = (environ.parent / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(environ.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def kill_marked(variable: str, marker: str) -> None:
    """SIGKILL every process `marked_processes` finds."""
    for pid in marked_processes(variable, marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


# Holds the lease of run argv[2] under root argv[1] until stdin says "release" (then exits normally) or it is killed.
RUN_DRIVER = """
import sys
from storage.layout import RunLayout
from storage.lock import run_lock
with run_lock(RunLayout.create(sys.argv[1], sys.argv[2])):
    print("driving", flush=True)
    sys.stdin.readline()
print("released", flush=True)
"""


def start_run_driver(root: str, run_id: str) -> subprocess.Popen:
    """A process that holds the run lease as a flow process does (it returns once it holds it); write
    "release" and a newline to its stdin to have it release the lease and exit."""
    driver = spawn_tied([sys.executable, "-c", RUN_DRIVER, root, run_id], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "driving"
    return driver
