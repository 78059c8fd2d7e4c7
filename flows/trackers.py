"""Experiment trackers: TensorBoard, MLflow and W&B receive a run's per-iteration metrics and its config.

`log.trackers: [tensorboard, mlflow, wandb]` turns them on; the flow calls `log_iterations(run)` after each
iteration (plain functions, no Prefect). The numbers are the report's (`reports.html.collect`, from the storage
root only, wherever the stages ran): training reward and solve rate (per verl `data_source` too with two or more),
held-out pass@k per dataset (and per data_source where a test file mixes them, verl's `val-core/<data_source>/`) with
its 95% interval, each reward function's mean and failed share (`reward/<function>/mean`, `.../error_frac`), lengths,
the optimizer steps' losses, KL, clip fractions, entropy and IS statistics (averaged over the iteration),
seconds per stage. The config goes in as MLflow params, W&B config, TensorBoard hparams + text.

The step is the iteration, logged once: `runs/<run>/trackers/<tracker>.json` lists the steps a tracker has (and
its own run id, so a resumed run continues the same MLflow or W&B run). Only finished iterations missing from
it are logged, in order, the file rewritten after each; the run lease (storage/lock.py) makes the driving flow
its only writer. A failing tracker (not installed, server down) is a warning and is tried again after the next
iteration; it never fails the run. The libraries are optional extras (`pip install 'rlpipe[trackers]'`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from schemas.config import ConfigError, LogConfig, RunConfig, dump_config
from stages.registry import instance, iteration_stages, outputs_of
from storage.fs import atomic_write_bytes, is_remote, join
from storage.layout import BASE
from storage.manifest import read_manifest
from storage.run import Run

if TYPE_CHECKING:  # the report's collector (DuckDB) is imported only when a tracker is configured
    from reports.html import ReportData

log = logging.getLogger(__name__)

# The Python module each tracker needs (the `trackers` extra installs them).
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
# Per-step train_metrics columns averaged over an iteration's optimizer steps; min/max keep their extreme.
STEP_MEANS = ("loss", "policy_loss", "approx_kl", "kl_ref", "entropy", "clip_frac_low", "clip_frac_high",
              "clip_frac_dual", "is_ratio_mean", "is_ess", "rejected_frac", "grad_norm", "padding_frac",
              "staleness_mean")
# The critic's columns (PPO with GAE): 0 in every step of a run without a critic, which logs none of them.
CRITIC_MEANS = ("value_loss", "vf_clip_frac", "vf_explained_var")


def check_trackers(config: LogConfig) -> None:
    """A ConfigError naming each configured tracker whose library is not installed (checked before a run starts)."""
    missing = [name for name in config.trackers if importlib.util.find_spec(MODULES[name]) is None]
    if missing:
        raise ConfigError(f"log.trackers names {', '.join(missing)}, not installed here: "
                          "pip install 'rlpipe[trackers]' (or remove them from log.trackers)")


# --- what is logged ------------------------------------------------------------------------------------------


def _key(text: str) -> str:
    """A metric-name part every tracker accepts (MLflow allows letters, digits, `_-. /` only): pass@1 -> pass_at_1."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", text.replace("@", "_at_"))


def _finite(value: Any) -> bool:  # noqa: ANN401 - any cell
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _evaluation_scalars(prefix: str, rows: list[dict[str, Any]], ks: list[int]) -> dict[str, float]:
    scalars: dict[str, float] = {}
    for row in rows:
        base = f"{prefix}/{_key(row.get('data_source', row['dataset']))}"  # verl's val-core/<data_source>/...
        scalars[f"{base}/greedy_accuracy"] = row.get("greedy")
        scalars[f"{base}/prompts"] = row.get("prompts")
        for k in ks:
            scalars[f"{base}/pass_at_{k}"] = row.get(f"pass@{k}")
            if (interval := row.get(f"pass@{k}_ci")) is not None:
                scalars[f"{base}/pass_at_{k}_ci_low"], scalars[f"{base}/pass_at_{k}_ci_high"] = interval
    return scalars


