"""`rlpipe report RUN`: one self-contained HTML page about a run, read through the catalog.

At the top: a red banner when the run's failure record says it stopped at a stage (stage, exit code, reason),
and the optimizer steps taken, skipped (an iteration with no kept sample with a nonzero advantage) and not
applied (a non-finite gradient). Sections: reward and solve rate per iteration (and a table per verl
`data_source` when training draws on two or more); held-out pass@k and greedy accuracy per iteration and dataset
(base model included, as iteration -1; per data_source too where the evaluate stage recorded it, a test file
mixing sources; with multi-turn rollouts also turns, tool calls and solved-after-retry); response length and
truncation; clip fractions, KL and entropy per optimizer step; the
sandbox's status mix; time per stage; each reward function's mean and failed share per iteration (a chart, a
table, and a warning at the top when one failed); the best and worst samples of the last iteration. Plots are
inline SVG (reports/svg.py); there are no external assets, so the file renders offline, from S3, or as a CI
artifact, and one inline script only marks each chart as laid out (for tests).

`collect` gathers the numbers (testable on their own); `render` turns them into HTML; `write_report`
writes `runs/<run>/report.html` atomically (local or S3). The flow calls it at the end of every iteration
with the config it holds; `rlpipe report` reads the config once (`read_config`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any

from reports.svg import STATUS_COLOURS, Series, _finite, duration_unit, line_chart, stacked_bar_chart
from schemas.config import ConfigError, RunConfig
from schemas.tables import BASELINE_SAMPLE_IDX
from storage.catalog import Catalog
from storage.failure import StageFailure, read_failure
from storage.fs import atomic_write_bytes, join
from storage.layout import RunLayout
from storage.manifest import code_version
from storage.run import read_run_config

STAGES = ("generate", "score", "advantage", "train", "evaluate")
RUN_STAGES = ("prompts", "base_model", "evaluate_base")
# The policy's own samples: not remax's greedy baseline rows.
SAMPLED = f"sample_idx <> {BASELINE_SAMPLE_IDX}"
SAMPLE_COLUMNS = ("prompt_id", "sample_idx", "round", "reward", "passed", "total", "status", "advantage", "kept",
                  "num_tokens", "finish_reason")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k); the same estimator as stages/evaluation/metrics.py,
    repeated here because reports may import storage only (not the stage code and its model stack)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class ReportData:
    run_id: str
    root: str
    config: RunConfig | None
    iterations: list[int] = field(default_factory=list)
    reward: list[dict[str, Any]] = field(default_factory=list)  # iteration, mean_reward, solve_rate, rows
    # iteration, data_source, mean_reward, solve_rate, rows: only for a run training on two or more data_sources
    reward_by_source: list[dict[str, Any]] = field(default_factory=list)
    evaluation: list[dict[str, Any]] = field(default_factory=list)  # iteration, greedy, pass@k..., prompts
    lengths: list[dict[str, Any]] = field(default_factory=list)  # iteration, mean, p50, p90, truncated
    train: list[dict[str, Any]] = field(default_factory=list)  # one row per optimizer step
    statuses: dict[int, dict[str, int]] = field(default_factory=dict)  # iteration -> status -> count
    stage_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # column label -> stage -> s
    best: list[dict[str, Any]] = field(default_factory=list)
    worst: list[dict[str, Any]] = field(default_factory=list)
    last_iteration: int | None = None
    ks: list[int] = field(default_factory=lambda: [1])
    notes: list[str] = field(default_factory=list)
    devices: list[dict[str, Any]] = field(default_factory=list)  # stage, iteration, round, device record, tokens/s
    # iteration, function, calls, errors, error_frac, mean, first_error: the score stages' reward_functions
    reward_functions: list[dict[str, Any]] = field(default_factory=list)
    failure: StageFailure | None = None  # the run's failure record: it stopped at this stage (storage/failure.py)
    # iteration, turns, tool_calls (per answer), tool_error_rate (None without a call): multi-turn runs only
    multi_turn: list[dict[str, Any]] = field(default_factory=list)


def read_config(layout: RunLayout) -> RunConfig | None:
    """The run's config, or None when it has none that parses (the report then leaves out what needs it)."""
    try:
        return read_run_config(layout)
    except ConfigError:
        return None


Summaries = dict[tuple[int, str], dict[str, Any]]  # (iteration, dataset or data_source) -> an evaluate summary


