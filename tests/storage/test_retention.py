"""Checkpoint retention (train.keep_checkpoints, train.keep_optimizer_states) on real runs, local and on S3.

The runs are the reliability drills' stand-in runs (tests/reliability/helpers.py: real prompts, score and
advantage stages, stand-in model stages writing small checkpoints through the real harness, train's with an
optimizer.pt), four iterations with evaluate.every=2 (iterations 1 and 3 evaluated) and the default
keep_checkpoints=1 and keep_optimizer_states=1. The first pass runs after iteration 2 (stand-in runs are built
without the flow): it prunes checkpoint 0 whole and checkpoint 1's optimizer state (1 is evaluated), and the
pass after iteration 3 prunes checkpoint 2 whole: worked out by hand from the rules in stages/retention.py.

The crash drill SIGKILLs a pruning pass (a fresh interpreter) before each of its steps in turn (every manifest
write and every deletion: the only points where the storage changes), then resumes: nothing needed is lost, no
stage is pending, nothing pruned is usable, and after the last iteration and its pass the run equals an
uninterrupted one, tables and checkpoints alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

from flows.cli.status import status_table
from flows.runner.process import pending_stages
from stages.harness import StageContext
from stages.registry import RUN_STAGES, iteration_stages
from stages.retention import prune_checkpoints
from storage.checkpoints import HASH_CACHE_NAME, verify_checkpoint
from storage.fs import filesystem
from storage.layout import BASE, RunLayout, manifest_path_for
from storage.lineage import lineage
from storage.manifest import Manifest, read_manifest, write_manifest
from storage.retention import CheckpointPruned, disk_usage, prune_checkpoint, require_unpruned
from storage.run import Run
from tests.reliability import helpers as h
from tests.storage.test_s3 import s3_endpoint, s3_root  # noqa: F401 - the moto fixtures
from tests.support.stages import clone, run_stage_at
from tests.support.table_digests import run_digests

ITERATIONS = 4
RETENTION = ("iterations=4", "evaluate.every=2")  # the defaults: keep_checkpoints 1, keep_optimizer_states 1
FINAL = {0: "checkpoint", 1: "optimizer", 2: "checkpoint", 3: ""}  # by hand, see the module docstring

KILL_SCRIPT = """
import os, signal, sys
import storage.retention as retention
from stages.retention import prune_checkpoints
from storage.layout import RunLayout
from storage.run import Run

steps, kill_before = [0], int(sys.argv[3])

def step(function):
    def counted(*args, **kwargs):
        steps[0] += 1
        if steps[0] == kill_before:
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)
    return counted

retention.write_manifest, retention._delete = step(retention.write_manifest), step(retention._delete)
prune_checkpoints(Run.at(RunLayout.create(sys.argv[1], sys.argv[2])))
print(steps[0])
"""


def standin_train_with_optimizer(ctx: StageContext) -> None:
    """The drills' stand-in train, whose checkpoint also holds an optimizer.pt, as a real train stage's does."""
    publish = ctx.write_checkpoint

    def with_optimizer(local_dir: Path, metrics: dict | None = None) -> Manifest:
        (local_dir / "optimizer.pt").write_bytes(b"adam" * 256)
        return publish(local_dir, metrics)

    ctx.write_checkpoint = with_optimizer  # type: ignore[method-assign]
    h.standin_train(ctx)


def build(layout: RunLayout, iterations: range) -> None:
    """The run-level stages (first time), then each iteration's stages in order, in this process."""
    run = Run.at(layout)
    stages = [(stage, BASE) for stage in RUN_STAGES] if iterations.start == 0 else []
    stages += [(stage, k) for k in iterations for stage in iteration_stages(run.config, k)]
    for stage, k in stages:
        run_stage_at(stage, layout, k, standin_train_with_optimizer if stage == "train" else h.work_for(stage))


def checkpoint_manifest(layout: RunLayout, iteration: int) -> Manifest:
    manifest = read_manifest(layout.fs, manifest_path_for(layout.checkpoint_dir(iteration), "checkpoint"))
    assert manifest is not None, iteration
    return manifest


def checkpoint_state(layout: RunLayout, iteration: int) -> tuple[str, list[str], list[str], list[str]]:
    """(pruned, files, pruned files, what the storage holds under the checkpoint's folder but a hash cache)."""
    manifest = checkpoint_manifest(layout, iteration)
    folder = layout.fs._strip_protocol(layout.checkpoint_dir(iteration)) + "/"
    held = sorted(p.removeprefix(folder) for p in layout.fs.find(layout.checkpoint_dir(iteration))
                  if not p.endswith(HASH_CACHE_NAME))
    return manifest.pruned, sorted(manifest.files), sorted(manifest.pruned_files), held


def checkpoints(layout: RunLayout) -> dict[int, tuple[str, list[str], list[str], list[str]]]:
    layout.fs.invalidate_cache()
    return {k: checkpoint_state(layout, k) for k in [BASE, *range(ITERATIONS)]}


