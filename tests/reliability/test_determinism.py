"""Determinism drill for the stages that need no model: rerunning a finished stage from the same inputs, on the
same machine, reproduces its table's content hash, or its manifest says that it cannot.

(Generate and train, with SmolLM2 on the HF backend, are drilled in test_model_stages.py.)
"""

from __future__ import annotations

from pathlib import Path

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
    writes a table with the same sha256 as before, or a manifest that says `deterministic: false`, so that no
    one expects byte-equal reruns from it."""
    iteration = BASE if stage == "prompts" else 0
    table = {"prompts": "prompts", "score": "scores", "advantage": "batch"}[stage]
    manifest_path = run.table_path(table, iteration) + ".manifest.json"
    h.ensure_done(run, stage)  # an earlier parametrization may have changed this stage's inputs
    first = read_manifest(run.fs, manifest_path)
    rerun = h.fork_stage(run, stage, h.work_for(stage), tmp_path / "rerun.log")
    assert rerun.wait(300) == 0, rerun.output()[-2000:]
    second = read_manifest(run.fs, manifest_path)
    assert second.ended_at != first.ended_at  # it did run again
    assert second.inputs == first.inputs
    if second.sha256 != first.sha256:
        assert second.metrics.get("deterministic") is False, (
            f"{Path(manifest_path).name}: content hash changed on a rerun from the same inputs "
            f"({first.sha256[:12]} -> {second.sha256[:12]}) and the manifest does not say the stage is "
            f"non-deterministic; rows that differ: {differing_columns(first.path, run)}"
        )


def differing_columns(path: str, run: RunLayout) -> str:
    """Which columns can differ between reruns (for the failure message): the ones that measure time."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    return ", ".join(name for name in names if name in h.TIMING_COLUMNS) or "unknown"
