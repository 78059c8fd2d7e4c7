"""flows/trackers.py with the real libraries, offline: TensorBoard event files read back with tensorboard's event
reader, MLflow's local file store read back with MlflowClient, W&B's offline run files read back record by record.

The run is synthetic (tests/support/synthetic_runs.py) and is "resumed" the way a real one is: iteration 2's
outputs are removed, the trackers log iterations 0 and 1, then iteration 2 is written and they log again (and
once more, with nothing new). Each step must arrive exactly once, with values computed here from the run's
Parquet files and manifests. Each test is skipped, with the reason, where its library is not installed
(`pip install 'rlpipe[trackers]'`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import struct
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows import trackers
from flows.trackers import check_trackers, iteration_scalars, log_iterations, read_marker
from reports.html import ReportData
from schemas.config import ConfigError, LogConfig
from storage.run import Run
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec


def needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install 'rlpipe[trackers]')")


# --- the numbers -------------------------------------------------------------------------------------------


def test_iteration_scalars_by_hand() -> None:
    nan = math.nan
    data = ReportData(
        run_id="r", root="/x", config=None, ks=[1],
        reward=[{"iteration": 0, "mean_reward": 0.5, "solve_rate": 0.25, "rows": 8}],
        lengths=[{"iteration": 0, "mean": 40.0, "p50": 38.0, "p90": 90.0, "truncated": 0.125}],
        evaluation=[
            {"iteration": -1, "dataset": "human eval", "greedy": 0.0, "prompts": 4, "pass@1": 0.125,
             "pass@1_ci": (0.0, 0.25)},
            {"iteration": 0, "dataset": "human eval", "greedy": 0.25, "prompts": 4, "pass@1": 0.375},
            {"iteration": 1, "dataset": "human eval", "greedy": 1.0, "prompts": 4, "pass@1": 1.0},
        ],
        train=[
            {"iteration": 0, "step": 0, "skipped": False, "loss": 1.0, "approx_kl": 0.02, "is_ratio_min": 0.5,
             "is_ratio_max": 1.5, "lr": 1e-5, "tokens": 100, "seconds": 2.0},
            {"iteration": 0, "step": 1, "skipped": False, "loss": 3.0, "approx_kl": nan, "is_ratio_min": 0.7,
             "is_ratio_max": 2.5, "lr": 2e-5, "tokens": 300, "seconds": 2.0},
            {"iteration": 1, "step": 2, "skipped": True, "loss": nan, "lr": 2e-5, "tokens": 0, "seconds": 0.0},
        ],
        stage_seconds={"run": {"prompts": 1.5}, "0": {"generate": 10.0, "train": 4.0}, "1": {"train": 0.5}},
        reward_functions=[
            {"iteration": 0, "function": "code_tests", "mean": 0.25, "error_frac": 0.0},
            {"iteration": 0, "function": "concise.compute_score", "mean": None, "error_frac": 1.0},  # every call failed
            {"iteration": 1, "function": "code_tests", "mean": 0.75, "error_frac": 0.0},
        ],
    )
    assert iteration_scalars(data, 0) == {
        "train/reward_mean": 0.5, "train/solve_rate": 0.25, "train/samples": 8.0,
        "reward/code_tests/mean": 0.25, "reward/code_tests/error_frac": 0.0,
        "reward/concise.compute_score/error_frac": 1.0,  # no mean: not one value
        "length/mean": 40.0, "length/p50": 38.0, "length/p90": 90.0, "length/truncated_frac": 0.125,
        "eval/human_eval/greedy_accuracy": 0.25, "eval/human_eval/prompts": 4.0, "eval/human_eval/pass_at_1": 0.375,
        "eval_base/human_eval/greedy_accuracy": 0.0, "eval_base/human_eval/prompts": 4.0,
        "eval_base/human_eval/pass_at_1": 0.125, "eval_base/human_eval/pass_at_1_ci_low": 0.0,
        "eval_base/human_eval/pass_at_1_ci_high": 0.25,
        "update/steps": 2.0, "update/loss": 2.0, "update/approx_kl": 0.02,  # the NaN step is left out of the mean
        "update/is_ratio_min": 0.5, "update/is_ratio_max": 2.5, "update/lr": 2e-5,
        "update/tokens_per_second": 100.0,  # (100 + 300) tokens / 4 s
        "time/generate": 10.0, "time/train": 4.0, "time/prompts": 1.5,
    }
    # A skipped step trains nothing: no update statistics, 0 steps.
    assert iteration_scalars(data, 1) == {
        "eval/human_eval/greedy_accuracy": 1.0, "eval/human_eval/prompts": 4.0, "eval/human_eval/pass_at_1": 1.0,
        "reward/code_tests/mean": 0.75, "reward/code_tests/error_frac": 0.0, "update/steps": 0.0, "time/train": 0.5}


def test_critic_scalars_are_logged_only_for_a_run_with_a_critic() -> None:
    """Proves: PPO's critic columns (value_loss, vf_clip_frac, vf_explained_var) are averaged over the trained
    steps like the policy's when the run has a critic, and left out when every step's value_loss is 0 (the
    train_metrics value of a run without one)."""
    def data(value_losses: list[float]) -> ReportData:
        return ReportData(run_id="r", root="/x", config=None, ks=[1], train=[
            {"iteration": 0, "step": i, "skipped": False, "loss": 1.0, "lr": 1e-5, "tokens": 10, "seconds": 1.0,
             "value_loss": v, "vf_clip_frac": 0.1 * i, "vf_explained_var": -0.5 + i}
            for i, v in enumerate(value_losses)])

    with_critic = iteration_scalars(data([0.25, 0.75]), 0)
    assert {k: round(v, 9) for k, v in with_critic.items() if k.startswith("update/v")} == {
        "update/value_loss": 0.5, "update/vf_clip_frac": 0.05, "update/vf_explained_var": 0.0}
    without = iteration_scalars(data([0.0, 0.0]), 0)
    assert not [k for k in without if k.startswith("update/v")], without


def test_a_tracker_library_that_is_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    check_trackers(LogConfig())  # none configured: nothing needed
    monkeypatch.setitem(trackers.MODULES, "wandb", "rlpipe_no_such_module")
    with pytest.raises(ConfigError, match=r"log.trackers names wandb, not installed here: pip install"):
        check_trackers(LogConfig(trackers=["wandb"]))


# --- a run logged in two sessions --------------------------------------------------------------------------


def expected_scalars(run_dir: Path, k: int) -> dict[str, float]:
    """A few of step k's numbers, from the run's files on disk (not through the report's catalog)."""
    directory = run_dir / f"iter={k:04d}"
    manifest = json.loads((directory / "eval.parquet.manifest.json").read_text())["metrics"]["synthetic"]
    expected = {
        "train/reward_mean": pc.mean(pq.read_table(directory / "scores.parquet")["reward"]).as_py(),
        "length/mean": pc.mean(pq.read_table(directory / "rollouts.parquet")["num_tokens"]).as_py(),
        "update/loss": pc.mean(pq.read_table(directory / "train_metrics.parquet")["loss"]).as_py(),
        "eval/synthetic/pass_at_1": manifest["pass@1"],
        "eval/synthetic/pass_at_1_ci_low": manifest["pass@1_ci_low"],
        "eval/synthetic/pass_at_4_ci_high": manifest["pass@4_ci_high"],
        "time/generate": json.loads((directory / "rollouts.parquet.manifest.json").read_text())["seconds"],
    }
    if k == 0:
        base = json.loads((run_dir / "base/eval.parquet.manifest.json").read_text())["metrics"]["synthetic"]
        expected["eval_base/synthetic/pass_at_1_ci_high"] = base["pass@1_ci_high"]
    return expected


def log_in_two_sessions(root: Path, tracker: str, extra_log: dict | None = None) -> Run:
    """Write a 3-iteration synthetic run with iteration 2 not yet run, log; write iteration 2, log twice."""
    spec = SyntheticSpec(run_id="tr", iterations=3, test_prompts=5, seed=5,
                         extra_config={"log": {"trackers": [tracker], **(extra_log or {})}})
    synthetic = SyntheticRun(str(root), spec)
    synthetic.write()
    run_dir = root / "runs/tr"
    shutil.rmtree(run_dir / "iter=0002")
    shutil.rmtree(run_dir / "checkpoints/iter=0002")
    warnings: list[str] = []
    assert log_iterations(Run.open(str(root), "tr"), warn=warnings.append) == {tracker: [0, 1]}
    synthetic.write_iteration(2)  # the resumed run finishes its last iteration
    assert log_iterations(Run.open(str(root), "tr"), warn=warnings.append) == {tracker: [2]}
    assert log_iterations(Run.open(str(root), "tr"), warn=warnings.append) == {tracker: []}
    assert warnings == []
    run = Run.open(str(root), "tr")
    assert read_marker(run, tracker).logged == [0, 1, 2]
    return run


def check_history(history: dict[str, list[tuple[int, float]]], run_dir: Path) -> None:
    """Every metric has each step once, in order; the checked ones carry the values on disk."""
    assert len(history) > 40
    for name, points in history.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)) and set(steps) <= {0, 1, 2}, (name, steps)
    for k in range(3):
        for name, value in expected_scalars(run_dir, k).items():
            assert dict(history[name])[k] == pytest.approx(value, rel=1e-6), (name, k)


