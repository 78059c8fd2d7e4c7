"""Scaling out in one run: two vLLM engines vs one in the generate stage, and score in two shards vs one process.

The real stages, each a child process forked from the stage server as under `rlpipe run`, on the default config
cut down (1 iteration, 8 prompt groups x 4 samples x <= 64 tokens, engines of the stage's own, not the warm
server's); the run-level stages first, untimed.
1. generate with generate.engines=1 (one engine on all the stage's cores) and =2 (on CPU each pinned to its share
   of the cores, stages/generation/replicas.py; on GPU one GPU each) in two copies of one run (same prompts and
   seeds): tokens/s over the manifests' generation time (engine start apart) and the ratio, the ratio of the stage
   processes' walls (engine start in), and whether the rollouts tables are byte-identical (else the share of rows
   with equal tokens and their largest logprob difference).
2. score in one process vs pipeline.shards={score: 2} (`run_sharded`: both shards at once, then the merge) on
   copies of the same rollouts: programs/s over the stage's wall, the ratio, and whether the merged table equals
   the unsharded one (less `sandbox_seconds`, a measured time).
3. sharding's own cost as a share of the sharded stage's wall (target <= 2%): planning and dispatch (the wall less
   the longest shard process and the merge process), the longest part's write (harness timer: part and manifest),
   and the whole merge process (reading the parts, the table's contract validation, writing it, removing the parts).
Load average at start and end. Target: 2 engines on 2 GPUs >= 1.8x one (on the CPU both share its cores). On
2026-11-29, quiet, `--set generate.prompts_per_iteration=64`: 0.84x (0.73x with engine start), 1.05x, 6.2% of a 4 s
score stage (0.25 s, fixed); loaded, the defaults: 4.85x, 0.42x, 6.4% (docs/measurements.md).
Run: `.venv/bin/python -m benchmarks.scale` (`--config`, `--set s.f=v`; `--root DIR`, a new directory, keeps the runs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from benchmarks.overhead import TARGET, stage_times
from flows.runner import forkserver
from flows.runner.process import StageOutcome, run_sharded, run_stage_process, stage_environment
from schemas.config import load_config
from schemas.tables import ROLLOUTS
from stages.registry import Output, instance, outputs_of
from storage.manifest import Manifest, read_manifest
from storage.run import Run
from storage.tables import read_table
from tests.support.stages import clone
from tests.support.table_digests import table_digest

SIZE = ["iterations=1", "generate.prompts_per_iteration=8", "generate.n_samples=4", "generate.max_new_tokens=64",
        # each generate stage its own engines: with `auto` the warm server's use depends on the memory free then
        "generate.warm_engine=off"]


@dataclass
class Agreement:
    """How far two rollouts tables of the same requests agree, row by row in table order."""

    rows: int
    same_tokens: int  # rows whose response_token_ids are equal
    max_logprob_diff: float  # over the rows with equal tokens

    def line(self) -> str:
        share = 100 * self.same_tokens / self.rows
        return (f"{self.same_tokens}/{self.rows} rows with equal response_token_ids ({share:.1f}%), "
                f"max |logprob difference| over those {self.max_logprob_diff:.2e}")


def rollouts_agreement(first: pa.Table, second: pa.Table) -> Agreement:
    tokens_a, tokens_b = first["response_token_ids"].to_pylist(), second["response_token_ids"].to_pylist()
    logprobs_a, logprobs_b = first["response_logprobs"].to_pylist(), second["response_logprobs"].to_pylist()
    if len(tokens_a) != len(tokens_b):
        raise ValueError(f"the tables have {len(tokens_a)} and {len(tokens_b)} rows: not the same requests")
    same = [i for i in range(len(tokens_a)) if tokens_a[i] == tokens_b[i]]
    diff = max((abs(a - b) for i in same for a, b in zip(logprobs_a[i], logprobs_b[i], strict=True)), default=0.0)
    return Agreement(len(tokens_a), len(same), diff)


def manifest_of(run: Run, output: Output) -> Manifest:
    run.fs.invalidate_cache()
    manifest = read_manifest(run.fs, output.manifest_path(run.layout))
    if manifest is None:
        raise RuntimeError(f"{output.path(run.layout)} has no manifest after its stage ran")
    return manifest


def copy_with(run: Run, root: Path, config_path: str, overrides: list[str]) -> Run:
    """A copy of `run` under `root` with a config that differs in scheduling only (engines, shards: in no stage
    key), so what is done stays done."""
    layout = clone(run.layout, str(root))
    return Run.start(load_config(config_path, overrides), layout.root, replace_config=True)


def generate(run: Run) -> tuple[float, float, float]:
    """Run the generate stage: (tokens/s over its generation time, engine start, process wall)."""
    target = instance("generate", 0)
    wall = run_stage_process(run, target)
    [timed] = stage_times(run.layout, [StageOutcome(target, ran=True, seconds=wall)])
    metrics = manifest_of(run, outputs_of(target)[0]).metrics
    return metrics["generated_tokens"] / metrics["generation_seconds"], timed.engine_start, wall


@dataclass
class ShardedScore:
    wall: float
    part_walls: list[float]
    merge_wall: float
    part_write: float  # the longest part's harness write timer (the part file and its manifest)
    validation: float  # the merge's contract validation of the whole table

    @property
    def planning(self) -> float:
        return self.wall - max(self.part_walls) - self.merge_wall

    @property
    def cost(self) -> float:
        return self.planning + self.part_write + self.merge_wall


def score_sharded(run: Run) -> ShardedScore:
    """The score stage as its shards at once, then their merge, each process timed (as flows/pipeline.py
    `run_stage_here` runs a sharded stage)."""
    target = instance("score", 0)
    part_walls: list[float] = []
    merge_walls: list[float] = []
    started = time.monotonic()
    run_sharded(run, target, lambda part: part_walls.append(run_stage_process(run, part)),
                lambda whole: merge_walls.append(run_stage_process(run, whole, merge=True)))
    wall = time.monotonic() - started
    merged = manifest_of(run, outputs_of(target)[0])
    part_write = max(part["metrics"]["harness"].get("write_seconds", 0.0) for part in merged.metrics["shards"])
    return ShardedScore(wall, part_walls, merge_walls[0], part_write, merged.metrics["contract"]["seconds"])


def load1() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="deployments/configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="section.field=value (repeatable)")
    parser.add_argument("--root", default=None, help="a new directory for the runs (default: a temporary one)")
    args = parser.parse_args()

    load_start = os.getloadavg()
    scratch = Path(args.root or tempfile.mkdtemp(prefix="rlpipe-scale-"))
    overrides = ["run_id=scale", *SIZE, *args.set]
    one = Run.start(load_config(args.config, [*overrides, "generate.engines=1"]), str(scratch / "one"))
    server = forkserver.start(stage_environment(one.config))  # every stage below forks from it, as under `rlpipe run`
    if server is not None:
        server.wait_ready()
    for stage in ("prompts", "base_model"):  # what generate and score read; evaluate_base is not needed
        run_stage_process(one, instance(stage))
    two = copy_with(one, scratch / "two", args.config, [*overrides, "generate.engines=2"])
    print(f"{one.config.generate.prompts_per_iteration} prompts x {one.config.generate.n_samples} samples x <= "
          f"{one.config.generate.max_new_tokens} tokens; cores {len(os.sched_getaffinity(0))}; "
          f"load average at start {load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f}", flush=True)

    rates: dict[int, float] = {}
    walls: dict[int, float] = {}
    for engines, run in ((1, one), (2, two)):
        before = load1()
        rates[engines], engine_start, walls[engines] = generate(run)
        print(f"generate, {engines} engine(s): {rates[engines]:7.1f} tok/s   engine start {engine_start:5.1f} s   "
              f"process wall {walls[engines]:6.1f} s   load {before:.1f} -> {load1():.1f}", flush=True)
    rollouts = Output("rollouts", 0)
    manifests = [manifest_of(run, rollouts) for run in (one, two)]
    if manifests[0].sha256 == manifests[1].sha256:
        agreement_line = "the two rollouts tables are byte-identical"
    else:
        agreement = rollouts_agreement(*(read_table(run.fs, manifest.path, ROLLOUTS)
                                         for run, manifest in zip((one, two), manifests, strict=True)))
        agreement_line = f"the rollouts tables differ: {agreement.line()}"

    sharded = copy_with(one, scratch / "sharded", args.config, [*overrides, "generate.engines=1",
                                                                 "pipeline.shards={score: 2}"])
    before = load1()
    single_wall = run_stage_process(one, instance("score", 0))
    print(f"score, 1 process: wall {single_wall:6.1f} s   load {before:.1f} -> {load1():.1f}", flush=True)
    before = load1()
    shards = score_sharded(sharded)
    print(f"score, 2 shards: wall {shards.wall:6.1f} s (shards {', '.join(f'{w:.1f}' for w in shards.part_walls)} "
          f"s, merge {shards.merge_wall:.1f} s)   load {before:.1f} -> {load1():.1f}", flush=True)
    scores = Output("scores", 0)
    digests = [table_digest(run, manifest_of(run, scores)) for run in (one, sharded)]
    programs = manifest_of(one, scores).rows

    print()
    print(f"generate: 2 engines / 1 engine = {rates[2] / rates[1]:.2f} ({rates[2]:.1f} / {rates[1]:.1f} tok/s); "
          f"the whole stage, engine start in: {walls[1] / walls[2]:.2f} ({walls[2]:.1f} / {walls[1]:.1f} s); "
          f"{agreement_line}")
    single_rate, sharded_rate = programs / single_wall, programs / shards.wall
    print(f"score: 2 shards / 1 process = {sharded_rate / single_rate:.2f} ({sharded_rate:.1f} / {single_rate:.1f} "
          f"programs/s over the stage's wall, {programs} programs); merged table "
          + ("equals the unsharded one" if digests[0] == digests[1] else "DIFFERS from the unsharded one")
          + f" ({', '.join(digests[0].get('without', []))} left out)")
    share = shards.cost / shards.wall
    print(f"sharding's own cost {shards.cost:.2f} s = {100 * share:.1f}% of the sharded stage's "
          f"{shards.wall:.1f} s (target <= {100 * TARGET:.0f}%: {'met' if share <= TARGET else 'NOT met'}): "
          f"planning and dispatch {shards.planning:.2f} s, part writes {shards.part_write:.2f} s, merge process "
          f"{shards.merge_wall:.2f} s (of which the whole table's validation {shards.validation:.2f} s)")
    load_end = os.getloadavg()
    print(f"load average at end {load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f}; runs kept at {scratch}")


if __name__ == "__main__":
    main()
