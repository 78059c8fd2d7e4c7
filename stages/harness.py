"""The harness every stage runs in: arguments, config, inputs, outputs, manifests, timing.

A stage is plain Python (no Prefect): `python -m stages.<name> --run R --iter K [--root ROOT]`. The harness

1. reads the run's config from `<root>/runs/<run>/config.yaml` (written when the run started),
2. checks the stage's inputs have valid manifests and computes the stage key from their content hashes,
3. removes the manifests of the stage's own outputs *before* writing anything, so an output that is being
   rewritten is never mistaken for a finished one if the process dies half-way,
4. calls the stage's `run(ctx)`, which writes its outputs through `ctx.write_table` / `ctx.write_checkpoint`,
5. writes each output's manifest last and prints one timing line,
6. on failure writes the run's failure record (stage, exit code, one-line reason; storage/failure.py), which
   the same stage instance's next success removes.

A sharded instance (pipeline.shards) is K shard runs (`--shard k/K`: `ctx.shard_groups` gives each its prompt
groups, `write_table` writes its part, schema-checked) and a merge (`--merge`: `merge_shards`), which checks the
whole table's contract and writes the manifest last, as step 5 does for any stage.

Exit codes: 0 done, 2 bad input or config (message names the file/row/field), 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
from rich.console import Console
from rich.markup import escape

from schemas.config import ConfigError, InvalidRunId, RunConfig
from schemas.contracts import ContractViolation, rejected_path, validate_table, validation_path
from schemas.errors import InputError
from schemas.settings import LANE_CPUS, VERBOSE, cache_dir, lane_cpus
from schemas.tables import TABLES, SchemaMismatch, conform
from stages.registry import (
    LANES,
    STAGES,
    MissingInput,
    Output,
    ResolvedInputs,
    StageSpec,
    instance,
    is_done_now,
    lane_of,
    outputs_of,
    resolve_inputs,
    shards_of,
)
from stages.rl.advantages import ESTIMATORS, check_estimator_fits
from storage.checkpoints import checkpoint_digest, fetch_checkpoint, publish_checkpoint
from storage.failure import clear_failure, record_failure
from storage.fs import atomic_write_bytes, describe_os_error, is_remote, temporary_prefix
from storage.layout import BASE, RunLayout, Shard, StageInstance, parts_dir
from storage.manifest import Manifest, config_hash, output_damage, output_intact, read_manifest, write_manifest
from storage.process import end_process
from storage.retention import require_unpruned
from storage.run import Run, resolve_root
from storage.sharing import refuse_lost_share
from storage.tables import TableVersionError, read_table, write_table

console = Console(stderr=True)


@dataclass
class StageContext:
    """What a stage's `run(ctx)` works with: the run, which instance of the stage this is, its inputs
    (resolved once, when the stage starts) and what it has written so far."""

    run: Run
    instance: StageInstance
    resolved: ResolvedInputs
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    started_monotonic: float = field(default_factory=time.monotonic)
    metrics: dict[str, Any] = field(default_factory=dict)
    written: list[tuple[Output, Manifest]] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)
    undo_at_end: list[Callable[[], None]] = field(default_factory=list)  # process state a stage changed
    claimed: bool = False

    @property
    def spec(self) -> StageSpec:
        return STAGES[self.instance.stage]

    @property
    def config(self) -> RunConfig:
        return self.run.config

    @property
    def layout(self) -> RunLayout:
        return self.run.layout

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.run.fs

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def iteration(self) -> int:
        return self.instance.iteration

    @property
    def round_idx(self) -> int:
        """The generation round of a per-round stage (generate, score); 0 for the others."""
        return self.instance.round_idx

    @property
    def key(self) -> str:
        return self.resolved.key

    @property
    def log_path(self) -> Path:
        """This stage instance's log file for the libraries' own lines (vLLM's): `logs/<slug>.log` of the run."""
        return self.layout.log_path(self.instance.slug)

    def route_engine_logs(self) -> None:
        """Called by a stage before it starts a generation engine: vLLM's log lines go to `log_path`, not the
        console, unless RLPIPE_VERBOSE=1 (`rlpipe run --verbose`)."""
        from stages.generation.vllm_backend import route_vllm_logs

        if VERBOSE.get() != "1":
            self.undo_at_end.append(route_vllm_logs(self.log_path))

    @property
    def inputs(self) -> dict[str, Manifest]:
        return self.resolved.manifests

    @property
    def sources(self) -> dict[str, Output]:
        """Where each input lives (its table name, iteration and round)."""
        return self.resolved.sources

    @contextmanager
    def harness_time(self, what: str) -> Iterator[None]:
        """Add the block's wall time to `metrics["harness"]["<what>_seconds"]` (every output's manifest gets
        it): the harness's own work (reading and writing tables and checkpoints, contract validation), which
        benchmarks/overhead.py separates from the model and sandbox work of the stage."""
        started = time.monotonic()
        try:
            yield
        finally:
            harness = self.metrics.setdefault("harness", {})
            harness[f"{what}_seconds"] = round(harness.get(f"{what}_seconds", 0.0) + time.monotonic() - started, 4)

    def read_input(self, name: str) -> pa.Table:
        """An input table by its input name ("prompts", "rollouts", ...), checked against its schema. A fork's
        shared table (storage/sharing.py) is read as this run's: its rows' `run_id` is the run that computed it,
        and what this run builds from them (scores, batch) belongs to this run."""
        manifest = self.inputs[name]
        spec = TABLES[self.sources[name].name]
        try:
            with self.harness_time("read"):
                table = read_table(self.fs, manifest.path, spec)
        except (TableVersionError, SchemaMismatch) as error:
            raise InputError(str(error)) from None
        if manifest.shared_from and "run_id" in table.column_names:
            column = table.schema.get_field_index("run_id")
            ours = pa.array([self.run_id] * table.num_rows, table.schema.field(column).type)
            table = table.set_column(column, "run_id", ours)
        return table

    def round_input_names(self, table: str) -> list[str]:
        """The input names of `table` in every generation round this stage reads, round 0 first."""
        return [name for name, source in self.sources.items() if source.name == table and name.startswith(table)]

    def read_rounds(self, table: str, columns: list[str]) -> pa.Table:
        """`table` (rollouts, scores) of every generation round this stage reads, concatenated in round order."""
        parts = [self.read_input(name).select(columns) for name in self.round_input_names(table)]
        return pa.concat_tables(parts)

    def policy_dir(self, name: str = "policy") -> Path:
        """A local directory holding the checkpoint input `name`, verified against its manifest."""
        manifest = self.inputs[name]
        if manifest.kind != "checkpoint":
            raise TypeError(f"input {name} is a {manifest.kind}, not a checkpoint")
        with self.harness_time("read"):
            return self._policy_dir(manifest)

    def _policy_dir(self, manifest: Manifest) -> Path:
        if manifest.metrics.get("local_path"):  # the base model: resolved on this machine, then verified
            from stages.generation.models import ModelError, resolve_model

            try:
                local = resolve_model(self.config.model)
            except ModelError as error:  # e.g. a hub model this machine's cache lacks, offline
                raise InputError(str(error)) from None
            digest, _, _ = checkpoint_digest(local)
            if digest != manifest.sha256:
                raise InputError(
                    f"base model at {local} has content hash {digest[:12]}, but this run started from "
                    f"{manifest.sha256[:12]} ({manifest.path}): the model changed under the run"
                )
            return local
        if is_remote(self.layout.root):
            return fetch_checkpoint(self.fs, manifest, cache_dir() / "checkpoints")
        return Path(manifest.path)

    def output(self, name: str) -> Output:
        for output in outputs_of(self.instance):
            if output.name == name:
                return output
        raise KeyError(f"stage {self.spec.name} has no output {name}")

    def claim_outputs(self) -> None:
        """Remove the manifests of this stage's outputs, once, right before the first output is written.

        Not earlier: a stage that stops on bad input (found while reading) must leave its previous outputs
        valid. Not later: an output being rewritten must never be vouched for by its old manifest.
        """
        if not self.claimed:
            invalidate_outputs(self)
            self.claimed = True

    def _manifest(self, output: Output, **values: Any) -> Manifest:
        return Manifest(
            stage=self.spec.name,
            key=self.key,
            kind=output.kind,
            inputs={name: m.sha256 for name, m in self.inputs.items()},
            config_hash=config_hash(self.spec.config_payload(self.config)),
            started_at=self.started_at,
            **values,
        )

    def write_table(self, name: str, table: pa.Table, metrics: dict[str, Any] | None = None) -> Manifest:
        """Check `table` against its schema and data contract, then write it (manifest comes in `finish`).

        A table that breaks its contract is kept beside the output as `<table>.rejected.parquet` (never under
        the output's name) and the stage fails naming the expectations and sample rows. The validation
        result is stored beside the table either way (JSON, and GX's HTML page).
        """
        output = self.output(name)
        spec = TABLES[name]
        path = output.path(self.layout)
        if output.shard is not None:  # a shard's part: its schema now, the whole table's contract at the merge
            return self._write_part(output, conform(table, spec, path), metrics)
        with self.harness_time("validate"):
            table = conform(table, spec, path)
            greedy_baselines = ESTIMATORS[self.config.advantage.estimator].needs_greedy_baseline
            contract = validate_table(name, table, self.config, greedy_baselines)
            self.claim_outputs()
            atomic_write_bytes(self.fs, validation_path(path), contract.to_json())
            if (html := contract.to_html()) is not None:
                atomic_write_bytes(self.fs, validation_path(path, "html"), html.encode())
        if not contract.success:
            write_table(self.fs, rejected_path(path), table, spec)
            raise ContractViolation(path, contract, kept_at=rejected_path(path))
        if self.fs.exists(rejected_path(path)):
            self.fs.rm_file(rejected_path(path))
        with self.harness_time("write"):
            written = write_table(self.fs, path, table, spec)
        contract_metrics = {"contract": {"expectations": contract.evaluated, "seconds": round(contract.seconds, 3)}}
        manifest = self._manifest(
            output, path=written.path, sha256=written.sha256, bytes=written.bytes, rows=written.rows,
            schema=spec.tag, metrics={**contract_metrics, **(metrics or {})},
        )
        self.written.append((output, manifest))
        return manifest

    def _write_part(self, output: Output, table: pa.Table, metrics: dict[str, Any] | None) -> Manifest:
        self.claim_outputs()
        with self.harness_time("write"):
            written = write_table(self.fs, output.path(self.layout), table, TABLES[output.name])
        manifest = self._manifest(output, path=written.path, sha256=written.sha256, bytes=written.bytes,
                                  rows=written.rows, schema=TABLES[output.name].tag, metrics=dict(metrics or {}))
        self.written.append((output, manifest))
        return manifest

    def shard_groups(self, prompt_ids: list[str]) -> list[str]:
        """The prompt groups this run of the stage computes, in their order: all of `prompt_ids` (distinct, first
        appearance kept), or in shard k of K the k-th of K contiguous ranges of them (sizes differ by one at most).

        Contiguous, not hashed: the merge then rebuilds the unsharded table's row order by concatenating the parts
        (and moving each stage's trailing block, e.g. remax's greedy rows, back to the end), and the shards'
        sizes are even at any count, where a hash leaves small counts lopsided.
        """
        groups = list(dict.fromkeys(prompt_ids))
        shard = self.instance.shard
        if shard is None:
            return groups
        if len(groups) < shard.count:
            stage = "evaluate" if self.spec.name == "evaluate_base" else self.spec.name
            raise ConfigError(
                f"pipeline.shards.{stage}={shard.count} is more than the {len(groups)} prompt groups of "
                f"{self.instance.whole.label}: a shard holds whole groups; lower it to {len(groups)} at most"
            )
        return groups[shard.index * len(groups) // shard.count:(shard.index + 1) * len(groups) // shard.count]

    def write_checkpoint(self, local_dir: Path, metrics: dict[str, Any] | None = None) -> Manifest:
        """Publish a finished local checkpoint directory as this stage's checkpoint output."""
        output = self.output("checkpoint")
        destination = output.path(self.layout)
        with self.harness_time("write"):
            digest, files, total = self._publish_checkpoint(local_dir, destination)
        manifest = self._manifest(
            output, path=destination, sha256=digest, bytes=total, files=files, metrics=dict(metrics or {})
        )
        self.written.append((output, manifest))
        return manifest

    def _publish_checkpoint(self, local_dir: Path, destination: str) -> tuple[str, dict[str, Any], int]:
        digest, files, total = checkpoint_digest(local_dir)
        self.claim_outputs()
        if not is_remote(self.layout.root) and Path(destination).resolve() != local_dir.resolve():
            # Local: move the finished directory into place in one rename (same file system: the stage
            # builds it under a temporary name beside the destination, see `scratch_checkpoint_dir`).
            if Path(destination).exists():
                shutil.rmtree(destination)
            os.replace(local_dir, destination)
        elif is_remote(self.layout.root):
            publish_checkpoint(self.fs, local_dir, destination)
            if local_dir in self.scratch:  # uploaded: the local copy was only a staging area
                shutil.rmtree(local_dir, ignore_errors=True)
        return digest, files, total

    def record_external_checkpoint(self, path: str, sha256: str, total_bytes: int, metrics: dict[str, Any]) -> None:
        """Record a checkpoint that lives outside the run (the base model) without copying it.

        Its per-file hashes go into `metrics["files"]`, not `files`, because the directory is on this
        machine's disk, not under the storage root: consumers re-resolve it and compare content hashes.
        """
        output = self.output("checkpoint")
        self.claim_outputs()
        manifest = self._manifest(output, path=path, sha256=sha256, bytes=total_bytes, metrics=metrics)
        self.written.append((output, manifest))

    def scratch_checkpoint_dir(self) -> Path:
        """An empty local directory to build this stage's checkpoint in (beside its destination when local).

        Its name marks it as this output's temporary (`.<name>.tmp-*`), so the next attempt of the stage
        removes it if this one dies before publishing (`remove_stale_temporaries`); a failure that Python
        sees removes it on the way out (`run_stage`).
        """
        destination = self.output("checkpoint").path(self.layout)
        if is_remote(self.layout.root):
            parent = cache_dir() / "scratch"
        else:
            parent = Path(destination).parent
        parent.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=temporary_prefix(destination), dir=parent))
        self.scratch.append(directory)
        return directory

    def seconds(self) -> float:
        return time.monotonic() - self.started_monotonic


