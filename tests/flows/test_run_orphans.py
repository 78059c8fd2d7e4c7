"""A killed `rlpipe run` leaves nothing running (issue 29): Prefect's temporary server included.

`rlpipe run` of the default job in a subprocess carrying a marker in its environment, which every process below
it inherits. Once Prefect's temporary server (a uvicorn process Prefect starts, with no tie to its starter) is up
beside the stage server, the run gets SIGKILL (nothing of it runs after) or SIGTERM (which it does not catch:
the same end). 10 s later no process with the marker may be left. Before `GroupReaper(follow_children=True)`
the temporary server outlived the run for good (found after a soak's SIGTERM, 2026-11-28).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.reliability import helpers as h
from tests.support.processes import kill_marked, marked_processes, spawn_tied

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER_VARIABLE = "RLPIPE_TEST_RUN_ORPHANS"
ORPHAN_BOUND_S = 10.0


def prefect_server_of(run: subprocess.Popen) -> psutil.Process | None:
    """The run's Prefect temporary server, a child of the run process, once it is there."""
    try:
        children = psutil.Process(run.pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if "uvicorn" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_run_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """Proves: 10 s after `rlpipe run` is killed (its Prefect temporary server and stage server up), no process
    it started, nor any they started, is running."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), MARKER_VARIABLE: marker}
    command = [sys.executable, "-m", "flows.cli", "run", "--root", str(tmp_path / "root"), "--set",
               "generate.backend=hf"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = spawn_tied(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        h.wait_for(lambda: prefect_server_of(run) is not None or run.poll() is not None, 240,
                   what="the run's Prefect temporary server")
        assert run.poll() is None, log.read_text(errors="replace")[-3000:]
        server = prefect_server_of(run)
        assert server is not None and MARKER_VARIABLE in server.environ()
        time.sleep(1.0)  # the reaper notes the run's children every 0.25 s: one started just now may be unseen
        run.send_signal(sig)
        run.wait(timeout=30)
        try:
            h.wait_for(lambda: not marked_processes(MARKER_VARIABLE, marker), ORPHAN_BOUND_S,
                       what="every process of the killed run to end")
        except AssertionError as error:
            left = [" ".join(psutil.Process(pid).cmdline())[:160] for pid in marked_processes(MARKER_VARIABLE, marker)]
            tail = log.read_text(errors="replace")[-2000:]
            raise AssertionError(f"{error}; run exited {run.returncode}; left: {left}\n{tail}") from None
        assert not server.is_running()
    finally:
        kill_marked(MARKER_VARIABLE, marker)
