"""`rlpipe fork`: GRPO vs RLOO on the same iteration-0 rollouts and scores, on a run made by the real stage harness
(a tiny Llama as base model, generate and score stand-ins, real advantage and train: tests/rl/pipeline_helpers.py),
on a local root and on an S3 root (moto's server: the run is cloned there and forked there).

The fork shares prompts, base model, generate and score at no copy (locally hard links: the same inode; on S3 no
object at all under the fork's prefix, its manifests naming grpo's files), and computes advantage and train itself;
its advantages are checked against RLOO and GRPO worked by hand on the stand-in's rewards (0, 1, 0, 1 in every
group). The catalog reads a shared table once per run that has it, each time with that run's id; a fork of the fork
shares from both runs; a shared output lost or changed is refused by name, never redone; the origin pruning a
checkpoint a fork shares leaves a local fork's data and is refused by name on S3; a run whose earlier checkpoints
retention pruned forks at its kept one; a fork killed in a stage resumes to the uninterrupted fork's bytes; bad
input is one line and exit 2.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
import pytest
from rich.console import Console

from flows.artifacts import iteration_metrics
from flows.cli.status import status_table
from flows.fork import Fork, fork
from reports.html import build_report
from schemas.config import apply_overrides, parse_config
from schemas.errors import InputError
from schemas.tables import TABLES
from stages import advantage, train
from stages.data.export import export_run
from stages.harness import StageContext
from stages.registry import Output, instance, stage_state
from storage.catalog import Catalog
from storage.fs import is_remote, join, listing_prefix
from storage.layout import RunLayout
from storage.lineage import lineage, to_dict
from storage.manifest import Manifest, output_intact, read_manifest
from storage.retention import CheckpointPruned, prune_checkpoint
from storage.run import Run
from storage.sharing import verify_run_shares
from storage.tables import read_table
from tests.flows.test_refusals import rlpipe, the_one_line
from tests.rl.pipeline_helpers import N_PROMPTS, N_SAMPLES, run_iteration, start_tiny_run
from tests.storage.test_s3 import BUCKET, s3_endpoint  # noqa: F401 - the moto fixture
from tests.support.stages import clone, run_stage_at

SHARED_AT_0 = ["prompts", "base_model", "generate iter=0", "score iter=0"]
# What a fork of grpo at 0 that shares SHARED_AT_0 holds of them: its manifests (and, locally, hard links)
SHARED_MANIFESTS = {"prompts.parquet.manifest.json", "checkpoints/base/manifest.json",
                    "iter=0000/rollouts.parquet.manifest.json", "iter=0000/scores.parquet.manifest.json"}


@pytest.fixture(scope="module")
def local_grpo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root of run `grpo` (2 iterations configured, iteration 0 done)."""
    tmp = tmp_path_factory.mktemp("fork")
    run_iteration(start_tiny_run(tmp, "grpo", iterations=2), 0)
    return tmp / "root"


@pytest.fixture(scope="module", params=["local", "s3"])
def root(request: pytest.FixtureRequest, local_grpo: Path) -> str:
    """A root holding `grpo` and its fork `rloo` at 0 with advantage and train computed: the local one, or an S3
    root that grpo is cloned to."""
    if request.param == "local":
        root = str(local_grpo)
    else:
        request.getfixturevalue("s3_endpoint")
        root = clone(RunLayout.create(str(local_grpo), "grpo"), f"s3://{BUCKET}/fork").root
    grpo = Run.open(root, "grpo")
    before = files_of(grpo)
    forked = fork_of(grpo, "rloo", ["advantage.estimator=rloo"])
    assert [target.label for target in forked.shared] == SHARED_AT_0
    assert files_of(grpo) == before  # the origin is only read
    assert_nothing_copied(grpo, forked.run, SHARED_MANIFESTS)
    run_stage_at("advantage", forked.run.layout, 0, advantage.run)
    run_stage_at("train", forked.run.layout, 0, train.run)
    return root


def fork_of(source: Run, new: str, overrides: list[str], at: int = 0) -> Fork:
    """What `rlpipe fork SOURCE NEW --at K --set ...` does before it drives the new run."""
    values = apply_overrides(source.config.model_dump(mode="json"), overrides) | {"run_id": new}
    return fork(source, parse_config(values), at)


def files_of(run: Run) -> dict[str, int]:
    """Path inside the run's folder -> bytes, of every file (object) there."""
    run.fs.invalidate_cache()
    prefix = listing_prefix(run.fs, run.layout.run_dir)
    return {path.removeprefix(prefix): int(info["size"])
            for path, info in run.fs.find(run.layout.run_dir, detail=True).items()}


