"""Overlapped iterations with real processes: the overlapped schedule (flows/runner/overlap.py, two lanes at
once) on a three-iteration stand-in run with `pipeline.max_staleness: 1`, driven by
tests/reliability/overlap_driver.py (every stage a process forked from the real stage server, under its lease;
`prompts`, `score`, `advantage` real, the model stages stand-ins). Proves that stages of the two lanes really
ran at the same time (their manifests' start and end times), that the outputs equal those of the same plan run
one stage at a time, and that an overlapped run SIGKILLed while both lanes run resumes to those same outputs
with nothing lost, duplicated or redone. The Prefect side (`loop_flow` submitting task futures) with the real
model: tests/e2e/test_overlap.py.
"""

from __future__ import annotations

import re
import shutil
import sys
from datetime import datetime
from pathlib import Path

import pytest

from stages.registry import LANES, RUN_STAGES, STAGES, instance
from storage.layout import BASE, RunLayout
from tests.support.stages import run_stage_at

from . import helpers as h

pytestmark = pytest.mark.slow
ITERATIONS = 3
PAUSE = {"RLPIPE_DRILL_PAUSE_S": "0.3"}  # a stand-in pauses between its writes: about 1 s per stage


def driver(layout: RunLayout, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tests.reliability.overlap_driver", layout.root, layout.run_id, *flags]


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """A three-iteration overlapped run whose run-level stages are done."""
    base = tmp_path_factory.mktemp("overlap")
    layout = h.start(str(base / "root"), base / "sources", f"iterations={ITERATIONS}", "pipeline.max_staleness=1",
                     "train.is_level=token")
    for stage in RUN_STAGES:
        run_stage_at(stage, layout, BASE, h.work_for(stage))
    return layout


def copy_of(layout: RunLayout, root: Path) -> RunLayout:
    root.mkdir(parents=True, exist_ok=True)
    return h.clone_run(layout, root)


def contents(layout: RunLayout) -> dict[str, object]:
    """Manifest path -> what the output holds: table rows without timing columns, a checkpoint's content hash."""
    found: dict[str, object] = {}
    for name, manifest in h.manifests_of(layout).items():
        if manifest.kind == "checkpoint":
            found[name] = manifest.sha256
        else:
            with layout.fs.open(manifest.path, "rb") as handle:
                import pyarrow.parquet as pq

                rows = pq.read_table(handle).to_pylist()
            found[name] = [{k: v for k, v in r.items() if k not in h.TIMING_COLUMNS} for r in rows]
    return found


def spans(layout: RunLayout) -> dict[tuple[str, int], tuple[float, float]]:
    """(stage, iteration) -> (start, end) of every iteration stage, from its manifests."""
    found = {}
    for manifest in h.manifests_of(layout).values():
        if not STAGES[manifest.stage].run_level:
            iteration = int(re.search(r"iter=(\d+)", manifest.path).group(1))
            found[(manifest.stage, iteration)] = (datetime.fromisoformat(manifest.started_at).timestamp(),
                                                           datetime.fromisoformat(manifest.ended_at).timestamp())
    return found


def assert_complete(layout: RunLayout) -> None:
    """Every scheduled stage done, every table holds each rollout key exactly once, every manifest vouches."""
    from stages.registry import stage_state
    from storage.run import Run, read_run_config

    layout.fs.invalidate_cache()
    run = Run(layout, read_run_config(layout))
    for k in range(ITERATIONS):
        for stage in ("generate", "score", "advantage", "train", "evaluate"):
            assert stage_state(run, instance(stage, k)).done, f"{stage} iter={k}"
        for table in ("rollouts", "scores", "batch"):
            keys = sorted((r["prompt_id"], r["sample_idx"]) for r in h.table_rows(layout, table, k))
            assert keys == h.Keys.expected().rollout, f"{table} iter={k}: {keys}"
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())


@pytest.fixture(scope="module")
def sequential(started: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """The reference: the same run, its plan run one stage at a time in strict order."""
    layout = copy_of(started, tmp_path_factory.mktemp("sequential") / "root")
    result = h.run(driver(layout, "--sequential"), layout.root, **PAUSE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_complete(layout)
    return layout


def test_an_overlapped_run_runs_both_lanes_at_once_and_equals_the_sequential_run(
    started: RunLayout, sequential: RunLayout, tmp_path: Path
) -> None:
    layout = copy_of(started, tmp_path / "root")
    result = h.run(driver(layout), layout.root, **PAUSE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("iteration")] == [
        f"iteration {k} done" for k in range(ITERATIONS)]
    assert_complete(layout)
    assert contents(layout) == contents(sequential)
    timeline = spans(layout)
    rollout = [span for (stage, _), span in timeline.items() if stage in LANES["rollout"]]
    train = [span for (stage, _), span in timeline.items() if stage in LANES["train"]]
    for lane in (rollout, train):  # one stage at a time per lane
        lane.sort()
        assert all(a[1] <= b[0] for a, b in zip(lane, lane[1:], strict=False)), lane
    together = sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for a in rollout for b in train)
    assert together > 0.5, f"the lanes overlapped {together:.2f} s: {timeline}"
    # generate k+1 ran beside train k at least once, and never before train k-1 had ended
    beside = [k for k in range(ITERATIONS - 1) if timeline[("generate", k + 1)][0] < timeline[("train", k)][1]]
    assert beside, timeline
    for k in range(2, ITERATIONS):
        assert timeline[("generate", k)][0] >= timeline[("train", k - 2)][1]


def test_sigkill_of_an_overlapped_run_while_both_lanes_run_then_resume(
    started: RunLayout, sequential: RunLayout, tmp_path: Path
) -> None:
    layout = copy_of(started, tmp_path / "root")
    process = h.spawn(driver(layout), layout.root, tmp_path / "driver.log", **PAUSE)

    def lanes_running() -> set[str]:
        running = set()
        for lane, stages in LANES.items():
            for stage in stages:
                if h.processes_matching(f"stages.{stage} ", layout.root) or h.processes_matching(
                        f"standin_stage {stage} ", layout.root):
                    running.add(lane)
        return running

    try:
        h.wait_for(lambda: lanes_running() == {"rollout", "train"} or process.poll() is not None, 300,
                   what="a stage of each lane running at once")
        assert process.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        h.kill_group(process)
    h.wait_for(lambda: not h.processes_matching("stage", layout.root), 30, what="the stage processes to end")
    h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
    before = h.manifests_of(layout)
    assert len(before) < len(h.manifests_of(sequential)), "the kill came after the run had finished"
    result = h.run(driver(layout), layout.root, **PAUSE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_complete(layout)
    assert contents(layout) == contents(sequential)
    after = h.manifests_of(layout)
    redone = [name for name, manifest in before.items() if after[name].ended_at != manifest.ended_at]
    assert redone == [], f"finished before the kill, yet redone: {redone}"
    assert h.temporary_files(Path(layout.run_dir)) == []
    shutil.rmtree(tmp_path / "root", ignore_errors=True)
