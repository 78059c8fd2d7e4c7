"""Where a run's files live, the same under a local folder or an `s3://` URL.

    <root>/runs/<run_id>/config.yaml
    <root>/runs/<run_id>/prompts.parquet                     (+ .manifest.json)
    <root>/runs/<run_id>/base/eval.parquet                   evaluation of the base model
    <root>/runs/<run_id>/iter=0003/<table>.parquet           rollouts, scores, batch, train_metrics, eval
    <root>/runs/<run_id>/iter=0003/round=01/<table>.parquet  rollouts, scores of a dynamic-sampling round
    <root>/runs/<run_id>/iter=0003/<table>.parquet.parts/    a sharded stage's parts until the merge (`part_path`)
    <root>/runs/<run_id>/checkpoints/base/manifest.json      points at the base model directory
    <root>/runs/<run_id>/checkpoints/iter=0003/              HF model dir + optimizer.pt + manifest.json
    <root>/runs/<run_id>/logs/generate@iter=0003.log          a stage's library log (vLLM's), local roots

`iter=NNNN` is Hive-style so DuckDB reads `runs/*/iter=*/rollouts.parquet` with the iteration as a column.
Round 0 of an iteration (the only one unless dynamic sampling asks for more) lives directly in `iter=NNNN/`;
extra generation rounds r >= 1 in `iter=NNNN/round=RR/` (every row also carries its `round`).
Every output's manifest sits beside it (`<file>.manifest.json`, or `manifest.json` inside a checkpoint dir).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import fsspec

from schemas.config import check_run_id
from schemas.settings import cache_dir
from storage.fs import filesystem, is_remote, join, normalize_root

BASE = -1  # the "iteration" of the base model: its checkpoint and its evaluation
def iteration_name(iteration: int) -> str:
    return "base" if iteration == BASE else f"iter={iteration:04d}"


def round_name(round_idx: int) -> str:
    return f"round={round_idx:02d}"


def instance_name(iteration: int, round_idx: int = 0) -> str:
    """`base`, `iter=0003`, or `iter=0003/round=01`: where a stage instance writes, and how logs name it."""
    name = iteration_name(iteration)
    return f"{name}/{round_name(round_idx)}" if round_idx > 0 else name


@dataclass(frozen=True)
class Shard:
    """Shard `index` (0-based) of `count` of a sharded stage instance (`pipeline.shards`)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count}: the index must be in 0..{self.count - 1}")

    @property
    def name(self) -> str:
        """`part-01-of-04`: the part file's name, and the shard's in labels and leases."""
        return f"part-{self.index:02d}-of-{self.count:02d}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`1/4` (the `--shard` argument) -> Shard(1, 4)."""
        index, _, count = text.partition("/")
        try:
            return cls(int(index), int(count))
        except ValueError as error:
            raise ValueError(f"--shard {text!r}: expected INDEX/COUNT with 0 <= INDEX < COUNT ({error})") from None


def parts_dir(output_path: str) -> str:
    """The folder of a sharded table's parts, `<table>.parquet.parts/` beside it: no table pattern of the catalog
    matches inside it, so no reader sees a part; the merge removes it once the whole table's manifest is written."""
    return output_path + ".parts"


def part_path(output_path: str, shard: Shard) -> str:
    """Where shard `shard` writes its part of the table at `output_path`: `<table>.parquet.parts/<name>.parquet`."""
    return join(parts_dir(output_path), f"{shard.name}.parquet")


@dataclass(frozen=True)
class StageInstance:
    """One run of one stage: the stage, its iteration (BASE for run-level stages) and its generation round.
    The one value that names it everywhere: paths (`where`), logs and errors (`label`), leases and flow runs
    (`slug`)."""

    stage: str
    iteration: int = BASE
    round_idx: int = 0
    shard: Shard | None = None  # one shard run of a sharded instance (pipeline.shards); None: the whole instance

    @property
    def where(self) -> str:
        return instance_name(self.iteration, self.round_idx)

    @property
    def whole(self) -> StageInstance:
        """The instance this shard is a part of (itself when it is no shard)."""
        return StageInstance(self.stage, self.iteration, self.round_idx)

    def part(self, index: int, count: int) -> StageInstance:
        return StageInstance(self.stage, self.iteration, self.round_idx, Shard(index, count))

    @property
    def label(self) -> str:
        """`prompts`, `generate iter=3`, `generate iter=3 round=1`, `score iter=3 part-01-of-02`."""
        label = self.stage if self.iteration == BASE else (
            f"{self.stage} iter={self.iteration}" + (f" round={self.round_idx}" if self.round_idx else ""))
        return f"{label} {self.shard.name}" if self.shard else label

    @property
    def slug(self) -> str:
        """`prompts@base`, `generate@iter=0003`, `generate@iter=0003.round=01`, `score@iter=0003.part-01-of-02`: a
        file or flow-run name (a shard's lease is its own: the whole instance's belongs to the merge)."""
        slug = f"{self.stage}@{self.where.replace('/', '.')}"
        return f"{slug}.{self.shard.name}" if self.shard else slug


@dataclass(frozen=True)
class RunLayout:
    root: str
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @classmethod
    def create(cls, root: str, run_id: str) -> RunLayout:
        return cls(normalize_root(root), run_id)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return filesystem(self.root)

    @property
    def runs_dir(self) -> str:
        return join(self.root, "runs")

    @property
    def run_dir(self) -> str:
        return join(self.runs_dir, self.run_id)

    @property
    def config_path(self) -> str:
        return join(self.run_dir, "config.yaml")

    @property
    def prompts_path(self) -> str:
        return join(self.run_dir, "prompts.parquet")

    def iteration_dir(self, iteration: int) -> str:
        return join(self.run_dir, iteration_name(iteration))

    def table_path(self, table: str, iteration: int, round_idx: int = 0) -> str:
        if table == "prompts":
            return self.prompts_path
        if round_idx > 0:
            return join(self.iteration_dir(iteration), round_name(round_idx), f"{table}.parquet")
        return join(self.iteration_dir(iteration), f"{table}.parquet")

    def checkpoint_dir(self, iteration: int) -> str:
        return join(self.run_dir, "checkpoints", iteration_name(iteration))

    def log_path(self, name: str) -> Path:
        """A local log file of this run, `logs/<name>.log` (a stage's slug, e.g. `generate@iter=0003`): in the run's
        folder under a local root; under a remote one in this machine's cache, `<cache>/logs/<run_id>/`, since a
        log is appended line by line as it is written."""
        folder = Path(cache_dir()) / "logs" / self.run_id if is_remote(self.root) else Path(self.run_dir) / "logs"
        return folder / f"{name}.log"

    def lock_path(self) -> str:
        return join(self.run_dir, "run.lock")


def manifest_path_for(output_path: str, kind: str) -> str:
    return join(output_path, "manifest.json") if kind == "checkpoint" else output_path + ".manifest.json"