def data_source_label(data_source: str) -> str:
    """How a per-data_source row is named beside the per-dataset ones (the report's and `rlpipe status`'s)."""
    return f"{data_source} (data_source)"


def _evaluation(catalog: Catalog, run_id: str, ks: list[int]) -> list[dict[str, Any]]:
    """One row per (evaluated checkpoint, held-out dataset), in checkpoint order: greedy accuracy, pass@k
    and, where the evaluate stage recorded it, pass@k's bootstrap 95% interval (`pass@k_ci`); `summary`: the
    stage's summary (the multi-turn figures are read from it). Then, where the stage recorded summaries per verl
    `data_source` (a test file mixing sources), one row per (checkpoint, data_source), its `data_source` set."""
    rows = _evaluation_by(catalog, run_id, ks, "dataset", _eval_summaries(catalog, run_id))
    by_source = _eval_summaries(catalog, run_id, "data_sources")
    for row in _evaluation_by(catalog, run_id, ks, "data_source", by_source) if by_source else []:
        if (row["iteration"], row["dataset"]) in by_source:
            rows.append(row | {"data_source": row["dataset"], "dataset": data_source_label(row["dataset"])})
    return rows


def _evaluation_by(catalog: Catalog, run_id: str, ks: list[int], column: str,
                   summaries: Summaries) -> list[dict[str, Any]]:
    """`_evaluation`'s rows grouped by the eval view's `column` (dataset or data_source), named `dataset`."""
    groups = catalog.rows(
        f"""SELECT iteration, {column} AS dataset, prompt_id, count(*) AS n, CAST(count_if(correct) AS BIGINT) AS c
            FROM eval WHERE run_id = $run AND mode = 'sampled' GROUP BY ALL""", {"run": run_id})
    greedy = {
        (row["iteration"], row["dataset"]): row["accuracy"] for row in catalog.rows(
            f"""SELECT iteration, {column} AS dataset, avg(CAST(correct AS DOUBLE)) AS accuracy
                FROM eval WHERE run_id = $run AND mode = 'greedy' GROUP BY ALL""", {"run": run_id})
    }
    by_checkpoint: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in groups:
        by_checkpoint.setdefault((row["iteration"], row["dataset"]), []).append(row)
    intervals = _eval_intervals(summaries)
    result = []
    for iteration, dataset in sorted(set(by_checkpoint) | set(greedy)):
        problems = by_checkpoint.get((iteration, dataset), [])
        entry: dict[str, Any] = {"iteration": iteration, "dataset": dataset,
                                 "greedy": greedy.get((iteration, dataset)), "prompts": len(problems),
                                 "summary": summaries.get((iteration, dataset), {})}
        for k in ks:
            values = [pass_at_k(g["n"], g["c"], k) for g in problems if g["n"] >= k]
            entry[f"pass@{k}"] = sum(values) / len(values) if values else None
            if (interval := intervals.get((iteration, dataset), {}).get(f"pass@{k}")) is not None:
                entry[f"pass@{k}_ci"] = interval
        result.append(entry)
    return result


MULTI_TURN_COLUMNS = ("turns", "tool calls / answer", "tool error rate", "solved after retry")


def multi_turn_cells(summary: dict[str, Any], mode: str) -> list[str]:
    """The multi-turn figures of one evaluation summary (the evaluate manifest's, per dataset) as text, one per
    MULTI_TURN_COLUMNS: `n/a` where the mode has no such thing (tool calls and errors in feedback mode, retries
    in tool mode) or nothing to count (no tool call; no answer that got a retry); `rlpipe status` shows the same."""
    def number(name: str) -> str:
        return f"{summary[name]:.3f}" if summary.get(name) is not None else "n/a"

    if "mean_turns" not in summary:
        return ["–"] * len(MULTI_TURN_COLUMNS)
    tool = mode == "tool"
    retried = summary.get("retried_answers")
    solved = f"{number('solved_after_retry')} ({retried:.0f} retried)" if retried is not None else "n/a"
    return [f"{summary['mean_turns']:.2f}", number("tool_calls_per_answer") if tool else "n/a",
            number("tool_error_rate") if tool else "n/a", solved if mode == "feedback" else "n/a"]


