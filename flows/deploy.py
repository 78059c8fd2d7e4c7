"""Running rlpipe as a team: a Prefect server, work pools with workers, and the deployments of prefect.yaml.

`rlpipe server` starts a Prefect server on 127.0.0.1 (for people without Prefect Cloud), creates the work
pools that deployments/prefect.yaml names, and starts one worker per pool on this machine; `rlpipe deploy`
registers the deployments with `prefect deploy` (optionally scheduling one run to advance by an iteration per
trigger). Other machines join by starting a worker of their pool against the same server (docs/team.md);
the storage root (S3) is the only thing the machines share.

Everything here is a plain function around Prefect's own CLI and client, so that tests can start the same
pieces the commands start, and tear them down: every child is started in its own process group and
`stop_processes` ends each group, never anything by name. The children die with the process that started
them whatever ends it: each gets a parent-death signal (SIGKILL, set before it runs anything), and a
`GroupReaper` process kills their whole process groups (the flow runs a worker started included) once the
starter is gone, even when that was a SIGKILL, which no `finally` sees. A flow run whose machine dies stays
Running in Prefect: its heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY in prefect.yaml's job env) stop, and the
automation `rlpipe deploy` creates, Prefect's documented one for zombie flow runs, sets it Crashed; a second
one crashes a run that went Pending and never sent a heartbeat (its worker died starting it).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from schemas import settings
from schemas.config import ConfigError, read_yaml
from storage.process import die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "deployments" / "prefect.yaml"
# The deployment a schedule drives: the `iteration` flow with no iteration advances the run by the next one.
SCHEDULED_DEPLOYMENT = "advance"
PREFECT_QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
UNRESPONSIVE_AUTOMATION = "rlpipe: crash unresponsive flow runs"
UNSTARTED_AUTOMATION = "rlpipe: crash flow runs that never started"
HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY of prefect.yaml's job env: Prefect's minimum
START_ALLOWANCE_S = 600  # Pending to the first heartbeat: a process start, or an image pull on a container pool
SKIPPED_STATE = "Skipped"  # the Completed state of a scheduled trigger that found its run driven (flows/pipeline.py)


class DeployError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------
# The pull step workers run before each flow run


def enter_checkout(directory: str | None = None) -> dict[str, str]:
    """Prefect pull step: work from this machine's rlpipe checkout.

    `$RLPIPE_HOME` when set, else the checkout the installed `flows` package lives in. Each worker machine
    has its own checkout (or install) of the same rlpipe version, so nothing is copied at run time and the
    path on the machine that ran `prefect deploy` does not matter.
    """
    target = Path(directory or settings.HOME.get() or REPO_ROOT).expanduser().resolve()
    if not (target / "flows" / "pipeline.py").is_file():
        raise DeployError(f"{target} is not an rlpipe checkout (no flows/pipeline.py); set RLPIPE_HOME on the worker")
    os.chdir(target)
    return {"directory": str(target)}


# ---------------------------------------------------------------------------------------------------------
# prefect.yaml


def load_spec(path: Path = PREFECT_YAML) -> dict[str, Any]:
    return read_yaml(path.read_text())


def deployment_pools(spec: dict[str, Any]) -> dict[str, str]:
    """Deployment name -> work pool name."""
    return {d["name"]: d["work_pool"]["name"] for d in spec["deployments"]}


def pool_names(spec: dict[str, Any]) -> list[str]:
    return sorted(set(deployment_pools(spec).values()))


def render_spec(spec: dict[str, Any], run_id: str | None, root: str | None, every_s: float | None) -> dict[str, Any]:
    """The spec with the scheduled deployment bound to one run, and its schedule on when `every_s` is given."""
    rendered = copy.deepcopy(spec)
    if run_id is None:
        if every_s is not None:
            raise ConfigError("a schedule advances one run: give --run-id and --root with --every")
        return rendered
    if not root:
        raise ConfigError("--run-id needs --root (the storage root the run lives in, e.g. s3://bucket/prefix)")
    (scheduled,) = [d for d in rendered["deployments"] if d["name"] == SCHEDULED_DEPLOYMENT]
    scheduled["parameters"] = {**scheduled.get("parameters", {}), "run": {"root": root, "run_id": run_id}}
    if every_s is not None:
        scheduled["schedules"] = [{"interval": every_s, "active": True}]
    return rendered


# ---------------------------------------------------------------------------------------------------------
# Processes: server, workers, prefect deploy


def prefect_executable() -> list[str]:
    return [sys.executable, "-m", "prefect"]


def client_environment(api_url: str, home: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that talks to the server at `api_url` (workers, `prefect deploy`)."""
    env = {**os.environ, **PREFECT_QUIET, "PREFECT_API_URL": api_url, **(extra or {})}
    # A server is given: never start a temporary one (flows/prefect_env.py turns that on for the local case).
    env["PREFECT_SERVER_EPHEMERAL_ENABLED"] = "false"
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


