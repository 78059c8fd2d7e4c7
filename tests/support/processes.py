"""Processes a test starts end with the test process, whatever ends it (issue 29: no orphan, ever).

`spawn_tied` is `subprocess.Popen` in a session of its own (so the test can end the child's whole group, and a
terminal's Ctrl-C reaches only pytest) with the kernel's parent-death signal set (storage/process.py): a pytest
killed by SIGTERM or SIGKILL, whose fixtures' teardown never runs, still takes the child along. What the child
starts is the child's to end (`rlpipe server`'s reaper, the stage server's children, the generation server's
run-lease watch).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from storage.process import die_with_parent


def spawn_tied(command: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` leading a session of its own, and dead with this process."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent(os.getpid()), **popen)
