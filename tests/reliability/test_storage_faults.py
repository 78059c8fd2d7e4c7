"""Storage drills: a disk that fills up, a storage root that cannot be written, an S3 server that dies mid-write.

Real file systems (a small tmpfs, a read-only remount of it; root ignores file modes, so the mount takes the
permission away) and a real S3 API (moto's server on 127.0.0.1, killed with SIGKILL and started again).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from stages.registry import instance, stage_state
from storage.layout import RunLayout
from storage.run import Run, read_run_config

from . import helpers as h
from .conftest import BUCKET, Moto, remount, tmpfs


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """A ballast file that takes the file system's free space, all of it or all but `leave_bytes`."""
    ballast = directory / "ballast"
    stat = os.statvfs(directory)
    target = max(0, stat.f_bavail * stat.f_frsize - leave_bytes)
    with open(ballast, "wb") as handle:
        try:
            while target > 0:
                chunk = min(target, 1 << 20)
                handle.write(b"\0" * chunk)
                handle.flush()
                target -= chunk
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return ballast


def assert_one_clear_line(output: str, *names: str) -> None:
    """The failure is reported as a message naming what failed, not as a Python traceback."""
    assert "Traceback" not in output, f"a traceback instead of a message:\n{output[-2500:]}"
    for name in names:
        assert name in output.replace("\n", ""), f"{name!r} not named in:\n{output[-2500:]}"