def _spawn(command: list[str], env: dict[str, str], log_path: Path | None, cwd: Path = REPO_ROOT) -> subprocess.Popen:
    output = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    try:
        # A process group of its own, so that stopping it stops everything it started; dead with its parent.
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
    finally:
        if log_path:
            output.close()


# The reaper's program: read process group ids from stdin, one per line; with a starter pid (argv[2]), note the
# starter's children (pid, start time) four times a second. At end of input (its starter is gone, however it ended)
# SIGTERM each group and each noted child still running, then SIGKILL what is left after the grace period. A
# line `release` ends it at once, killing nothing (its starter ends its children itself).
_REAPER = """
import os, select, signal, sys, time
import psutil
for name in ("SIGINT", "SIGTERM", "SIGHUP"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
grace_s, starter = float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None
groups, children, pending = [], {}, b""
while True:
    if starter is not None:
        try:
            for child in psutil.Process(starter).children():
                if child.pid != os.getpid():
                    children.setdefault(child.pid, child)
        except psutil.Error:
            pass
    if not select.select([sys.stdin], [], [], 0.25)[0]:
        continue
    chunk = os.read(sys.stdin.fileno(), 4096)
    if not chunk:
        break
    *lines, pending = (pending + chunk).split(b"\\n")
    if b"release" in lines:
        sys.exit(0)
    groups += [int(line) for line in lines if line.strip()]
def group_alive(group):
    try:
        os.killpg(group, 0)
        return True
    except OSError:
        return False
def living():
    return [g for g in groups if group_alive(g)], [c for c in children.values() if c.is_running()]
for sig in (signal.SIGTERM, signal.SIGKILL):
    alive_groups, alive_children = living()
    for group in alive_groups:
        os.killpg(group, sig)
    for child in alive_children:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    while any(living()) and time.monotonic() < deadline:
        time.sleep(0.2)
"""


