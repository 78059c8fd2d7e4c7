"""Lineage: the chain behind an iteration, followed by content hashes, and every file re-verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli.inspect import main as inspect_main
from schemas.tables import TABLES
from storage.layout import RunLayout, manifest_path_for
from storage.lineage import lineage, trace
from storage.manifest import read_manifest, write_manifest
from storage.tables import write_table
from tests.support.synthetic_runs import write_synthetic_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lineage")
    write_synthetic_run(str(root), run_id="r", iterations=3, seed=3)
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A private copy to damage (the base model directory lives under the root, so it is copied too)."""
    copy = tmp_path / "root"
    shutil.copytree(pristine, copy)
    # The copied base-model manifest still points at the pristine model directory: point it at the copy.
    layout = RunLayout.create(str(copy), "r")
    path = manifest_path_for(layout.checkpoint_dir(-1), "checkpoint")
    manifest = read_manifest(layout.fs, path)
    manifest.metrics["local_path"] = manifest.path = str(copy / "models/r-base")
    write_manifest(layout.fs, path, manifest)
    return copy


def test_chain_runs_from_base_model_and_prompts_to_the_checkpoint(pristine: Path) -> None:
    result = lineage(str(pristine), "r", 2)
    assert result.ok and result.problems == [] and result.warnings == []
    labels = [n.label for n in result.nodes]
    assert labels[:2] == ["prompts", "base model"]
    for k in range(3):
        for name in ("rollouts", "scores", "batch", "checkpoint"):
            assert f"iter={k:04d}/{name}" in labels
    # Outputs that nothing downstream used are not ancestors: earlier evals and train metrics.
    assert "iter=0001/eval" not in labels and "iter=0001/train_metrics" not in labels
    assert {"iter=0002/eval", "iter=0002/train_metrics"} <= set(labels)
    assert result.node("iter=0000/rollouts").inputs == {"policy": "base model", "prompts": "prompts"}
    assert result.node("iter=0002/checkpoint").inputs == {
        "batch": "iter=0002/batch", "policy": "iter=0001/checkpoint", "rollouts": "iter=0002/rollouts"}
    assert all(n.check == "ok" for n in result.nodes)
    assert sum(n.hashed_bytes for n in result.nodes) > 0
    assert result.data["train"] == "humaneval"


def test_tampered_and_lost_files_are_named(root: Path) -> None:
    table = root / "runs/r/iter=0001/batch.parquet"
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only hashing can tell
    table.write_bytes(bytes(data))
    (root / "runs/r/checkpoints/iter=0000/model.safetensors").unlink()
    weights = root / "models/r-base/model.safetensors"
    weights.write_bytes(b"\0" + weights.read_bytes()[1:])
    result = lineage(str(root), "r", 2)
    assert not result.ok
    assert sorted(result.problems) == sorted([
        f"modified: {table}: content differs from its manifest (sha256 "
        f"{result.node('iter=0001/batch').manifest.sha256[:12]})",
        f"missing: {root}/runs/r/checkpoints/iter=0000/model.safetensors: missing",
        f"modified: {weights}: content differs from its manifest",
    ])
    assert result.node("iter=0001/batch").check == "modified"
    assert result.node("iter=0000/checkpoint").check == "missing"
    assert result.node("base model").check == "modified"
    # --quick compares sizes only: it misses both same-size edits, and still finds the lost file.
    quick = lineage(str(root), "r", 2, mode="size")
    assert quick.problems == [f"missing: {root}/runs/r/checkpoints/iter=0000/model.safetensors: missing"]


def test_lost_table_and_rewritten_upstream_are_reported(root: Path) -> None:
    (root / "runs/r/iter=0000/scores.parquet").unlink()
    # Rewrite iteration 1's rollouts (new content, new manifest) without redoing what was made from them.
    layout = RunLayout.create(str(root), "r")
    path = layout.table_path("rollouts", 1)
    manifest = read_manifest(layout.fs, manifest_path_for(path, "table"))
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("seed"), "seed", pc.add(table.column("seed"), 1))
    written = write_table(layout.fs, path, table, TABLES["rollouts"])
    manifest.sha256, manifest.bytes = written.sha256, written.bytes
    write_manifest(layout.fs, manifest_path_for(path, "table"), manifest)
    result = lineage(str(root), "r", 2)
    assert f"missing: {root}/runs/r/iter=0000/scores.parquet: the manifest's file is gone (lost output)" in (
        result.problems)
    stale = [p for p in result.problems if p.startswith("unresolved input")]
    assert {p.split(" was made from")[0] for p in stale} == {
        "unresolved input: iter=0001/scores", "unresolved input: iter=0001/batch",
        "unresolved input: iter=0001/checkpoint"}
    assert all("rollouts" in p for p in stale)


def test_base_model_elsewhere_is_a_warning_not_a_failure(root: Path) -> None:
    shutil.rmtree(root / "models")
    result = lineage(str(root), "r", 0)
    assert result.ok
    assert result.node("base model").check == "unverified"
    assert result.warnings == [f"base model directory {root}/models/r-base is not on this machine: its files were "
                               "not checked"]


def test_trace_refuses_an_iteration_without_outputs(pristine: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no outputs for iteration 7 \(iterations with outputs: \[0, 1, 2\]\)"):
        trace(str(pristine), "r", 7)


def test_lineage_command(root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert inspect_main(["lineage", "r", "--root", str(root)]) == 0  # defaults to the latest iteration
    out = capsys.readouterr().out
    assert "lineage of run r, iteration 2" in out and "✓ every file of the chain matches its manifest" in out
    assert "iter=0002/checkpoint" in out and "← iter=0002/batch, iter=0001/checkpoint, iter=0002/rollouts" in out
    (root / "runs/r/checkpoints/iter=0001/config.json").write_text("{}")
    assert inspect_main(["lineage", "r", "2", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"✗ modified: {root}/runs/r/checkpoints/iter=0001/config.json: content differs from its manifest" in out
    assert inspect_main(["lineage", "r", "1", "--json", "--root", str(root)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["iteration"] == 1
    assert {n["label"]: n["check"] for n in report["nodes"]}["iter=0001/checkpoint"] == "modified"
