"""A flow run whose process dies without a word (its machine or its worker gone) is set Crashed by the automation
`rlpipe deploy` makes (flows/deploy.py), on a real Prefect server: two real flow runs send heartbeats every 30 s;
one is SIGKILLed, the other lives on. The silence allowed is cut to 40 s here (deploy's: 90 s), still above the
heartbeat, so the living run is never crashed. A dispatching flow waits on exactly this state (flows/pipeline.py).
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

from flows.deploy import (
    HEARTBEAT_S,
    UNRESPONSIVE_AUTOMATION,
    api_url_for,
    ensure_unresponsive_run_automation,
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
from prefect import flow, runtime

@flow(name="{FLOW_NAME}")
def sleeper() -> None:
    print(runtime.flow_run.id, flush=True)
    time.sleep(600)

sleeper()
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


def flow_run_state(run_id: UUID) -> tuple[str, str]:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    return state.type.value, state.message or ""


def test_deployments_send_heartbeats_that_the_automation_expects() -> None:
    for variables in load_spec()["definitions"]["job_variables"].values():
        assert int(variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) == HEARTBEAT_S


def test_a_flow_run_that_stops_sending_heartbeats_is_crashed_and_a_living_one_is_not(tmp_path: Path) -> None:
    port = free_port()
    api_url = api_url_for("127.0.0.1", port)
    server = start_server("127.0.0.1", port, tmp_path / "prefect-home", tmp_path / "server.log")
    sleepers: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()
    try:
        wait_healthy(api_url, 180, server)
        # Prefect in this process keeps the settings it had when first imported (an earlier test's server)
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        ensure_unresponsive_run_automation([FLOW_NAME], silence_s=40)
        ensure_unresponsive_run_automation([FLOW_NAME], silence_s=40)  # a second deploy replaces it: still one
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name(UNRESPONSIVE_AUTOMATION)) == 1

        env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
               "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
        for _ in range(2):
            sleepers.append(spawn_tied([sys.executable, "-c", SLEEPER], env=env, stdout=subprocess.PIPE, text=True))
        dead, living = (UUID(sleeper.stdout.readline().strip()) for sleeper in sleepers)  # both running their flow
        assert flow_run_state(dead)[0] == flow_run_state(living)[0] == "RUNNING"
        wait_for_a_heartbeat(dead)
        os.killpg(sleepers[0].pid, signal.SIGKILL)  # no final state, no more heartbeats: a machine gone
        killed_at = time.monotonic()

        while (state := flow_run_state(dead))[0] == "RUNNING" and time.monotonic() - killed_at < 120:
            time.sleep(2)
        assert state[0] == "CRASHED", state
        assert "no heartbeat for 40 s" in state[1]
        assert 40 - HEARTBEAT_S <= time.monotonic() - killed_at  # not before its silence could have been 40 s
        assert flow_run_state(living)[0] == "RUNNING"  # its heartbeats kept coming
    finally:
        stack.close()
        for sleeper in sleepers:
            if sleeper.poll() is None:
                os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait()
        stop_processes([server])