class GroupReaper:
    """A small process that outlives its starter only to end what it was told about: the process groups written
    to its pipe, and with `follow_children` every process the starter had started (noted every 0.25 s; a child
    that a library starts, as Prefect its temporary server, has no other tie to us). The pipe it reads from is
    held by the starter alone (not inherited by any child), so its end of input comes exactly when the starter is
    gone, by exit, exception, signal or SIGKILL. It runs in a session of its own (a terminal's Ctrl-C does not
    reach it) and ignores SIGINT, SIGTERM and SIGHUP. SIGKILL follows SIGTERM after `grace_s`, 5 s by default:
    nothing outlives its starter by more than 10 s (docs/reliability.md). A child that was noted, then ended and
    its pid reused, is not killed: psutil checks the start time."""

    def __init__(self, grace_s: float = 5.0, follow_children: bool = False) -> None:
        command = [sys.executable, "-c", _REAPER, str(grace_s), *([str(os.getpid())] if follow_children else [])]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        start_new_session=True)

    def watch(self, process: subprocess.Popen) -> subprocess.Popen:
        """Have `process`'s group (it leads one: `_spawn`) ended with us; returns `process`."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{process.pid}\n".encode())
        self.process.stdin.flush()
        return process

    def close(self) -> None:
        """End of input: the reaper ends what is left of the groups (and the children it noted) and exits."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()

    def release(self) -> None:
        """The reaper exits killing nothing: the starter ends normally and stops its children itself."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"release\n")
        self.process.stdin.close()
        self.process.wait()


def start_server(host: str, port: int, home: Path, log_path: Path | None = None, ui: bool = False) -> subprocess.Popen:
    env = {**os.environ, **PREFECT_QUIET, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": str(ui).lower()}
    env.pop("PREFECT_API_URL", None)
    home.mkdir(parents=True, exist_ok=True)
    command = [*prefect_executable(), "server", "start", "--host", host, "--port", str(port), "--analytics-off"]
    return _spawn(command, env, log_path)


def api_url_for(host: str, port: int) -> str:
    return f"http://{host}:{port}/api"


def wait_healthy(api_url: str, timeout_s: float, process: subprocess.Popen | None = None) -> float:
    """Seconds until `GET /health` answers; raises if the server process dies or the time runs out."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process is not None and process.poll() is not None:
            raise DeployError(f"the Prefect server exited with code {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{api_url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise DeployError(f"the Prefect server at {api_url} was not healthy after {timeout_s:.0f}s")


def ensure_work_pools(names: Iterable[str], pool_type: str = "process") -> list[str]:
    """Create the pools that do not exist yet (server from $PREFECT_API_URL); returns those created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.base import BaseWorker

    created = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_work_pool(name)
                continue
            except ObjectNotFound:
                pass
            worker_class = BaseWorker.get_worker_class_from_type(pool_type)
            if worker_class is None:
                raise DeployError(f"no worker type {pool_type!r} is installed here to create pool {name!r}")
            template = worker_class.get_default_base_job_template()
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
                created.append(name)
            except ObjectAlreadyExists:
                pass  # another `rlpipe deploy` created it in the meantime
    return created


def start_worker(pool: str, env: dict[str, str], log_path: Path | None = None, limit: int | None = None,
                 name: str | None = None) -> subprocess.Popen:
    command = [*prefect_executable(), "worker", "start", "--pool", pool, "--type", "process"]
    command += ["--name", name or f"{pool}-{socket.gethostname()}-{os.getpid()}"]
    if limit is not None:
        command += ["--limit", str(limit)]
    return _spawn(command, env, log_path)


def stop_processes(processes: Iterable[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `grace_s`."""
    processes = [p for p in processes if p is not None]
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Children of the group may outlive its leader (a flow run a worker started): kill the group always.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def run_prefect_deploy(spec: dict[str, Any], env: dict[str, str], timeout_s: float = 600) -> str:
    """`prefect deploy --all` for `spec` (written to a temporary prefect.yaml); returns its output."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="rlpipe-prefect-", delete=False) as handle:
        yaml.safe_dump(spec, handle, sort_keys=False)
        spec_path = handle.name
    try:
        command = [*prefect_executable(), "--no-prompt", "deploy", "--all", "--prefect-file", spec_path]
        completed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    finally:
        os.unlink(spec_path)
    output = completed.stdout + completed.stderr
    # `prefect deploy` only warns about a spec it cannot validate, and exits 0 having deployed nothing.
    if completed.returncode != 0 or "Skipping" in output:
        raise DeployError(f"prefect deploy failed (exit code {completed.returncode}):\n{output[-4000:]}")
    return output


def deployed_names(api_url: str) -> set[str]:
    """'flow/deployment' of every deployment on the server at `api_url`."""
    import httpx

    flows = httpx.post(f"{api_url}/flows/filter", json={}, timeout=30).json()
    names = {f["id"]: f["name"] for f in flows}
    deployments = httpx.post(f"{api_url}/deployments/filter", json={}, timeout=30).json()
    return {f"{names.get(d['flow_id'], '?')}/{d['name']}" for d in deployments}


def entrypoint_flow(entrypoint: str) -> Any:
    """The flow object an entrypoint `path/to/module.py:function` (relative to the checkout) names."""
    import importlib

    path, _, function = entrypoint.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, function)


def expected_names(spec: dict[str, Any]) -> set[str]:
    """'flow/deployment' for each deployment of `spec`."""
    return {f"{entrypoint_flow(d['entrypoint']).name}/{d['name']}" for d in spec["deployments"]}


# A state's event is named by the state's name, and a trigger that finds its run driven ends Completed, named so
FINAL_EVENTS = frozenset(f"prefect.flow-run.{state}"
                         for state in ("Completed", SKIPPED_STATE, "Failed", "Cancelled", "Crashed"))


def crash_without_heartbeat(name: str, description: str, after: str, related: list[dict[str, Any]], within_s: float,
                            message: str) -> Any:  # noqa: ANN401
    """Prefect's pattern for zombie flow runs (docs.prefect.io, "detect zombie flows"): after an `after` event of a
    flow run whose related resources match each of `related`, neither a heartbeat nor a final state within
    `within_s` sets it Crashed with `message`. The dispatching flow then sees a final state and fails the stage
    (flows/pipeline.py)."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=name,
        description=description,
        trigger=EventTrigger(
            after={after},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=[ResourceSpecification(labels) for labels in related],
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"{message} (automation: {name})")],
    )