def assert_sound(layout: RunLayout, built: int = ITERATIONS) -> None:
    """What must hold at any point of a pruning pass over the first `built` iterations: every manifest vouches
    for the files it lists (full content hashes), no stage of them is pending (so nothing reruns), and a
    checkpoint either is whole or says it is pruned and is refused; the storage holds no checkpoint file its
    manifest does not name (listed or pruned)."""
    layout.fs.invalidate_cache()
    run = Run.at(layout)
    assert [target for target in pending_stages(run) if target.iteration < built] == []
    for k in range(built):
        manifest = checkpoint_manifest(layout, k)
        assert verify_checkpoint(layout.fs, manifest) == [], k
        _, files, pruned_files, held = checkpoint_state(layout, k)
        assert set(held) - {"manifest.json"} <= set(files) | set(pruned_files), k
        if manifest.pruned == "checkpoint":
            assert files == [] and pruned_files
            with pytest.raises(CheckpointPruned, match=f"iteration {k} "):
                require_unpruned(manifest)
        elif manifest.pruned == "optimizer":
            assert "optimizer.pt" in pruned_files and "model.safetensors" in files


@pytest.fixture(scope="module")
def before_retention(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """Iterations 0-2 built, retention not yet applied (the pass after iteration 2 is the one the drill kills)."""
    base = tmp_path_factory.mktemp("retention")
    layout = h.start(str(base / "root"), base / "sources", *RETENTION)
    build(layout, range(3))
    return layout


def finish_run(layout: RunLayout) -> None:
    """What a resume does from here: the pass of iteration 2, iteration 3, its pass."""
    prune_checkpoints(Run.at(layout))
    build(layout, range(3, ITERATIONS))
    prune_checkpoints(Run.at(layout))


@pytest.fixture(scope="module")
def uninterrupted(before_retention: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    layout = clone(before_retention, str(tmp_path_factory.mktemp("uninterrupted") / "root"))
    finish_run(layout)
    return layout


def test_retention_keeps_the_base_the_evaluated_the_last_and_prunes_the_rest(
    before_retention: RunLayout, uninterrupted: RunLayout
) -> None:
    """Proves: checkpoints 0 and 2 lose every file but their manifest, 1 (evaluated) only its optimizer state,
    3 (the last) and the base nothing; every stage stays done; the freed bytes are the deleted files' sizes on
    disk before the pass; tables are untouched; `rlpipe status` and `rlpipe lineage` show the pruned ones."""
    layout = uninterrupted
    states = checkpoints(layout)
    assert {k: state[0] for k, state in states.items()} == {BASE: "", **FINAL}
    assert states[0][3] == states[2][3] == ["manifest.json"]
    assert "optimizer.pt" not in states[1][3] and "model.safetensors" in states[1][3]
    assert "optimizer.pt" in states[3][3] and "model.safetensors" in states[BASE][3]
    assert_sound(layout)

    source = Path(before_retention.run_dir)
    freed = sum(p.stat().st_size for k in (0, 2) for p in (source / "checkpoints" / f"iter={k:04d}").iterdir()
                if p.name not in ("manifest.json", HASH_CACHE_NAME))
    freed += (source / "checkpoints" / "iter=0001" / "optimizer.pt").stat().st_size
    usage = disk_usage(layout, ITERATIONS)
    assert (usage.checkpoints_pruned, usage.optimizer_states_pruned, usage.checkpoints_kept) == (2, 1, 2)
    assert usage.pruned_bytes == freed
    assert usage.free_bytes is not None and usage.free_bytes > 0
    tables = {name: digest for name, digest in h.snapshot(source).items() if name.endswith(".parquet")}
    assert tables.items() <= h.snapshot(Path(layout.run_dir)).items()  # tables are never pruned

    console = Console(width=250, record=True)
    console.print(status_table(Run.at(layout)))
    assert "pruned 2 checkpoints, 1 optimizer states" in console.export_text()
    chain = lineage(layout.root, layout.run_id, 3)  # `rlpipe lineage`: pruned is a state, not a problem
    assert chain.problems == []
    assert {n.entry.iteration: n.check for n in chain.nodes if n.entry.name == "checkpoint"} == {
        BASE: "ok", 0: "pruned", 1: "ok", 2: "pruned", 3: "ok"}


def test_using_a_pruned_checkpoint_is_refused_naming_its_iteration(uninterrupted: RunLayout, tmp_path: Path) -> None:
    """Proves: evaluating pruned checkpoint 0, and rerunning train 2 (whose input, checkpoint 1, lost its optimizer
    state), fail with an InputError naming the iteration; their outputs stay as they were."""
    layout = clone(uninterrupted, str(tmp_path / "root"))
    before = checkpoints(layout)
    with pytest.raises(CheckpointPruned, match=r"checkpoint of iteration 0 .* it was pruned \(train.keep_checkpoints"):
        run_stage_at("evaluate", layout, 0, h.STANDINS["evaluate"])
    with pytest.raises(CheckpointPruned, match=r"iteration 1 .* its optimizer state was pruned"):
        run_stage_at("train", layout, 2, h.real_stage("train"))
    require_unpruned(checkpoint_manifest(layout, 3), optimizer=True)  # the last: whole
    assert checkpoints(layout) == before
    assert pending_stages(Run.at(layout)) == []


def kill_points(layout: RunLayout, uninterrupted: RunLayout, every_step: bool = True) -> None:
    """Clone `layout` for each point, SIGKILL its pruning pass before that step, check it is sound, resume it to
    the end and compare with `uninterrupted`. Without `every_step`: three points (after the first manifest is
    marked, halfway through, before the last deletion), as each costs a rebuilt iteration."""
    probe = clone(layout, f"{layout.root}-probe")
    counted = h.run([sys.executable, "-c", KILL_SCRIPT, probe.root, probe.run_id, "0"], probe.root)
    assert counted.returncode == 0, counted.stderr[-3000:]
    steps = int(counted.stdout.split()[-1])
    assert steps >= 3, counted.stdout  # a manifest and at least two deletions
    expected_tables = run_digests(Run.at(uninterrupted))
    for point in range(1, steps + 1) if every_step else sorted({2, steps // 2 + 1, steps}):
        drill = clone(layout, f"{layout.root}-kill{point}")
        killed = h.run([sys.executable, "-c", KILL_SCRIPT, drill.root, drill.run_id, str(point)], drill.root)
        assert killed.returncode == -9, (point, killed.stderr[-3000:])
        assert_sound(drill, built=3)
        finish_run(drill)
        assert checkpoints(drill) == checkpoints(uninterrupted), point
        assert run_digests(Run.at(drill)) == expected_tables, point


def test_sigkill_at_every_step_of_a_pruning_pass_then_resume(
    before_retention: RunLayout, uninterrupted: RunLayout, tmp_path: Path
) -> None:
    """Proves, on a local root, for a kill before each step of the pass (each manifest write, each deletion):
    the run is sound right after the kill and, resumed, ends equal to the uninterrupted run."""
    kill_points(before_retention, uninterrupted)


def test_retention_and_its_crash_drill_on_s3(
    before_retention: RunLayout, uninterrupted: RunLayout, s3_root: str, tmp_path: Path  # noqa: F811
) -> None:
    """Proves the same on an S3 root (moto's server): the pass prunes what it prunes locally, a kill at three of
    its steps leaves the run sound and its resume ends equal to the uninterrupted run (every step is the local
    drill's: each costs half a minute here); status shows free space as n/a."""
    on_s3 = clone(before_retention, s3_root)
    reference = clone(on_s3, f"{s3_root}-uninterrupted")
    finish_run(reference)
    assert {k: state[0] for k, state in checkpoints(reference).items()} == {BASE: "", **FINAL}
    assert checkpoints(reference) == checkpoints(uninterrupted)
    assert run_digests(Run.at(reference)) == run_digests(Run.at(uninterrupted))
    kill_points(on_s3, reference, every_step=False)
    assert disk_usage(reference, ITERATIONS).free_bytes is None
    console = Console(width=250, record=True)
    console.print(status_table(Run.at(reference)))
    assert "free on root n/a (S3)" in console.export_text()


def test_a_checkpoint_saved_without_optimizer_state_is_never_marked(tmp_path: Path) -> None:
    """Proves: pruning the optimizer state of a checkpoint that has none (train.save_optimizer false) marks
    nothing, so a train stage may still start from it; pruning it whole then marks and deletes its two files."""
    fs, directory = filesystem(str(tmp_path)), tmp_path / "checkpoints" / "iter=0002"
    directory.mkdir(parents=True)
    files = {}
    for name, data in {"config.json": b"{}", "model.safetensors": b"w" * 100}.items():
        (directory / name).write_bytes(data)
        files[name] = {"bytes": len(data), "sha256": "-"}
    manifest = Manifest(stage="train", key="k", kind="checkpoint", path=str(directory), sha256="s", bytes=102,
                        files=files)
    write_manifest(fs, str(directory / "manifest.json"), manifest)
    assert prune_checkpoint(fs, str(directory / "manifest.json"), "optimizer") == {}
    require_unpruned(read_manifest(fs, str(directory / "manifest.json")), optimizer=True)
    assert sorted(prune_checkpoint(fs, str(directory / "manifest.json"), "checkpoint")) == sorted(files)
    assert sorted(p.name for p in directory.iterdir()) == ["manifest.json"]
    with pytest.raises(CheckpointPruned, match=r"checkpoint of iteration 2 .* it was pruned"):
        require_unpruned(read_manifest(fs, str(directory / "manifest.json")))