def iteration_scalars(data: ReportData, iteration: int) -> dict[str, float]:
    """Every number logged at step `iteration`, by name (`train/...`, `train/<data_source>/...` with two or more
    training sources, `reward/<function>/...`, `eval/<dataset>/...` and `eval/<data_source>/...` where a test file
    mixes sources, `length/...`, `update/...`, `time/<stage>`); iteration 0 also carries the base model's
    evaluation (`eval_base/...`) and the run-level stages' seconds. Missing or non-finite values are left out."""
    scalars: dict[str, Any] = {}
    for row in data.reward:
        if row["iteration"] == iteration:
            scalars |= {"train/reward_mean": row["mean_reward"], "train/solve_rate": row["solve_rate"],
                        "train/samples": row["rows"]}
    for row in data.reward_by_source:
        if row["iteration"] == iteration:
            name = _key(row["data_source"])
            scalars |= {f"train/{name}/reward_mean": row["mean_reward"], f"train/{name}/solve_rate": row["solve_rate"]}
    for row in data.reward_functions:
        if row["iteration"] == iteration:
            name = _key(row["function"])
            scalars |= {f"reward/{name}/mean": row["mean"], f"reward/{name}/error_frac": row["error_frac"]}
    for row in data.lengths:
        if row["iteration"] == iteration:
            scalars |= {"length/mean": row["mean"], "length/p50": row["p50"], "length/p90": row["p90"],
                        "length/truncated_frac": row["truncated"]}
    scalars |= _evaluation_scalars("eval", [r for r in data.evaluation if r["iteration"] == iteration], data.ks)
    steps = [r for r in data.train if r["iteration"] == iteration]
    trained = [r for r in steps if not r.get("skipped")]
    if steps:
        scalars["update/steps"] = len(trained)
    has_critic = any(r.get("value_loss") for r in trained)
    for name in STEP_MEANS + (CRITIC_MEANS if has_critic else ()):
        values = [r[name] for r in trained if _finite(r.get(name))]
        if values:
            scalars[f"update/{name}"] = sum(values) / len(values)
    for name, pick in (("is_ratio_min", min), ("is_ratio_max", max), ("staleness_max", max)):
        values = [r[name] for r in trained if _finite(r.get(name))]
        if values:
            scalars[f"update/{name}"] = pick(values)
    if trained:
        scalars["update/lr"] = trained[-1]["lr"]
        seconds = sum(r["seconds"] for r in trained)
        scalars["update/tokens_per_second"] = sum(r["tokens"] for r in trained) / seconds if seconds > 0 else None
    for stage, seconds in data.stage_seconds.get(str(iteration), {}).items():
        scalars[f"time/{stage}"] = seconds
    if iteration == 0:
        scalars |= _evaluation_scalars("eval_base", [r for r in data.evaluation if r["iteration"] == BASE], data.ks)
        for stage, seconds in data.stage_seconds.get("run", {}).items():
            scalars[f"time/{stage}"] = seconds
    return {name: float(value) for name, value in sorted(scalars.items()) if _finite(value)}


