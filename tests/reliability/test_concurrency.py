"""Concurrency drills: two drivers of one run, and a person at a shell beside a driver.

Real `rlpipe` processes on one run directory; the leases are the real ones (flock on a local root).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from flows.cli import start_run
from schemas.config import load_config
from storage.layout import RunLayout
from storage.lock import stage_lock

from . import helpers as h


@pytest.fixture
def run(tmp_path: Path) -> RunLayout:
    layout = h.start(str(tmp_path / "root"), tmp_path / "sources")
    h.build_run(layout)
    return layout


def test_two_resumes_at_once_one_drives_the_other_names_it(run: RunLayout, tmp_path: Path) -> None:
    """Proves: two `rlpipe resume` of the same run started at the same moment (with score and everything after it
    stale) end with one driving the run to the end and the other exiting 3 with a message that names the
    driver's host and pid; score and advantage each ran exactly once; the run is complete with exactly the
    expected keys."""
    # Change the score section in the run's config, so that both find score and advantage to do.
    start_run(load_config(None, h.run_overrides(tmp_path / "sources", "score.timeout_s=3")), run.root,
              replace_config=True)
    command = h.rlpipe_command("resume", run.run_id)
    first = h.spawn(command, run.root, tmp_path / "a.log")
    second = h.spawn(command, run.root, tmp_path / "b.log")
    codes = sorted([(h.finish(first, 900), first.pid, "a"), (h.finish(second, 900), second.pid, "b")])
    (winner_code, winner_pid, winner), (loser_code, _, loser) = codes
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("a", "b")}
    assert (winner_code, loser_code) == (0, 3), logs
    assert re.search(rf"being driven by .*\b{winner_pid}\b", logs[loser].replace("\n", "")), logs[loser]
    both = logs["a"] + logs["b"]
    assert both.count("▶ score") == 1 and both.count("▶ advantage") == 1, both
    h.assert_run_done(run)
    h.assert_exact_keys(run)


def test_rlpipe_stage_beside_a_running_stage_waits_or_names_the_holder(run: RunLayout, tmp_path: Path) -> None:
    """Proves: `rlpipe stage score` (a person at a shell) while another process holds score's lease for this
    iteration (as a flow's stage does while it runs) does not run the stage a second time beside it: it exits
    with a message naming the holder, or waits until the lease is free. Score's outputs are untouched while
    the lease is held."""
    before = h.snapshot(Path(run.run_dir))
    with stage_lock(run, "score", 0):
        started = time.monotonic()
        process = h.spawn(h.rlpipe_command("stage", "score", "--run", run.run_id, "--iter", "0"), run.root,
                          tmp_path / "stage.log")
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still waiting after 60 s: it waits for the lease, which is fine
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
