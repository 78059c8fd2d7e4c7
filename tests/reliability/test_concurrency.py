"""Concurrency drill: a person at a shell beside a running stage.

(Two `rlpipe resume` at once is drilled at the end of test_crash.py's flow drills, where it also finishes the
run those drills killed.) Real `rlpipe` processes on one run directory; the lease is the real one (flock).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from stages.registry import instance
from storage.layout import RunLayout
from storage.lock import stage_lock

from . import helpers as h


@pytest.fixture
def run(clone: RunLayout) -> RunLayout:
    return clone


def test_rlpipe_stage_beside_a_running_stage_waits_or_names_the_holder(run: RunLayout, tmp_path: Path) -> None:
    """Proves: `rlpipe stage score` (a person at a shell) while another process holds score's lease for this
    iteration (as a flow's stage does while it runs) does not run the stage a second time beside it: it exits
    with a message naming the holder, or waits until the lease is free. Score's outputs are untouched while
    the lease is held."""
    before = h.snapshot(Path(run.run_dir))
    with stage_lock(run, instance("score", 0)):
        started = time.monotonic()
        process = h.spawn(h.rlpipe_command("stage", "score", "--run", run.run_id, "--iter", "0"), run.root,
                          tmp_path / "stage.log")
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still waiting after 30 s: it waits for the lease, which is fine
            code = None
        waited = time.monotonic() - started
        during = h.snapshot(Path(run.run_dir))
    if code is None:
        code = h.finish(process, 600)
        assert code == 0
    else:
        h.finish(process)
        output = (tmp_path / "stage.log").read_text().replace("\n", "")
        assert code != 0 and str(os.getpid()) in output, f"ran beside the holder (exit {code}, {waited:.0f}s):" \
            f" {output[-1500:]}"
    assert {k for k in before if during.get(k) != before[k]} == set(), "score ran while another held its lease"