def test_disk_full_during_a_table_write(pristine_run: RunLayout, tmp_path: Path) -> None:
    """Proves: when the disk under the storage root is full while the score stage writes its table (a 4 MiB
    tmpfs filled by a ballast file), the stage exits non-zero with a message naming the reason and the table,
    without a traceback; no temporary is left; the old scores file is byte for byte what it was, no manifest
    vouches for anything incomplete and every other output and manifest is untouched. Once the space is freed,
    running the stage again completes with exactly the expected keys."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        layout = h.clone_run(pristine_run, disk / "root")
        run_dir = Path(layout.run_dir)
        scores = Path(layout.table_path("scores", 0))
        assert scores.stat().st_size > 4096  # more than the one page the harness frees by removing the manifest
        before = h.snapshot(run_dir)
        ballast = fill(disk)

        failed = h.run(h.stage_command(layout, "score"), layout.root)
        output = failed.stdout + failed.stderr
        assert failed.returncode != 0
        assert "No space left on device" in output, output[-2500:]
        after = h.snapshot(run_dir)
        # Score's own manifest may be gone (removed before its first write) or kept (the stage stopped before
        # writing anything, e.g. when even its lease file could not be created); if kept it still vouches.
        assert {k for k in before if after.get(k) != before[k]} <= {"iter=0000/scores.parquet.manifest.json"}
        # the one new file allowed: the stage's failure record, when its few bytes still fit (storage/failure.py)
        assert set(after) - {"failed.json"} <= set(before), f"new files on a full disk: {set(after) - set(before)}"
        assert after["iter=0000/scores.parquet"] == before["iter=0000/scores.parquet"]
        h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
        assert h.temporary_files(run_dir) == []

        ballast.unlink()
        resumed = h.run(h.stage_command(layout, "score"), layout.root)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        h.ensure_upstream_done(layout, "train")
        h.assert_exact_keys(layout)
        h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())
        assert_one_clear_line(output, "No space left on device", "scores.parquet")


def test_disk_full_during_a_checkpoint_write_then_free_space_and_resume(
    pristine_run: RunLayout, tmp_path: Path
) -> None:
    """Proves: when the disk fills up while a stage builds its checkpoint (train's stand-in work writes 1.5 MiB
    of weights through the real harness on a 4 MiB tmpfs with 1 MiB free), the stage fails with a message naming
    the reason, the previous checkpoint's files and every manifest are intact, and after freeing exactly as much
    space as the checkpoint needs, resuming the stage completes: the failed attempt's partial checkpoint does
    not keep holding the space."""
    weights = 1536 << 10
    with tmpfs(tmp_path / "disk", "4m") as disk:
        layout = h.clone_run(pristine_run, disk / "root")
        run_dir = Path(layout.run_dir)
        before = h.snapshot(run_dir)
        ballast = fill(disk, leave_bytes=1 << 20)
        command = h.standin_command(layout, "train")

        failed = h.run(command, layout.root, RLPIPE_DRILL_WEIGHTS_BYTES=str(weights))
        output = failed.stdout + failed.stderr
        assert failed.returncode != 0 and "No space left on device" in output, output[-2500:]
        after = h.snapshot(run_dir)
        for name, digest in before.items():
            if "manifest" in name and name.startswith(("checkpoints/iter=0000", "iter=0000/train_metrics")):
                continue  # train's own manifests are removed before it writes (by design)
            if name.startswith(("checkpoints/iter=0000", "iter=0000/train_metrics")) or "manifest" not in name:
                assert after.get(name) == digest, f"{name} changed on a failed write"
        h.assert_manifests_vouch_for_their_outputs(layout.fs, h.manifests_of(layout).values())

        # Free what the checkpoint needs, and only that.
        with open(ballast, "r+b") as handle:
            handle.truncate(max(0, ballast.stat().st_size - weights))
        resumed = h.run(command, layout.root, RLPIPE_DRILL_WEIGHTS_BYTES=str(weights))
        assert resumed.returncode == 0, (
            f"resume after freeing {weights} bytes failed; temporaries: {h.temporary_files(run_dir)}\n"
            + resumed.stderr[-1500:]
        )
        config = read_run_config(layout)
        assert stage_state(Run(layout, config), instance("train", 0)).done
        assert h.temporary_files(run_dir) == []
        assert_one_clear_line(output, "No space left on device")


def test_storage_root_without_write_permission(pristine_run: RunLayout, tmp_path: Path) -> None:
    """Proves: on a storage root that cannot be written (a tmpfs remounted read-only: as root, file modes would
    not stop us), `rlpipe run` of a new run and a stage of an existing run exit non-zero with a message naming
    the path and the reason, without a traceback, and nothing under the root changes. After the root is
    writable again the stage runs."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        layout = h.clone_run(pristine_run, disk / "root")
        before = h.snapshot(disk)
        remount(disk, "ro")
        try:
            train, test = h.write_sources(tmp_path / "sources")  # the new run's own sources (readable)
            new_run = h.run(h.rlpipe_command("run", "--run-id", "fresh", "--set", f"data.train={train}",
                                             "--set", f"data.test={test}"), layout.root)
            stage = h.run(h.stage_command(layout, "score"), layout.root)
            assert h.snapshot(disk) == before
        finally:
            remount(disk, "rw")
        assert new_run.returncode != 0 and stage.returncode != 0
        rerun = h.run(h.stage_command(layout, "score"), layout.root)
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert_one_clear_line(new_run.stdout + new_run.stderr, "Read-only file system", str(disk))
        assert_one_clear_line(stage.stdout + stage.stderr, "Read-only file system", str(disk))


# ---------------------------------------------------------------------------------------------------------
# S3


def s3_manifests(layout: RunLayout) -> list:
    from storage.manifest import read_manifest

    fs = layout.fs
    fs.invalidate_cache()
    paths = [p for p in fs.find(layout.run_dir) if p.endswith("manifest.json")]
    return [read_manifest(fs, f"s3://{p}") for p in paths]


def put_seen(moto: Moto, key_part: str, after_line: int) -> bool:
    """Whether moto has received a PUT of the object `key_part` (or of any object under it, for a prefix ending
    in "/"), among the requests after line `after_line` of its recording (which logs requests as they arrive)."""
    try:
        lines = moto.recording.read_text().splitlines()[after_line:]
    except OSError:
        return False
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        url = unquote(entry.get("url", "")).split("?")[0]
        if entry.get("method") == "PUT" and (key_part in url if key_part.endswith("/") else url.endswith(key_part)):
            return True
    return False