def remove_stale_temporaries(ctx: StageContext) -> list[str]:
    """Delete what a killed earlier attempt of this stage left half-written: temporaries of its own outputs
    (beside them, and the local staging area of remote checkpoints). Only the stage's lease holder calls
    this, so no live writer owns them."""
    removed = []
    for output in outputs_of(ctx.instance):
        destination = output.path(ctx.layout)
        # `.<name>.tmp-*` (the output itself) and `.<name>.<suffix>.tmp-*` (its manifest, contract report).
        name = temporary_prefix(destination).removesuffix(".tmp-")
        places = [] if is_remote(ctx.layout.root) else [Path(destination).parent]
        if output.kind == "checkpoint" and is_remote(ctx.layout.root):
            places.append(cache_dir() / "scratch")
        for place in places:
            if not place.is_dir():
                continue
            for stale in place.glob(f"{name}.*"):
                if ".tmp-" not in stale.name:
                    continue
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
                removed.append(str(stale))
    return removed


def prepare_context(run: Run, target: StageInstance) -> StageContext:
    """Check the instance against the run's config (and the config's estimator against the rest of it, as the CLI
    does where it loads a config) and resolve its inputs, once; raises ConfigError, MissingInput, or
    CheckpointPruned (an InputError) when a checkpoint it reads was pruned (storage/retention.py)."""
    check_estimator_fits(run.config)
    if not STAGES[target.stage].run_level and not 0 <= target.iteration < run.config.iterations:
        raise ConfigError(
            f"iteration {target.iteration} is outside 0..{run.config.iterations - 1} for run {run.run_id}"
        )
    check_round(STAGES[target.stage], run.config, target.round_idx)
    resolved = resolve_inputs(run, target)
    for manifest in resolved.manifests.values():  # a pruned input still counts for keys, never for reading
        if manifest.kind == "checkpoint":
            require_unpruned(manifest)
    return StageContext(run=run, instance=target, resolved=resolved)