def assert_nothing_copied(source: Run, new: Run, manifests: set[str]) -> None:
    """The fork just made holds its config.yaml and its `manifests`, and besides them (locally) only hard links to
    the origin's files of the same names: on S3 not one object of a shared table or checkpoint."""
    held = files_of(new)
    data = set(held) - manifests - {"config.yaml"}
    assert manifests <= set(held), sorted(held)
    if is_remote(new.layout.root):
        assert data == set(), sorted(data)
        return
    assert data >= {"prompts.parquet", "iter=0000/rollouts.parquet", "iter=0000/scores.parquet"}
    for relative in data:
        assert Path(new.layout.run_dir, relative).stat().st_ino == Path(source.layout.run_dir, relative).stat().st_ino


def table_manifest(run: Run, table: str, iteration: int = 0) -> Manifest:
    return read_manifest(run.fs, Output(table, iteration).manifest_path(run.layout))


def checkpoint_manifest(run: Run, iteration: int = 0) -> Manifest:
    return read_manifest(run.fs, Output("checkpoint", iteration).manifest_path(run.layout))


@contextmanager
def put_back(fs: fsspec.AbstractFileSystem, paths: list[str]) -> Iterator[None]:
    """The files at `paths` as they are now, written back on the way out: on S3 a fork's shared files are grpo's,
    which the later tests share too."""
    saved = {path: fs.cat_file(path) for path in paths}
    try:
        yield
    finally:
        for path, data in saved.items():
            if fs.exists(path):
                fs.rm_file(path)
            fs.pipe_file(path, data)
        fs.invalidate_cache()


class Killed(BaseException):
    """A stage process's end by SIGKILL, as the harness sees it: nothing after the point it struck runs."""