@needs("tensorboard")
def test_tensorboard_event_files(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_in_two_sessions(tmp_path, "tensorboard")
    log_dir = tmp_path / "runs/tr/trackers/tensorboard"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one event file per logging session
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    history = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    check_history(history, tmp_path / "runs/tr")
    assert [e.step for e in events.Tensors("config")] == [0]  # the config, as text, once
    config_text = events.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert "run_id: tr" in config_text and "trackers:\n  - tensorboard" in config_text


@needs("mlflow")
def test_mlflow_file_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = log_in_two_sessions(tmp_path, "mlflow")
    handle = read_marker(run, "mlflow").handle
    client = MlflowClient(tracking_uri=(tmp_path / "runs/tr/trackers/mlruns").as_uri())
    logged = client.get_run(handle)
    assert logged.info.run_name == "tr" and logged.info.status == "FINISHED"  # all 3 iterations are in
    assert client.get_experiment(logged.info.experiment_id).name == "rlpipe"
    assert logged.data.params["train.lr"] == "1e-05" and logged.data.params["log.trackers"] == '["mlflow"]'
    history = {name: [(m.step, m.value) for m in client.get_metric_history(handle, name)]
               for name in logged.data.metrics}
    check_history(history, tmp_path / "runs/tr")


@needs("mlflow")
def test_mlflow_unreachable_server_is_a_warning_and_the_steps_come_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real fault: the tracking server refuses connections. The run goes on, the steps are logged once the
    config points at a store that works (a resume with --set log.mlflow_tracking_uri=...)."""
    from mlflow.tracking import MlflowClient

    from schemas.config import dump_config, parse_config

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    spec = SyntheticSpec(run_id="down", iterations=2, seed=6,
                         extra_config={"log": {"trackers": ["mlflow"], "mlflow_tracking_uri": "http://127.0.0.1:9"}})
    SyntheticRun(str(tmp_path), spec).write()
    warnings: list[str] = []
    assert log_iterations(Run.open(str(tmp_path), "down"), warn=warnings.append) == {"mlflow": []}
    assert len(warnings) == 1 and warnings[0].startswith("tracker mlflow: ")
    assert warnings[0].endswith("iterations [0, 1] will be logged after the next iteration")
    store = (tmp_path / "store").as_uri()
    run = Run.open(str(tmp_path), "down")
    values = run.config.model_dump(mode="json")
    values["log"]["mlflow_tracking_uri"] = store
    (tmp_path / "runs/down/config.yaml").write_text(dump_config(parse_config(values)))
    assert log_iterations(Run.open(str(tmp_path), "down"), warn=warnings.append) == {"mlflow": [0, 1]}
    handle = read_marker(run, "mlflow").handle
    assert [m.step for m in MlflowClient(tracking_uri=store).get_metric_history(handle, "train/reward_mean")] == [0, 1]


def wandb_records(path: Path):  # noqa: ANN201 - protobuf Records
    """The records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header (":W&B", 0xBEE1, version 0),
    then 32 KiB blocks of records, each `crc32 (4) | length (2) | type (1) | data`, types full 1, first 2,
    middle 3, last 4 (the LevelDB log format); data is a serialized wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        position += 7
        pending += data[position:position + length]
        position += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@needs("wandb")
def test_wandb_offline_run_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = log_in_two_sessions(tmp_path, "wandb")
    handle = read_marker(run, "wandb").handle
    # Two sessions of one W&B run (the same id, resumed), each in its folder `offline-run-<start second>-<id>`;
    # W&B adds `-1` to the second's name when both started in the same second: ordered by (second, suffix).
    logs = sorted((tmp_path / "runs/tr/trackers/wandb").glob(f"offline-run-*-{handle}*/run-{handle}.wandb"),
                  key=lambda path: (path.parent.name.split("-")[2], len(path.parent.name)))
    assert len(logs) == 2
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, object] = {}
    for path in logs:
        for record in wandb_records(path):
            if record.HasField("history"):
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        history.setdefault(name, []).append((record.history.step.num, json.loads(item.value_json)))
            for update in record.config.update if record.HasField("config") else []:
                config[update.key] = json.loads(update.value_json)
    check_history(history, tmp_path / "runs/tr")
    assert config["train"]["lr"] == 1e-05 and config["run_id"] == "tr"
