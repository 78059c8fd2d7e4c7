"""deployments/prefect.yaml declares what the product needs, in a form `prefect deploy` accepts.

`prefect deploy` only *warns* about a file it cannot validate and then deploys nothing, and it accepts
parameters a flow does not have until a run fails on them; so the file is checked here against Prefect's own
model, the flows' signatures and the stage registry. That the server accepts it is the integration test's job.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
from prefect.cli.deploy._models import PrefectYamlModel

from flows import pipeline
from flows.deploy import (
    PREFECT_YAML,
    REPO_ROOT,
    SCHEDULED_DEPLOYMENT,
    DeployError,
    deployment_pools,
    enter_checkout,
    entrypoint_flow,
    load_spec,
    pool_names,
    render_spec,
)
from schemas.config import ConfigError
from stages.registry import STAGES

SPEC = load_spec()
BY_NAME = {d["name"]: d for d in SPEC["deployments"]}


def test_prefects_own_model_accepts_the_file() -> None:
    model = PrefectYamlModel.model_validate(SPEC)
    assert len(model.deployments) == len(SPEC["deployments"]) == len(BY_NAME)  # names are unique
    for deployment in model.deployments:
        assert deployment.name and deployment.entrypoint and deployment.work_pool and deployment.work_pool.name


def test_every_stage_has_a_deployment_on_the_pool_it_needs() -> None:
    stage_deployments = {name: d for name, d in BY_NAME.items() if entrypoint_flow(d["entrypoint"]).name == "stage"}
    assert set(stage_deployments) == set(STAGES)
    for name, deployment in stage_deployments.items():
        assert deployment["parameters"] == {"stage": name}
        assert pipeline.stage_deployment(name) == f"stage/{name}"
    pools = deployment_pools(SPEC)
    assert {stage: pools[stage] for stage in ("generate", "train", "evaluate", "score", "advantage", "prompts")} == {
        "generate": "gpu", "train": "gpu", "evaluate": "gpu", "score": "cpu", "advantage": "cpu", "prompts": "cpu",
    }
    assert pool_names(SPEC) == ["cpu", "gpu"]


def test_flows_and_their_parameters_exist() -> None:
    flows = {name: entrypoint_flow(d["entrypoint"]) for name, d in BY_NAME.items()}
    assert flows["loop"].name == "loop" and flows["iteration"].name == flows["advance"].name == "iteration"
    assert {"config", "run", "iterations"} <= set(inspect.signature(flows["loop"].fn).parameters)
    for name, deployment in BY_NAME.items():
        accepted = set(inspect.signature(flows[name].fn).parameters)
        assert set(deployment.get("parameters", {})) <= accepted, name
    # The orchestrating flows dispatch their stages to the stage deployments.
    for name in ("loop", "iteration", SCHEDULED_DEPLOYMENT):
        assert BY_NAME[name]["parameters"]["dispatch"] == "deployments"


def test_job_variables_are_string_environments() -> None:
    for name, deployment in BY_NAME.items():
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["RLPIPE_POOL"] == deployment["work_pool"]["name"], name
        assert all(isinstance(value, str) for value in env.values()), name


def test_schedule_is_off_until_bound_to_a_run() -> None:
    [schedule] = BY_NAME[SCHEDULED_DEPLOYMENT]["schedules"]
    assert schedule["active"] is False
    rendered = render_spec(SPEC, "tiny", "s3://bucket/prefix", 600)
    advance = {d["name"]: d for d in rendered["deployments"]}[SCHEDULED_DEPLOYMENT]
    assert advance["parameters"] == {"dispatch": "deployments", "run": {"root": "s3://bucket/prefix", "run_id": "tiny"}}
    assert advance["schedules"] == [{"interval": 600, "active": True}]
    assert BY_NAME[SCHEDULED_DEPLOYMENT]["schedules"][0]["active"] is False  # the loaded spec is untouched
    PrefectYamlModel.model_validate(rendered)
    # Bound without a schedule: triggered by hand (or by an automation), never on its own.
    unscheduled = {d["name"]: d for d in render_spec(SPEC, "tiny", "/data", None)["deployments"]}
    assert unscheduled[SCHEDULED_DEPLOYMENT]["schedules"][0]["active"] is False
    with pytest.raises(ConfigError, match="--run-id"):
        render_spec(SPEC, None, None, 600)
    with pytest.raises(ConfigError, match="--root"):
        render_spec(SPEC, "tiny", None, None)


def test_pull_step_enters_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SPEC["pull"] == [{"flows.deploy.enter_checkout": {}}]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLPIPE_HOME", raising=False)
    assert enter_checkout() == {"directory": str(REPO_ROOT)} and Path(os.getcwd()) == REPO_ROOT
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    with pytest.raises(DeployError, match="not an rlpipe checkout"):
        enter_checkout()
    assert PREFECT_YAML.parent.name == "deployments"


def test_dispatch_mode_comes_from_the_parameter_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPIPE_DISPATCH", raising=False)
    assert pipeline.resolve_dispatch(None) == "local"
    monkeypatch.setenv("RLPIPE_DISPATCH", "deployments")
    assert pipeline.resolve_dispatch(None) == "deployments"
    assert pipeline.resolve_dispatch("local") == "local"
    with pytest.raises(ConfigError, match="'k8s' must be one of local, deployments"):
        pipeline.resolve_dispatch("k8s")
