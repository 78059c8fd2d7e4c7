"""Determinism drill for the stages that need no model: rerunning a finished stage from the same inputs, on the
same machine, reproduces its table's content hash, or its manifest says that it cannot.

(Generate and train, with SmolLM2 on the HF backend, are drilled in test_model_stages.py.)
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from storage.layout import BASE, RunLayout
from storage.manifest import read_manifest

from . import helpers as h


@pytest.fixture(scope="module")
def run(pristine_run: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    return h.clone_run(pristine_run, tmp_path_factory.mktemp("determinism") / "root")


@pytest.mark.parametrize("stage", ["prompts", "score", "advantage"])
def test_rerun_reproduces_the_content_hash_or_the_manifest_says_so(
    run: RunLayout, stage: str, tmp_path: Path
) -> None:
    """Proves: running a finished stage again (a stage process: helpers.fork_stage; same inputs, same machine)
    writes a table with the same sha256 as before; or its manifest says `deterministic: false` and names the
    columns that may differ (`nondeterministic_columns`), and every other column is equal, value for value and
    row for row, so that no one expects byte-equal reruns from it and everyone can rely on the rest.

    Why columns and not only the flag: score measures each program's wall time (`sandbox_seconds`), so its
    bytes never repeat and its manifest always says `deterministic: false`; a drill that accepted the flag
    alone would check nothing about score, although its rewards, statuses and per-test results must repeat.
    A manifest that says `false` without naming columns is refused here too: none of these stages needs a
    model, so each one can say exactly which columns measure time."""
    import pyarrow.parquet as pq

    iteration = BASE if stage == "prompts" else 0
    table = {"prompts": "prompts", "score": "scores", "advantage": "batch"}[stage]
    manifest_path = run.table_path(table, iteration) + ".manifest.json"
    h.ensure_done(run, stage)  # an earlier parametrization may have changed this stage's inputs
    first = read_manifest(run.fs, manifest_path)
    before = pq.read_table(first.path)  # read now: the rerun replaces the file
    rerun = h.fork_stage(run, stage, h.work_for(stage), tmp_path / "rerun.log")
    assert rerun.wait(300) == 0, rerun.output()[-2000:]
    second = read_manifest(run.fs, manifest_path)
    after = pq.read_table(second.path)
    assert second.ended_at != first.ended_at  # it did run again
    assert second.inputs == first.inputs
    assert after.schema.names == before.schema.names and after.num_rows == before.num_rows > 0
    changed = changed_columns(before, after)
    declared = second.metrics.get("nondeterministic_columns", [])
    assert set(declared) <= set(after.schema.names), f"the manifest names columns the table lacks: {declared}"
    if second.metrics.get("deterministic") is False:
        assert declared, f"{Path(manifest_path).name}: says deterministic: false but names no columns"
        assert set(changed) <= set(declared), (
            f"{Path(manifest_path).name}: a rerun from the same inputs changed {changed}, the manifest allows "
            f"only {declared}"
        )
        kept = [name for name in after.schema.names if name not in declared]
        assert kept and before.select(kept).equals(after.select(kept))  # the columns that must repeat did
    else:
        assert second.sha256 == first.sha256 and changed == [], (
            f"{Path(manifest_path).name}: content hash changed on a rerun from the same inputs "
            f"({first.sha256[:12]} -> {second.sha256[:12]}; columns {changed}) and the manifest does not say the "
            "stage is non-deterministic"
        )


def changed_columns(before: pa.Table, after: pa.Table) -> list[str]:
    """The columns whose values differ between two tables of the same schema and length, row by row."""
    return [name for name in before.schema.names if not before.column(name).equals(after.column(name))]
