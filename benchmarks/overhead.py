"""Where an iteration's wall time goes: model and sandbox work vs everything rlpipe adds around it.

Runs the real thing once, as `rlpipe run` does: the Prefect `loop` flow in this process drives one iteration
of a fresh run, every stage a child process; the run-level stages run first, untimed (once per run). The
iteration is timed inside the flow run, and split per stage instance from clocks that never overlap: process
wall (the flow, around each child), stage body (the manifest's `seconds`), the harness's read/validate/write
timers (plus what the trainer's save waited for its checkpoint's hashes) and the engine start inside it:

  model / sandbox work   body - harness - engine start
  process + harness      process wall - body        (fork, lease, manifests, process exit)
  Parquet I/O + checks   harness read + validate + write
  orchestration          iteration wall - sum of process walls  (Prefect task runs, done-checks, artifacts, report)

Overhead = the last three, as a share of the iteration's wall time less engine start; target <= 2%. Once per
run and reported apart: Prefect's import and temporary server, the stage server's imports, the flow run's own
start and end (creating it, the run-level done-checks, joining its heartbeat thread); the share with the last
counted in is printed too. Figures and history: docs/measurements.md. Run: `.venv/bin/python -m
benchmarks.overhead` (the default config, iterations=1; `--config`, `--set s.f=v`, `--root DIR` keeps the run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

console = Console(width=140)  # the breakdown table is wide
TARGET = 0.02  # overhead as a share of an iteration's wall time less engine start

if TYPE_CHECKING:
    from flows.runner.process import StageOutcome
    from storage.layout import RunLayout


@dataclass
class StageTime:
    label: str
    process_wall: float
    body: float
    engine_start: float
    read: float
    validate: float
    write: float
    skipped_step: bool = False

    @property
    def harness(self) -> float:
        return self.read + self.validate + self.write

    @property
    def work(self) -> float:
        return self.body - self.harness - self.engine_start

    @property
    def process_overhead(self) -> float:
        return self.process_wall - self.body


def stage_times(layout: RunLayout, outcomes: list[StageOutcome]) -> list[StageTime]:
    """Join the flow's per-process wall times with the stage manifests' clocks."""
    from stages.registry import outputs_of
    from storage.manifest import read_manifest

    times = []
    for outcome in outcomes:
        if not outcome.ran:
            continue
        # Every output's manifest of one stage instance carries the same seconds and harness timers.
        output = outputs_of(outcome.target)[-1]
        manifest = read_manifest(layout.fs, output.manifest_path(layout))
        harness = manifest.metrics.get("harness", {})
        times.append(StageTime(
            label=f"{outcome.target.stage} {outcome.target.where}",
            process_wall=outcome.seconds,
            body=manifest.seconds,
            engine_start=float(manifest.metrics.get("engine_start_seconds", 0.0)),
            read=harness.get("read_seconds", 0.0),
            validate=harness.get("validate_seconds", 0.0),
            # The trainer hashes the checkpoint while saving it: what the save waited for hashes is I/O overhead.
            write=harness.get("write_seconds", 0.0) + manifest.metrics.get("checkpoint_hash_wait_seconds", 0.0),
            skipped_step=bool(manifest.metrics.get("skipped", False)),
        ))
    return times


def main() -> None:
    from flows.prefect_env import configure_prefect
    from flows.runner import forkserver
    from flows.runner.process import run_stage_process, stage_environment
    from schemas.config import load_config
    from stages.registry import RUN_STAGES, instance
    from storage.run import Run

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="deployments/configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="section.field=value (repeatable)")
    parser.add_argument("--root", default=None, help="storage root (default: a temporary directory)")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="rlpipe-overhead-"))
    root = args.root or str(scratch / "root")
    config = load_config(args.config, ["run_id=overhead", "iterations=1", *args.set])
    run = Run.start(config, root)
    layout = run.layout
    # Once per run, as `rlpipe run` does before Prefect starts: the stage server (flows/runner/forkserver.py) imports
    # torch, Great Expectations and vLLM once; every stage after it is a fork. Timed apart like Prefect's start.
    configure_prefect()  # as `rlpipe run` does: the stage server gets the environment every stage gets
    server = forkserver.start(stage_environment(config))
    server_start = server.wait_ready() if server is not None else 0.0
    # The run-level stages (prompts, base model, the base model's evaluation) run once per run, not per
    # iteration: done first, untimed, the way the flow would, so the measured call only checks them.
    for stage in RUN_STAGES:
        run_stage_process(run, instance(stage))

    load_before = os.getloadavg()[0]
    # Once per `rlpipe run`, not per iteration: importing Prefect and starting its temporary server (what the
    # first flow run of a process pays). Timed apart with an empty flow, and reported apart like engine start.
    started = time.monotonic()
    from prefect import flow

    from flows import pipeline
    from storage.run import RunRef

    @flow(name="overhead-warm-up")
    def warm_up() -> None:
        """Nothing: the first flow run of the process starts Prefect's temporary server."""

    warm_up()
    prefect_start = time.monotonic() - started

    # The iteration itself, timed inside the flow run: the flow run's own start and end (creating it, the
    # run-level stages' done-checks, joining its heartbeat thread, stopping the run's generation server) are
    # paid once per run, however many iterations it has, and are reported apart.
    iteration_clock: list[float] = []
    run_iteration = pipeline._run_iteration

    def timed_iteration(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the flow's own signature
        started = time.monotonic()
        try:
            return run_iteration(*args, **kwargs)
        finally:
            iteration_clock.append(time.monotonic() - started)

    pipeline._run_iteration = timed_iteration
    started = time.monotonic()
    outcomes = pipeline.loop_flow(RunRef(root=layout.root, run_id=layout.run_id))
    flow_wall = time.monotonic() - started
    load_after = os.getloadavg()[0]
    if len(iteration_clock) != 1:
        raise RuntimeError(f"expected the flow to run one iteration, it ran {len(iteration_clock)}")
    total = iteration_clock[0]

    times = stage_times(layout, outcomes)
    table = Table(title=f"one iteration of {args.config} {' '.join(args.set)} (seconds)")
    for column in ("stage", "process wall", "engine start", "model/sandbox work", "process+harness",
                   "read", "validate", "write"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for t in times:
        table.add_row(t.label, *[f"{v:.1f}" for v in (t.process_wall, t.engine_start, t.work)],
                      *[f"{v:.2f}" for v in (t.process_overhead, t.read, t.validate, t.write)])
    console.print(table)
    if any(t.skipped_step for t in times):
        console.print("the train stage skipped its step (no group with a learning signal): its checkpoint is a copy")

    engine_start = sum(t.engine_start for t in times)
    work = sum(t.work for t in times)
    process = sum(t.process_overhead for t in times)
    io_checks = sum(t.harness for t in times)
    orchestration = total - sum(t.process_wall for t in times)
    flow_run = flow_wall - total
    budget = total - engine_start
    overhead = process + io_checks + orchestration
    console.print(f"iteration wall {total:.1f} s, of which engine start {engine_start:.1f} s (reported apart); "
                  f"once per run, apart: Prefect import and temporary server {prefect_start:.1f} s, stage server "
                  f"imports {server_start:.1f} s" + ("" if server is not None else " (off: RLPIPE_STAGE_FORK=0)")
                  + f", the flow run's own start and end {flow_run:.2f} s")
    for name, seconds in [("model/sandbox work", work), ("process start + harness", process),
                          ("Parquet I/O + validation", io_checks), ("orchestration (Prefect, checks, report)",
                                                                    orchestration)]:
        console.print(f"  {name:<42} {seconds:>8.2f} s  {100 * seconds / budget:>5.1f}% of wall less engine start")
    share = overhead / budget
    with_flow_run = (overhead + flow_run) / (budget + flow_run)
    verdict = "met" if share <= TARGET else "NOT met"
    console.print(f"overhead {overhead:.2f} s = {100 * share:.1f}% (target <= {100 * TARGET:.0f}%: {verdict}); with "
                  f"the flow run's start and end counted in too: {100 * with_flow_run:.1f}%; "
                  f"load average {load_before:.1f} -> {load_after:.1f}; run kept at {root}")

if __name__ == "__main__":
    main()