def unresponsive_run_automation(flow_names: Iterable[str], silence_s: float) -> Any:  # noqa: ANN401
    """A flow run of the flows named that sent a heartbeat and then nothing, not even a final state, for
    `silence_s` is set Crashed: its process, machine or worker died."""
    flows = sorted(flow_names)
    return crash_without_heartbeat(
        UNRESPONSIVE_AUTOMATION,
        f"A flow run of {', '.join(flows)} silent for {silence_s:.0f} s (its machine or worker died) is set "
        "Crashed, so that the flow waiting on it goes on (flows/deploy.py).",
        "prefect.flow-run.heartbeat", [{"prefect.resource.role": "flow", "prefect.resource.name": flows}],
        silence_s, f"no heartbeat for {silence_s:.0f} s: its process, machine or worker died")


def unstarted_run_automation(flow_names: Iterable[str], allowance_s: float) -> Any:  # noqa: ANN401
    """The case the zombie automation cannot see: a flow run of a deployment of the flows named that went Pending
    (a worker took it) and then sent no heartbeat and reached no final state within `allowance_s` is set Crashed.
    Its worker died before the run's process started, or the process died before its first heartbeat reached the
    server. Deployment runs only: they send heartbeats (prefect.yaml's job env); a flow run started by hand may
    not. The allowance covers a process start (seconds for a process pool; an image pull or a node scaling up on
    Docker or Kubernetes pools, whose workers also watch their own starts)."""
    flows = sorted(flow_names)
    return crash_without_heartbeat(
        UNSTARTED_AUTOMATION,
        f"A deployment's flow run of {', '.join(flows)} Pending and without a heartbeat for {allowance_s:.0f} s "
        "(its worker or process died starting it) is set Crashed, so that the flow waiting on it goes on "
        "(flows/deploy.py).",
        "prefect.flow-run.Pending",
        [{"prefect.resource.role": "flow", "prefect.resource.name": flows}, {"prefect.resource.role": "deployment"}],
        allowance_s, f"no heartbeat within {allowance_s:.0f} s of going Pending: its worker or its process died "
                     "starting it")


def ensure_run_automations(flow_names: Iterable[str], silence_s: float = 3 * HEARTBEAT_S,
                           allowance_s: float = START_ALLOWANCE_S, attempts: int = 3) -> None:
    """Make `unresponsive_run_automation` and `unstarted_run_automation` the one automation of each name on the
    server ($PREFECT_API_URL): an earlier deploy's (other flows, other times) is replaced. A request that times
    out (a loaded server) is tried again from the start, so a creation that went through unseen is deleted, not
    doubled."""
    import httpx
    from prefect.client.orchestration import get_client

    flow_names = sorted(flow_names)
    wanted = [unresponsive_run_automation(flow_names, silence_s), unstarted_run_automation(flow_names, allowance_s)]
    for attempt in range(1, attempts + 1):
        try:
            with get_client(sync_client=True) as client:
                for automation in wanted:
                    for existing in client.read_automations_by_name(automation.name):
                        client.delete_automation(existing.id)
                    client.create_automation(automation)
            return
        except httpx.TimeoutException as error:
            if attempt == attempts:
                raise DeployError(f"the Prefect server did not answer in time creating the automations "
                                  f"{[a.name for a in wanted]} ({attempts} attempts): {error!r}") from error


def deploy(api_url: str, spec: dict[str, Any], pool_type: str = "process") -> set[str]:
    """Create the pools `spec` names, deploy every deployment, check the server lists them all, and create the
    automations that crash their flow runs whose heartbeats stopped or never came."""
    env = client_environment(api_url)
    os.environ.update({"PREFECT_API_URL": api_url, "PREFECT_SERVER_EPHEMERAL_ENABLED": "false"})
    ensure_work_pools(pool_names(spec), pool_type)
    run_prefect_deploy(spec, env)
    expected = expected_names(spec)
    if missing := expected - deployed_names(api_url):
        raise DeployError(f"prefect deploy finished, but the server lacks deployments {sorted(missing)}")
    ensure_run_automations({name.partition("/")[0] for name in expected})
    return expected
