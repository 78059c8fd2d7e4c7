"""The GPU path in one command: one tiny iteration of the default job on a GPU, checked from its manifests.

`make gpu-check` installs the gpu extra (constraints-gpu.txt) and runs this. It starts `rlpipe run` with the
default config, one iteration and `device: cuda` (so a machine without a GPU stops with exit 2 instead of
quietly running on the CPU), in a fresh storage root; then reads every model stage's manifest (evaluate_base,
generate, train, evaluate) and fails unless each ran on CUDA; and prints, per stage, the device, GPU, dtype,
peak GPU memory, vLLM engines and tokens/s (generate and train are the figures to compare). The default
`generate.engines: auto` starts one vLLM engine per GPU, each in its own process (stages/generation/replicas.py):
on a machine with two or more GPUs the generating stages must report that many engines, which checks the
several-engine path (CUDA_VISIBLE_DEVICES per engine, reload and sleep in the warm server) on real GPUs.
`--device cpu` runs the same check on a CPU machine (the manifests must then say cpu), which is how the checks
themselves are tested.

NOT RUN ON A GPU YET: this project's machines have no GPU, so no output is recorded here. Whoever first runs it
on a GPU machine: paste its output, the date and the GPU below, and update README.md and docs/gpu.md.
Run: `make gpu-check`, or `.venv/bin/python -m benchmarks.gpu_smoke [--root DIR] [--set section.field=value]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deployments" / "configs" / "default.yaml"
RUN_ID = "gpu-smoke"
# (stage, iteration) of every model stage of a one-iteration run; -1 is the run-level base-model evaluation.
MODEL_STAGES = (("evaluate_base", -1), ("generate", 0), ("train", 0), ("evaluate", 0))

console = Console()


def stage_records(root: str, run_id: str) -> dict[str, dict[str, Any] | None]:
    """Each model stage's manifest metrics (its `device` record and tokens/s), None for a stage not done."""
    from schemas.config import ConfigError
    from stages.registry import instance, stage_state
    from storage.run import Run

    records: dict[str, dict[str, Any] | None] = dict.fromkeys(stage for stage, _ in MODEL_STAGES)
    try:
        run = Run.open(root, run_id)
    except ConfigError:  # the run never started
        return records
    for stage, iteration in MODEL_STAGES:
        state = stage_state(run, instance(stage, iteration))
        records[stage] = state.manifests[-1].metrics if state.done else None
    return records


def check_records(records: dict[str, dict[str, Any] | None], device_type: str, engines: int = 1) -> list[str]:
    """What is wrong: a model stage not done, without a device record, or not on `device_type` ("cuda" or
    "cpu"); on CUDA also a record without a GPU name or peak memory; a generating stage whose vLLM ran other than
    `engines` engines (`generate.engines: auto` = one per GPU here). Empty when all is as expected."""
    problems = []
    for stage, metrics in records.items():
        engine = (metrics or {}).get("engine") or {}
        if "compiled" in engine and engine.get("engines", 1) != engines:  # a vLLM stage's record (HF has no compiled)
            problems.append(f"{stage}: {engine.get('engines', 1)} vLLM engine(s), not {engines}")
        record = (metrics or {}).get("device")
        if metrics is None:
            problems.append(f"{stage}: not done")
        elif not isinstance(record, dict):
            problems.append(f"{stage}: its manifest records no device")
        elif not str(record.get("device")).startswith(device_type):
            problems.append(f"{stage}: ran on {record.get('device')}, not {device_type}")
        elif device_type == "cuda" and not (record.get("gpu_name") and record.get("peak_gpu_memory_mb")):
            problems.append(f"{stage}: on CUDA without a GPU name or peak memory: {record}")
    return problems


def figures_table(records: dict[str, dict[str, Any] | None]) -> Table:
    table = Table(title="model stages")
    for column in ("stage", "device", "GPU", "dtype", "engines", "peak GPU MB", "tokens/s"):
        table.add_column(column)
    for stage, metrics in records.items():
        record = (metrics or {}).get("device") or {}
        engine = (metrics or {}).get("engine") or {}
        gpu = f"{record['gpu_name']} x {record['gpu_count']}" if record.get("gpu_name") else "-"
        peak = record.get("peak_gpu_memory_mb")
        speed = (metrics or {}).get("tokens_per_second")
        engines = str(engine.get("engines", 1)) if "compiled" in engine else "-"
        table.add_row(stage, str(record.get("device", "-")), gpu, str(record.get("dtype", "-")), engines,
                      "-" if peak is None else f"{peak:,.0f}", "-" if speed is None else f"{speed:,.1f}")
    return table


def visible_gpus() -> int:
    """GPUs this machine shows (NVML, without initialising CUDA): the default config's `generate.engines: auto` runs
    one vLLM engine on each (TP 1), so a machine with two or more checks the several-engine path."""
    import torch

    return max(1, int(torch.cuda.device_count()))


def expected_engines(device: str, overrides: list[str]) -> int:
    """The vLLM engines the generating stages must report: a `generate.engines=N` override's N, else `auto`'s (one
    per GPU on CUDA with the default TP 1, one on the CPU)."""
    chosen = [value for name, _, value in (o.partition("=") for o in overrides) if name == "generate.engines"]
    if chosen and chosen[-1] != "auto":
        return int(chosen[-1])
    return visible_gpus() if device == "cuda" else 1


def run_job(root: str, device: str, overrides: list[str]) -> int:
    """`rlpipe run` of the default config, one iteration, on `device`; its exit code."""
    command = [sys.executable, "-m", "flows.cli", "run", "--config", str(CONFIG), "--root", root,
               "--run-id", RUN_ID, "--iterations", "1", "--set", f"device={device}"]
    for override in overrides:
        command += ["--set", override]
    console.print(" ".join(command))
    return subprocess.call(command, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the stages must run")
    parser.add_argument("--root", help="storage root to keep the run in (default: a temporary directory)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlpipe-gpu-smoke-") as scratch:
        root = args.root or scratch
        code = run_job(root, args.device, args.set)
        records = stage_records(root, RUN_ID)
        console.print(figures_table(records))
    problems = check_records(records, args.device, expected_engines(args.device, args.set))
    for problem in problems:
        console.print(f"[red]✗ {problem}[/]")
    if code != 0 or problems:
        console.print(f"[red]gpu smoke failed[/] (rlpipe run exited {code})")
        return 1
    console.print(f"[green]✓ every model stage ran on {args.device}[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
