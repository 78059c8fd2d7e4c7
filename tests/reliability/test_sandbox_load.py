"""Load drill: the sandbox keeps its throughput when programs hang and crash, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sandbox_load.py"
PROGRAMS = 1000


def test_sandbox_throughput_with_hanging_and_crashing_programs() -> None:
    """Proves: scoring 1,000 programs of which 10% hang (block forever) and 10% crash (SIGSEGV), on 32 warm
    workers with a 1 s budget, runs at >= 80% of the throughput of 1,000 all-good programs; every hang is
    judged `timeout`, every crash `error`, every good program `ok` (none misjudged under the load); and once
    the sandbox is closed no worker, fork server, job process or job cgroup of it is left.

    Scale: the issue asks for 5,000 programs; that is `python benchmarks/sandbox_load.py` (about 3 minutes
    on 2 cores), too long for CI's budget, so CI runs the same benchmark, in its own process, on 1,000 (the
    hang share, and so the ratio, does not depend on the count). With 4 workers (the default) or spinning
    hangs the ratio is far lower: see the benchmark's docstring and the report.
    """
    result = subprocess.run([sys.executable, str(BENCHMARK), "--programs", str(PROGRAMS), "--workers", "32",
                             "--timeout", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    mixed = report["mixed"]["statuses"]
    assert report["all_good"]["statuses"] == {"good": {"ok": PROGRAMS}}
    assert mixed == {"good": {"ok": PROGRAMS * 8 // 10}, "hang": {"timeout": PROGRAMS // 10},
                     "crash": {"error": PROGRAMS // 10}}
    assert report["ratio"] >= 0.8, result.stdout
    assert report["job_processes_between_runs"] == 0
    assert report["left_after_close"] == {"descendants": [], "job_processes": [], "job_cgroups": []}
