"""`rlpipe fork`: GRPO vs RLOO on the same iteration-0 rollouts and scores, on a run made by the real stage harness
(a tiny Llama as base model, generate and score stand-ins, real advantage and train: tests/rl/pipeline_helpers.py).

The fork shares prompts, base model, generate and score (hard links: the same inode, manifests that say
`shared_from`), and computes advantage and train itself; its advantages are checked against RLOO and GRPO worked
by hand on the stand-in's rewards (0, 1, 0, 1 in every group). The catalog reads a shared table once per run that
has it, each time with that run's id; a fork of the fork shares from both runs; a shared output lost or changed
is refused by name, never redone; bad input is one line and exit 2.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from flows.cli.status import status_table
from flows.fork import Fork, fork
from schemas.config import apply_overrides, parse_config
from schemas.errors import InputError
from stages import advantage, train
from stages.registry import Output, instance, stage_state
from storage.catalog import Catalog
from storage.lineage import lineage, to_dict
from storage.manifest import read_manifest
from storage.retention import CheckpointPruned, prune_checkpoint
from storage.run import Run
from storage.sharing import verify_run_shares
from tests.flows.test_refusals import rlpipe, the_one_line
from tests.rl.pipeline_helpers import N_PROMPTS, N_SAMPLES, run_iteration, start_tiny_run
from tests.support.stages import run_stage_at

SHARED_AT_0 = ["prompts", "base_model", "generate iter=0", "score iter=0"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run `grpo` (2 iterations configured, iteration 0 done), and its fork `rloo` at 0 with advantage and train
    computed."""
    tmp = tmp_path_factory.mktemp("fork")
    layout = start_tiny_run(tmp, "grpo", iterations=2)
    run_iteration(layout, 0)
    forked = fork_of(Run.at(layout), "rloo", ["advantage.estimator=rloo"])
    assert [target.label for target in forked.shared] == SHARED_AT_0
    run_stage_at("advantage", forked.run.layout, 0, advantage.run)
    run_stage_at("train", forked.run.layout, 0, train.run)
    return tmp / "root"


def fork_of(source: Run, new: str, overrides: list[str], at: int = 0) -> Fork:
    """What `rlpipe fork SOURCE NEW --at K --set ...` does before it drives the new run."""
    values = apply_overrides(source.config.model_dump(mode="json"), overrides) | {"run_id": new}
    return fork(source, parse_config(values), at)


def test_generate_and_score_are_shared_and_advantage_is_rloos(root: Path) -> None:
    grpo, rloo = Run.open(str(root), "grpo"), Run.open(str(root), "rloo")
    for table in ("rollouts", "scores"):
        original, shared = Path(grpo.layout.table_path(table, 0)), Path(rloo.layout.table_path(table, 0))
        assert os.stat(original).st_ino == os.stat(shared).st_ino  # one file, two names: no rollout generated
        manifest = read_manifest(rloo.fs, f"{shared}.manifest.json")
        assert manifest.shared_from == {"run": "grpo", "path": str(original)}
        assert manifest.path == str(shared)
        assert manifest.sha256 == read_manifest(grpo.fs, f"{original}.manifest.json").sha256
    checkpoint = Path(rloo.layout.checkpoint_dir(0)) / "model.safetensors"
    assert os.stat(checkpoint).st_ino != os.stat(Path(grpo.layout.checkpoint_dir(0)) / "model.safetensors").st_ino
    assert read_manifest(rloo.fs, f"{rloo.layout.table_path('batch', 0)}.manifest.json").shared_from is None
    # The stand-in scores sample s with s % 2: each group of 4 is 0, 1, 0, 1 (mean 1/2, population std 1/2).
    expected = {"grpo": {0: -0.5 / (0.5 + 1e-6), 1: 0.5 / (0.5 + 1e-6)},  # (r - mean) / (std + eps)
                "rloo": {0: 0 - 2 / 3, 1: 1 - 1 / 3}}  # r minus the mean of the other three
    for run in (grpo, rloo):
        rows = pq.read_table(run.layout.table_path("batch", 0)).to_pylist()
        assert len(rows) == N_PROMPTS * N_SAMPLES
        for row in rows:
            assert row["advantage"] == pytest.approx(expected[run.run_id][row["sample_idx"] % 2], abs=1e-6)
    assert all(stage_state(rloo, instance(stage, 0)).done for stage in ("generate", "score", "advantage", "train"))