def cli(root: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlpipe ARGS --root ROOT` in a child process (its hub cache in `tmp_path`)."""
    return rlpipe(tmp_path, *args, "--root", root)


def test_generate_and_score_are_shared_and_advantage_is_rloos(root: str) -> None:
    grpo, rloo = Run.open(root, "grpo"), Run.open(root, "rloo")
    for table in ("prompts", "rollouts", "scores"):
        iteration = -1 if table == "prompts" else 0
        original, own = Output(table, iteration).path(grpo.layout), Output(table, iteration).path(rloo.layout)
        manifest = table_manifest(rloo, table, iteration)
        assert manifest.shared_from == {"run": "grpo", "path": original}
        assert manifest.sha256 == table_manifest(grpo, table, iteration).sha256
        if is_remote(root):  # a reference: the manifest names grpo's object, the fork's prefix holds none
            assert manifest.path == original and not rloo.fs.exists(own)
        else:  # one file, two names: no rollout generated
            assert manifest.path == own and Path(original).stat().st_ino == Path(own).stat().st_ino
    checkpoint = checkpoint_manifest(rloo)
    assert checkpoint.shared_from is None and checkpoint.path == rloo.layout.checkpoint_dir(0)
    assert rloo.fs.exists(join(rloo.layout.checkpoint_dir(0), "model.safetensors"))
    assert checkpoint.sha256 != checkpoint_manifest(grpo).sha256  # trained on other advantages
    assert table_manifest(rloo, "batch").shared_from is None
    # The stand-in scores sample s with s % 2: each group of 4 is 0, 1, 0, 1 (mean 1/2, population std 1/2).
    expected = {"grpo": {0: -0.5 / (0.5 + 1e-6), 1: 0.5 / (0.5 + 1e-6)},  # (r - mean) / (std + eps)
                "rloo": {0: 0 - 2 / 3, 1: 1 - 1 / 3}}  # r minus the mean of the other three
    for run in (grpo, rloo):
        rows = read_table(run.fs, run.layout.table_path("batch", 0), TABLES["batch"]).to_pylist()
        assert len(rows) == N_PROMPTS * N_SAMPLES
        for row in rows:
            assert row["advantage"] == pytest.approx(expected[run.run_id][row["sample_idx"] % 2], abs=1e-6)
    assert all(stage_state(rloo, instance(stage, 0)).done for stage in ("generate", "score", "advantage", "train"))


def test_status_names_the_shared_stages(root: str) -> None:
    rloo = Run.open(root, "rloo")
    console = Console(width=250, record=True)
    console.print(status_table(rloo))
    text = console.export_text()
    assert text.count("shared from grpo") == len(SHARED_AT_0)
    assert "not scheduled" in text or "missing" in text  # evaluate_base: not computed by grpo, not shared
    # the training reward of iteration 0, read from the shared scores (0, 1, 0, 1: mean 0.5, half solved)
    assert re.search(r"│\s+0\s+│\s+8\s+│\s+0\.500\s+│\s+0\.500\s+│", text), text
    # the iteration's numbers as the flow's artifacts give them, the reward from the shared scores
    summaries = {(row["stage"], row["metric"]): row["value"] for row in iteration_metrics(rloo, 0)}
    assert summaries[("score", "reward.mean")] == 0.5 and summaries[("advantage", "kept.rows")] == 8


def test_the_catalog_reads_shared_rows_once_per_run_with_its_id(root: str) -> None:
    with Catalog(root, ["grpo", "rloo"]) as catalog:
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
        assert catalog.skipped == []  # no shared table is taken for a lost one
    with Catalog(root, ["rloo"]) as catalog:  # grpo's files, not listed with it, are read for the fork
        assert catalog.rows("SELECT count(*) AS n, min(run_id) AS run FROM scores") == [
            {"n": N_PROMPTS * N_SAMPLES, "run": "rloo"}]
    traced = lineage(root, "rloo", 0)  # re-hashes every file behind checkpoint 0 of the fork
    assert traced.ok, traced.problems
    origins = {node["label"]: (node["shared_from"] or {}).get("run") for node in to_dict(traced)["nodes"]}
    assert origins["iter=0000/rollouts"] == "grpo" and origins["iter=0000/batch"] is None


def test_export_and_report_read_the_shared_rows(root: str, tmp_path: Path) -> None:
    grpo, rloo = Run.open(root, "grpo"), Run.open(root, "rloo")
    done = export_run(root, "rloo", "hf", tmp_path / "hf")
    assert done.rows == N_PROMPTS * N_SAMPLES  # grpo's rollouts, once
    assert done.manifest["inputs"]["iter=0000/rollouts"] == table_manifest(grpo, "rollouts").sha256
    html = build_report(rloo.layout, rloo.config)
    assert "the manifest's file is gone" not in html  # no shared table left out of the report as lost


def test_a_fork_of_the_fork_shares_from_both(root: str) -> None:
    rloo = Run.open(root, "rloo")
    again = fork_of(rloo, "rloo-again", [])
    assert [target.label for target in again.shared] == [*SHARED_AT_0, "advantage iter=0", "train iter=0"]
    origins = {output: table_manifest(again.run, output).shared_from["run"]
               for output in ("rollouts", "batch", "train_metrics")}
    assert origins == {"rollouts": "grpo", "batch": "rloo", "train_metrics": "rloo"}  # the run that computed it
    assert_nothing_copied(rloo, again.run, SHARED_MANIFESTS | {
        "iter=0000/batch.parquet.manifest.json", "iter=0000/train_metrics.parquet.manifest.json",
        "checkpoints/iter=0000/manifest.json"})
    assert checkpoint_manifest(again.run).path == (rloo.layout.checkpoint_dir(0) if is_remote(root)
                                                   else again.run.layout.checkpoint_dir(0))
    verify_run_shares(again.run.layout)  # every shared file hashes to its manifest
    with Catalog(root, ["rloo-again"]) as catalog:
        rows = catalog.rows("SELECT count(*) AS n, min(run_id) AS low, max(run_id) AS high FROM batch")
        assert rows == [{"n": N_PROMPTS * N_SAMPLES, "low": "rloo-again", "high": "rloo-again"}]
    traced = lineage(root, "rloo-again", 0)  # the shared checkpoint's files hashed where they are
    assert traced.ok, traced.problems
    # iteration 1 samples with, and trains from, the shared checkpoint 0 (weights and optimizer state: on S3
    # downloaded from rloo's objects)
    run_iteration(again.run.layout, 1)
    rollouts = read_table(again.run.fs, again.run.layout.table_path("rollouts", 1), TABLES["rollouts"])
    assert set(rollouts["policy_version"].to_pylist()) == {checkpoint_manifest(rloo).sha256}
    assert checkpoint_manifest(again.run, 1).inputs["policy"] == checkpoint_manifest(rloo).sha256


def test_a_lost_share_is_refused_by_name_and_never_redone(root: str, tmp_path: Path) -> None:
    lost = fork_of(Run.open(root, "grpo"), "lost", [])
    fs = lost.run.fs
    rollouts = table_manifest(lost.run, "rollouts").path  # locally the fork's link, on S3 grpo's object
    with put_back(fs, [rollouts]):
        fs.rm_file(rollouts)
        with pytest.raises(InputError, match=f"run lost shares generate's output with run grpo .*"
                                             f"{re.escape(rollouts)} is missing"):
            verify_run_shares(lost.run.layout)
        with pytest.raises(InputError, match="rerunning the stage would give other data"):
            run_stage_at("generate", lost.run.layout, 0, lambda ctx: pytest.fail("a lost share was redone"))
        fs.invalidate_cache()
        assert not fs.exists(rollouts) and not fs.exists(lost.run.layout.table_path("rollouts", 0))
        console = Console(width=250, record=True)
        console.print(status_table(lost.run))
        assert "shared from grpo, lost" in console.export_text()
        line = the_one_line(cli(root, tmp_path, "resume", "lost"))  # the next use of the fork, from the command line
        assert line.startswith("run lost shares generate's output with run grpo") and rollouts in line


def test_changed_bytes_of_a_share_are_refused(root: str) -> None:
    changed = fork_of(Run.open(root, "grpo"), "changed", [])
    fs = changed.run.fs
    scores = table_manifest(changed.run, "scores").path
    with put_back(fs, [scores]):
        data = bytearray(fs.cat_file(scores))
        data[len(data) // 2] ^= 0xFF
        fs.rm_file(scores)  # locally a file of its own: grpo's (the other name of the old one) stays as it was
        fs.pipe_file(scores, bytes(data))
        with pytest.raises(InputError, match=f"{re.escape(scores)}: content differs from its manifest"):
            verify_run_shares(changed.run.layout)


def test_a_fork_that_would_share_a_lost_checkpoint_is_refused(root: str) -> None:
    kept = fork_of(Run.open(root, "grpo"), "kept", [])
    fs = kept.run.fs
    weights = join(checkpoint_manifest(kept.run).path, "model.safetensors")
    with put_back(fs, [weights]):
        fs.rm_file(weights)
        with pytest.raises(InputError, match=r"run kept's train iter=0 output is lost or pruned \(.*model.safetensors "
                                             "is missing\\): it cannot be shared; fork at an earlier iteration than 0"):
            fork_of(kept.run, "from-kept", [])
    assert not fs.exists(join(root, "runs", "from-kept", "config.yaml"))


def test_a_fork_at_an_iteration_whose_checkpoint_retention_pruned_is_refused_by_iteration(root: str) -> None:
    grpo = Run.open(root, "grpo")
    pruned = fork_of(grpo, "pruned", [])
    prune_checkpoint(pruned.run.fs, Output("checkpoint", 0).manifest_path(pruned.run.layout), "checkpoint")
    with pytest.raises(CheckpointPruned, match=r"the checkpoint of iteration 0 \(.*\) cannot be used: it was pruned "
                                               r"\(train.keep_checkpoints\)"):
        fork_of(pruned.run, "from-pruned", [])
    assert not pruned.run.fs.exists(join(root, "runs", "from-pruned", "config.yaml"))
    grpo.fs.invalidate_cache()
    assert output_intact(grpo.fs, checkpoint_manifest(grpo))  # the fork's prune deleted none of grpo's files


def test_a_run_whose_earlier_checkpoints_retention_pruned_forks_at_its_kept_one(root: str) -> None:
    """keep_checkpoints 1 after two iterations: checkpoint 0 pruned, 1 whole. Forking at 1 to train on shares
    checkpoint 0 as pruned and trains iteration 2 from 1; with 1's optimizer state pruned too, the same fork is
    refused naming iteration 1 and leaves nothing, while a fork that trains no more goes through."""
    longer = fork_of(Run.open(root, "grpo"), "longer", []).run  # iteration 0 shared, 1 computed here
    run_iteration(longer.layout, 1)
    prune_checkpoint(longer.fs, Output("checkpoint", 0).manifest_path(longer.layout), "checkpoint")

    extended = fork_of(longer, "extended", ["iterations=3"], at=1)
    assert [t.label for t in extended.shared][-4:] == ["generate iter=1", "score iter=1", "advantage iter=1",
                                                       "train iter=1"]
    assert checkpoint_manifest(extended.run, 0).pruned == "checkpoint"  # as in `longer`: its tables stay
    assert not checkpoint_manifest(extended.run, 1).pruned
    run_iteration(extended.run.layout, 2)  # samples from checkpoint 1 and trains on with its optimizer state
    assert checkpoint_manifest(extended.run, 2).inputs["policy"] == checkpoint_manifest(longer, 1).sha256

    prune_checkpoint(longer.fs, Output("checkpoint", 1).manifest_path(longer.layout), "optimizer")
    with pytest.raises(CheckpointPruned, match=r"the checkpoint of iteration 1 \(.*\) cannot be used: its optimizer "
                                               r"state was pruned \(train.keep_optimizer_states\)"):
        fork_of(longer, "refused", ["iterations=3"], at=1)
    assert not longer.fs.exists(join(root, "runs", "refused"))
    assert fork_of(longer, "copied", [], at=1).shared[-1].label == "train iter=1"  # trains no more: goes through


def test_the_origin_pruning_a_checkpoint_its_fork_shares(root: str, tmp_path: Path) -> None:
    """Locally the fork's hard links keep the bytes; on S3 the fork's next use names what is missing."""
    grpo = Run.open(root, "grpo")
    heir = fork_of(grpo, "heir", [])  # shares train iter=0: grpo's checkpoint 0
    directory = grpo.layout.checkpoint_dir(0)
    with put_back(grpo.fs, grpo.fs.find(directory)):
        prune_checkpoint(grpo.fs, Output("checkpoint", 0).manifest_path(grpo.layout), "checkpoint")  # grpo's retention
        assert not grpo.fs.exists(join(directory, "model.safetensors"))
        if not is_remote(root):
            verify_run_shares(heir.run.layout)
            return
        line = the_one_line(cli(root, tmp_path, "resume", "heir"))
        assert line.startswith("run heir shares train's output with run grpo")
        assert f"{directory}/" in line and " is missing" in line


def test_a_fork_killed_in_a_stage_resumes_to_the_uninterrupted_forks_bytes(root: str) -> None:
    resumed = fork_of(Run.open(root, "grpo"), "resumed", ["advantage.estimator=rloo"]).run
    uninterrupted = Run.open(root, "rloo")

    def killed(work: Callable[[StageContext], None]) -> Callable[[StageContext], None]:
        def run(ctx: StageContext) -> None:  # what a kill leaves: the outputs written, none of their manifests
            work(ctx)
            raise Killed

        return run

    for stage, work in (("advantage", advantage.run), ("train", train.run)):
        with pytest.raises(Killed):
            run_stage_at(stage, resumed.layout, 0, killed(work))
        assert not stage_state(resumed, instance(stage, 0)).done
        run_stage_at(stage, resumed.layout, 0, work)  # the resume
    assert checkpoint_manifest(resumed).sha256 == checkpoint_manifest(uninterrupted).sha256  # the same weights
    for table, varying in (("batch", ["run_id"]), ("train_metrics", ["run_id", "seconds"])):
        rows = [read_table(run.fs, run.layout.table_path(table, 0), TABLES[table]).drop_columns(varying).to_pylist()
                for run in (resumed, uninterrupted)]
        assert rows[0] == rows[1], table


@pytest.mark.parametrize(("args", "line"), [
    (["nope", "x", "--at", "0"], "run nope has no config at {root}/runs/nope/config.yaml"),
    (["grpo", "rloo", "--at", "0"], "run rloo already exists at {root}/runs/rloo: fork into a new run id"),
    (["grpo", "x", "--at", "5"], "run grpo has iterations 0 to 1: there is no iteration 5 to fork at"),
    (["grpo", "x", "--at", "1"], "run grpo has not reached iteration 1: it has no rollouts there"),
])
def test_bad_input_is_one_line_and_exit_2(root: str, tmp_path: Path, args: list[str], line: str) -> None:
    assert the_one_line(cli(root, tmp_path, "fork", *args)).startswith(line.format(root=root))
    assert not Run.open(root, "grpo").fs.exists(join(root, "runs", "x"))


def test_a_killed_fork_is_started_over(root: str) -> None:
    grpo = Run.open(root, "grpo")
    leftover = join(root, "runs", "half")
    grpo.fs.pipe_file(join(leftover, "iter=0000", "rollouts.parquet"), b"half a fork")  # no config.yaml: killed
    again = fork_of(grpo, "half", [])
    assert [target.label for target in again.shared][:4] == SHARED_AT_0
    verify_run_shares(again.run.layout)
    manifests = {relative for relative in files_of(again.run) if relative.endswith("manifest.json")}
    assert_nothing_copied(grpo, again.run, manifests)  # the leftover file is gone, or a link to grpo's now
    grpo.fs.rm(leftover, recursive=True)