def _eval_summaries(catalog: Catalog, run_id: str, under: str | None = None) -> Summaries:
    """(iteration, dataset) -> the evaluate stage's summary in its manifest (one per held-out dataset); with
    `under` ("data_sources"), (iteration, data_source) -> the summaries the stage recorded under that key."""
    summaries: Summaries = {}
    for row in catalog.rows(
        """SELECT iter, metrics FROM manifests WHERE run_id = $run AND stage IN ('evaluate', 'evaluate_base')
           AND name = 'eval'""", {"run": run_id}
    ):
        metrics = json.loads(row["metrics"])
        for dataset, summary in (metrics.get(under, {}) if under else metrics).items():
            if isinstance(summary, dict) and "prompts" in summary:
                summaries[(row["iter"], dataset)] = summary
    return summaries


def _eval_intervals(summaries: Summaries) -> dict[tuple[int, str], dict[str, tuple[float, float]]]:
    """(iteration, dataset) -> metric -> the bootstrap 95% interval the evaluate stage recorded in its
    manifest's `summaries` (`_eval_summaries`)."""
    return {
        key: {metric.removesuffix("_ci_low"): (value, summary[metric.replace("_ci_low", "_ci_high")])
              for metric, value in summary.items() if metric.endswith("_ci_low")}
        for key, summary in summaries.items()
    }


MODEL_STAGES = ("evaluate_base", "generate", "train", "evaluate")


def _devices(catalog: Catalog, run_id: str) -> list[dict[str, Any]]:
    """One row per model stage instance whose manifest records where it ran (stages/generation/device.py): its
    device record (device, GPU name and count, dtype, peak GPU memory) and tokens/s, in run order."""
    rows = []
    for row in catalog.rows(
        """SELECT DISTINCT ON (stage, iter, round) stage, iter, round, metrics FROM manifests
           WHERE run_id = $run AND stage IN ('evaluate_base', 'generate', 'train', 'evaluate')
           ORDER BY stage, iter, round, name""", {"run": run_id}
    ):
        metrics = json.loads(row["metrics"])
        if isinstance(metrics.get("device"), dict):
            rows.append({"stage": row["stage"], "iteration": row["iter"], "round": row["round"] or 0,
                         **metrics["device"], "tokens_per_second": metrics.get("tokens_per_second")})
    return sorted(rows, key=lambda r: (r["iteration"] if r["iteration"] is not None else -1, r["round"],
                                       MODEL_STAGES.index(r["stage"])))