def check_round(spec: StageSpec, config: RunConfig, round_idx: int) -> None:
    if round_idx == 0:
        return
    if not spec.per_round:
        raise ConfigError(f"stage {spec.name} has no generation rounds (only generate and score do)")
    cap = config.advantage.round_cap  # None: unlimited
    if config.advantage.target_groups is None or round_idx < 1 or (cap is not None and round_idx >= cap):
        raise ConfigError(
            f"round {round_idx} of stage {spec.name}: extra generation rounds exist only for dynamic sampling "
            f"(advantage.target_groups set), numbered "
            + (f"1..{cap - 1} (advantage.max_generation_rounds={cap})" if cap else "from 1")
        )


def invalidate_outputs(ctx: StageContext, only_damaged: bool = False) -> None:
    """Remove the manifests of the stage's outputs (with `only_damaged`: those whose output is missing or
    changed size, which vouch for nothing already)."""
    for output in outputs_of(ctx.instance):
        path = output.manifest_path(ctx.layout)
        manifest = read_manifest(ctx.fs, path)
        if only_damaged and (manifest is None or output_damage(ctx.fs, manifest) is None):
            continue
        if manifest is not None or ctx.fs.exists(path):
            ctx.fs.rm_file(path)


def finish(ctx: StageContext) -> list[Manifest]:
    expected = set(outputs_of(ctx.instance))
    produced = {o for o, _ in ctx.written}
    if produced != expected:
        raise RuntimeError(f"stage {ctx.spec.name} wrote {sorted(produced)}, expected {sorted(expected)}")
    ended_at = datetime.now(UTC).isoformat()
    seconds = round(ctx.seconds(), 3)
    manifests = []
    for output, manifest in ctx.written:
        manifest.ended_at = ended_at
        manifest.seconds = seconds
        manifest.metrics = {**ctx.metrics, **manifest.metrics}
        write_manifest(ctx.fs, output.manifest_path(ctx.layout), manifest)
        manifests.append(manifest)
    return manifests


