"""The DeepSpeed launch's guards that need no launch: its timeout setting (`train.launch_timeout_s`, else sized
from the job), and the stale torch-extensions build lock a killed first launch leaves behind, made here for real
with torch's own FileBaton in a process that is then SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.file_baton import FileBaton

from schemas.config import TrainConfig
from stages.rl.deepspeed_backend import launch_timeout, remove_stale_build_locks
from tests.support.processes import spawn_tied


def test_the_launch_timeout_is_the_setting_or_sized_from_the_job() -> None:
    samples = [{"prompt_ids": [1] * 10, "response_ids": [2] * 20}, {"prompt_ids": [1] * 5, "response_ids": [2] * 5}]
    # 40 tokens, trained over 2 epochs plus the old-policy pass: 900 s + 1 s x 40 x 3
    assert launch_timeout(TrainConfig(epochs=2), samples) == 1020.0
    assert launch_timeout(TrainConfig(epochs=2, launch_timeout_s=30), samples) == 30.0


# Takes the build lock as torch's extension build does (cpp_extension: FileBaton.try_acquire, held while
# compiling), says so, and "compiles" until it is killed.
HOLDER = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold(lock: Path) -> subprocess.Popen:
    holder = spawn_tied([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_build_lock_whose_builder_was_killed_is_removed_and_a_held_one_kept(tmp_path: Path) -> None:
    """Two ops' locks under the extensions root (`<build>/<op>/lock`): one whose builder is still compiling,
    one whose builder was SIGKILLed mid-build (the file stays: FileBaton only deletes it on release). Only the
    orphan is removed; a new build then takes its lock at once instead of waiting forever."""
    live = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    orphan = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for lock in (live, orphan):
        lock.parent.mkdir(parents=True)
    builder = hold(live)
    killed = hold(orphan)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert orphan.exists()  # what a later build would wait on
        waiting = FileBaton(str(orphan))
        assert not waiting.try_acquire()
        assert remove_stale_build_locks(tmp_path) == [orphan]
        assert live.exists() and not orphan.exists()
        started = time.monotonic()
        assert waiting.try_acquire()  # the next build goes ahead
        waiting.release()
        assert time.monotonic() - started < 1.0
        assert remove_stale_build_locks(tmp_path) == []  # the builder still holds its lock
    finally:
        builder.kill()
        builder.wait()
    assert remove_stale_build_locks(tmp_path) == [live]  # its builder gone too
    assert not os.path.exists(live)