def config_params(config: RunConfig) -> dict[str, str]:
    """The run config flattened to `section.field` -> its value as text (lists as JSON)."""
    params: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:  # noqa: ANN401 - any config value
        if isinstance(value, dict):
            for name, inner in value.items():
                walk(f"{prefix}.{name}" if prefix else name, inner)
        else:
            params[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", config.model_dump(mode="json"))
    return params


# --- the trackers --------------------------------------------------------------------------------------------


class Tracker(Protocol):
    def open(self, run: Run, handle: str | None, params: dict[str, str], config_changed: bool) -> str:
        """Start (handle None) or continue the tracker's run; log `params` when new or changed; return its id."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, finished: bool) -> None: ...


class TensorBoardTracker:
    """Event files in `<dir>/tensorboard`, written with tensorboard's own event writer (no TensorFlow, no torch)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "tensorboard"
        self.next_step = 0

    def open(self, run: Run, handle: str | None, params: dict[str, str], config_changed: bool) -> str:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(self.directory))
        self.config_text = dump_config(run.config) if handle is None or config_changed else None
        self.params = params
        self.run_id = run.run_id
        return "tensorboard"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import summary_v2 as hparams
        from tensorboard.plugins.text.summary_v2 import text_pb

        now = time.time()
        if self.config_text is not None:  # the config, with the first step logged after it was set or changed
            self.writer.add_event(Event(wall_time=now, step=step, summary=text_pb("config", self.config_text)))
            session = hparams.hparams_pb(self.params, trial_id=self.run_id)
            self.writer.add_event(Event(wall_time=now, step=step, summary=session))
            self.config_text = None
        values = [Summary.Value(tag=name, simple_value=value) for name, value in scalars.items()]
        self.writer.add_event(Event(wall_time=now, step=step, summary=Summary(value=values)))
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per rlpipe run, in experiment `log.project`, through MlflowClient (no global active run)."""

    PARAM_VALUE_LIMIT = 6000  # MLflow's bound on a param value

    def __init__(self, directory: Path, config: LogConfig) -> None:
        self.uri = config.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self.uri is None:
            # MLflow 3 keeps its file store only behind this opt-in ("maintenance mode"); a local folder of
            # plain files beside the run is what an offline job wants, and `mlflow ui` reads it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.uri = (directory / "mlruns").resolve().as_uri()
        self.experiment = config.project

    def open(self, run: Run, handle: str | None, params: dict[str, str], config_changed: bool) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if handle is None:
            experiment = self.client.get_experiment_by_name(self.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
            handle = self.client.create_run(experiment_id, run_name=run.run_id, tags={
                "rlpipe.run_id": run.run_id, "rlpipe.root": run.root}).info.run_id
        self.handle = handle
        # Params are immutable in MLflow: new keys are logged as params; a changed value (a resume with --set)
        # goes in as a tag `config.<key>`.
        logged = self.client.get_run(handle).data.params
        new = [Param(k, v[: self.PARAM_VALUE_LIMIT]) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"config.{k}", v[: self.PARAM_VALUE_LIMIT]) for k, v in params.items()
                   if k in logged and logged[k] != v[: self.PARAM_VALUE_LIMIT]]
        for start in range(0, max(len(new), len(changed)), 100):  # at most 100 params per batch
            self.client.log_batch(handle, params=new[start:start + 100], tags=changed[start:start + 100])
        return handle

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        metrics = [Metric(name, value, timestamp, step) for name, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # at most 1000 metrics per batch
            self.client.log_batch(self.handle, metrics=metrics[start:start + 1000])

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.handle, "FINISHED")


class WandbTracker:
    """One W&B run per rlpipe run (id kept in the marker, resumed with resume="allow"); files under `<dir>`.
    WANDB_MODE=offline keeps everything local (`wandb sync <dir>/wandb/offline-run-*` uploads it later)."""

    def __init__(self, directory: Path, config: LogConfig) -> None:
        self.directory = directory
        self.project = config.project

    def open(self, run: Run, handle: str | None, params: dict[str, str], config_changed: bool) -> str:
        import wandb

        handle = handle or uuid.uuid4().hex[:12]  # W&B run ids: unique per project, letters and digits
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, name=run.run_id, id=handle, resume="allow",
                              dir=str(self.directory), reinit="create_new")
        self.run.config.update(run.config.model_dump(mode="json"), allow_val_change=True)
        return handle

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish()


def make_tracker(name: str, directory: Path, config: LogConfig) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(directory)
    if name == "mlflow":
        return MlflowTracker(directory, config)
    return WandbTracker(directory, config)


# --- logging each iteration once -----------------------------------------------------------------------------


@dataclass
class Marker:
    """What a tracker has received: the steps (iterations) logged, its own run id, the config logged."""

    logged: list[int] = field(default_factory=list)
    handle: str | None = None
    config_digest: str | None = None


def marker_path(run: Run, tracker: str) -> str:
    return join(run.layout.run_dir, "trackers", f"{tracker}.json")


def read_marker(run: Run, tracker: str) -> Marker:
    path = marker_path(run, tracker)
    if not run.fs.exists(path):
        return Marker()
    return Marker(**json.loads(run.fs.cat_file(path)))


def write_marker(run: Run, tracker: str, marker: Marker) -> None:
    atomic_write_bytes(run.fs, marker_path(run, tracker), json.dumps(marker.__dict__).encode())


def tracker_dir(run: Run) -> Path:
    """Where the trackers' local files go: log.dir, else `<run dir>/trackers` (a local root), else a folder
    per run under ~/.cache/rlpipe/trackers (an s3:// root: the libraries write local files)."""
    if run.config.log.dir:
        return Path(run.config.log.dir).expanduser()
    if is_remote(run.root):
        return Path("~/.cache/rlpipe/trackers").expanduser() / run.run_id
    return Path(run.layout.run_dir) / "trackers"


def finished_iterations(run: Run, skip: set[int]) -> list[int]:
    """The iterations, in order, whose every scheduled stage has written its outputs (their manifests are
    there), up to the first that has not, leaving out `skip` (already logged). The flow calls this right after
    an iteration's stages ran, so their manifests are current; a later config change does not re-log a step."""
    finished = []
    for k in range(run.config.iterations):
        if k in skip:
            continue
        outputs = [output for stage in iteration_stages(run.config, k) for output in outputs_of(instance(stage, k))]
        if any(read_manifest(run.fs, output.manifest_path(run.layout)) is None for output in outputs):
            break
        finished.append(k)
    return finished


def log_iterations(run: Run, warn: Callable[[str], None] = log.warning) -> dict[str, list[int]]:
    """Log every finished iteration each configured tracker has not received yet; returns tracker -> the
    iterations logged now. A failure (a tracker's, or reading the run's numbers) is passed to `warn` and leaves
    the missing steps for next time."""
    config = run.config
    if not config.log.trackers:
        return {}
    params = config_params(config)
    digest = config.digest()
    pending = {name: read_marker(run, name) for name in config.log.trackers}
    todo = {name: finished_iterations(run, set(marker.logged)) for name, marker in pending.items()}
    if not any(todo.values()):
        return {name: [] for name in pending}
    from reports.html import collect
    from storage.catalog import Catalog

    try:
        with Catalog(run.root, [run.run_id]) as catalog:
            data = collect(catalog, run.run_id, config)
    except Exception as error:  # noqa: BLE001 - as below: the trackers are a view of the run
        warn(f"trackers: the run's metrics could not be read ({type(error).__name__}: {error}); "
             f"iterations {sorted(set().union(*todo.values()))} will be logged after the next iteration")
        return {name: [] for name in pending}
    done: dict[str, list[int]] = {}
    for name, marker in pending.items():
        done[name] = []
        if not todo[name]:
            continue
        tracker = make_tracker(name, tracker_dir(run), config.log)
        try:
            marker.handle = tracker.open(run, marker.handle, params, marker.config_digest not in (None, digest))
            marker.config_digest = digest
            try:
                for k in todo[name]:
                    tracker.log(k, iteration_scalars(data, k))
                    marker.logged.append(k)
                    done[name].append(k)
                    write_marker(run, name, marker)
            finally:
                tracker.close(finished=len(marker.logged) == config.iterations)
        except Exception as error:  # noqa: BLE001 - a tracker is a view of the run; its failure must not fail it
            write_marker(run, name, marker)
            kind = "not installed (pip install 'rlpipe[trackers]')" if isinstance(error, ImportError) else (
                f"{type(error).__name__}: {error}")
            missing = [k for k in todo[name] if k not in marker.logged]
            warn(f"tracker {name}: {kind}; iterations {missing} will be logged after the next iteration")
    return done
