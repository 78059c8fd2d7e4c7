"""What an iteration shows in the Prefect UI: a table artifact of its metrics and a link to the run's report.

The numbers come only from the storage root (manifests, and a few columns of the iteration's tables), never
from stage processes' return values, so the artifact is the same whether the stages ran as local child
processes or as flow runs on other machines. Both artifacts are keyed per run (`rlpipe-<run>-metrics`,
`rlpipe-<run>-report`), so the UI lists one version per iteration under the same key: progress at a glance.

The HTML report is built by `reports.html.write_report(layout) -> str`; when that fails, the link is skipped
with a logged reason and the iteration is not failed: a report is a view of the run, not a part of it.

`iteration_metrics` and `report_link` are plain functions (no Prefect); `publish_iteration_artifacts` is the
only part that talks to Prefect and must run inside a flow run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.tables import BASELINE_SAMPLE_IDX, TABLES
from stages.registry import instance, iteration_stages, round_inputs, stage_state
from storage.fs import is_remote
from storage.manifest import located
from storage.run import Run
from storage.tables import read_table

log = logging.getLogger(__name__)

# Manifest metrics that are bookkeeping, not measurements.
SKIPPED_METRICS = {"files", "local_path", "name_or_path"}
MAX_METRIC_ROWS = 200


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"rlpipe-{run_id}-{what}".lower()).strip("-")


def _flatten(prefix: str, value: Any, depth: int = 0) -> list[tuple[str, float]]:
    if isinstance(value, bool):
        return [(prefix, float(value))]
    if isinstance(value, int | float):
        return [(prefix, float(value))]
    if isinstance(value, dict) and depth < 3:
        rows: list[tuple[str, float]] = []
        for name, inner in sorted(value.items()):
            if name not in SKIPPED_METRICS:
                rows += _flatten(f"{prefix}.{name}", inner, depth + 1)
        return rows
    return []


def _table_paths(run: Run, table: str, iteration: int) -> list[str]:
    """Where `table` of `iteration` is read (a fork's share by reference: the origin's file): one file, or, for
    the per-round tables (rollouts, scores), round 0 and every complete dynamic-sampling round (the rounds the batch
    is built from)."""
    extra = round_inputs(run, "advantage", iteration)
    rounds = [output.round_idx for output in extra.values() if output.name == table]
    return [located(run.fs, run.layout.table_path(table, iteration, r)) for r in [0, *rounds]]


def _table_summaries(run: Run, iteration: int) -> list[tuple[str, str, float]]:
    """A few numbers read from the tables themselves: mean reward (over every generation round), kept rows,
    last loss."""

    def mean(column: str) -> Callable[[Any], float]:
        # the sampled responses: remax's greedy baseline rows (sample_idx -1) are not the policy's samples
        return lambda t: pc.mean(t.filter(pc.not_equal(t["sample_idx"], BASELINE_SAMPLE_IDX))[column]).as_py()

    wanted: list[tuple[str, str, str, Callable[[Any], float]]] = [
        ("score", "scores", "reward.mean", mean("reward")),
        ("score", "scores", "passed.mean", mean("passed")),
        ("advantage", "batch", "kept.rows", lambda t: float(pc.sum(t["kept"]).as_py() or 0)),
        ("train", "train_metrics", "loss.last", lambda t: t["loss"][-1].as_py()),
        ("train", "train_metrics", "steps", lambda t: float(t.num_rows)),
    ]
    rows = []
    for stage, table, name, compute in wanted:
        try:
            paths = _table_paths(run, table, iteration)
            value = compute(pa.concat_tables(read_table(run.fs, path, TABLES[table]) for path in paths))
        except Exception as error:  # noqa: BLE001 - a summary that cannot be computed is left out, not fatal
            log.info("metric %s.%s left out: %s", stage, name, error)
            continue
        if value is not None:
            rows.append((stage, name, float(value)))
    return rows


def iteration_metrics(run: Run, iteration: int) -> list[dict[str, Any]]:
    """Rows of {stage, metric, value} for one iteration: status, seconds, rows, host, and stage metrics."""
    states = {stage: stage_state(run, instance(stage, iteration)) for stage in iteration_stages(run.config, iteration)}
    # Every stage's status comes first, so the row limit can only ever cut details.
    status = [{"stage": stage, "metric": "status", "value": state.reason} for stage, state in states.items()]
    rows: list[dict[str, Any]] = []
    for stage, state in states.items():
        for manifest in state.manifests:
            rows.append({"stage": stage, "metric": "seconds", "value": round(manifest.seconds, 1)})
            rows.append({"stage": stage, "metric": "host", "value": manifest.host})
            if manifest.rows is not None:
                rows.append({"stage": stage, "metric": f"{Path(manifest.path).name}.rows", "value": manifest.rows})
            for name, value in _flatten("", manifest.metrics):
                rows.append({"stage": stage, "metric": name.lstrip("."), "value": round(value, 6)})
    for stage, name, value in _table_summaries(run, iteration):
        rows.append({"stage": stage, "metric": name, "value": round(value, 6)})
    return status + rows[: MAX_METRIC_ROWS - len(status)]


def report_link(run: Run) -> tuple[str | None, str]:
    """(link to the run's HTML report, or None) and why: built, or the reason it was skipped."""
    from reports.html import write_report  # here, not above: the flow process loads DuckDB only to build a report

    try:
        location = write_report(run.layout, run.config)
    except Exception as error:  # noqa: BLE001 - the report is a view of the run; its failure must not fail it
        return None, f"report skipped: write_report failed: {type(error).__name__}: {error}"
    if not is_remote(location) and not location.startswith(("http://", "https://", "file://")):
        location = Path(location).resolve().as_uri()
    return location, f"report written to {location}"


def publish_iteration_artifacts(run: Run, iteration: int) -> dict[str, Any]:
    """Create the metrics table artifact and the report link artifact; returns what was published."""
    from prefect.artifacts import create_link_artifact, create_table_artifact
    from prefect.logging import get_run_logger

    # The report (DuckDB over the run's tables, no Prefect) is built in a second thread while this one
    # gathers the metrics and sends them to the Prefect server, which artifacts must be created from.
    with ThreadPoolExecutor(max_workers=1) as pool:
        report = pool.submit(report_link, run)
        rows = iteration_metrics(run, iteration)
        description = f"run `{run.run_id}` iteration {iteration} of {run.config.iterations} ({run.layout.run_dir})"
        create_table_artifact(table=rows, key=artifact_key(run.run_id, "metrics"), description=description)
        link, why = report.result()
    if link is not None:
        create_link_artifact(
            link=link, link_text=f"{run.run_id} report", key=artifact_key(run.run_id, "report"),
            description=f"HTML report after iteration {iteration}",
        )
    else:
        get_run_logger().warning(why)
    return {"metrics_rows": len(rows), "report": link, "report_note": why}