# A sharded stage's merge: its shards' parts (in shard order) and their manifests -> the whole table and its
# manifest's metrics. `concatenate_parts` unless the stage's rows need more (stages/generate.py `merge`).
Merge = Callable[[StageContext, list[pa.Table], list[Manifest]], tuple[pa.Table, dict[str, Any]]]


def combine_part_metrics(parts: list[dict[str, Any]], counts: Collection[str] = (), prefix: str = "") -> dict[str, Any]:
    """One manifest's metrics from its shards': the `counts` (dotted names; a mapping of counts, such as status
    counts, entry by entry) are summed, a figure all parts agree on is kept, `*_seconds` take the longest part's
    (the parts ran at once: wall time), other mappings are combined key by key; any other figure (a mean, a rate)
    is None here, recomputed from the whole table by the stage's merge where it can. A figure some parts lack is
    combined over those that have it. Every part's own metrics stay under the merged manifest's `shards`."""
    combined: dict[str, Any] = {}
    for key in dict.fromkeys(key for part in parts for key in part):
        values, name = [part[key] for part in parts if key in part], prefix + key
        if name in counts and all(isinstance(value, dict) for value in values):
            combined[key] = dict(sum((Counter(value) for value in values), Counter()))
        elif name in counts:
            combined[key] = sum(values)
        elif all(value == values[0] for value in values):
            combined[key] = values[0]
        elif all(isinstance(value, dict) for value in values):
            combined[key] = combine_part_metrics(values, counts, f"{name}.")
        elif key.endswith("_seconds") and all(isinstance(value, int | float) for value in values):
            combined[key] = max(values)
        else:
            combined[key] = None
    return combined


