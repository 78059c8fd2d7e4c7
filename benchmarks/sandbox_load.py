"""Sandbox under load: throughput with 10% hanging and 10% crashing programs, against the all-good case.

Scores N all-good programs, then N programs of which 10% hang and 10% crash (the same good programs
otherwise), on one warm local sandbox, and prints programs/s of each, their ratio (mixed / all-good), the
status counts, how many sandbox processes (workers, fork servers, jobs, their cgroups) are left once the
sandbox is closed, and the load average before and after. A "hang" never returns: `--hang sleep` blocks
without CPU (a deadlock, a sleep), `--hang spin` loops on the CPU; a "crash" kills itself with SIGSEGV. The
mixed run costs about one hang budget more whatever the count, which is why the drill runs 5,000 programs.

A blocking hang holds its worker for the whole budget T, so with W workers the mixed run takes at least
h·N·T/W (h the hang fraction) and the ratio is at most W / (R·h·T), R the all-good rate: the pool must be
sized to the sandbox's speed. The script prints that ceiling. 32 workers sufficed while R was ~300/s; at
~390/s (2026-11-25, after the sandbox got faster) their ceiling is 0.82 and the measured ratio 0.75, hence 48.

    python benchmarks/sandbox_load.py                       # the full drill: 5,000 programs, 48 workers
    python benchmarks/sandbox_load.py --programs 1000 --json
    python benchmarks/sandbox_load.py --hang spin --workers 4

Prints one JSON object last with `--json` (tests/reliability/test_sandbox_load.py reads it). Target: ratio
>= 0.8 (figures: docs/measurements.md, "Benchmark notes").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.config import ScoreConfig  # noqa: E402
from stages.sandbox import Sandbox, ScoreJob  # noqa: E402

SPEC = {
    "kind": "code_tests", "entry_point": "f", "preamble": "",
    "test": "def check(candidate):\n    assert candidate(2) == 3\n    assert candidate(-1) == 0\n",
}
GOOD = "```python\ndef f(x):\n    return x + 1\n```"
HANGS = {
    "sleep": "```python\ndef f(x):\n    import time\n    time.sleep(3600)\n    return x + 1\n```",
    "spin": "```python\ndef f(x):\n    while True:\n        pass\n```",
}
CRASH = "```python\ndef f(x):\n    import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)\n```"


def workload(n: int, mixed: bool, hang: str) -> tuple[list[ScoreJob], list[str]]:
    """Jobs and what each is: 'good', 'hang' or 'crash'. In the mixed case programs 3, 13, 23, ... hang and
    7, 17, 27, ... crash: 10% each, spread evenly over the run."""
    kinds = []
    for i in range(n):
        kind = "good"
        if mixed and i % 10 == 3:
            kind = "hang"
        elif mixed and i % 10 == 7:
            kind = "crash"
        kinds.append(kind)
    texts = {"good": GOOD, "hang": HANGS[hang], "crash": CRASH}
    return [ScoreJob(texts[kind], SPEC) for kind in kinds], kinds


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def job_processes(owner_pid: int) -> list[int]:
    """Processes running as one of this sandbox's job uids (stages/sandbox/isolation.py `job_uid`)."""
    low = (1 << 30) + ((owner_pid & 0x3FFFFF) << 6)
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        if low <= int(fields.get("Uid", "0").split()[0]) < low + 64:
            found.append(int(status.parent.name))
    return found


def job_cgroups(owner_pid: int) -> list[str]:
    return [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/**/rlpipe-sandbox-{owner_pid}-*")]


def measure(sandbox: Sandbox, n: int, mixed: bool, hang: str) -> dict:
    jobs, kinds = workload(n, mixed, hang)
    started = time.perf_counter()
    results = sandbox.score(jobs)
    seconds = time.perf_counter() - started
    by_kind = {kind: dict(Counter(r.status for r, k in zip(results, kinds, strict=True) if k == kind))
               for kind in sorted(set(kinds))}
    return {"programs": n, "seconds": round(seconds, 3), "programs_per_second": round(n / seconds, 2),
            "statuses": by_kind}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=1.0, help="score.timeout_s (the hang budget)")
    parser.add_argument("--hang", choices=sorted(HANGS), default="sleep")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every number last")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    load_before = os.getloadavg()
    cfg = ScoreConfig(workers=args.workers, timeout_s=args.timeout)
    started = time.perf_counter()
    with Sandbox.from_config(cfg) as sandbox:
        isolation = sandbox.isolation
        sandbox.score(workload(2 * args.workers, False, args.hang)[0])  # warm every worker
        start_seconds = time.perf_counter() - started
        good = measure(sandbox, args.programs, False, args.hang)
        mixed = measure(sandbox, args.programs, True, args.hang)
        left_during = sandbox.leftover_processes()
        closing = time.perf_counter()
    close_seconds = time.perf_counter() - closing
    time.sleep(0.5)
    left = {"descendants": descendants(os.getpid()), "job_processes": job_processes(os.getpid()),
            "job_cgroups": job_cgroups(os.getpid())}
    ratio = mixed["programs_per_second"] / good["programs_per_second"]
    # Hung workers bound the mixed run from below: 10% of the programs each hold a worker for the budget.
    ceiling = args.workers / (good["programs_per_second"] * 0.1 * args.timeout)
    report = {
        "isolation": isolation, "workers": args.workers, "timeout_s": args.timeout, "hang": args.hang,
        "start_seconds": round(start_seconds, 2), "close_seconds": round(close_seconds, 2),
        "all_good": good, "mixed": mixed, "ratio": round(ratio, 3),
        "ratio_ceiling_blocking_hangs": round(ceiling, 3), "job_processes_between_runs": left_during,
        "left_after_close": left, "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"isolation {isolation}, {args.workers} workers, timeout {args.timeout:g} s, hang = {args.hang}; "
          f"start + warm-up {start_seconds:.1f} s, close {close_seconds:.1f} s")
    print(f"all good : {good['programs']} programs in {good['seconds']:.1f} s = {good['programs_per_second']:.1f}/s"
          f"  {good['statuses']}")
    print(f"10% hang, 10% crash: {mixed['programs']} programs in {mixed['seconds']:.1f} s = "
          f"{mixed['programs_per_second']:.1f}/s  {mixed['statuses']}")
    print(f"ratio (mixed / all good): {ratio:.3f}  (the issue asks >= 0.8); ceiling with blocking hangs "
          f"W / (R·h·T) = {ceiling:.2f}")
    print(f"left after close: {sum(len(v) for v in left.values())} ({left})")
    print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
