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
    """Proves: scoring 5,000 programs of which 10% hang (block forever) and 10% crash (SIGSEGV), on 32 warm
    workers with a 1 s budget, runs at >= 80% of the throughput of 5,000 all-good programs (the issue's
    drill, at the issue's scale); every hang is judged `timeout`, every crash `error`, every good program `ok`
    (none misjudged under the load); and once the sandbox is closed no worker, fork server, job process or
    job cgroup of it is left.

    Scale: 5,000, the issue's count, not fewer. The ratio depends on the count: the mixed run costs about one
    hang budget (1 s) more than the all-good one, the hangs that start near its end holding their workers
    after the last good program, and that fixed tail weighs five times more at 1,000 programs than at 5,000.
    Measured on the 2-core box (2026-11-23, no other heavy process; see the benchmark's docstring): 1,000
    programs 3.4 s all good vs 4.3 s mixed, ratio 0.80, right at the bar; 5,000 programs 16.9 s vs 17.9 s,
    ratio 0.94 (1.09 in another run). Cost: this drill took 65.6 s at 5,000 and the benchmark 25.4 s at 1,000
    (both quiet; 150 s and 68 s with other engineers' jobs at load 9-26), of which starting and warming the 32
    workers is 13 s either way; the extra 40-80 s fits CI's 90-minute budget (the suite takes ~48 min), so
    the drill runs the issue's count instead of a smaller one that passes with no margin.

    The budget is wall time: on a machine that others load heavily (load average 10-25 on 2 cores), good
    programs miss their 1 s and the drill fails at any count (measured: 60 of 4,000 good programs judged
    `timeout`, ratio 0.75). Run it where nothing else loads the CPU. With 4 workers (the default) or
    spinning hangs the ratio is far lower: see the benchmark's docstring.
    """
    result = subprocess.run([sys.executable, str(BENCHMARK), "--programs", str(PROGRAMS), "--workers", "32",
                             "--timeout", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    mixed = report["mixed"]["statuses"]
    assert report["all_good"]["statuses"] == {"good": {"ok": PROGRAMS}}, result.stdout
    assert mixed == {"good": {"ok": PROGRAMS * 8 // 10}, "hang": {"timeout": PROGRAMS // 10},
                     "crash": {"error": PROGRAMS // 10}}, result.stdout
    assert report["ratio"] >= 0.8, result.stdout
    assert report["job_processes_between_runs"] == 0
    assert report["left_after_close"] == {"descendants": [], "job_processes": [], "job_cgroups": []}
