"""`rlpipe report RUN1 RUN2 ...`: several runs' curves overlaid on one self-contained HTML page.

The way runs are compared in an experiment tracker: one colour per run, the same charts for every run:
training reward (solve rate dashed) per iteration; held-out pass@k per dataset and k with its 95% bootstrap
band (the base model's evaluation at `base`); mean response length; KL per optimizer step; time per stage.
A table below puts each run's configuration, last training reward, last evaluation and optimizer steps (taken,
skipped) side by side, and marks a run that failed with its stage and reason (its failure record).

The numbers are `reports.html.collect`'s, run by run, from one catalog over all the runs: a run shows here
exactly what its own report shows. The page reuses the single-run report's style and its render check
script (every chart is marked once laid out), so the same headless test reads both.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from html import escape

from reports.html import (
    CSS,
    RUN_STAGES,
    SCRIPT,
    STAGES,
    ReportData,
    _interval,
    _num,
    _pct,
    collect,
    describe_config,
    describe_steps,
    interval_band,
    iteration_labels,
    read_config,
)
from reports.svg import PALETTE, Series, duration_unit, line_chart, stacked_bar_chart
from storage.catalog import Catalog
from storage.fs import atomic_write_bytes, filesystem, join, normalize_root
from storage.layout import RunLayout
from storage.manifest import code_version


class UnknownRun(LookupError):
    """A run named for a report (one run's or a comparison) has no config under the root."""


def require_runs(root: str, run_ids: list[str]) -> list[RunLayout]:
    """The runs' layouts; UnknownRun names those without a config under `root` and the runs that are there (a
    run whose `rlpipe run` was refused before it started, or a misspelt name, is not left out silently)."""
    layouts = [RunLayout.create(root, run_id) for run_id in run_ids]
    missing = [layout.run_id for layout in layouts if not layout.fs.exists(layout.config_path)]
    if missing:
        fs, runs_dir = layouts[0].fs, layouts[0].runs_dir
        present = sorted(path.split("/")[-2] for path in fs.glob(join(runs_dir, "*", "config.yaml")))
        raise UnknownRun(f"no run {', '.join(missing)} under {layouts[0].root} (no runs/<run>/config.yaml); "
                         f"runs there: {', '.join(present) or 'none'}")
    return layouts


def collect_runs(root: str, run_ids: list[str]) -> list[ReportData]:
    """Each run's report numbers, in the order given, read through one catalog over all of them."""
    layouts = require_runs(root, run_ids)
    with Catalog(root, run_ids) as catalog:
        return [collect(catalog, layout.run_id, read_config(layout)) for layout in layouts]


def run_colours(runs: list[ReportData]) -> dict[str, str]:
    return {run.run_id: PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def comparison_charts(runs: list[ReportData]) -> list[str]:
    colours = run_colours(runs)
    labels = iteration_labels({r["iteration"] for run in runs for r in run.evaluation}
                              | {i for run in runs for i in run.iterations})
    reward: list[Series] = []
    for run in runs:
        xs = [float(r["iteration"]) for r in run.reward]
        reward += [Series(run.run_id, xs, [r["mean_reward"] for r in run.reward], colour=colours[run.run_id]),
                   Series(f"{run.run_id} solve rate", xs, [r["solve_rate"] for r in run.reward],
                          colour=colours[run.run_id], dashed=True)]
    charts = [line_chart("chart-reward", "Training reward per iteration (solve rate dashed)", reward, "iteration",
                         "reward", y_range=(0.0, 1.0), x_labels=labels)]
    datasets = sorted({r["dataset"] for run in runs for r in run.evaluation})
    ks = sorted({k for run in runs for k in run.ks})
    for dataset in datasets:
        for k in ks:
            series = []
            for run in runs:
                rows = [r for r in run.evaluation if r["dataset"] == dataset]
                if rows and k in run.ks:
                    series.append(Series(run.run_id, [float(r["iteration"]) for r in rows],
                                         [r.get(f"pass@{k}") for r in rows], colour=colours[run.run_id],
                                         band=interval_band(rows, f"pass@{k}")))
            charts.append(line_chart(
                f"chart-pass-at-{k}-{_slug(dataset)}", f"Held-out {dataset} pass@{k}, 95% interval", series,
                "iteration", "fraction of prompts", y_range=(0.0, 1.0), x_labels=labels,
            ))
    charts.append(line_chart(
        "chart-length", "Mean response length (tokens)",
        [Series(run.run_id, [float(r["iteration"]) for r in run.lengths], [r["mean"] for r in run.lengths],
                colour=colours[run.run_id]) for run in runs],
        "iteration", "tokens", y_range=(0.0, None), x_labels=labels,
    ))
    if multi_turn := [run for run in runs if run.multi_turn]:
        charts.append(line_chart(
            "chart-multi-turn", "Tool calls per answer in the rollouts (turns dashed)",
            [series for run in multi_turn for series in (
                Series(run.run_id, [float(r["iteration"]) for r in run.multi_turn],
                       [r["tool_calls"] for r in run.multi_turn], colour=colours[run.run_id]),
                Series(f"{run.run_id} turns", [float(r["iteration"]) for r in run.multi_turn],
                       [r["turns"] for r in run.multi_turn], colour=colours[run.run_id], dashed=True))],
            "iteration", "per answer", y_range=(0.0, None), x_labels=labels,
        ))
    kl = []
    for run in runs:
        trained = [r for r in run.train if not r.get("skipped")]
        kl.append(Series(run.run_id, [float(r["step"]) for r in trained], [r.get("approx_kl") for r in trained],
                         colour=colours[run.run_id]))
    charts.append(line_chart("chart-kl", "Approx. KL to the sampling policy per optimizer step", kl, "step",
                             "nats per token", y_range=(0.0, None)))
    stages = [s for s in (*RUN_STAGES, *STAGES) if any(s in c for run in runs for c in run.stage_seconds.values())]
    per_unit, unit = duration_unit(max((_total_seconds(run) for run in runs), default=0.0))
    charts.append(stacked_bar_chart(
        "chart-stage-time", "Time per stage, whole run", [run.run_id for run in runs],
        {s: [sum(float(c.get(s) or 0.0) for c in run.stage_seconds.values()) / per_unit for run in runs]
         for s in stages},
        "run", unit,
    ))
    return charts


def _total_seconds(run: ReportData) -> float:
    return sum(float(v or 0.0) for column in run.stage_seconds.values() for v in column.values())


def comparison_table(runs: list[ReportData]) -> str:
    """One row per run: configuration, last training reward, and per held-out dataset the base and the last
    evaluated checkpoint's first pass@k with its interval."""
    colours = run_colours(runs)
    datasets = sorted({r["dataset"] for run in runs for r in run.evaluation})
    head = ("<tr><th>run</th><th>configuration</th><th>last mean reward</th>"
            + "".join(f"<th>{escape(d)} pass@k: base → last [95% CI]</th>" for d in datasets)
            + "<th>optimizer steps</th><th>stage seconds</th></tr>")
    body = []
    for run in runs:
        k = run.ks[0]
        cells = []
        for dataset in datasets:
            rows = [r for r in run.evaluation if r["dataset"] == dataset]
            if not rows:
                cells.append("<td>–</td>")
                continue
            first, last = rows[0], rows[-1]
            cells.append(f"<td class='num'>pass@{k} {_pct(first.get(f'pass@{k}'))} → {_pct(last.get(f'pass@{k}'))}"
                         f"{_interval(last.get(f'pass@{k}_ci'))}</td>")
        last_reward = run.reward[-1]["mean_reward"] if run.reward else None
        failed = f"<p class='failed'>{escape(run.failure.describe())}</p>" if run.failure else ""
        body.append(f"<tr data-run='{escape(run.run_id)}'><td><b style='color:{colours[run.run_id]}'>"
                    f"{escape(run.run_id)}</b>{failed}</td><td class='meta'>{describe_config(run.config)}</td>"
                    f"<td class='num'>{_num(last_reward)}</td>{''.join(cells)}"
                    f"<td>{escape(describe_steps(run.train)) if run.train else '–'}</td>"
                    f"<td class='num'>{_total_seconds(run):.0f}</td></tr>")
    return f"<table class='runs'><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


def render_comparison(runs: list[ReportData], root: str) -> str:
    """The whole comparison page as one HTML string (no external references)."""
    names = " · ".join(run.run_id for run in runs)
    charts = "".join(f"<div class='card'>{chart}</div>" for chart in comparison_charts(runs))
    notes = "".join(f"<p class='note'>{escape(run.run_id)}: not read: {escape(n)}</p>" for run in runs
                    for n in run.notes)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rlpipe runs · {escape(names)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body data-runs="{escape(' '.join(run.run_id for run in runs))}">
<h1>rlpipe runs {escape(names)}</h1>
<p class="meta">root {escape(root)} · generated {generated} · rlpipe {escape(code_version())}</p>
{comparison_table(runs)}{notes}
<h2>Plots</h2><div class="grid">{charts}</div>
<script>{SCRIPT}</script>
</body></html>
"""


def comparison_path(root: str, run_ids: list[str]) -> str:
    """Where `rlpipe report A B` writes by default: `<root>/reports/compare-A-vs-B.html`."""
    return join(normalize_root(root), "reports", f"compare-{'-vs-'.join(run_ids)}.html")


def build_comparison(root: str, run_ids: list[str]) -> str:
    root = normalize_root(root)
    return render_comparison(collect_runs(root, run_ids), root)


def write_comparison(root: str, run_ids: list[str]) -> str:
    """Write the comparison page of `run_ids` (atomically; local or S3) and return its path."""
    path = comparison_path(root, run_ids)
    atomic_write_bytes(filesystem(path), path, build_comparison(root, run_ids).encode())
    return path