def concatenate_parts(
    ctx: StageContext, parts: list[pa.Table], manifests: list[Manifest], counts: Collection[str] = (),
) -> tuple[pa.Table, dict[str, Any]]:
    """The default merge: the parts one after another (shard k holds the k-th range of prompt groups), their
    metrics combined (`combine_part_metrics`, `counts` summed)."""
    return pa.concat_tables(parts), combine_part_metrics([manifest.metrics for manifest in manifests], counts)


def trailing_rows_last(table: pa.Table, trailing: pa.Array) -> pa.Table:
    """`table` with the rows where `trailing` is true moved to the end, each block in its order: the unsharded
    stage writes such a block after all groups (remax's greedy rows, evaluate's sampled rows after the greedy)."""
    flags = trailing.to_pylist()
    return table.take([i for i, flag in enumerate(flags) if not flag] + [i for i, flag in enumerate(flags) if flag])


def part_record(manifest: Manifest) -> dict[str, Any]:
    """What the merged manifest keeps of a part (`shards`): which host made it when, its rows, hash and figures."""
    return {"part": manifest.path.rsplit("/", 1)[-1], "host": manifest.host, "started_at": manifest.started_at,
            "ended_at": manifest.ended_at, "seconds": manifest.seconds, "rows": manifest.rows,
            "sha256": manifest.sha256, "metrics": manifest.metrics}