def test_status_names_the_shared_stages(root: Path) -> None:
    console = Console(width=250, record=True)
    console.print(status_table(Run.open(str(root), "rloo")))
    text = console.export_text()
    assert text.count("shared from grpo") == len(SHARED_AT_0)
    assert "not scheduled" in text or "missing" in text  # evaluate_base: not computed by grpo, not shared


def test_the_catalog_reads_shared_rows_once_per_run_with_its_id(root: Path) -> None:
    with Catalog(str(root), ["grpo", "rloo"]) as catalog:
        counts = dict(catalog.sql("SELECT run_id, count(*) FROM rollouts GROUP BY run_id").fetchall())
        assert counts == {"grpo": N_PROMPTS * N_SAMPLES, "rloo": N_PROMPTS * N_SAMPLES}
        # the fork's own batch (built from grpo's rollouts, whose rows say grpo) joins the fork's rollouts
        advantages = catalog.sql("SELECT run_id, sample_idx % 2, min(advantage), max(advantage), count(*) "
                                 "FROM samples GROUP BY ALL ORDER BY ALL").fetchall()
        assert [(run, odd, count) for run, odd, _, _, count in advantages] == [
            ("grpo", 0, 4), ("grpo", 1, 4), ("rloo", 0, 4), ("rloo", 1, 4)]
        assert advantages[2][2] == advantages[2][3] == pytest.approx(-2 / 3)
        shared = catalog.sql("SELECT name FROM manifests WHERE run_id = 'rloo' AND shared_from = 'grpo' "
                             "ORDER BY name").fetchall()
        assert [name for (name,) in shared] == ["checkpoint", "prompts", "rollouts", "scores"]
    traced = lineage(str(root), "rloo", 0)  # re-hashes every file behind checkpoint 0 of the fork
    assert traced.ok, traced.problems
    origins = {node["label"]: (node["shared_from"] or {}).get("run") for node in to_dict(traced)["nodes"]}
    assert origins["iter=0000/rollouts"] == "grpo" and origins["iter=0000/batch"] is None


def test_a_fork_of_the_fork_shares_from_both(root: Path) -> None:
    again = fork_of(Run.open(str(root), "rloo"), "rloo-again", [])
    assert [target.label for target in again.shared] == [*SHARED_AT_0, "advantage iter=0", "train iter=0"]
    origins = {output: read_manifest(again.run.fs, f"{again.run.layout.table_path(output, 0)}.manifest.json")
               .shared_from["run"] for output in ("rollouts", "batch", "train_metrics")}
    assert origins == {"rollouts": "grpo", "batch": "rloo", "train_metrics": "rloo"}  # the run that computed it
    verify_run_shares(again.run.layout)  # every shared file hashes to its manifest
    with Catalog(str(root), ["rloo-again"]) as catalog:
        rows = catalog.rows("SELECT count(*) AS n, min(run_id) AS low, max(run_id) AS high FROM batch")
        assert rows == [{"n": N_PROMPTS * N_SAMPLES, "low": "rloo-again", "high": "rloo-again"}]


def test_a_lost_share_is_refused_by_name_and_never_redone(root: Path) -> None:
    lost = fork_of(Run.open(str(root), "grpo"), "lost", [])
    rollouts = Path(lost.run.layout.table_path("rollouts", 0))
    rollouts.unlink()
    with pytest.raises(InputError, match=f"run lost shares generate's output with run grpo .*{rollouts} is missing"):
        verify_run_shares(lost.run.layout)
    with pytest.raises(InputError, match="rerunning the stage would give other data"):
        run_stage_at("generate", lost.run.layout, 0, lambda ctx: pytest.fail("a lost share was redone"))
    assert not rollouts.exists()
    console = Console(width=250, record=True)
    console.print(status_table(lost.run))
    assert "shared from grpo, lost" in console.export_text()
    line = the_one_line(rlpipe(root, "resume", "lost"))  # the next use of the fork, from the command line
    assert line.startswith("run lost shares generate's output with run grpo") and str(rollouts) in line


