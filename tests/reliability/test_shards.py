"""Sharded stages (pipeline.shards) with real processes: the merged tables equal the unsharded run's.

- Two-iteration stand-in runs (tests/reliability/helpers.py: `score` real, `generate` a stand-in that honours its
  shard) driven by tests/reliability/overlap_driver.py, strict (`--sequential`, max_staleness 0) and overlapped
  (max_staleness 1), sharded `{generate: 2, score: 2}` against the same run unsharded: equal tables, no part left
  behind, the catalog reading the merged tables.
- A shard SIGKILLed mid-run reruns alone: the finished shard's part is not recomputed (same file, same manifest),
  and the merged table equals the unsharded one. A second merge while one holds the instance's lease: exit 3.
- The model stages' own code with SmolLM2 on the HF backend (one request at a time): generate and evaluate_base
  sharded in two, merged, byte-identical to the unsharded table (evaluate's summaries equal too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.runner.process import run_sharded, run_stage_process
from schemas.config import RunConfig
from stages.harness import merge_shards, run_stage
from stages.registry import RUN_STAGES, instance, stage_state
from storage.catalog import Catalog
from storage.layout import BASE, RunLayout, Shard, parts_dir
from storage.lock import stage_lock
from storage.manifest import Manifest, read_manifest
from storage.run import Run, read_run_config
from tests.support.stages import run_stage_at

from . import helpers as h

pytestmark = pytest.mark.slow
ITERATIONS = 2


def with_shards(layout: RunLayout, shards: dict[str, int]) -> Run:
    """The run with pipeline.shards set (no stage key holds it: what is done stays done)."""
    config = read_run_config(layout)
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"shards": shards})})
    return Run.start(RunConfig.model_validate(config.model_dump()), layout.root, replace_config=True)


def manifest_of(layout: RunLayout, table: str, iteration: int = 0) -> Manifest:
    layout.fs.invalidate_cache()
    manifest = read_manifest(layout.fs, layout.table_path(table, iteration) + ".manifest.json")
    assert manifest is not None, f"{table} iter={iteration} has no manifest"
    return manifest


def rows_without_timing(layout: RunLayout, table: str, iteration: int = 0) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in h.TIMING_COLUMNS} for row in h.table_rows(layout, table,
                                                                                                 iteration)]


def driver(layout: RunLayout, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tests.reliability.overlap_driver", layout.root, layout.run_id, *flags]


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_sharded_run_equals_the_unsharded_run(staleness: int, tmp_path: Path) -> None:
    extra = ["pipeline.max_staleness=1", "train.is_level=token"] if staleness else []
    started = h.start(str(tmp_path / "started"), tmp_path / "sources", f"iterations={ITERATIONS}", *extra)
    for stage in RUN_STAGES:
        run_stage_at(stage, started, BASE, h.work_for(stage))
    reference = h.clone_run(started, tmp_path / "reference")
    sharded = h.clone_run(started, tmp_path / "sharded")
    with_shards(sharded, {"generate": 2, "score": 2})
    # strict: one stage at a time in order; overlapped: both lanes at once (flows/runner/overlap.py)
    mode = ["--sequential"] if staleness == 0 else []
    for layout in (reference, sharded):
        result = h.run(driver(layout, *mode), layout.root)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run = Run(sharded, read_run_config(sharded))
    for k in range(ITERATIONS):
        for stage in ("generate", "score", "advantage", "train", "evaluate"):
            assert stage_state(run, instance(stage, k)).done, f"{stage} iter={k}"
        for table in ("rollouts", "scores", "batch", "eval"):
            assert rows_without_timing(sharded, table, k) == rows_without_timing(reference, table, k), (table, k)
        for table in ("rollouts", "scores"):
            parts = manifest_of(sharded, table, k).metrics["shards"]
            assert [p["part"] for p in parts] == ["part-00-of-02.parquet", "part-01-of-02.parquet"]
            assert [p["rows"] for p in parts] == [h.N_SAMPLES, h.N_SAMPLES]  # one prompt group each
            assert not Path(parts_dir(sharded.table_path(table, k))).exists()
        # the whole table's contract was checked by the merge, and its figures are over all of it
        assert manifest_of(sharded, "scores", k).metrics["mean_reward"] == manifest_of(reference, "scores",
                                                                                       k).metrics["mean_reward"]
        assert manifest_of(sharded, "scores", k).metrics["contract"]["expectations"] > 0
    with Catalog(sharded.root) as catalog:  # a reader of merged tables, as of any
        assert catalog.rows("SELECT count(*) AS n FROM scores") == [{"n": ITERATIONS * len(h.TRAIN_IDS) * h.N_SAMPLES}]


@pytest.fixture
def slow_scores_run(tmp_path: Path) -> RunLayout:
    """A stand-in run up to score whose right answers sleep 2 s in the sandbox: a shard scores for seconds."""
    layout = h.start(str(tmp_path / "root"), tmp_path / "sources")
    for stage in RUN_STAGES:
        run_stage_at(stage, layout, BASE, h.work_for(stage))
    run_stage_at("generate", layout, 0, lambda ctx: h.standin_generate(ctx, sleep_s=2.0))
    return layout


def test_a_killed_shard_reruns_alone_and_the_merge_equals_the_unsharded_table(
    slow_scores_run: RunLayout, tmp_path: Path
) -> None:
    reference = h.clone_run(slow_scores_run, tmp_path / "reference")
    run_stage_at("score", reference, 0, h.real_stage("score"))
    layout = slow_scores_run
    run = with_shards(layout, {"score": 2})
    whole = instance("score", 0)
    part_path = Path(parts_dir(layout.table_path("scores", 0))) / "part-00-of-02.parquet"

    finished = h.run(h.stage_command(layout, "score") + ["--shard", "0/2"], layout.root)
    assert finished.returncode == 0, finished.stderr[-3000:]
    first = part_path.stat()
    first_manifest = read_manifest(layout.fs, str(part_path) + ".manifest.json")

    log = tmp_path / "shard1.log"
    killed = h.spawn(h.stage_command(layout, "score") + ["--shard", "1/2"], layout.root, log)
    h.wait_for(lambda: "▶ score iter=0 part-01-of-02" in log.read_text(errors="replace"), 120, what="shard 1 to start")
    h.wait_for(lambda: h.job_uid_processes(killed.pid) != [] or killed.poll() is not None, 30, what="its sandbox jobs")
    h.kill_group(killed)
    assert killed.returncode == -9
    assert not stage_state(run, whole.part(1, 2)).done and stage_state(run, whole.part(0, 2)).done
    h.assert_readers_see_only_finished_outputs(layout, [o for o in h.STAGES["score"].outputs(0)])

    # two merges at once: the one holding the instance's lease runs, the other is refused (exit 3)
    with stage_lock(layout, whole):
        assert h.run(h.stage_command(layout, "score") + ["--merge"], layout.root).returncode == 3

    seen_at_merge: list[os.stat_result] = []

    def merge(target: object) -> None:
        seen_at_merge.append(part_path.stat())
        run_stage_process(run, whole, 60.0, merge=True)

    run_sharded(run, whole, lambda part: run_stage_process(run, part, 60.0), merge)  # the flow's resume path
    (at_merge,) = seen_at_merge
    assert (at_merge.st_ino, at_merge.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # shard 0: not redone
    assert manifest_of(layout, "scores").metrics["shards"][0]["started_at"] == first_manifest.started_at
    assert stage_state(Run(layout, read_run_config(layout)), whole).done
    assert rows_without_timing(layout, "scores") == rows_without_timing(reference, "scores")
    assert not part_path.parent.exists()


# ---------------------------------------------------------------------------------------------------------
# The model stages' own code (SmolLM2, HF backend)


def four_problems(directory: Path) -> tuple[Path, Path]:
    """Two train and two test problems (each split needs two prompt groups for two shards)."""
    import json

    problems = [{"task_id": f"shard/{i}", "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
                 "entry_point": f"f{i}", "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"}
                for i in range(4)]
    directory.mkdir(parents=True, exist_ok=True)
    train, test = directory / "train.jsonl", directory / "test.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in problems[:2]))
    test.write_text("".join(json.dumps(p) + "\n" for p in problems[2:]))
    return train, test


def test_sharded_model_stages_equal_the_unsharded_ones(tmp_path: Path) -> None:
    from schemas.config import load_config
    from stages import base_model, evaluate, generate, prompts
    from tests.support.stages import start_run

    train, test = four_problems(tmp_path / "sources")
    config = load_config(None, [
        "run_id=shards", f"data.train={train}", f"data.test={test}", "iterations=1", "threads=2",
        "generate.backend=hf", "generate.batch_size=1", "generate.prompts_per_iteration=2", "generate.n_samples=2",
        "generate.max_new_tokens=4", "generate.mismatch_samples=0", "evaluate.n_samples=1", "evaluate.k=[1]",
        "evaluate.max_new_tokens=4", "score.workers=1", "score.timeout_s=5",
    ])
    layout = start_run(config, str(tmp_path / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    run_stage_at("base_model", layout, BASE, base_model.run)
    unsharded: dict[str, tuple[Manifest, object]] = {}
    for stage, table, iteration in (("evaluate_base", "eval", BASE), ("generate", "rollouts", 0)):
        run_stage_at(stage, layout, iteration, evaluate.run if stage == "evaluate_base" else generate.run)
        unsharded[stage] = (manifest_of(layout, table, iteration), pq.read_table(layout.table_path(table, iteration)))

    run = with_shards(layout, {"generate": 2, "evaluate": 2})
    for stage, table, iteration in (("evaluate_base", "eval", BASE), ("generate", "rollouts", 0)):
        module = evaluate if stage == "evaluate_base" else generate
        for k in range(2):
            run_stage(run, instance(stage, iteration, shard=Shard(k, 2)), module.run)
        merge_shards(run, instance(stage, iteration), module.merge)
        manifest, reference = unsharded[stage]
        merged = manifest_of(layout, table, iteration)
        assert pq.read_table(layout.table_path(table, iteration)).equals(reference), stage
        assert merged.sha256 == manifest.sha256, f"{stage}: the merged file is not byte-identical"
        assert [p["rows"] for p in merged.metrics["shards"]] == [reference.num_rows // 2] * 2
        if stage == "evaluate_base":  # pass@k, greedy accuracy and their intervals over all test prompts
            summaries = {k: v for k, v in manifest.metrics.items() if isinstance(v, dict) and "prompts" in v}
            assert summaries and all(merged.metrics[k] == v for k, v in summaries.items())
        else:
            assert merged.metrics["generated_tokens"] == manifest.metrics["generated_tokens"]