def merge_shards(run: Run, target: StageInstance, merge: Merge) -> list[Manifest]:
    """Merge a sharded instance (pipeline.shards): every shard's part, which must be valid for this instance's
    key, into the whole table through `ctx.write_table` (so the table's full contract is checked and its manifest
    is written last, as any stage's), then remove the parts. Runs under the instance's own lease, so of two merges
    one runs and the other waits or is refused; no reader ever sees a part (storage/layout.py `part_path`)."""
    parts = shards_of(run.config, target)
    if not parts:
        raise ConfigError(f"{target.label} is not sharded (pipeline.shards.{target.stage} is 1): nothing to merge")

    def work(ctx: StageContext) -> None:
        for output in outputs_of(target):
            tables, manifests = [], []
            for part in parts:
                part_output = replace(output, shard=part.shard)
                manifest = read_manifest(ctx.fs, part_output.manifest_path(ctx.layout))
                if manifest is None or manifest.key != ctx.key or not output_intact(ctx.fs, manifest):
                    raise MissingInput(f"{part.label}: no valid part at {part_output.path(ctx.layout)} for this "
                                       "config and these inputs; run that shard first")
                with ctx.harness_time("read"):
                    tables.append(read_table(ctx.fs, manifest.path, TABLES[output.name]))
                manifests.append(manifest)
            table, metrics = merge(ctx, tables, manifests)
            ctx.write_table(output.name, table, {**metrics, "shards": [part_record(m) for m in manifests]})

    manifests = run_stage(run, target, work)
    for output in outputs_of(target):  # after the manifest: a merge killed before it finds its parts again
        if run.fs.exists(folder := parts_dir(output.path(run.layout))):
            run.fs.rm(folder, recursive=True)
    return manifests


