"""The command line refuses bad input before any stage runs, naming the file, line or field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures"


def rlpipe(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLPIPE_ROOT": str(root), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("bad_json.jsonl", "bad_json.jsonl line 3"),
        ("bad_empty_test.jsonl", "bad_empty_test.jsonl line 2"),
    ],
)
def test_bad_data_is_refused_before_anything_is_written(tmp_path: Path, source: str, expected: str) -> None:
    result = rlpipe(tmp_path, "run", "--set", f"data.train={FIXTURES / source}", "--run-id", "bad")
    assert result.returncode == 2
    assert expected in result.stdout.replace("\n", "")
    assert not (tmp_path / "runs").exists()


def test_config_typo_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text("train:\n  lrr: 0.1\n")
    result = rlpipe(tmp_path, "run", "--config", str(config))
    assert result.returncode == 2
    assert "train.lrr" in result.stdout and str(config) in result.stdout.replace("\n", "")
    assert not (tmp_path / "runs").exists()


def test_run_id_with_path_separator_is_refused(tmp_path: Path) -> None:
    result = rlpipe(tmp_path, "run", "--run-id", "../escape")
    assert result.returncode == 2 and "run_id" in result.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "escape").exists()


def test_status_of_unknown_run_is_a_clear_error(tmp_path: Path) -> None:
    result = rlpipe(tmp_path, "status", "nope")
    assert result.returncode == 2 and "has no config" in result.stdout


def test_existing_run_with_other_config_is_not_silently_changed(tmp_path: Path) -> None:
    from schemas.config import load_config
    from tests.support.stages import start_run

    start_run(load_config(None, ["run_id=r"]), str(tmp_path))
    result = rlpipe(tmp_path, "run", "--run-id", "r", "--set", "train.lr=0.5")
    assert result.returncode == 2 and "rlpipe resume r --set" in result.stdout.replace("\n", " ")


def test_stage_command_uses_the_default_root_like_run_and_status(tmp_path: Path) -> None:
    """`rlpipe stage` with neither --root nor $RLPIPE_ROOT finds the run where `rlpipe run` put it
    (./rlpipe-data), as the README's example does after `make run`."""
    from schemas.config import load_config
    from schemas.settings import DEFAULT_ROOT
    from tests.support.stages import start_run

    start_run(load_config(None, ["run_id=here"]), str(tmp_path / DEFAULT_ROOT))
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_ROOT"}
    result = subprocess.run([sys.executable, "-m", "flows.cli", "stage", "prompts", "--run", "here"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "rlpipe-data" / "runs" / "here" / "prompts.parquet.manifest.json").exists()


@pytest.mark.parametrize(("stage_exit", "run_exit"), [(2, 2), (1, 1), (-9, 1)])
def test_run_exits_2_when_a_stage_refused_its_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    stage_exit: int, run_exit: int) -> None:
    """A stage that failed on bad input (its exit code 2) makes `rlpipe run` exit 2 too; other failures 1."""
    import flows.pipeline
    from flows.cli.commands import _drive
    from flows.runner.process import StageFailed
    from schemas.config import load_config
    from storage.layout import StageInstance
    from storage.run import Run, RunRef

    def loop_flow(run: RunRef) -> None:
        raise StageFailed(StageInstance("score", 0), stage_exit)

    monkeypatch.setenv("RLPIPE_DISPATCH", "deployments")  # no stage server: the flow is replaced
    monkeypatch.setattr(flows.pipeline, "loop_flow", loop_flow)
    assert _drive(Run.start(load_config(None, ["run_id=t"]), str(tmp_path))) == run_exit


def test_a_failed_stage_rewrites_the_report_to_say_so(tmp_path: Path) -> None:
    """The run's report, last written after its last finished iteration, is rewritten when a stage fails: it
    opens with the stage and the reason."""
    from flows.pipeline import report_on_failure
    from flows.runner.process import StageFailed
    from storage.failure import record_failure
    from storage.layout import StageInstance
    from storage.run import Run
    from tests.support.synthetic_runs import SyntheticSpec, write_synthetic_run

    layout = write_synthetic_run(str(tmp_path), SyntheticSpec(run_id="s", iterations=1))
    target = StageInstance("train", 0)
    record_failure(layout, target, 1, "RuntimeError: CUDA out of memory")
    with pytest.raises(StageFailed), report_on_failure(Run.at(layout)):
        raise StageFailed(target, 1)
    report = (tmp_path / "runs/s/report.html").read_text()
    assert "Run failed at train iter=0 (exit code 1): RuntimeError: CUDA out of memory" in report
