"""A process opens its run once: config.yaml is read once and each lease taken once, wherever the run goes next.

Counted at the bottom, where nothing can go round the count: every open of `runs/<run>/config.yaml` through
the local filesystem, and every call for a lease (storage/lock.py's `lease`, which a nested hold goes through
too). `rlpipe resume` runs the real loop flow in this process (Prefect's temporary server, the report and a
tracker after each iteration); only the stage processes are left out (a stand-in reports each as done), so a
synthetic run with no model will do. The stage process is counted apart, through the harness's `main`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

import storage.lock
from flows.cli.commands import main
from flows.runner import forkserver
from schemas.errors import InputError
from stages.harness import StageContext
from stages.harness import main as stage_main
from storage.layout import RunLayout
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec


def count_config_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    local_open = LocalFileSystem._open

    def counted(self: LocalFileSystem, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        if path.endswith("/config.yaml") and "r" in mode:
            reads.append(path)
        return local_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "_open", counted)
    return reads


def count_leases(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    taken: list[str] = []
    lease = storage.lock.lease

    def counted(root: str, path: str, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        taken.append(path)
        return lease(root, path, *args, **kwargs)

    monkeypatch.setattr(storage.lock, "lease", counted)
    return taken


def test_rlpipe_resume_reads_the_config_once_and_takes_the_run_lease_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SyntheticSpec(run_id="once", iterations=2, extra_config={"log": {"trackers": ["tensorboard"]}})
    SyntheticRun(str(tmp_path), spec).write()
    layout = RunLayout.create(str(tmp_path), "once")
    launched: list[list[str]] = []
    monkeypatch.setenv("RLPIPE_STAGE_FORK", "0")
    monkeypatch.setattr(forkserver, "run", lambda command, env: launched.append(command) or 0)
    reads, leases = count_config_reads(monkeypatch), count_leases(monkeypatch)

    assert main(["resume", "once", "--root", str(tmp_path)]) == 0

    assert reads == [layout.config_path]
    assert leases == [layout.lock_path()]
    # The flow did go on past the first open: it started stages, and after each iteration it wrote the report
    # and logged the iteration to the tracker, all from the config read above.
    assert any(command[2] == "stages.train" for command in launched)
    assert Path(layout.run_dir, "report.html").exists()
    assert json.loads(Path(layout.run_dir, "trackers/tensorboard.json").read_text())["logged"] == [0, 1]


def stop_at_work(ctx: StageContext) -> None:
    raise InputError("stand-in: the stage stops where its work would begin")


def test_a_stage_process_reads_the_config_once_and_takes_its_own_lease_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    SyntheticRun(str(tmp_path), SyntheticSpec(run_id="once", iterations=1)).write()
    layout = RunLayout.create(str(tmp_path), "once")
    reads, leases = count_config_reads(monkeypatch), count_leases(monkeypatch)

    assert stage_main("advantage", stop_at_work, ["--run", "once", "--iter", "0", "--root", str(tmp_path)]) == 2

    assert reads == [layout.config_path]
    assert leases == [f"{layout.run_dir}/locks/advantage@iter=0000.lock"]


def test_a_flow_run_elsewhere_opens_the_run_from_json_and_one_handed_over_is_not_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.pipeline import _driven_run
    from storage.run import Run, RunRef

    SyntheticRun(str(tmp_path), SyntheticSpec(run_id="once", iterations=1)).write()
    layout = RunLayout.create(str(tmp_path), "once")
    driving = RunRef.driving(Run.open(str(tmp_path), "once"))
    reads, leases = count_config_reads(monkeypatch), count_leases(monkeypatch)
    # What a deployment's flow run receives: the JSON, without the Run this process holds.
    parameter = json.loads(json.dumps(driving.model_dump(mode="json")))
    assert parameter == {"root": str(tmp_path), "run_id": "once"}
    with _driven_run(RunRef.model_validate(parameter)) as run:
        assert run.config.iterations == 1
    assert (reads, leases) == ([layout.config_path], [layout.lock_path()])
    with _driven_run(driving) as run:  # handed over: no second read, no second lease
        assert run is driving.driven
    assert (reads, leases) == ([layout.config_path], [layout.lock_path()])
