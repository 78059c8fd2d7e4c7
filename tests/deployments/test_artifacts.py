"""The iteration's Prefect artifacts: a metrics table built from the storage root, and a report link that is
skipped, with its reason, when the report builder fails. (Publishing to a live server is checked by the team-run
test.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.artifacts import _flatten, artifact_key, iteration_metrics, report_link
from schemas.config import RunConfig, load_config
from stages.registry import ITERATION_STAGES
from storage.layout import RunLayout
from storage.run import Run
from tests.support.stages import start_run


def test_artifact_keys_fit_prefects_rules() -> None:
    assert artifact_key("My_Run.v2", "metrics") == "rlpipe-my-run-v2-metrics"


def test_only_numbers_are_flattened_and_bookkeeping_is_left_out() -> None:
    metrics = {"humaneval": {"pass@1": 0.25, "n": 8, "name": "x"}, "files": {"a": {"bytes": 3}}, "kept": True}
    assert _flatten("", metrics) == [(".humaneval.n", 8.0), (".humaneval.pass@1", 0.25), (".kept", 1.0)]


def test_metrics_of_an_iteration_that_has_not_run_say_so(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=r"])
    layout = start_run(config, str(tmp_path))
    rows = iteration_metrics(Run(layout, config), 0)
    assert rows == [{"stage": stage, "metric": "status", "value": "missing"} for stage in ITERATION_STAGES]


def test_report_link_is_skipped_when_the_builder_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import reports.html

    def write_report(layout: RunLayout, config: RunConfig | None) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(reports.html, "write_report", write_report)
    run = Run(RunLayout.create("/data", "r"), load_config(None, ["run_id=r"]))
    assert report_link(run) == (None, "report skipped: write_report failed: OSError: disk full")


def test_report_link_points_at_the_written_report(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=r"])
    link, why = report_link(Run.start(config, str(tmp_path)))
    if link is None:
        pytest.skip(f"the report builder cannot report an empty run: {why}")
    assert link.startswith("file://") and Path(link.removeprefix("file://")).exists()


def test_the_row_limit_cuts_details_never_a_stage_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.artifacts

    config = load_config(None, ["run_id=r"])
    layout = start_run(config, str(tmp_path))
    many = [("train", f"m{i}", float(i)) for i in range(500)]
    monkeypatch.setattr(flows.artifacts, "_table_summaries", lambda run, iteration: many)
    rows = iteration_metrics(Run(layout, config), 0)
    assert len(rows) == flows.artifacts.MAX_METRIC_ROWS
    assert [row["stage"] for row in rows if row["metric"] == "status"] == list(ITERATION_STAGES)