def parse_args(stage: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=f"rlpipe stage {stage}")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--iter", type=int, default=BASE, help="iteration (ignored by run-level stages)")
    parser.add_argument("--round", type=int, default=0, help="generation round (generate and score, dynamic sampling)")
    parser.add_argument("--root", help="storage root (default $RLPIPE_ROOT, else ./rlpipe-data)")
    parser.add_argument("--if-needed", action="store_true",
                        help="do nothing when the outputs are valid (checked after the stage's lease is taken)")
    parser.add_argument("--lock-wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long for the stage's lease when another process holds it (default: refuse)")
    sharding = parser.add_mutually_exclusive_group()
    sharding.add_argument("--shard", metavar="INDEX/COUNT",
                          help="run shard INDEX (0-based) of COUNT = pipeline.shards.<stage>: write its part only")
    sharding.add_argument("--merge", action="store_true",
                          help="merge the finished shards' parts into the stage's table (pipeline.shards)")
    return parser.parse_args(argv)


def check_shard(config: RunConfig, target: StageInstance) -> None:
    """A shard run's count must be the config's (a shard of another split would cover other groups)."""
    count = config.pipeline.shards_of(target.stage)
    if target.shard is not None and target.shard.count != count:
        raise ConfigError(f"{target.label}: pipeline.shards.{target.stage} is {count}, not {target.shard.count}")


def run_stage(run: Run, target: StageInstance, work: Callable[[StageContext], None]) -> list[Manifest]:
    """Run one stage instance in this process and return its manifests (used by `main` and by tests)."""
    ctx = prepare_context(run, target)
    if "torch" in sys.modules:  # stage modules that compute import torch at the top
        sys.modules["torch"].set_num_threads(run.config.threads)
    console.print(f"[bold]▶ {target.label}[/] run={run.run_id}")
    if removed := remove_stale_temporaries(ctx):
        console.print(f"  removed {len(removed)} temporaries of an earlier attempt that did not finish")
    # a fork's shared output that is lost is refused, never redone with other data (storage/sharing.py)
    refuse_lost_share(run.fs, run.run_id, [output.manifest_path(run.layout) for output in outputs_of(target)])
    invalidate_outputs(ctx, only_damaged=True)  # the others stay valid until the first write (claim_outputs)
    try:
        work(ctx)
    finally:
        for directory in ctx.scratch:  # published ones were moved or uploaded already
            shutil.rmtree(directory, ignore_errors=True)
        for undo in reversed(ctx.undo_at_end):
            undo()
    manifests = finish(ctx)
    clear_failure(run.layout, target)  # an earlier attempt's failure record, now fixed
    rows = ", ".join(f"{m.rows} rows" if m.rows is not None else f"{m.bytes / 1e6:.0f} MB" for m in manifests)
    console.print(f"[green]✓ {target.label}[/] {rows} in {ctx.seconds():.1f}s")
    if ctx.log_path.exists():  # where the engine's own lines went (route_engine_logs)
        console.print(f"  [dim]vLLM's log: {ctx.log_path}[/]", soft_wrap=True)
    return manifests


def pin_to_lane(stage: str) -> None:
    """Run this process, and every process it starts (sandbox jobs, a generation server, DeepSpeed ranks), on the
    cores `RLPIPE_LANE_CPUS` gives the stage's lane, as `taskset` does: on one machine, the stand-in for a
    rollout machine and a train machine. Unset, or no cores for this lane: the affinity stays as inherited."""
    try:
        lanes = lane_cpus()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if unknown := sorted(set(lanes) - set(LANES)):
        raise ConfigError(f"{LANE_CPUS.name}: unknown lane {', '.join(unknown)}; lanes are {', '.join(LANES)}")
    if cpus := lanes.get(lane_of(stage)):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as error:
            raise ConfigError(f"{LANE_CPUS.name}: cannot run on cores {sorted(cpus)} here: {error}") from None