def test_changed_bytes_of_a_share_are_refused(root: Path) -> None:
    changed = fork_of(Run.open(str(root), "grpo"), "changed", [])
    scores = Path(changed.run.layout.table_path("scores", 0))
    data = bytearray(scores.read_bytes())
    data[len(data) // 2] ^= 0xFF
    scores.unlink()  # a file of its own: grpo's (the other name of the old one) stays as it was
    scores.write_bytes(bytes(data))
    with pytest.raises(InputError, match=f"{scores}: content differs from its manifest"):
        verify_run_shares(changed.run.layout)


def test_a_fork_that_would_share_a_pruned_checkpoint_is_refused(root: Path) -> None:
    kept = fork_of(Run.open(str(root), "grpo"), "kept", [])
    (Path(kept.run.layout.checkpoint_dir(0)) / "model.safetensors").unlink()  # as retention would prune it
    with pytest.raises(InputError, match=r"run kept's train iter=0 output is lost or pruned \(.*model.safetensors "
                                         "is missing\\): it cannot be shared; fork at an earlier iteration than 0"):
        fork_of(kept.run, "from-kept", [])
    assert not Path(root / "runs" / "from-kept" / "config.yaml").exists()


def test_a_fork_at_an_iteration_whose_checkpoint_retention_pruned_is_refused_by_iteration(root: Path) -> None:
    pruned = fork_of(Run.open(str(root), "grpo"), "pruned", [])
    prune_checkpoint(pruned.run.fs, Output("checkpoint", 0).manifest_path(pruned.run.layout), "checkpoint")
    with pytest.raises(CheckpointPruned, match=r"the checkpoint of iteration 0 \(.*\) cannot be used: it was pruned "
                                               r"\(train.keep_checkpoints\)"):
        fork_of(pruned.run, "from-pruned", [])
    assert not Path(root / "runs" / "from-pruned" / "config.yaml").exists()


@pytest.mark.parametrize(("args", "line"), [
    (["nope", "x", "--at", "0"], "run nope has no config at {root}/runs/nope/config.yaml"),
    (["grpo", "rloo", "--at", "0"], "run rloo already exists at {root}/runs/rloo: fork into a new run id"),
    (["grpo", "x", "--at", "5"], "run grpo has iterations 0 to 1: there is no iteration 5 to fork at"),
    (["grpo", "x", "--at", "1"], "run grpo has not reached iteration 1: it has no rollouts there"),
])
def test_bad_input_is_one_line_and_exit_2(root: Path, args: list[str], line: str) -> None:
    assert the_one_line(rlpipe(root, "fork", *args)).startswith(line.format(root=root))
    assert not (root / "runs" / "x").exists()


def test_a_fork_is_refused_on_an_object_store(root: Path) -> None:
    grpo = Run.open(str(root), "grpo")
    source = Run(grpo.layout.__class__("s3://bucket/prefix", "grpo"), grpo.config)
    with pytest.raises(InputError, match="rlpipe fork needs a local storage root; s3://bucket/prefix is an object"):
        fork_of(source, "x", [])


def test_a_killed_fork_is_started_over(root: Path) -> None:
    leftover = root / "runs" / "half"
    (leftover / "iter=0000").mkdir(parents=True)
    (leftover / "iter=0000" / "rollouts.parquet").write_bytes(b"half a fork")  # no config.yaml: killed mid-way
    again = fork_of(Run.open(str(root), "grpo"), "half", [])
    assert [target.label for target in again.shared][:4] == SHARED_AT_0
    verify_run_shares(again.run.layout)
    shutil.rmtree(leftover)
