"""Soak: a long run of the tiny config on the warm engine, overlapped, with checkpoint retention; leaks show here.

One real `rlpipe run` (driver, stage server, generation server, every stage a process) of `tests/e2e/tiny.yaml`'s
sizes on vLLM with `generate.warm_engine: on`, `pipeline.max_staleness: 1` and `train.keep_checkpoints`. Every
two seconds it samples the run's long-lived processes (the flow process, the stage server, the generation server:
RSS, open file descriptors, threads) and counts every process of the run (their descendants, and any process
carrying an environment marker the run inherits: one re-parented to init still carries it). Per iteration (a
window that ends when that iteration's train manifest appears) it keeps the median of each figure, plus the disk
under the root (all, and checkpoints) and a catalog query's time (open the catalog, mean reward of the last
iteration, median of three). It prints the last iterations against iteration 10 as a ratio of window medians (the
last `--window` iterations vs as many around iteration 10: one iteration's reading is noise, and the last one's
checkpoint keeps its optimizer state), with the targets: each at most 1.10 x, checkpoint disk bounded by the
retention, and no process of the run left 10 s after it ends. Stages and sandbox workers come and go, so the
process count is a median too, not a peak. Opening the catalog grows with the tables it lists (tables are never
pruned): it is printed, and judged on the query alone.

Run: `.venv/bin/python -m benchmarks.soak` (`--iterations 100`; `--help`). Measurements: docs/measurements.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import psutil

from schemas.config import ConfigError
from storage.catalog import Catalog

REPO = Path(__file__).resolve().parents[1]
MARKER = "RLPIPE_SOAK_MARKER"
ROLES = {"stage server": "rlpipe stage server", "generation server": "rlpipe generation server"}


def run_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"iterations={args.iterations}", "threads=1", "device=cpu", "generate.backend=vllm",
        "generate.warm_engine=on", "generate.prompts_per_iteration=2", "generate.n_samples=4",
        "generate.max_new_tokens=40", "generate.temperature=1.0", "generate.vllm_kv_cache_gib=1",
        "data.max_test_prompts=2", "evaluate.n_samples=1", "evaluate.k=[1]", "evaluate.max_new_tokens=40",
        f"evaluate.every={args.evaluate_every}", "score.workers=1", "train.is_level=token",
        "advantage.drop_zero_variance_groups=false", "train.micro_batch_tokens=1024",
        f"train.keep_checkpoints={args.keep_checkpoints}", "pipeline.max_staleness=1", f"seed={args.seed}",
    ]


def engine_socket(root: Path, run_id: str) -> str | None:
    """The socket the run's generation server listens on (stages/generation/client.py `server_address`), once the
    run's config is written; None before."""
    from stages.generation.client import server_address
    from storage.run import Run

    try:
        run = Run.open(str(root), run_id)
    except ConfigError:
        return None
    return str(server_address(run.layout.run_dir, run.config.generate, run.config.device).socket_path)


def run_processes(marker: str, flow_pid: int, socket_path: str | None) -> list[psutil.Process]:
    """Every live process of the run and their descendants: the flow process (the stage server is its child),
    the generation server (a session of its own, its command line retitled: found by the socket it listens on),
    and whatever still carries the marker in its environment (one re-parented to init; setproctitle hides the
    environment of the retitled servers). Another run's servers on the machine are never counted."""
    listening = {c.pid for c in psutil.net_connections("unix") if socket_path and c.laddr == socket_path}
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter():
        try:
            ours = process.pid in (flow_pid, *listening) or process.environ().get(MARKER) == marker
            for member in [process, *process.children(recursive=True)] if ours else []:
                if member.status() != psutil.STATUS_ZOMBIE:
                    found[member.pid] = member
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def role_of(process: psutil.Process, flow_pid: int) -> str | None:
    """Which long-lived process of the run this is (by title among `run_processes`), or None."""
    if process.pid == flow_pid:
        return "flow process"
    command = " ".join(process.cmdline())
    return next((role for role, title in ROLES.items() if title in command), None)


def sample(processes: list[psutil.Process], flow_pid: int) -> dict[str, float]:
    """One reading: per long-lived role RSS (MiB), fds, threads; and the run's process count."""
    figures: dict[str, float] = {"processes of the run": len(processes)}
    for process in processes:
        try:
            role = role_of(process, flow_pid)
            if role is None:
                continue
            with process.oneshot():
                figures[f"{role} RSS MiB"] = process.memory_info().rss / 2**20
                figures[f"{role} fds"] = process.num_fds()
                figures[f"{role} threads"] = process.num_threads()
        except psutil.NoSuchProcess:
            continue
    return figures


def disk_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def catalog_seconds(root: Path, run_id: str, repeats: int = 3) -> tuple[float, float]:
    """(seconds to open the catalog, seconds for the last iteration's mean reward): medians of `repeats` fresh opens,
    as one reading of a ~0.05 s query on a busy machine is noise."""
    opens, queries = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with Catalog(str(root), [run_id], threads=1) as catalog:
            opened = time.perf_counter()
            # The latest iteration from the manifests, then a literal filter: DuckDB reads that iteration's files
            # alone (a subquery in the filter reads every file: 2.3x at 100 iterations, docs/usage.md).
            (latest,) = catalog.rows("SELECT max(iter) AS iter FROM manifests WHERE name = 'scores'")
            catalog.rows(f"SELECT avg(reward) AS reward FROM scores WHERE iter = {int(latest['iter'])}")
            opens.append(opened - started)
            queries.append(time.perf_counter() - opened)
    return statistics.median(opens), statistics.median(queries)