def collect(catalog: Catalog, run_id: str, config: RunConfig | None) -> ReportData:
    """Every number the report shows, from the catalog's views (one run)."""
    data = ReportData(run_id=run_id, root=catalog.root, config=config)
    data.ks = list(config.evaluate.k) if config else [1]
    run = {"run": run_id}
    data.reward = catalog.rows(
        f"""SELECT iteration, avg(reward) AS mean_reward, avg(CAST(status = 'ok' AS DOUBLE)) AS solve_rate,
                  count(*) AS rows
           FROM scores WHERE run_id = $run AND {SAMPLED} GROUP BY iteration ORDER BY iteration""", run)
    data.reward_by_source = catalog.rows(
        f"""SELECT iteration, data_source, avg(reward) AS mean_reward,
                  avg(CAST(status = 'ok' AS DOUBLE)) AS solve_rate, count(*) AS rows
           FROM scores WHERE run_id = $run AND {SAMPLED} GROUP BY ALL ORDER BY ALL""", run)
    if len({row["data_source"] for row in data.reward_by_source}) < 2:
        data.reward_by_source = []
    data.evaluation = _evaluation(catalog, run_id, data.ks)
    data.lengths = catalog.rows(
        f"""SELECT iteration, avg(num_tokens) AS mean, quantile_cont(num_tokens, 0.5) AS p50,
                  quantile_cont(num_tokens, 0.9) AS p90, avg(CAST(truncated AS DOUBLE)) AS truncated
           FROM rollouts WHERE run_id = $run AND {SAMPLED} GROUP BY iteration ORDER BY iteration""", run)
    data.train = catalog.rows("SELECT * FROM train_metrics WHERE run_id = $run ORDER BY step", run)
    for row in catalog.rows(
        f"SELECT iteration, status, count(*) AS n FROM scores WHERE run_id = $run AND {SAMPLED} "
        "GROUP BY ALL ORDER BY ALL", run
    ):
        data.statuses.setdefault(row["iteration"], {})[row["status"]] = row["n"]
    # A stage's seconds are recorded in each of its outputs' manifests (train has two): one value per stage
    # instance, and the instances of one iteration (dynamic-sampling rounds of generate and score) add up.
    for row in catalog.rows(
        """SELECT iter, stage, sum(seconds) AS seconds FROM (
               SELECT iter, round, stage, max(seconds) AS seconds FROM manifests
               WHERE run_id = $run AND stage IS NOT NULL GROUP BY ALL)
           GROUP BY ALL ORDER BY ALL""", run
    ):
        label = "run" if row["stage"] in RUN_STAGES or row["iter"] is None or row["iter"] < 0 else str(row["iter"])
        data.stage_seconds.setdefault(label, {})[row["stage"]] = row["seconds"]
    iterations = sorted({r["iteration"] for r in data.reward} | {r["iteration"] for r in data.lengths})
    data.iterations = iterations
    data.last_iteration = iterations[-1] if iterations else None
    if data.last_iteration is not None:
        query = """SELECT s.*, p.messages FROM samples s
                    LEFT JOIN (SELECT DISTINCT ON (run_id, prompt_id) run_id, prompt_id, messages FROM prompts) p
                      ON p.run_id = s.run_id AND p.prompt_id = s.prompt_id
                    WHERE s.run_id = $run AND s.iteration = $iteration AND s.reward IS NOT NULL
                    ORDER BY s.reward {order}, s.advantage {order} NULLS LAST, s.prompt_id, s.sample_idx
                    LIMIT 5"""
        params = {"run": run_id, "iteration": data.last_iteration}
        data.best = catalog.rows(query.format(order="DESC"), params)
        data.worst = catalog.rows(query.format(order="ASC"), params)
    data.devices = _devices(catalog, run_id)
    if config is not None and config.generate.multi_turn.mode != "off":
        data.multi_turn = catalog.rows(
            f"""SELECT iteration, avg(num_turns) AS turns, avg(tool_calls) AS tool_calls,
                      sum(tool_errors) / nullif(sum(tool_calls), 0) AS tool_error_rate
               FROM rollouts WHERE run_id = $run AND {SAMPLED} GROUP BY iteration ORDER BY iteration""", run)
    # One row per iteration and function: an iteration's generation rounds pooled (mean over the calls with a value).
    data.reward_functions = catalog.rows(
        """SELECT iter AS iteration, function, sum(calls) AS calls, sum(errors) AS errors,
                  sum(errors) / sum(calls) AS error_frac, sum(mean * "values") / sum("values") AS mean,
                  arg_min(first_error, round) FILTER (WHERE first_error <> '') AS first_error
           FROM reward_functions WHERE run_id = $run AND stage = 'score' AND calls > 0
           GROUP BY ALL ORDER BY iteration, function""", run)
    data.notes = [f"{s.path}: {s.reason}" for s in catalog.skipped]
    data.failure = read_failure(RunLayout.create(catalog.root, run_id))
    return data


def optimizer_steps(train: list[dict[str, Any]]) -> tuple[int, list[int], int]:
    """(steps taken, iterations whose train step was skipped, steps whose update was not applied) from the
    train_metrics rows: a skipped iteration (no kept sample with a nonzero advantage: the checkpoint is a copy)
    has one row with skipped = True; a step whose gradient was not finite is computed but not applied."""
    skipped = sorted({r["iteration"] for r in train if r.get("skipped")})
    not_applied = sum(1 for r in train if not r.get("skipped") and not _finite(r.get("grad_norm")))
    return sum(1 for r in train if not r.get("skipped")) - not_applied, skipped, not_applied


def describe_steps(train: list[dict[str, Any]]) -> str:
    """`3 taken, 2 skipped (iterations 0, 1: no kept sample with a nonzero advantage)`, as plain text."""
    taken, skipped, not_applied = optimizer_steps(train)
    parts = [f"{taken} taken"]
    if skipped:
        parts.append(f"{len(skipped)} skipped (iteration{'s' if len(skipped) > 1 else ''} "
                     f"{', '.join(map(str, skipped))}: no kept sample with a nonzero advantage)")
    if not_applied:
        parts.append(f"{not_applied} not applied (gradient not finite)")
    return ", ".join(parts)


# --- rendering ---------------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1200px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.meta { color: #666; font-size: 13px; } .grid { display: flex; flex-wrap: wrap; gap: 16px; }
.card { border: 1px solid #e2e2e2; border-radius: 6px; padding: 6px; background: #fff; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #eee; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { white-space: pre-wrap; background: #f7f7f7; padding: 6px; margin: 4px 0; max-width: 640px;
      font-size: 12px; }
