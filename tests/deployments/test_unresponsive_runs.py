"""A flow run whose process dies without a word (its machine or its worker gone) is set Crashed by the automations
`rlpipe deploy` makes (flows/deploy.py), on a real Prefect server. Four flow runs of a deployment, each set Pending
as a worker sets it before starting the run's process: three are started as a process worker starts them (`python
-m prefect.flow_engine`), sending heartbeats every 30 s; one of those is SIGKILLed, one lives on, one ends
`Skipped` as a trigger that finds its run driven does; the fourth is never started (its worker died in between).
The silence allowed is cut to 40 s here (deploy's: 90 s), still above the heartbeat, and the start allowance to
60 s (deploy's: 600 s), so the living run is never crashed, and each automation fires once: never for the
`Skipped` run (a state event named by its name, which the automation must count as an end). A dispatching flow
waits on exactly these states (flows/pipeline.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Pending

from flows.deploy import (
    HEARTBEAT_S,
    SKIPPED_STATE,
    UNRESPONSIVE_AUTOMATION,
    UNSTARTED_AUTOMATION,
    api_url_for,
    ensure_run_automations,
    load_spec,
    start_server,
    stop_processes,
    wait_healthy,
)
from tests.support.ports import free_port
from tests.support.processes import spawn_tied

pytestmark = pytest.mark.slow
FLOW_NAME = "rlpipe-test-sleeper"
SLEEPER = f"""
import time
from prefect import flow
from prefect.states import Completed

@flow(name="{FLOW_NAME}")
def sleeper() -> None:
    time.sleep(600)

@flow(name="{FLOW_NAME}")
def skipper():  # a scheduled trigger that found its run driven (flows/pipeline.py)
    time.sleep(2)
    return Completed(name="{SKIPPED_STATE}")
"""


def wait_for_a_heartbeat(run_id: UUID, timeout_s: float = 60) -> None:
    """Until the server holds a heartbeat event of the run: the automation's silence counts from one. The
    first is sent as the flow starts but reaches the server later (Prefect's events client, a websocket); a
    run killed before that is never crashed by the automation (seen on a loaded CI machine)."""
    def wanted() -> EventFilter:  # made anew: its window ends at the time it is made
        return EventFilter(event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                           resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]))

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while not client.read_events(wanted(), limit=1).events:
            assert time.monotonic() < deadline, f"no heartbeat of flow run {run_id} reached the server"
            time.sleep(0.5)


def automation_firings() -> dict[str, int]:
    """How often each automation of the server fired (its `prefect.automation.triggered` events)."""
    with get_client(sync_client=True) as client:
        names = {f"prefect.automation.{a.id}": a.name for a in client.read_automations()}
        events = client.read_events(EventFilter(event=EventNameFilter(name=["prefect.automation.triggered"])),
                                    limit=50).events
    fired: dict[str, int] = {}
    for event in events:
        fired[names[event.resource.id]] = fired.get(names[event.resource.id], 0) + 1
    return fired


def flow_run_state(run_id: UUID) -> tuple[str, str]:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    return state.type.value, state.message or ""


def test_deployments_send_heartbeats_that_the_automation_expects() -> None:
    for variables in load_spec()["definitions"]["job_variables"].values():
        assert int(variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) == HEARTBEAT_S


def test_flow_runs_that_stop_or_never_send_heartbeats_are_crashed_and_a_living_one_is_not(tmp_path: Path) -> None:
    port = free_port()
    api_url = api_url_for("127.0.0.1", port)
    server = start_server("127.0.0.1", port, tmp_path / "prefect-home", tmp_path / "server.log")
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    processes: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()
    try:
        wait_healthy(api_url, 180, server)
        # Prefect in this process keeps the settings it had when first imported (an earlier test's server)
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        ensure_run_automations([FLOW_NAME], silence_s=40, allowance_s=60)
        ensure_run_automations([FLOW_NAME], silence_s=40, allowance_s=60)  # a second deploy replaces them
        with get_client(sync_client=True) as client:
            for name in (UNRESPONSIVE_AUTOMATION, UNSTARTED_AUTOMATION):
                assert len(client.read_automations_by_name(name)) == 1
            deployment = client.create_deployment(client.create_flow_from_name(FLOW_NAME), "test",
                                                  entrypoint="sleeper.py:sleeper", path=str(tmp_path))
            silent, living, unstarted, skipped = (client.create_flow_run_from_deployment(deployment).id
                                                  for _ in range(4))
            for run_id in (silent, living, unstarted, skipped):
                assert client.set_flow_run_state(run_id, Pending()).status.value == "ACCEPT"  # a worker took it
        pending_at = time.monotonic()

        env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
               "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
        for run_id, entrypoint in ((silent, "sleeper"), (living, "sleeper"), (skipped, "skipper")):
            # what a process worker runs for a flow run
            processes.append(spawn_tied([sys.executable, "-m", "prefect.flow_engine", f"sleeper.py:{entrypoint}"],
                                        env={**env, "PREFECT__FLOW_RUN_ID": str(run_id)}, cwd=tmp_path))
        wait_for_a_heartbeat(silent)
        wait_for_a_heartbeat(living)
        assert flow_run_state(silent)[0] == flow_run_state(living)[0] == "RUNNING"
        os.killpg(processes[0].pid, signal.SIGKILL)  # no final state, no more heartbeats: a machine gone
        killed_at = time.monotonic()

        def ended() -> bool:
            return all(flow_run_state(run_id)[0] not in ("RUNNING", "PENDING") for run_id in (silent, unstarted))

        while not ended() and time.monotonic() - killed_at < 150:
            time.sleep(2)
        state, started_state = flow_run_state(silent), flow_run_state(unstarted)
        assert state[0] == "CRASHED", state
        assert "no heartbeat for 40 s" in state[1]
        assert 40 - HEARTBEAT_S <= time.monotonic() - killed_at  # not before its silence could have been 40 s
        assert started_state[0] == "CRASHED", started_state
        assert "no heartbeat within 60 s of going Pending" in started_state[1]
        assert time.monotonic() - pending_at >= 60
        assert flow_run_state(living)[0] == "RUNNING"  # its heartbeats kept coming
        # a run that ended Skipped after its heartbeat ended: neither automation fired for it (once each above)
        assert flow_run_state(skipped)[0] == "COMPLETED" and processes[2].wait(timeout=60) == 0
        once_each = {UNRESPONSIVE_AUTOMATION: 1, UNSTARTED_AUTOMATION: 1}
        deadline = time.monotonic() + 60  # the server stores events in batches, seconds after they happen
        while automation_firings() != once_each and time.monotonic() < deadline:
            time.sleep(2)
        time.sleep(10)  # and a late firing for the Skipped run would be stored by now
        assert automation_firings() == once_each
    finally:
        stack.close()
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stop_processes([server])