def window_medians(rows: dict[int, dict[str, float]], iterations: range) -> dict[str, float]:
    """Per figure, the median of its per-iteration values over `iterations` (those present in `rows`)."""
    picked = [rows[i] for i in iterations if i in rows]
    if not picked:
        return {}
    names = {name for row in picked for name in row}
    return {name: statistics.median(row[name] for row in picked if name in row) for name in sorted(names)}


def compare(rows: dict[int, dict[str, float]], reference: int, window: int) -> tuple[range, range, list[tuple]]:
    """The reference window (`window` iterations centred on `reference`), the last `window` iterations, and per figure
    (name, reference median, last median, ratio, target, over): the soak's verdict, from its per-iteration rows."""
    last = max(rows)
    before_iters = range(max(0, reference - window // 2), reference - window // 2 + window)
    after_iters = range(max(before_iters.stop, last - window + 1), last + 1)
    before, after = window_medians(rows, before_iters), window_medians(rows, after_iters)
    verdicts = []
    for name in before:
        ratio = after.get(name, float("nan")) / before[name] if before[name] else float("nan")
        target = "<= 1.10" if name not in ("disk MiB", "catalog open s") else "(grows with the tables)"
        verdicts.append((name, before[name], after.get(name, float("nan")), ratio, target,
                         target == "<= 1.10" and not ratio <= 1.10))
    return before_iters, after_iters, verdicts


def finished_iterations(run_dir: Path) -> int:
    return len(list(run_dir.glob("iter=*/train_metrics.parquet.manifest.json")))


def watch(marker: str, flow: subprocess.Popen, root: Path, run_id: str, rows: dict[int, dict[str, float]],
          seen: dict[int, psutil.Process]) -> None:
    """Sample until the run ends; close a window (one row) each time an iteration's train finishes. `seen` gets
    every process of the run met on the way, to look for again at the end."""
    run_dir = root / "runs" / run_id
    window: defaultdict[str, list[float]] = defaultdict(list)
    socket_path = None
    while flow.poll() is None:
        socket_path = socket_path or engine_socket(root, run_id)  # the run's config is read once it exists
        processes = run_processes(marker, flow.pid, socket_path)
        seen.update({process.pid: process for process in processes})
        for name, value in sample(processes, flow.pid).items():
            window[name].append(value)
        done = finished_iterations(run_dir)
        if done > len(rows):
            row = {name: statistics.median(values) for name, values in window.items()}
            row["disk MiB"] = disk_mib(root)
            row["checkpoint disk MiB"] = disk_mib(run_dir / "checkpoints")
            row["catalog open s"], row["catalog query s"] = catalog_seconds(root, run_id)
            rows[done - 1] = row
            print(f"iteration {done - 1}: " + ", ".join(f"{k} {v:.3f}" if k.endswith(" s") else f"{k} {v:.1f}"
                                                   for k, v in sorted(row.items())), flush=True)
            window.clear()
        time.sleep(2.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--reference", type=int, default=10, help="the iteration every figure is compared with")
    parser.add_argument("--window", type=int, default=10, help="iterations per median (around --reference; the last)")
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="train.keep_checkpoints")
    parser.add_argument("--evaluate-every", type=int, default=1000, help="evaluate.every (1000: only the last)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", help="keep the run here (default: a temporary directory, removed after)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="rlpipe-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    run_id, marker = "soak", uuid.uuid4().hex
    print(f"soak: {args.iterations} iterations of the tiny config, warm engine, max_staleness 1, keep "
          f"{args.keep_checkpoints} checkpoints; load {os.getloadavg()[0]:.2f}; run under {root}", flush=True)
    command = [sys.executable, "-m", "flows.cli", "run", "--root", str(root), "--run-id", run_id]
    for override in run_overrides(args):
        command += ["--set", override]
    log = root / "soak.log"
    rows: dict[int, dict[str, float]] = {}
    seen: dict[int, psutil.Process] = {}
    started = time.monotonic()
    with open(log, "wb") as handle:
        flow = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, MARKER: marker})
        try:
            watch(marker, flow, root, run_id, rows, seen)
        except KeyboardInterrupt:
            flow.send_signal(signal.SIGINT)
            flow.wait(30)
            raise
    wall = time.monotonic() - started
    time.sleep(10.0)
    # a process seen during the run and still running (psutil compares its start time, so a reused pid is not it)
    left = [process for process in seen.values() if process.is_running()] + [
        process for process in run_processes(marker, flow.pid, engine_socket(root, run_id)) if process.pid not in seen]
    print(f"\nrun exited {flow.returncode} after {wall:.0f} s (log {log}); load {os.getloadavg()[0]:.2f}")
    if args.reference not in rows:
        raise SystemExit(f"no figures for iteration {args.reference}: the run finished {len(rows)} iterations")
    before_iters, after_iters, verdicts = compare(rows, args.reference, args.window)
    heads = [f"iters {r.start}-{r.stop - 1}" for r in (before_iters, after_iters)]
    print(f"\nmedians per window\n{'figure':36} {heads[0]:>12} {heads[1]:>12} {'ratio':>7}  target")
    for name, before, after, ratio, target, over in verdicts:
        print(f"{name:36} {before:12.3f} {after:12.3f} {ratio:7.2f}  {target}{'  OVER' if over else ''}")
    peak = max(row["checkpoint disk MiB"] for row in rows.values())
    print(f"checkpoint disk, most at any iteration: {peak:.0f} MiB (the last checkpoint keeps its optimizer state)")
    print(f"\nprocesses of the run left 10 s after it ended: {len(left)}"
          + "".join(f"\n  {p.pid} {' '.join(p.cmdline())[:120]}" for p in left))
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