def main(
    stage: str, work: Callable[[StageContext], None], argv: list[str] | None = None, merge: Merge = concatenate_parts,
) -> int:
    """Run a stage as a process: under its lease, so that no two processes (a flow's child, a retry, a person
    at a shell) ever run the same stage of the same iteration at once. The lease lives as long as this
    process, so a stage whose driver was killed stays guarded until it ends. The run's config is read once,
    under the lease.

    A shard run (`--shard k/K`) holds a lease of its own and writes its part; the merge (`--merge`) holds the
    instance's lease.

    Exit codes: 0 done (or already done with --if-needed), 1 failed, 2 bad input or config, 3 lease held.
    """
    from storage.lock import RunLocked, stage_lock

    args = parse_args(stage, argv)
    layout: RunLayout | None = None
    target: StageInstance | None = None
    try:
        layout = RunLayout.create(resolve_root(args.root), args.run)
        target = instance(stage, args.iter, args.round, Shard.parse(args.shard) if args.shard else None)
        pin_to_lane(stage)
        with stage_lock(layout, target, wait_s=args.lock_wait):
            run = Run.at(layout)
            check_shard(run.config, target)
            # With --if-needed, asked once the lease is ours: the holder we waited for may have done it.
            if args.if_needed and is_done_now(run, target):
                console.print(f"· {target.label} is done already")
                return 0
            if args.merge:
                merge_shards(run, target, merge)
            else:
                run_stage(run, target, work)
    except (ConfigError, InputError, MissingInput, SchemaMismatch, TableVersionError, InvalidRunId) as error:
        # one line however long (the user's paths), its text never read as markup (a message may hold brackets)
        console.print(f"[red]✗ {stage}: {escape(str(error))}[/]", soft_wrap=True)
        return recorded(layout, target, 2, str(error))
    except ContractViolation as error:  # the stage's own output is wrong: not a bad-input exit
        console.print(f"[red]✗ {stage}: {error}[/]")
        return recorded(layout, target, 1, str(error))
    except RunLocked as error:  # another process runs it: not a failure of the stage
        console.print(f"[red]✗ {stage}: {error}[/]")
        return 3
    except OSError as error:
        # Disk full, read-only or unwritable root, storage unreachable after retries: one line naming the
        # path. Nothing is lost: outputs are written under temporary names and manifests come last.
        console.print(f"[red]✗ {stage}: storage error: {describe_os_error(error)}[/]")
        return recorded(layout, target, 1, f"storage error: {describe_os_error(error)}")
    except Exception as error:  # a crash: its traceback goes to the terminal as before, its last line on record
        recorded(layout, target, 1, f"{type(error).__name__}: {error}")
        raise
    return 0


def recorded(layout: RunLayout | None, target: StageInstance | None, exit_code: int, reason: str) -> int:
    """Write the run's failure record (storage/failure.py) if the stage instance is known; return `exit_code`.
    A record that cannot be written (the storage error being reported, say) is left out, never raised. A shard's
    failure is its instance's, the shard named in the reason (`rlpipe status` lists instances)."""
    if layout is not None and target is not None:
        reason = f"{target.shard.name}: {reason}" if target.shard else reason
        with contextlib.suppress(OSError):
            record_failure(layout, target.whole, exit_code, reason)
    return exit_code


def exit_with(stage: str, run: Callable[[StageContext], None], merge: Merge = concatenate_parts) -> None:
    """Run the stage (a shard of it, or its merge: `merge` builds the whole table from the parts), then end the
    process with its exit code as a stage forked from the stage server ends (flows/runner/forkserver.py): no C++
    static destructor runs (storage/process.py says why)."""
    end_process(main(stage, run, merge=merge))
