"""Load drill: the sandbox keeps its throughput when programs hang and crash, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sandbox_load.py"
PROGRAMS = 5000


@pytest.mark.slow
def test_sandbox_throughput_with_hanging_and_crashing_programs() -> None:
    """Proves: scoring 5,000 programs of which 10% hang (block forever) and 10% crash (SIGSEGV), on 48 warm
    workers with a 1 s budget, runs at >= 80% of the throughput of 5,000 all-good programs (the issue's
    drill, at the issue's scale); every hang is judged `timeout`, no good program is judged anything but `ok`
    or `timeout` and no crash anything but `error` or `timeout`, and at most 0.2% of each run's programs are
    starved into `timeout`; and once the sandbox is closed no worker, fork server, job process or job cgroup
    of it is left.

    Starved: 48 workers on 2 cores keep ~20 processes runnable per core, so a good program that is slow to be
    scheduled can miss its 1 s of wall time while loading (measured: start to spawned 0.001-0.03 s, loading
    1.0 s). CI saw 3 of 5,000 on 2026-11-29 (load 19 from the drill itself), and 3 extra spinning processes
    here give 3-4 per 3,000. The sandbox does not yet discount a job's run-queue delay from its budget
    (docs/measurements.md, sandbox_load), so the drill bounds how often this happens.

    Workers: a blocking hang holds its worker for the budget, so the ratio is at most W / (R·0.1·1 s), R the
    all-good rate (the benchmark prints this ceiling). At 32 workers CI failed once the sandbox reached
    ~390 programs/s (2026-11-25: ceiling 0.82, measured 0.75 at load 1.5); 48 workers gave 1.03 (ceiling 1.4)
    and 64 gave 0.95 (more jobs share the 2 cores, so the all-good rate drops). The pool is sized to the
    sandbox's speed, as a user sizes `score.workers` to their hang rate.

    Scale: 5,000, the issue's count: the mixed run costs about one hang budget more than the all-good one
    (the hangs started last hold their workers after the last good program), a fixed tail that weighs five
    times more at 1,000 programs. Cost ~60 s quiet, of which starting and warming the workers is ~14 s.
    """
    result = subprocess.run([sys.executable, str(BENCHMARK), "--programs", str(PROGRAMS), "--workers", "48",
                             "--timeout", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    good, mixed = report["all_good"]["statuses"], report["mixed"]["statuses"]
    assert set(good) == {"good"} and set(good["good"]) <= {"ok", "timeout"}, result.stdout
    assert set(mixed["good"]) <= {"ok", "timeout"} and set(mixed["crash"]) <= {"error", "timeout"}, result.stdout
    assert mixed["hang"] == {"timeout": PROGRAMS // 10}, result.stdout
    starved = {"all good": good["good"].get("timeout", 0),
               "mixed": mixed["good"].get("timeout", 0) + mixed["crash"].get("timeout", 0)}
    assert max(starved.values()) <= PROGRAMS // 500, (starved, result.stdout)
    assert report["ratio"] >= 0.8, result.stdout
    assert report["job_processes_between_runs"] == 0
    assert report["left_after_close"] == {"descendants": [], "job_processes": [], "job_cgroups": []}
