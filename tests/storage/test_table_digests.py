"""The run fingerprint the tiny end-to-end run is checked against (tests/support/table_digests.py), on a synthetic
run: it lists every table, ignores exactly the columns a manifest declares nondeterministic, and notices the rest."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from schemas.tables import TABLES
from storage.layout import manifest_path_for
from storage.manifest import read_manifest, write_manifest
from storage.run import Run
from storage.tables import read_table, write_table
from tests.support.synthetic_runs import write_synthetic_run
from tests.support.table_digests import run_digests

SCORES = "iter=0000/scores.parquet"
TIMED = {"deterministic": False, "nondeterministic_columns": ["sandbox_seconds"]}


def rewrite_scores(run: Run, change: dict[str, pa.Array], metrics: dict) -> None:
    """Write iteration 0's scores again with some columns replaced, and a manifest that vouches for the new bytes."""
    path = f"{run.layout.run_dir}/{SCORES}"
    table = read_table(run.fs, path, TABLES["scores"])
    for name, values in change.items():
        table = table.set_column(table.schema.get_field_index(name), name, values)
    written = write_table(run.fs, path, table, TABLES["scores"])
    manifest = read_manifest(run.fs, manifest_path_for(path, "table"))
    write_manifest(run.fs, manifest_path_for(path, "table"), replace(
        manifest, sha256=written.sha256, bytes=written.bytes, metrics={**manifest.metrics, **metrics}))


def test_digests_cover_every_table_and_only_the_declared_columns_may_change(tmp_path: Path) -> None:
    run = Run.at(write_synthetic_run(str(tmp_path), iterations=2))
    digests = run_digests(run)
    per_iteration = ["rollouts", "scores", "batch", "train_metrics", "eval"]
    assert list(digests) == ["prompts.parquet", "base/eval.parquet"] + [
        f"iter={k:04d}/{table}.parquet" for k in (0, 1) for table in per_iteration]
    assert all(set(digest) == {"sha256"} for digest in digests.values())

    rows = read_table(run.fs, f"{run.layout.run_dir}/{SCORES}", TABLES["scores"]).num_rows
    rewrite_scores(run, {"sandbox_seconds": pa.array([0.5] * rows, pa.float64())}, TIMED)
    timed = run_digests(run)
    assert timed[SCORES]["without"] == ["sandbox_seconds"]
    assert {table: d for table, d in timed.items() if d != digests[table]} == {SCORES: timed[SCORES]}

    rewrite_scores(run, {"sandbox_seconds": pa.array([9.0] * rows, pa.float64())}, TIMED)
    assert run_digests(run) == timed  # another measured time, same digest
    rewards = read_table(run.fs, f"{run.layout.run_dir}/{SCORES}", TABLES["scores"])["reward"]
    rewrite_scores(run, {"reward": pc.add(rewards, 1.0)}, TIMED)
    assert run_digests(run)[SCORES] != timed[SCORES]  # a reward is not a measured time

    rewrite_scores(run, {}, {"nondeterministic_columns": []})
    with pytest.raises(ValueError, match="names no columns"):
        run_digests(run)
    rewrite_scores(run, {}, TIMED)
    (Path(run.layout.run_dir) / "iter=0001" / "eval.parquet").write_bytes(b"not the table its manifest describes")
    with pytest.raises(ValueError, match="not its manifest's"):
        run_digests(run)