.kpi { display: inline-block; margin-right: 28px; } .kpi b { font-size: 20px; display: block; }
.note { color: #a15c00; font-size: 13px; }
.failed { color: #fff; background: #b3261e; padding: 6px 10px; border-radius: 4px; font-weight: 600; }
"""

# Marks each chart with its laid-out size once the page has rendered (headless tests read the attribute).
SCRIPT = """
window.addEventListener('load', function () {
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var box = svg.getBoundingClientRect();
    var marks = svg.querySelectorAll('polyline.series, rect.bar, circle.point').length;
    svg.setAttribute('data-rendered', Math.round(box.width) + 'x' + Math.round(box.height) + ':' + marks);
  });
  document.body.setAttribute('data-charts-rendered', document.querySelectorAll('svg[data-rendered]').length);
});
"""


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return escape(str(value))


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" <span class='meta'>[{interval[0]:.1%}, {interval[1]:.1%}]</span>"


def interval_band(rows: list[dict[str, Any]], metric: str) -> tuple[list[float | None], list[float | None]]:
    """(lows, highs) of `metric`'s recorded 95% interval (`<metric>_ci`) in each evaluation row (None: none)."""
    intervals = [r.get(f"{metric}_ci") for r in rows]
    return [i[0] if i else None for i in intervals], [i[1] if i else None for i in intervals]


def iteration_labels(iterations: set[int]) -> dict[float, str]:
    """x-axis labels of iteration charts: the base model's evaluation (iteration -1) is `base`."""
    return {float(i): ("base" if i < 0 else str(i)) for i in sorted(iterations)}


