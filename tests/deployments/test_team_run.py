"""A team's setup on one machine, real parts only: S3 (moto's server), `rlpipe server` (a Prefect server on
127.0.0.1, pools `gpu` and `cpu`, one process worker each, and a second one per pool that the test starts),
`rlpipe deploy`, and the real tiny pipeline.

Two triggers of the scheduled deployment are fired at the same instant: one advances the run by iteration 0
with every stage dispatched to a worker of its pool, the other finds the run lease held and ends `Skipped`.
The flow-run records must show each stage once, on its intended pool; the bucket must hold every table with
its manifest; the iteration must have published its metrics artifact. A third trigger resumes: nothing of
iteration 0 runs again and iteration 1 is done. Then a run with `pipeline.max_staleness: 1` goes through the
`loop` deployment: its two lanes dispatch stages to both pools at once. Everything is torn down even when an
assertion fails.

The second workers are started as a second machine would start them. A run with
`pipeline.shards: {generate: 2}` has its two shards taken by the two gpu workers and run at once; the test's
gpu worker, SIGKILLed with its flow run mid-shard, costs only that shard: the rerun dispatches it alone, and the
merged table equals the unsharded one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from flows.deploy import REPO_ROOT, GroupReaper, deployment_pools, load_spec, start_worker, stop_processes
from schemas import settings
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, instance, stage_state
from storage.layout import BASE, RunLayout
from storage.run import Run, read_run_config
from tests.reliability.helpers import table_rows
from tests.support.ports import free_port
from tests.support.processes import kill_marked, spawn_tied
from tests.support.scratch import scratch_dir

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("tiny.yaml")
BUCKET = "rlpipe-team"
RUN_ID = "tiny"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
MARKER_VARIABLE = "RLPIPE_TEST_CLUSTER"


@dataclass
class Cluster:
    api: str
    root: str
    env: dict[str, str]
    logs: Path
    second_workers: dict[str, subprocess.Popen]  # pool -> the worker the test started beside `rlpipe server`'s


def start_moto(log_dir: Path) -> tuple[subprocess.Popen, str]:
    import botocore.session

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with open(log_dir / "moto.log", "ab") as log:
        process = spawn_tied(command, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(240):
        try:
            httpx.get(endpoint, timeout=2)
            break
        except httpx.HTTPError:
            assert process.poll() is None, (log_dir / "moto.log").read_text()
            time.sleep(0.5)
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    return process, endpoint


def wait_for(condition: Any, timeout_s: float, what: str, interval_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def rest(method: str, url: str, body: dict | None = None, attempts: int = 10) -> Any:
    """One REST call, retried on 5xx and connection errors: under load the server's SQLite database is
    sometimes locked and it answers 503 (Prefect's own client retries those the same way)."""
    for attempt in range(attempts):
        try:
            response = httpx.request(method, url, json=body, timeout=60)
            if response.status_code < 500:
                response.raise_for_status()
                return response.json()
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        time.sleep(min(2**attempt, 15))
    response.raise_for_status()
    return None


def api_post(api_url: str, path: str, body: dict | None = None) -> Any:
    return rest("POST", f"{api_url}{path}", body or {})


def online_workers(api_url: str, pool: str) -> list[dict]:
    try:
        workers = api_post(api_url, f"/work_pools/{pool}/workers/filter")
    except httpx.HTTPError:
        return []  # not up yet, or the pool not created yet
    return [w for w in workers if w.get("status") == "ONLINE"]


def rlpipe(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    marker = uuid.uuid4().hex
    processes: list[subprocess.Popen] = []
    with scratch_dir(tmp_path_factory, "cluster") as logs, contextlib.ExitStack() as stop:
        # `rlpipe server` stops its server and workers on SIGTERM; after 3 s (Ctrl-C stops the suite within 10 s)
        # it is killed, its reaper ends their groups, and anything left is killed outright. A pytest that is
        # killed runs none of this: the two die with it (spawn_tied), and `rlpipe server`'s children with it (as the
        # second workers below do, with their flow runs).
        stop.callback(kill_marked, MARKER_VARIABLE, marker)
        stop.callback(lambda: stop_processes(reversed(processes), grace_s=3))
        moto, endpoint = start_moto(logs)
        processes.append(moto)
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        (logs / "cache").mkdir()
        env = {
            **os.environ, MARKER_VARIABLE: marker, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "RLPIPE_S3_ENDPOINT_URL": endpoint, "RLPIPE_CACHE": str(logs / "cache"),
            "PREFECT_API_URL": api, "PREFECT_HOME": str(logs / "client-home"),
            "PREFECT_SERVER_EPHEMERAL_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_LOGGING_LEVEL": "INFO", "RLPIPE_DISPATCH_POLL_S": "1", "DO_NOT_TRACK": "1", "COLUMNS": "200",
        }
        env.pop("RLPIPE_DISPATCH", None)
        with open(logs / "rlpipe-server.log", "ab") as log:
            server = spawn_tied(
                [sys.executable, "-m", "flows.cli", "server", "--port", str(port), "--home", str(logs / "server-home"),
                 "--no-ui", "--timeout", "400"],
                env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        processes.append(server)

        def ready() -> bool:
            assert server.poll() is None, (logs / "rlpipe-server.log").read_text()[-5000:]
            return bool(online_workers(api, "gpu") and online_workers(api, "cpu"))

        wait_for(ready, 480, "the Prefect server and one online worker per pool", interval_s=2)
        # A second worker per pool, as a second machine would start it (docs/team.md step 3): one flow run at a
        # time on gpu, so that two gpu flow runs at once are on two workers. Its flow runs are in its process
        # group, which a reaper ends once pytest is gone however it ended, as `rlpipe server`'s reaper does its own.
        reaper = GroupReaper(grace_s=3)
        stop.callback(reaper.close)
        worker_env = {**env, settings.HOME.name: str(REPO_ROOT)}
        second_workers = {pool: reaper.watch(start_worker(pool, worker_env, log_path=logs / f"worker-{pool}-second.log",
                                                          limit=1 if pool == "gpu" else None, name=f"{pool}-second"))
                          for pool in ("gpu", "cpu")}
        processes.extend(second_workers.values())
        wait_for(lambda: all(len(online_workers(api, pool)) == 2 for pool in ("gpu", "cpu")), 300,
                 "two online workers per pool", interval_s=2)
        root = f"s3://{BUCKET}/team"
        deployed = rlpipe(env, "deploy", "--api-url", api, "--run-id", RUN_ID, "--root", root, "--config", str(CONFIG))
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        with pytest.MonkeyPatch.context() as patch:
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "RLPIPE_S3_ENDPOINT_URL"):
                patch.setenv(name, env[name])
            yield Cluster(api=api, root=root, env=env, logs=logs, second_workers=second_workers)


def trigger(api_url: str, deployment: str, parameters: dict[str, Any] | None = None) -> str:
    deployment_id = rest("GET", f"{api_url}/deployments/name/{deployment}")["id"]
    body = {"parameters": parameters} if parameters else {}
    return api_post(api_url, f"/deployments/{deployment_id}/create_flow_run", body)["id"]


def flow_run(api_url: str, run_id: str) -> dict:
    return rest("GET", f"{api_url}/flow_runs/{run_id}")


def run_logs(api_url: str, run_id: str) -> str:
    logs = api_post(api_url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
    return "\n".join(entry["message"] for entry in logs)[-4000:]


def wait_finished(cluster: Cluster, run_ids: list[str], timeout_s: float) -> list[dict]:
    def finished() -> list[dict] | None:
        runs = [flow_run(cluster.api, run_id) for run_id in run_ids]
        return runs if all(run["state"]["type"] in TERMINAL for run in runs) else None

    try:
        return wait_for(finished, timeout_s, f"flow runs {run_ids}", interval_s=3)
    except AssertionError:
        worker_logs = "".join(p.read_text()[-3000:] for p in cluster.logs.glob("**/worker-*.log"))
        raise AssertionError(f"flow runs did not finish; worker logs:\n{worker_logs}") from None


def stage_runs(api_url: str, run_id: str = RUN_ID) -> list[dict]:
    runs = api_post(api_url, "/flow_runs/filter", {"flows": {"name": {"any_": ["stage"]}}, "limit": 200})
    return [run for run in runs if run["parameters"]["run"]["run_id"] == run_id]


def describe_failures(api_url: str, runs: list[dict]) -> str:
    return "\n\n".join(f"{run['name']}: {run['state']['name']}\n{run_logs(api_url, run['id'])}"
                       for run in runs if run["state"]["type"] != "COMPLETED")


def output_manifests(layout: RunLayout, stages: list[str], iteration: int) -> dict[str, dict]:
    fs = layout.fs
    fs.invalidate_cache()
    found = {}
    for stage in stages:
        for output in STAGES[stage].outputs(iteration):
            found[output.manifest_path(layout)] = json.loads(fs.cat_file(output.manifest_path(layout)))
    return found


# Minutes on an idle 2-core CPU; on a box shared with other jobs (load 10) the whole test took about 35.
WAIT_S = 2400


@pytest.mark.timeout(2 * WAIT_S + 900)
def test_two_pools_s3_root_overlapping_triggers_then_resume(cluster: Cluster) -> None:
    api = cluster.api
    started = time.monotonic()
    expected_pool = deployment_pools(load_spec())
    layout = RunLayout.create(cluster.root, RUN_ID)

    # Two triggers at once: one advances the run, the other finds it driven and is skipped.
    first = [trigger(api, "iteration/advance") for _ in range(2)]
    runs = wait_finished(cluster, first, timeout_s=WAIT_S)
    print(f"run-level stages + iteration 0: {time.monotonic() - started:.0f}s")
    assert sorted(run["state"]["name"] for run in runs) == ["Completed", "Skipped"], describe_failures(api, runs)
    skipped = next(run for run in runs if run["state"]["name"] == "Skipped")
    assert f"run {RUN_ID} is being driven by" in skipped["state"]["message"]

    # Every stage ran once, as a flow run on a worker of its own pool, and finished.
    stages = stage_runs(api)
    assert not describe_failures(api, stages), describe_failures(api, stages)
    ran = sorted((run["parameters"]["stage"], run["parameters"]["iteration"]) for run in stages)
    assert ran == sorted([(s, BASE) for s in RUN_STAGES] + [(s, 0) for s in ITERATION_STAGES])
    for run in stages:
        assert run["work_pool_name"] == expected_pool[run["parameters"]["stage"]], run["name"]
    assert {run["work_pool_name"] for run in stages} == {"gpu", "cpu"}

    # Every table is in the bucket with its manifest, and the run is done up to iteration 0.
    config = read_run_config(layout)
    fs = layout.fs
    fs.invalidate_cache()
    for k, names in ((BASE, RUN_STAGES), (0, ITERATION_STAGES)):
        for stage in names:
            assert stage_state(Run(layout, config), instance(stage, k)).done, (stage, k)
    for table in ("rollouts", "scores", "batch", "train_metrics", "eval"):
        path = layout.table_path(table, 0)
        assert fs.exists(path) and fs.exists(path + ".manifest.json"), path
    assert fs.exists(layout.table_path("prompts", BASE) + ".manifest.json")
    checkpoint = json.loads(fs.cat_file(f"{layout.checkpoint_dir(0)}/manifest.json"))
    assert checkpoint["path"].startswith("s3://") and "model.safetensors" in checkpoint["files"]
    assert not stage_state(Run(layout, config), instance("generate", 1)).done

    # The iteration published its metrics to the Prefect UI.
    artifacts = api_post(api, "/artifacts/filter", {"artifacts": {"key": {"any_": [f"rlpipe-{RUN_ID}-metrics"]}}})
    assert len(artifacts) == 1 and artifacts[0]["type"] == "table"
    rows = json.loads(artifacts[0]["data"]) if isinstance(artifacts[0]["data"], str) else artifacts[0]["data"]
    assert {"stage": "evaluate", "metric": "status", "value": "done"} in rows
    [report] = api_post(api, "/artifacts/filter", {"artifacts": {"key": {"any_": [f"rlpipe-{RUN_ID}-report"]}}})
    # Prefect stores a link artifact as markdown: "[text](link)".
    assert report["type"] == "markdown" and f"({cluster.root}/runs/{RUN_ID}/report.html)" in report["data"]

    # A later trigger resumes: iteration 0 is not touched, iteration 1 is done.
    before = output_manifests(layout, RUN_STAGES, BASE) | output_manifests(layout, ITERATION_STAGES, 0)
    resumed = time.monotonic()
    [third] = wait_finished(cluster, [trigger(api, "iteration/advance")], timeout_s=WAIT_S)
    print(f"iteration 1: {time.monotonic() - resumed:.0f}s")
    assert third["state"]["name"] == "Completed", describe_failures(api, [third, *stage_runs(api)])
    after = output_manifests(layout, RUN_STAGES, BASE) | output_manifests(layout, ITERATION_STAGES, 0)
    assert {path: m["ended_at"] for path, m in after.items()} == {path: m["ended_at"] for path, m in before.items()}
    later = [run for run in stage_runs(api) if run["id"] not in {r["id"] for r in stages}]
    assert sorted(run["parameters"]["stage"] for run in later) == sorted(ITERATION_STAGES)
    assert {run["parameters"]["iteration"] for run in later} == {1}
    assert not describe_failures(api, later), describe_failures(api, later)
    fs.invalidate_cache()
    for stage in ITERATION_STAGES:
        assert stage_state(Run(layout, config), instance(stage, 1)).done, stage


@pytest.mark.timeout(WAIT_S + 300)
def test_an_overlapped_run_dispatches_to_both_pools_at_once(cluster: Cluster) -> None:
    """Two iterations with max_staleness 1 through the `loop` deployment: generate 1 is sampled by the base model
    (not checkpoint 0), and stages of the two lanes ran as flow runs on different pools at the same time (in
    strict order no two stage runs of a run overlap)."""
    from schemas.config import load_config

    api, run_id = cluster.api, "overlapped"
    config = load_config(CONFIG, [f"run_id={run_id}", "pipeline.max_staleness=1", "train.is_level=token"])
    layout = Run.start(config, cluster.root).layout
    [loop] = wait_finished(cluster, [trigger(api, "loop/loop", {"run": {"root": cluster.root, "run_id": run_id}})],
                           timeout_s=WAIT_S)
    stages = stage_runs(api, run_id)
    assert loop["state"]["name"] == "Completed", describe_failures(api, [loop, *stages])
    ran = sorted((run["parameters"]["stage"], run["parameters"]["iteration"]) for run in stages)
    assert ran == sorted([(s, BASE) for s in RUN_STAGES] + [(s, k) for k in (0, 1) for s in ITERATION_STAGES])
    expected_pool = deployment_pools(load_spec())
    assert all(run["work_pool_name"] == expected_pool[run["parameters"]["stage"]] for run in stages)

    together = [(a["name"], b["name"]) for a in stages for b in stages
                if a["work_pool_name"] == "gpu" and b["work_pool_name"] == "cpu"
                and window(a)[0] < window(b)[1] and window(b)[0] < window(a)[1]]
    assert together, sorted((window(run), run["name"]) for run in stages)

    layout.fs.invalidate_cache()
    policy_steps = {k: {row["policy_step"] for row in table_rows(layout, "rollouts", k)} for k in (0, 1)}
    assert policy_steps == {0: {0}, 1: {0}}  # both sampled by the base model; strict order would give {1} for 1
    assert {row["staleness_max"] for row in table_rows(layout, "train_metrics", 1)} == {1}


# The dispatching part of the `iteration` flow (`dispatch_stage`, as its stage task calls it) for one stage, under
# the run lease as a flow holds it; exit 1 naming the failure when the stage fails.
DISPATCHER = """
import sys
from flows.pipeline import dispatch_stage
from flows.runner.process import StageFailed
from stages.registry import instance
from storage.layout import RunLayout
from storage.lock import run_lock
from storage.run import Run
layout = RunLayout.create(sys.argv[1], sys.argv[2])
with run_lock(layout):
    try:
        dispatch_stage(Run.at(layout), instance(sys.argv[3], int(sys.argv[4])))
    except StageFailed as error:
        sys.exit(f"dispatch failed: {error}")
"""


def dispatch(cluster: Cluster, run_id: str, stage: str, iteration: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as output:
        return spawn_tied([sys.executable, "-c", DISPATCHER, cluster.root, run_id, stage, str(iteration)],
                          env=cluster.env, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT)


def worker_name(flow_run: dict) -> str:
    """The `--name` of the worker that started the flow run's process (its `infrastructure_pid`, "[host:]pid")."""
    import psutil

    process: psutil.Process | None = psutil.Process(int(str(flow_run["infrastructure_pid"]).rsplit(":", 1)[-1]))
    while process is not None:
        command = process.cmdline()
        if "worker" in command and "--name" in command:
            return command[command.index("--name") + 1]
        process = process.parent()
    raise AssertionError(f"flow run {flow_run['name']} was started by no worker")


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a worker and every process under it (its flow runs' processes and their stages), as a machine
    that dies takes them all at once."""
    import psutil

    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    process.wait()


def window(run: dict) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(run["start_time"]), datetime.fromisoformat(run["end_time"])


@pytest.mark.timeout(WAIT_S)
def test_shards_run_on_two_workers_at_once_and_a_killed_worker_costs_only_its_shard(cluster: Cluster) -> None:
    """pipeline.shards {generate: 2} through the deployments: the dispatcher (the `iteration` flow's
    `dispatch_stage`, in a process of the test's, so the iteration's other stages do not run) makes one flow run
    per shard; the two gpu workers (one flow run at a time each) take one each, and both shards run at once. The
    test's own gpu worker is then SIGKILLed with its flow run's process mid-shard: the dispatcher sees that
    shard's lease abandoned, sets its flow run Crashed and fails once the other shard has finished. A rerun
    dispatches the killed shard alone, then the merge: the finished shard's part is not redone, and the merged
    rollouts equal the unsharded generate's of the same run."""
    from schemas.config import load_config
    from stages.registry import outputs_of
    from storage.layout import Shard
    from storage.lock import lease_state, stage_lock_path
    from storage.manifest import read_manifest
    from tests.reliability.test_shards import rows_without_timing

    api, run_id = cluster.api, "sharded"
    # Half tiny's samples, each half as long, no trainer-side logprob check: a shard still runs for its model's
    # load (hf shards: one request at a time, generate.batch_size 1).
    overrides = [f"run_id={run_id}", "iterations=1", "generate.batch_size=1", "generate.n_samples=2",
                 "generate.max_new_tokens=4", "generate.mismatch_samples=0"]
    layout = Run.start(load_config(CONFIG, overrides), cluster.root).layout
    ref = {"root": cluster.root, "run_id": run_id}

    # The reference: generate of iteration 0 unsharded (one flow run), after the run-level stages it reads.
    setup = [trigger(api, f"stage/{stage}", {"run": ref}) for stage in ("prompts", "base_model")]
    setup = wait_finished(cluster, setup, timeout_s=WAIT_S)
    assert all(run["state"]["name"] == "Completed" for run in setup), describe_failures(api, setup)
    [unsharded] = wait_finished(cluster, [trigger(api, "stage/generate", {"run": ref, "iteration": 0})], WAIT_S)
    assert unsharded["state"]["name"] == "Completed", describe_failures(api, [unsharded])
    reference = rows_without_timing(layout, "rollouts")
    assert len(reference) == 4  # 2 prompts x 2 samples
    for output in outputs_of(instance("generate", 0)):  # forgotten: generate 0 is to do again, sharded
        layout.fs.rm(output.manifest_path(layout))
    Run.start(load_config(CONFIG, [*overrides, "pipeline.shards={generate: 2}"]), cluster.root, replace_config=True)

    whole = instance("generate", 0)
    shards = [whole.part(k, 2) for k in range(2)]
    started = time.monotonic()
    first = dispatch(cluster, run_id, "generate", 0, cluster.logs / "dispatch-1.log")

    def both_mid_shard() -> dict[str, dict] | None:
        runs = {run["parameters"]["shard"]: run for run in stage_runs(api, run_id) if run["parameters"].get("shard")}
        assert first.poll() is None, (cluster.logs / "dispatch-1.log").read_text()[-3000:]
        assert not [run["name"] for run in runs.values() if run["state"]["type"] in TERMINAL], "a shard ended first"
        running = len(runs) == 2 and all(run["state"]["type"] == "RUNNING" for run in runs.values())
        held = running and all(lease_state(stage_lock_path(layout, shard)) == "held" for shard in shards)
        return runs if held else None

    runs = wait_for(both_mid_shard, WAIT_S, "both shards running, each holding its lease", interval_s=2)
    workers = {shard: worker_name(run) for shard, run in runs.items()}
    assert sorted(workers.values()) == sorted(online["name"] for online in online_workers(api, "gpu")), workers
    [killed] = [shard for shard, name in workers.items() if name == "gpu-second"]
    [kept] = [shard for shard in workers if shard != killed]
    kill_tree(cluster.second_workers["gpu"])

    assert first.wait(timeout=WAIT_S) == 1, (cluster.logs / "dispatch-1.log").read_text()[-3000:]
    print(f"sharded generate to the kill's failure: {time.monotonic() - started:.0f}s")
    runs = {run["parameters"]["shard"]: run for run in stage_runs(api, run_id) if run["parameters"].get("shard")}
    assert runs[killed]["state"]["type"] == "CRASHED" and "died holding the lease" in runs[killed]["state"]["message"]
    assert runs[kept]["state"]["name"] == "Completed", describe_failures(api, [runs[kept]])
    (a_start, a_end), (b_start, b_end) = window(runs[killed]), window(runs[kept])
    assert a_start < b_end and b_start < a_end  # the two flow runs' times overlap
    run = Run(layout, read_run_config(layout))
    layout.fs.invalidate_cache()
    kept_shard, killed_shard = Shard.parse(kept), Shard.parse(killed)
    assert stage_state(run, whole.part(kept_shard.index, 2)).done
    assert not stage_state(run, whole.part(killed_shard.index, 2)).done and not stage_state(run, whole).done
    [kept_part] = outputs_of(whole.part(kept_shard.index, 2))
    kept_manifest = read_manifest(layout.fs, kept_part.manifest_path(layout))
    assert kept_manifest is not None

    # The rerun: the killed shard alone, on the gpu worker left, then the merge.
    before = {run["id"] for run in stage_runs(api, run_id)}
    second = dispatch(cluster, run_id, "generate", 0, cluster.logs / "dispatch-2.log")
    assert second.wait(timeout=WAIT_S) == 0, (cluster.logs / "dispatch-2.log").read_text()[-3000:]
    print(f"sharded generate with the rerun: {time.monotonic() - started:.0f}s")
    rerun = [run for run in stage_runs(api, run_id) if run["id"] not in before]
    assert sorted((run["parameters"].get("shard", ""), run["parameters"].get("merge", False)) for run in rerun) == [
        ("", True), (killed, False)]
    assert all(run["state"]["name"] == "Completed" for run in rerun), describe_failures(api, rerun)
    layout.fs.invalidate_cache()
    assert stage_state(Run(layout, read_run_config(layout)), whole).done
    merged = read_manifest(layout.fs, outputs_of(whole)[0].manifest_path(layout))
    assert merged is not None
    assert merged.metrics["shards"][kept_shard.index]["started_at"] == kept_manifest.started_at  # not redone
    assert rows_without_timing(layout, "rollouts") == reference
