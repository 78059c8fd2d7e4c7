"""The processes `rlpipe server` starts die with it, whatever ends it (flows/deploy.py): a parent-death signal in
each child, and a reaper process that ends their whole process groups once the starter is gone, a SIGKILL
included (no `finally` runs then).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.deploy import api_url_for, wait_healthy
from tests.support.ports import free_port
from tests.support.processes import spawn_tied

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids of `pids` still running (zombies count as gone) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# A starter that puts a shell in a process group of its own (as `rlpipe server` starts its children), the shell
# leaving a background sleeper in that group, and prints their pids; then it waits to be killed.
STARTER = """
import json, subprocess, sys, time
from flows import deploy
reaper = deploy.GroupReaper(grace_s=2)
shell = reaper.watch(deploy._spawn(["/bin/sh", "-c", "sleep 600 & echo $!; wait"], dict(PATH="/usr/bin:/bin"), None))
print(json.dumps({"reaper": reaper.process.pid, "shell": shell.pid}), flush=True)
time.sleep(600)
"""


def test_a_killed_starter_takes_the_process_groups_it_started_along() -> None:
    """SIGKILL of the starter: its child (the group's leader) dies of its parent-death signal, and the sleeper the
    child left in its group, which has none, is ended by the reaper; the reaper then exits."""
    starter = spawn_tied([sys.executable, "-c", STARTER], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert starter.stdout is not None
    started = json.loads(starter.stdout.readline())
    deadline = time.monotonic() + 10
    while not (sleepers := psutil.Process(started["shell"]).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (sleeper,) = sleepers
    assert os.getpgid(sleeper.pid) == started["shell"]  # in the shell's group, not a leader of its own
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    assert wait_gone([started["shell"], sleeper.pid, started["reaper"]], timeout_s=15) == []


@pytest.mark.slow
def test_rlpipe_server_killed_outright_leaves_no_process(tmp_path: Path) -> None:
    """`rlpipe server` with one worker: once the Prefect server is healthy and the worker runs, SIGKILL the
    rlpipe process itself; the Prefect server, the worker and everything below them are gone within 30 s."""
    port = free_port()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_API_URL", None)
    with open(tmp_path / "rlpipe-server.log", "ab") as log:
        server = spawn_tied(
            [sys.executable, "-m", "flows.cli", "server", "--port", str(port), "--home", str(tmp_path / "home"),
             "--workers", "cpu", "--no-ui", "--timeout", "300"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(api_url_for("127.0.0.1", port), 300, server)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            tree = psutil.Process(server.pid).children(recursive=True)
            if any("worker" in process.cmdline() for process in tree):
                break
            time.sleep(1)
        else:
            pytest.fail("no worker started:\n" + (tmp_path / "rlpipe-server.log").read_text()[-3000:])
        below = [process.pid for process in psutil.Process(server.pid).children(recursive=True)]
        assert len(below) >= 3  # the reaper, the Prefect server, the worker
        server.send_signal(signal.SIGKILL)
        server.wait()
        assert wait_gone(below, timeout_s=30) == []
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