def _charts(data: ReportData) -> list[str]:
    labels = iteration_labels({r["iteration"] for r in data.evaluation} | set(data.iterations))
    xs = [float(r["iteration"]) for r in data.reward]
    charts = [line_chart(
        "chart-reward", "Training reward per iteration",
        [Series("mean reward", xs, [r["mean_reward"] for r in data.reward]),
         Series("solve rate", xs, [r["solve_rate"] for r in data.reward], dashed=True)],
        "iteration", "reward", y_range=(0.0, 1.0), x_labels=labels,
    )]
    ev_series = []
    datasets = sorted({r["dataset"] for r in data.evaluation})
    for dataset in datasets:
        rows = [r for r in data.evaluation if r["dataset"] == dataset]
        xs_ev = [float(r["iteration"]) for r in rows]
        named = f"{dataset} " if len(datasets) > 1 else ""
        ev_series += [Series(f"{named}pass@{k}", xs_ev, [r.get(f"pass@{k}") for r in rows],
                             band=interval_band(rows, f"pass@{k}")) for k in data.ks]
        ev_series.append(Series(f"{named}greedy accuracy", xs_ev, [r["greedy"] for r in rows], dashed=True))
    charts.append(line_chart("chart-pass-at-k", "Held-out pass@k, 95% interval (base = before training)",
                             ev_series, "iteration", "fraction of prompts", y_range=(0.0, 1.0),
                             x_labels=labels))
    len_xs = [float(r["iteration"]) for r in data.lengths]
    charts.append(line_chart(
        "chart-length", "Response length (tokens)",
        [Series("mean", len_xs, [r["mean"] for r in data.lengths]),
         Series("median", len_xs, [r["p50"] for r in data.lengths], dashed=True),
         Series("90th percentile", len_xs, [r["p90"] for r in data.lengths], dashed=True)],
        "iteration", "tokens", y_range=(0.0, None), x_labels=labels,
    ))
    charts.append(line_chart(
        "chart-truncated", "Truncated responses (hit max_new_tokens)",
        [Series("truncated", len_xs, [r["truncated"] for r in data.lengths])],
        "iteration", "fraction", y_range=(0.0, None), x_labels=labels,
    ))
    if data.multi_turn:  # how the agent loop's use moves with training
        mt_xs = [float(r["iteration"]) for r in data.multi_turn]
        charts.append(line_chart(
            "chart-multi-turn", "Multi-turn rollouts: turns and tool calls per answer",
            [Series("turns", mt_xs, [r["turns"] for r in data.multi_turn]),
             Series("tool calls", mt_xs, [r["tool_calls"] for r in data.multi_turn]),
             Series("tool error rate (errors / calls)", mt_xs, [r["tool_error_rate"] for r in data.multi_turn],
                    dashed=True)],
            "iteration", "per answer", y_range=(0.0, None), x_labels=labels,
        ))
    trained = [r for r in data.train if not r.get("skipped")]
    steps = [float(r["step"]) for r in trained]

    def metric(name: str) -> list[float | None]:
        return [r.get(name) for r in trained]

    clip = [Series("clip fraction low", steps, metric("clip_frac_low")),
            Series("clip fraction high", steps, metric("clip_frac_high"))]
    if trained and "clip_frac_dual" in trained[0]:
        clip.append(Series("dual clip", steps, metric("clip_frac_dual"), dashed=True))
    charts.append(line_chart("chart-clip", "Clip fraction per optimizer step", clip, "step", "fraction of tokens",
                             y_range=(0.0, None)))
    kl = [Series("approx KL", steps, metric("approx_kl"))]
    if trained and "kl_ref" in trained[0]:
        kl.append(Series("KL to ref.", steps, metric("kl_ref"), dashed=True))
    charts.append(line_chart("chart-kl", "KL per optimizer step", kl, "step", "nats per token", y_range=(0.0, None)))
    charts.append(line_chart("chart-entropy", "Policy entropy per optimizer step",
                             [Series("entropy", steps, metric("entropy"))], "step", "nats per token",
                             y_range=(0.0, None)))
    iterations = sorted(data.statuses)
    statuses = [s for s in STATUS_COLOURS if any(s in data.statuses[i] for i in iterations)]
    statuses += sorted({s for i in iterations for s in data.statuses[i]} - set(statuses))
    charts.append(stacked_bar_chart(
        "chart-status", "Sandbox status mix per iteration", [str(i) for i in iterations],
        {s: [float(data.statuses[i].get(s, 0)) for i in iterations] for s in statuses},
        "iteration", "share of samples", colours=STATUS_COLOURS, normalise=True,
    ))
    functions = sorted({r["function"] for r in data.reward_functions})
    if functions:  # a chart only where the score stages recorded their reward functions
        charts.append(line_chart(
            "chart-reward-functions", "Reward per function (mean value, before its weight)",
            [Series(name, [float(r["iteration"]) for r in rows], [r["mean"] for r in rows])
             for name in functions for rows in [[r for r in data.reward_functions if r["function"] == name]]],
            "iteration", "mean value", x_labels=labels,
        ))
    columns = sorted(data.stage_seconds, key=lambda c: (c != "run", int(c) if c.isdigit() else -1))
    stages = [s for s in (*RUN_STAGES, *STAGES) if any(s in data.stage_seconds[c] for c in columns)]
    per_unit, unit = duration_unit(max((sum(float(v or 0.0) for v in data.stage_seconds[c].values()) for c in columns),
                                       default=0.0))
    charts.append(stacked_bar_chart(
        "chart-stage-time", "Time per stage", columns,
        {s: [float(data.stage_seconds[c].get(s) or 0.0) / per_unit for c in columns] for s in stages},
        "iteration (run = run-level stages)", unit,
    ))
    return charts


def _prompt_text(messages: str | None) -> str:
    try:
        items = json.loads(messages or "[]")
        return "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in items if m.get("role") != "system")
    except (json.JSONDecodeError, AttributeError):
        return messages or ""


