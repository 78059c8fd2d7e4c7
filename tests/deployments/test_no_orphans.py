"""No orphan, ever (issue 29): a test run that is killed takes everything it started along.

Two pytest processes run the team deployment module (tests/deployments/test_team_run.py: moto's S3, `rlpipe
server` with its Prefect server and two workers, two more workers the module starts, flow runs of the real tiny
pipeline), side by side to keep the drill short. Once each has a flow run going, one gets SIGTERM (a CI job
cancelled) and the other SIGKILL (no teardown of any kind runs). Each pytest carries a marker in its
environment, which every process below it inherits; 10 s after a pytest ended, no process with its marker may be
left. Whatever happens, the drill kills every marked process before it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import kill_marked, marked_processes, spawn_tied

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER_VARIABLE = "RLPIPE_TEST_DRILL"
ORPHAN_BOUND_S = 10.0


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def a_flow_run_is_going(marker: str) -> bool:
    """A worker has started a flow run (Prefect's `python -m prefect.engine`) under this marker."""
    return any("-m prefect.engine" in command_line(pid) for pid in marked_processes(MARKER_VARIABLE, marker))


@contextlib.contextmanager
def team_module_run(tmp_path: Path, name: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """pytest on the team deployment module, marked; every marked process is killed when the block ends."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VARIABLE: marker}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--basetemp",
               str(tmp_path / name), "tests/deployments/test_team_run.py"]
    with open(tmp_path / f"{name}.log", "wb") as log:
        process = spawn_tied(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process, marker
    finally:
        kill_marked(MARKER_VARIABLE, marker)
        process.wait()


def survivors(markers: list[str], bound_s: float) -> list[str]:
    """The processes of `markers` still running after up to `bound_s` (each as marker, pid and command)."""
    deadline = time.monotonic() + bound_s
    while True:
        left = [(marker, pid) for marker in markers for pid in marked_processes(MARKER_VARIABLE, marker)]
        if not left or time.monotonic() >= deadline:
            return [f"{marker[:6]} {pid} {command_line(pid)[:160]}" for marker, pid in left]
        time.sleep(0.5)


def test_a_killed_test_run_leaves_no_process(tmp_path: Path) -> None:
    with team_module_run(tmp_path, "sigterm") as (terminated, term_marker), \
            team_module_run(tmp_path, "sigkill") as (killed, kill_marker):
        runs = {"sigterm": (terminated, term_marker), "sigkill": (killed, kill_marker)}
        deadline = time.monotonic() + 600
        while not all(a_flow_run_is_going(marker) for _, marker in runs.values()):
            for name, (process, _) in runs.items():
                assert process.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no flow run started within 600 s"
            time.sleep(1)
        # moto, rlpipe server, its reaper, the Prefect server, two workers, a flow run
        assert len(marked_processes(MARKER_VARIABLE, term_marker)) >= 7
        terminated.send_signal(signal.SIGTERM)
        killed.send_signal(signal.SIGKILL)
        assert terminated.wait(timeout=60) == -signal.SIGTERM and killed.wait(timeout=60) == -signal.SIGKILL
        assert survivors([term_marker, kill_marker], ORPHAN_BOUND_S) == []
