"""Every refusal before the first stage of `rlpipe run` exits 2 with one line and no traceback, and leaves no run
directory (or, for a stage that refused a new run before its base model, removes it, so a rerun starts over).

Each case runs the real command line in a child process on a temporary root, offline (HF_HUB_OFFLINE, a hub
endpoint that refuses connections): model not cached, model directory that is not a model, bad data file, bad
reward entry, tracker not installed, unknown tracker, a bad config file (wrong type, unknown field, YAML
syntax, wrong shape, missing) and bad `--set` overrides. A stage's own refusal inside the flow is run
once for real (`rlpipe resume` of a run whose model is not there: no pre-check without --set) to show Prefect's
traceback is gone; the removal of a new run's directory is checked in-process with the flow replaced.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NO_NETWORK = "http://127.0.0.1:9"  # the discard port: connections are refused at once
ABSENT = "tiny-org/absent-model"


def offline_env(root: Path) -> dict[str, str]:
    """No network, an empty hub cache, and no COLUMNS: a pipe's 80 columns, so a wrapped message would show."""
    inherited = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    return {**inherited, "RLPIPE_ROOT": str(root), "HF_HUB_CACHE": str(root / "hub-cache"), "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": NO_NETWORK, "HF_HUB_DISABLE_TELEMETRY": "1"}


def rlpipe(root: Path, *args: str, code: str = "") -> subprocess.CompletedProcess:
    """`rlpipe ARGS` in a child process; `code`: Python run before the command line's main (to hide a library)."""
    script = f"import sys\n{code}\nfrom flows.cli.commands import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", script, *args], env=offline_env(root), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def the_one_line(result: subprocess.CompletedProcess) -> str:
    """The refusal: exit code 2, no traceback, and one line of output in all (stdout and stderr together)."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_hub_model_that_is_not_cached_is_refused_before_the_run_exists(tmp_path: Path) -> None:
    line = the_one_line(rlpipe(tmp_path, "run", "--run-id", "m", "--set", f"model.name_or_path={ABSENT}"))
    assert line.startswith(f"model {ABSENT} is not in the Hugging Face cache {tmp_path / 'hub-cache'}")
    assert line.endswith("or point HF_HUB_CACHE at it")
    assert not (tmp_path / "runs").exists()  # nothing left over for a rerun with a model that is there


def test_a_model_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "my-model"
    directory.mkdir()
    line = the_one_line(rlpipe(tmp_path, "run", "--set", f"model.name_or_path={directory}"))
    assert line == f"model directory {directory} has no config.json"
    assert not (tmp_path / "runs").exists()


def test_a_data_file_that_is_not_there_is_refused(tmp_path: Path) -> None:
    line = the_one_line(rlpipe(tmp_path, "run", "--set", f"data.train={tmp_path / 'nope.jsonl'}"))
    assert str(tmp_path / "nope.jsonl") in line
    assert not (tmp_path / "runs").exists()


def test_a_reward_entry_that_does_not_import_is_refused(tmp_path: Path) -> None:
    line = the_one_line(rlpipe(tmp_path, "run", "--set", "score.rewards=[{fn: no_such_module_xyz:score}]"))
    assert "score.rewards[0] 'no_such_module_xyz:score'" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("tool", "expected"), [
    ("no_such_module_xyz:tool", "generate.multi_turn.tools[1] 'no_such_module_xyz:tool': ModuleNotFoundError"),
    ("stages.sandbox.tools:answer_text", "generate.multi_turn.tools[1] 'stages.sandbox.tools:answer_text': "
                                          "has no schema"),
])
def test_a_tool_that_does_not_import_or_has_no_schema_is_refused(tmp_path: Path, tool: str, expected: str) -> None:
    line = the_one_line(rlpipe(tmp_path, "run", "--config", "deployments/configs/tools-cpu.yaml", "--set",
                               f"generate.multi_turn.tools=[{{fn: code_interpreter}}, {{fn: '{tool}'}}]"))
    assert line.startswith(expected)
    assert not (tmp_path / "runs").exists()


def test_a_tracker_that_is_not_installed_is_refused(tmp_path: Path) -> None:
    hide = "import flows.trackers\nflows.trackers.MODULES['wandb'] = 'no_such_tracker_module_xyz'"
    line = the_one_line(rlpipe(tmp_path, "run", "--set", "log.trackers=[wandb]", code=hide))
    assert line.startswith("log.trackers names wandb, not installed here")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("override", "expected"), [
    ("log.trackers=[neptune]", "log.trackers[0]: Input should be"),
    ("train.lrr=0.1", "train.lrr: unknown field, did you mean train.lr?"),
    ("train.lr=fast", "train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')"),
    ("data.train=", "data.train: Input should be a valid string or Input should be a valid dictionary or instance of "
                    "DataSource or Input should be a valid list (got None)"),
    ("train.lr=[1", "override 'train.lr=[1': the value is not valid YAML: line 2, column 1: did not find expected "
                    "',' or ']' (while parsing a flow sequence started at line 1, column 1)"),
    ("train.lr", "override 'train.lr' must look like section.field=value"),
    ("=3", "override '=3' must look like section.field=value"),
])
def test_a_bad_override_is_refused(tmp_path: Path, override: str, expected: str) -> None:
    line = the_one_line(rlpipe(tmp_path, "run", "--set", override))
    assert expected in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("text", "expected"), [
    ("train:\n  lr: fast\n", "invalid config {file}: train.lr: Input should be a valid number"),
    ("train:\n  lrr: 0.1\ngenerate:\n  n_sample: 4\n", "invalid config {file}: generate.n_sample: unknown field, "
     "did you mean generate.n_samples?; train.lrr: unknown field, did you mean train.lr?"),  # in the config's order
    ("train:\n  lr: [1\n generate: x\n", "config file {file} is not valid YAML: line 3, column 10: did not find "
     "expected ',' or ']' (while parsing a flow sequence started at line 2, column 7)"),
    ("train:\n\tlr: 1\n", "config file {file} is not valid YAML: line 2, column 1: found character that cannot "
     "start any token"),
    ("- a list\n", "config file {file} must hold a mapping at the top level"),
    (None, "config file {file} does not exist"),
])
def test_a_bad_config_file_is_refused(tmp_path: Path, text: str | None, expected: str) -> None:
    """A config file with a wrong type, unknown fields, broken YAML (its line and column named), the wrong shape,
    or no file at all: one line naming the file and the field, exit 2, no run directory."""
    config = tmp_path / "my-config.yaml"
    if text is not None:
        config.write_text(text)
    line = the_one_line(rlpipe(tmp_path, "run", "--config", str(config)))
    assert line.startswith(expected.format(file=config)), line
    assert not (tmp_path / "runs").exists()


def test_a_stage_refusal_in_the_flow_prints_its_line_not_prefects_traceback(tmp_path: Path) -> None:
    """`rlpipe resume` of a run whose model is not there runs the flow: the prompts stage, then base_model refuses
    (exit 2). The output has the stage's one line and `rlpipe`'s, and none of Prefect's tracebacks."""
    from schemas.config import load_config
    from tests.support.stages import start_run

    start_run(load_config(None, ["run_id=r", f"model.name_or_path={ABSENT}"]), str(tmp_path))
    result = rlpipe(tmp_path, "resume", "r")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "StageFailed" not in output
    [cause] = [line for line in output.splitlines() if ABSENT in line]
    assert cause.startswith(f"✗ base_model: model {ABSENT} is not in the Hugging Face cache")
    assert result.stdout.strip().splitlines()[-1] == (
        "stage base_model failed: bad input or config (see the message above); fix it and run `rlpipe resume r` "
        "to go on from there")
    assert (tmp_path / "runs/r/config.yaml").exists()  # a run this command did not create is kept