def _samples_table(title: str, rows: list[dict[str, Any]], css_class: str) -> str:
    if not rows:
        return f"<h3>{escape(title)}</h3><p class='meta'>no scored samples</p>"
    head = "".join(f"<th>{escape(c)}</th>" for c in SAMPLE_COLUMNS) + "<th>prompt / response / tests</th>"
    body = []
    for row in rows:
        cells = []
        for column in SAMPLE_COLUMNS:
            value = row.get(column)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            cells.append(f"<td class='num'>{_num(value)}</td>" if numeric else f"<td>{_num(value)}</td>")
        tests = row.get("tests") or "[]"
        try:
            tests_text = "\n".join(f"{'✓' if t.get('passed') else '✗'} {t.get('name')} {t.get('message') or ''}"
                                   for t in json.loads(tests))
        except (json.JSONDecodeError, AttributeError):
            tests_text = tests
        details = (
            "<details><summary>show</summary>"
            f"<b>prompt</b><pre>{escape(_prompt_text(row.get('messages'))[:1500])}</pre>"
            f"<b>response</b><pre>{escape((row.get('response_text') or '')[:3000])}</pre>"
            f"<b>tests</b><pre>{escape(tests_text[:2000])}</pre></details>"
        )
        body.append(f"<tr>{''.join(cells)}<td>{details}</td></tr>")
    return (f"<h3>{escape(title)}</h3><table class='{css_class}'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def _summary(data: ReportData) -> str:
    parts = []
    for dataset in sorted({r["dataset"] for r in data.evaluation}):
        rows = [r for r in data.evaluation if r["dataset"] == dataset]
        first, last = rows[0], rows[-1]
        k = data.ks[0]
        parts.append(f"<span class='kpi'>{escape(dataset)} pass@{k} "
                     f"{'base' if first['iteration'] < 0 else first['iteration']} → {last['iteration']}"
                     f"<b>{_pct(first.get(f'pass@{k}'))} → {_pct(last.get(f'pass@{k}'))}</b></span>")
    if data.reward:
        parts.append(f"<span class='kpi'>mean train reward, last iteration<b>{_num(data.reward[-1]['mean_reward'])}"
                     "</b></span>")
        parts.append(f"<span class='kpi'>iterations with data<b>{len(data.iterations)}</b></span>")
    if data.train:
        taken, skipped, not_applied = optimizer_steps(data.train)
        parts.append(f"<span class='kpi'>optimizer steps taken<b>{taken}</b></span>")
        parts.append(f"<span class='kpi'>skipped or not applied<b>{len(skipped) + not_applied}</b></span>")
    status = "<p class='failed'>" + escape(f"Run {data.failure.describe()}") + "</p>" if data.failure else ""
    steps = f"<p class='meta'>optimizer steps: {escape(describe_steps(data.train))}</p>" if data.train else ""
    return status + "<div>" + "".join(parts) + "</div>" + steps


def describe_config(config: RunConfig | None) -> str:
    """One line of HTML naming what a run is: model, data, sizes, estimator, loss ('' without a config)."""
    if config is None:
        return ""
    sources = config.data.train if isinstance(config.data.train, list) else [config.data.train]
    train = " + ".join(s if isinstance(s, str) else str(getattr(s, "path", s)) for s in sources)  # a name or {path}
    return (f"model {escape(config.model.name_or_path)} · data {escape(train)} · "
            f"{config.iterations} iterations × {config.generate.prompts_per_iteration} prompts × "
            f"{config.generate.n_samples} samples · advantage {escape(config.advantage.estimator)} · "
            f"loss {escape(config.train.policy_loss)}")


def _reward_functions_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class='meta'>no score stage has recorded its reward functions yet</p>"
    body = "".join(
        f"<tr><td>{r['iteration']}</td><td>{escape(r['function'])}</td><td class='num'>{r['calls']}</td>"
        f"<td class='num'>{_num(r['mean'])}</td><td class='num'>{r['errors']} ({_pct(r['error_frac'])})</td>"
        f"<td>{escape(r['first_error'] or '')}</td></tr>"
        for r in rows
    )
    return ("<table class='reward-functions'><thead><tr><th>iteration</th><th>function</th><th>calls</th>"
            f"<th>mean</th><th>failed calls</th><th>first error</th></tr></thead><tbody>{body}</tbody></table>")


def reward_failure_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One warning per reward function that failed on some call: the iterations, the share, the first error."""
    notes = []
    for name in sorted({r["function"] for r in rows if r["errors"]}):
        failed = [r for r in rows if r["function"] == name and r["errors"]]
        errors, calls = sum(r["errors"] for r in failed), sum(r["calls"] for r in failed)
        notes.append(f"reward function {name} failed on {errors} of {calls} calls in iteration"
                     f"{'s' if len(failed) > 1 else ''} {', '.join(str(r['iteration']) for r in failed)}; "
                     f"first: {failed[0]['first_error']}")
    return notes


def _reward_by_source_table(rows: list[dict[str, Any]]) -> str:
    """Training reward per iteration and data_source; '' for a run with one source (nothing beside the chart)."""
    if not rows:
        return ""
    body = "".join(
        f"<tr><td>{r['iteration']}</td><td>{escape(r['data_source'])}</td><td class='num'>{r['rows']}</td>"
        f"<td class='num'>{_num(r['mean_reward'])}</td><td class='num'>{_pct(r['solve_rate'])}</td></tr>"
        for r in rows
    )
    return ("<h2>Training reward by data_source</h2><table class='reward-by-source'><thead><tr><th>iteration</th>"
            "<th>data_source</th><th>samples</th><th>mean reward</th><th>solve rate</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _devices_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class='meta'>no model stage has recorded its device yet</p>"
    body = "".join(
        f"<tr><td>{escape(r['stage'])}</td><td>{'base' if (r['iteration'] or 0) < 0 else r['iteration']}"
        + (f".{r['round']}" if r["round"] else "") + f"</td><td>{escape(str(r['device']))}</td>"
        + f"<td>{escape(str(r['gpu_name'])) + ' x ' + str(r['gpu_count']) if r.get('gpu_name') else '–'}</td>"
        + f"<td>{escape(str(r['dtype']))}</td><td class='num'>{_num(r.get('peak_gpu_memory_mb'), 0)}</td>"
        + f"<td class='num'>{_num(r.get('tokens_per_second'), 1)}</td></tr>"
        for r in rows
    )
    return ("<table><thead><tr><th>stage</th><th>iteration</th><th>device</th><th>GPU</th><th>dtype</th>"
            f"<th>peak GPU MB</th><th>tokens/s</th></tr></thead><tbody>{body}</tbody></table>")


def render(data: ReportData) -> str:
    """The whole page as one HTML string (no external references)."""
    described = describe_config(data.config)
    charts = "".join(f"<div class='card'>{chart}</div>" for chart in _charts(data))
    mode = data.config.generate.multi_turn.mode if data.config else "off"
    evaluation_rows = "".join(
        "<tr><td>" + ("base" if r["iteration"] < 0 else str(r["iteration"])) + f"</td><td>{escape(r['dataset'])}</td>"
        + "".join(f"<td class='num'>{_pct(r.get(f'pass@{k}'))}{_interval(r.get(f'pass@{k}_ci'))}</td>"
                  for k in data.ks)
        + f"<td class='num'>{_pct(r['greedy'])}</td><td class='num'>{r['prompts']}</td>"
        + ("".join(f"<td class='num'>{escape(cell)}</td>" for cell in multi_turn_cells(r.get("summary", {}), mode))
           if mode != "off" else "")
        + "</tr>"
        for r in data.evaluation
    )
    evaluation_table = (
        "<table><thead><tr><th>iteration</th><th>dataset</th>" + "".join(f"<th>pass@{k} [95% CI]</th>" for k in data.ks)
        + "<th>greedy</th><th>prompts</th>"
        + ("".join(f"<th>{column}</th>" for column in MULTI_TURN_COLUMNS) if mode != "off" else "")
        + f"</tr></thead><tbody>{evaluation_rows}</tbody></table>"
        if data.evaluation else "<p class='meta'>no evaluation yet</p>"
    )
    notes = "".join(f"<p class='note'>{escape(n)}</p>" for n in reward_failure_notes(data.reward_functions))
    notes += "".join(f"<p class='note'>not read: {escape(n)}</p>" for n in data.notes)
    last = "–" if data.last_iteration is None else str(data.last_iteration)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rlpipe report · {escape(data.run_id)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body data-run="{escape(data.run_id)}">
<h1>rlpipe run {escape(data.run_id)}</h1>
<p class="meta">{described}<br>root {escape(data.root)} · generated {generated} · rlpipe {escape(code_version())}</p>
{_summary(data)}{notes}
<h2>Plots</h2><div class="grid">{charts}</div>
<h2>Held-out evaluation</h2>{evaluation_table}
{_reward_by_source_table(data.reward_by_source)}
<h2>Reward functions: mean value and failed calls per iteration</h2>{_reward_functions_table(data.reward_functions)}
<h2>Model stages: device, memory, speed</h2>{_devices_table(data.devices)}
<h2>Best and worst samples of the last iteration ({last})</h2>
{_samples_table("best", data.best, "best")}
{_samples_table("worst", data.worst, "worst")}
<script>{SCRIPT}</script>
</body></html>
"""


def report_path(layout: RunLayout) -> str:
    return join(layout.run_dir, "report.html")


def build_report(layout: RunLayout, config: RunConfig | None) -> str:
    """The report's HTML for one run, given its config (`read_config`; the flow passes the one it holds)."""
    with Catalog(layout.root, [layout.run_id]) as catalog:
        return render(collect(catalog, layout.run_id, config))


def write_report(layout: RunLayout, config: RunConfig | None) -> str:
    """Write `runs/<run_id>/report.html` (atomically; local or S3) and return its path."""
    path = report_path(layout)
    atomic_write_bytes(layout.fs, path, build_report(layout, config).encode())
    return path