def outage_during(moto: Moto, process: subprocess.Popen, kill_when, outage_s: float) -> bool:  # noqa: ANN001
    """When `kill_when()` holds (or the stage ends first: then False), SIGKILL moto; the stage keeps running
    against the dead endpoint for `outage_s`, then is frozen while moto restarts and replays its state (so the
    replay cannot interleave with the stage's own requests), then continues."""
    while process.poll() is None and not kill_when():
        time.sleep(0.01)
    if process.poll() is not None:
        return False
    moto.stop()
    time.sleep(outage_s)
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        moto.start(replay=True)
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    return True


@pytest.fixture(scope="module")
def s3_run(moto: Moto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunLayout]:
    base = tmp_path_factory.mktemp("s3")
    (base / "cache").mkdir()  # as on a worker where rlpipe ran before (a fresh one: the drill below)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLPIPE_CACHE", str(base / "cache"))  # stage processes inherit it
        layout = h.start(f"s3://{BUCKET}/drills", base / "sources")
        h.build_run(layout)
        yield layout


@pytest.mark.parametrize("output_key", ["checkpoints/iter=0000/", "iter=0000/train_metrics.parquet"])
def test_s3_server_killed_mid_write_and_restarted(
    moto: Moto, s3_run: RunLayout, output_key: str, tmp_path: Path
) -> None:
    """Proves: when the S3 server dies (SIGKILL of moto) while the train stage writes to it (its stand-in work
    through the real harness: a multi-file checkpoint, then a table), at the first PUT of the checkpoint or of
    the table, and comes back 3 s later with its data, the stage either finishes through its retries with
    backoff or fails; either way no manifest in the bucket points at a missing or partial object, and
    running the stage again (if it failed) leaves it done with the same content as before the outage."""
    layout = s3_run
    h.ensure_upstream_done(layout, "train")
    reference = h.output_contents(layout, "train")
    command = h.standin_command(layout, "train")
    seen = len(moto.recording.read_text().splitlines())
    process = h.spawn(command, layout.root, tmp_path / "train.log")
    hit = outage_during(moto, process, lambda: put_seen(moto, f"drills/runs/drill/{output_key}", seen), outage_s=3.0)
    code = h.finish(process, timeout=600)
    assert hit, f"the stage ended before its first PUT of {output_key} was seen"
    h.assert_manifests_vouch_for_their_outputs(layout.fs, s3_manifests(layout))
    if code != 0:
        output = (tmp_path / "train.log").read_text()
        again = h.run(command, layout.root)
        assert again.returncode == 0, output[-1500:] + again.stderr[-1500:]
    config = read_run_config(layout)
    layout.fs.invalidate_cache()
    assert stage_state(Run(layout, config), instance("train", 0)).done
    assert h.output_contents(layout, "train") == reference
    h.assert_manifests_vouch_for_their_outputs(layout.fs, s3_manifests(layout))


def test_checkpoint_on_s3_leaves_no_local_copy_behind(moto: Moto, s3_run: RunLayout) -> None:
    """Proves: a stage that publishes a checkpoint to an S3 root (train's stand-in work through the real harness)
    does not leave its local build directory behind in the worker's cache: on a worker that trains every
    iteration, each leftover would be a whole model plus optimizer state."""
    layout = s3_run
    h.ensure_upstream_done(layout, "train")
    cache = Path(os.environ["RLPIPE_CACHE"])
    before = set(cache.rglob("*"))
    result = h.run(h.standin_command(layout, "train"), layout.root)
    assert result.returncode == 0, result.stderr[-2000:]
    left = {p for p in set(cache.rglob("*")) - before if ".tmp-" in p.name}
    assert left == set()


def test_checkpoint_on_s3_from_a_fresh_worker(moto: Moto, s3_run: RunLayout, tmp_path: Path) -> None:
    """Proves: a stage that builds a checkpoint for an S3 root works on a fresh worker, whose local cache
    directory ($RLPIPE_CACHE) does not exist yet."""
    layout = s3_run
    h.ensure_upstream_done(layout, "train")
    result = h.run(h.standin_command(layout, "train"), layout.root, RLPIPE_CACHE=str(tmp_path / "fresh-cache"))
    assert result.returncode == 0, result.stderr[-2000:]