def test_prefects_console_log_leaves_out_stage_failures_only() -> None:
    from flows.pipeline import _not_a_stage_failure
    from flows.runner.process import StageFailed
    from storage.layout import StageInstance

    failure = StageFailed(StageInstance("base_model", -1), 2)
    raised = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed with exception: %r",
                               (failure,), (StageFailed, failure, None))
    finished = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1,
                                 "Finished in state Failed('Task run encountered an exception StageFailed: ...')",
                                 (), None)
    other = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Crash detected", (),
                              (RuntimeError, RuntimeError("boom"), None))
    assert [_not_a_stage_failure(r) for r in (raised, finished, other)] == [False, False, True]


@pytest.mark.parametrize(("new", "base_model_done", "removed"), [(True, False, True), (False, False, False),
                                                                 (True, True, False)])
def test_a_new_run_refused_before_its_base_model_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            new: bool, base_model_done: bool, removed: bool) -> None:
    """A stage of a run this `rlpipe run` created refuses its input before the base model is resolved: the run
    directory goes (config, prompts, locks, failed.json), so the same run id starts over with another config.
    A run that was there before, or has its base model, is kept for `rlpipe resume`."""
    import flows.pipeline
    from flows.cli.commands import _drive
    from flows.runner.process import StageFailed
    from schemas.config import ConfigError, load_config
    from storage.layout import BASE, StageInstance, manifest_path_for
    from storage.run import Run, RunRef

    run = Run.start(load_config(None, ["run_id=t", f"model.name_or_path={ABSENT}"]), str(tmp_path))
    run_dir = Path(run.layout.run_dir)

    def loop_flow(ref: RunRef) -> None:
        (run_dir / "prompts.parquet").write_bytes(b"a finished prompts table")
        if base_model_done:
            manifest = Path(manifest_path_for(run.layout.checkpoint_dir(BASE), "checkpoint"))
            manifest.parent.mkdir(parents=True)
            manifest.write_text("{}")
        raise StageFailed(StageInstance("base_model", BASE), 2)

    monkeypatch.setenv("RLPIPE_DISPATCH", "deployments")  # no stage server: the flow is replaced
    monkeypatch.setattr(flows.pipeline, "loop_flow", loop_flow)
    assert _drive(run, new=new) == 2
    assert run_dir.exists() is not removed
    other_model = load_config(None, ["run_id=t", "model.name_or_path=tiny-org/another-model"])
    if removed:  # the rerun with a model that is there is not refused by leftovers of the refused one
        assert Run.start(other_model, str(tmp_path)).config.model.name_or_path == "tiny-org/another-model"
    else:
        with pytest.raises(ConfigError, match="rlpipe resume t --set"):
            Run.start(other_model, str(tmp_path))
