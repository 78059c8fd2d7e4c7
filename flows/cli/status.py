"""`rlpipe status RUN`: a table of iteration × stage with done/missing, rows and seconds.

Below it the training reward by iteration (and by verl `data_source` where the training prompts have two or more)
and the held-out results per dataset (and per data_source where a test file mixes sources, as the evaluate stage
recorded them).

Extra dynamic-sampling rounds of an iteration (generate and score, `iter=k/round=RR/`) get a row of their
own under it, `k.r`, for every round that left any output, finished or not. A stage instance the run's failure
record names reads "failed (exit code N)", and a last line gives the stage and the reason (storage/failure.py).
A fork's shared stage instance reads "shared from RUN" (`rlpipe fork`, storage/sharing.py); its tables are read
where its manifests say (`storage.manifest.located`: the origin's files on S3).
A `disk:` line gives what the run holds on its root, what retention pruned, and the root's free space.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from reports.html import MULTI_TURN_COLUMNS, data_source_label, multi_turn_cells
from schemas.tables import BASELINE_SAMPLE_IDX, TABLES
from stages.evaluation.metrics import clusters_of, data_sources_of, paired_gains
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, StageState, instance, is_scheduled, stage_state
from storage.failure import StageFailure, read_failure
from storage.layout import BASE
from storage.manifest import located
from storage.retention import disk_usage
from storage.run import Run
from storage.tables import read_table


def _cell(run: Run, stage: str, iteration: int, round_idx: int = 0, failure: StageFailure | None = None) -> str:
    if iteration != BASE and not is_scheduled(run.config, stage, iteration):
        return "[dim]not scheduled[/]"
    target = instance(stage, iteration, round_idx)
    state = stage_state(run, target)
    if not state.done and failure is not None and failure.label == target.label:
        return f"[red]failed (exit code {failure.exit_code})[/]"
    shared_from = next((m.shared_from["run"] for m in state.manifests if m.shared_from), None)
    if not state.done and shared_from and state.reason == "output changed":
        return f"[red]shared from {escape(shared_from)}, lost[/]"  # refused at the next resume (storage/sharing.py)
    if not state.done:
        return f"[yellow]{state.reason}[/]"
    main = state.manifests[-1]
    size = f"{main.rows} rows" if main.rows is not None else f"{main.bytes / 1e6:.0f} MB"
    if shared_from:
        return f"[green]shared[/] from {escape(shared_from)} {size}"
    return f"[green]done[/] {size} {main.seconds:.0f}s"


def status_table(run: Run) -> Group:
    run_table = Table(title=f"run {run.run_id} ({run.layout.run_dir})")
    for stage in RUN_STAGES:
        run_table.add_column(stage)
    failure = read_failure(run.layout)
    run_table.add_row(*[_cell(run, stage, BASE, failure=failure) for stage in RUN_STAGES])
    table = Table()
    table.add_column("iteration")
    for stage in ITERATION_STAGES:
        table.add_column(stage)
    for k in range(run.config.iterations):
        table.add_row(str(k), *[_cell(run, stage, k, failure=failure) for stage in ITERATION_STAGES])
        for r in extra_rounds(run, k):
            table.add_row(f"{k}.{r}", *[_cell(run, s, k, r, failure) if STAGES[s].per_round else ""
                                         for s in ITERATION_STAGES])
    devices = device_table(run)
    functions = reward_function_table(run)
    by_source = training_by_source_table(run)
    multi_turn = multi_turn_table(run)
    failed = [Text(f"✗ {failure.describe()}", style="red")] if failure else []  # the run's failure record
    rewards = [shown for shown in (by_source, functions) if shown.row_count]
    return Group(run_table, table, *([devices] if devices.row_count else []), training_table(run), *rewards,
                 held_out_table(run), *([multi_turn] if multi_turn is not None else []), disk_line(run), *failed)


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def disk_line(run: Run) -> Text:
    """What the run holds on its root (tables and the rest; checkpoints, how many keep their weights), what
    retention pruned (train.keep_checkpoints, keep_optimizer_states) and the root's free space (n/a on S3)."""
    usage = disk_usage(run.layout, run.config.iterations)
    pruned = f"{usage.checkpoints_pruned} checkpoints, {usage.optimizer_states_pruned} optimizer states"
    free = "n/a (S3)" if usage.free_bytes is None else _size(usage.free_bytes)
    return Text(f"disk: tables {_size(usage.table_bytes)} · checkpoints {_size(usage.checkpoint_bytes)} "
                f"({usage.checkpoints_kept} kept) · pruned {pruned} ({_size(usage.pruned_bytes)} freed) · "
                f"free on root {free}")


MODEL_STAGES = ("generate", "train", "evaluate")


def device_table(run: Run) -> Table:
    """Where each finished model stage ran and how fast, from its manifest (`device`, stages/generation/device.py):
    device, GPU name x count, dtype, peak GPU memory (torch's max allocated; the driver's figure for vLLM's
    engine) and tokens/s. Stages whose manifests predate the record are left out."""
    table = Table(title="model stages: device, memory, speed")
    for column in ["stage", "iteration", "device", "gpu", "dtype", "peak GPU MB", "tokens/s"]:
        table.add_column(column, no_wrap=column in ("stage", "gpu"))
    instances = [("evaluate_base", BASE)] + [(stage, k) for k in range(run.config.iterations) for stage in MODEL_STAGES]
    for stage, iteration in instances:
        if iteration != BASE and not is_scheduled(run.config, stage, iteration):
            continue
        state = stage_state(run, instance(stage, iteration))
        record = state.manifests[-1].metrics.get("device") if state.done else None
        if not isinstance(record, dict):
            continue
        metrics = state.manifests[-1].metrics
        gpu = f"{record['gpu_name']} x {record['gpu_count']}" if record.get("gpu_name") else "-"
        peak = record.get("peak_gpu_memory_mb")
        speed = metrics.get("tokens_per_second")
        table.add_row(stage, "base" if iteration == BASE else str(iteration), record["device"], gpu, record["dtype"],
                      "-" if peak is None else f"{peak:,.0f}", "-" if speed is None else f"{speed:,.1f}")
    return table


def training_rows(run: Run, iteration: int) -> list[dict]:
    """The policy's scored samples of one iteration, every generation round (not remax's greedy rows)."""
    rows = []
    for round_idx in [0, *extra_rounds(run, iteration)]:
        if stage_state(run, instance("score", iteration, round_idx)).done:
            path = located(run.fs, run.layout.table_path("scores", iteration, round_idx))
            scores = read_table(run.fs, path, TABLES["scores"]).select(["prompt_id", "reward", "status", "sample_idx"])
            rows += [row for row in scores.to_pylist() if row["sample_idx"] != BASELINE_SAMPLE_IDX]
    return rows


def training_table(run: Run) -> Table:
    """Training reward by iteration, from the scores tables of every generation round: samples, mean reward,
    share solved (status ok, every test passed), and the groups the batch kept (the others had no reward
    variance: nothing to learn from). The curve a first run shows moving."""
    table = Table(title="training reward by iteration")
    for column in ["iteration", "samples", "mean reward", "solved", "groups kept"]:
        table.add_column(column, justify="right")
    for k in range(run.config.iterations):
        rows = training_rows(run, k)
        if not rows:
            continue
        batch = stage_state(run, instance("advantage", k))
        kept = f"{batch.manifests[-1].metrics['groups_kept']}/{batch.manifests[-1].metrics['groups']}" if (
            batch.done) else ""
        solved = sum(row["status"] == "ok" for row in rows) / len(rows)
        table.add_row(str(k), str(len(rows)), f"{sum(row['reward'] for row in rows) / len(rows):.3f}", f"{solved:.3f}",
                      kept)
    return table


def training_by_source_table(run: Run) -> Table:
    """With training prompts from two or more verl `data_source`s (a row without one: its dataset), the training
    reward of each by iteration: samples, mean reward, share solved. Empty for a run with one source."""
    table = Table(title="training reward by data_source")
    for column in ["iteration", "data_source", "samples", "mean reward", "solved"]:
        table.add_column(column, justify="left" if column == "data_source" else "right")
    prompts_path = located(run.fs, run.layout.prompts_path)
    if not run.fs.exists(prompts_path):
        return table
    prompts = read_table(run.fs, prompts_path, TABLES["prompts"]).to_pylist()
    sources = data_sources_of([row for row in prompts if row["split"] == "train"])
    if len(set(sources.values())) < 2:
        return table
    for k in range(run.config.iterations):
        rows = training_rows(run, k)
        for source in sorted({sources[row["prompt_id"]] for row in rows}):
            mine = [row for row in rows if sources[row["prompt_id"]] == source]
            solved = sum(row["status"] == "ok" for row in mine) / len(mine)
            table.add_row(str(k), source, str(len(mine)), f"{sum(row['reward'] for row in mine) / len(mine):.3f}",
                          f"{solved:.3f}")
    return table


def reward_function_table(run: Run) -> Table:
    """Each score.rewards term by iteration (and generation round), from the score stages' manifests
    (`reward_functions`, stages/sandbox/rewards.py): calls, mean value, and the calls that failed (raised, ran
    past score.timeout_s, returned NaN or not a number) with the first message and the user's file:line."""
    table = Table(title="reward functions by iteration")
    for column in ["iteration", "function", "calls", "mean", "failed", "first error"]:
        table.add_column(column, justify="right" if column in ("calls", "mean", "failed") else "left",
                         no_wrap=column != "first error")
    for k in range(run.config.iterations):
        for round_idx in [0, *extra_rounds(run, k)]:
            state = stage_state(run, instance("score", k, round_idx))
            functions = state.manifests[-1].metrics.get("reward_functions") if state.done else None
            for name, figures in (functions or {}).items():
                mean = figures["mean"]
                failed = f"[red]{figures['errors']} ({figures['error_frac']:.0%})[/]" if figures["errors"] else "0"
                table.add_row(f"{k}.{round_idx}" if round_idx else str(k), name, str(figures["calls"]),
                              "-" if mean is None else f"{mean:.3f}", failed, escape(figures["first_error"]))
    return table


def held_out_table(run: Run) -> Group:
    """Held-out results of the base model and of each evaluated checkpoint, side by side: greedy accuracy and
    pass@k with its bootstrap 95% interval (from the eval manifests); then, in a table of their own (so each
    fits a terminal), the gains over the base model with paired bootstrap intervals over the same problems
    (from the eval tables): sampled pass@1, greedy accuracy, and the mean reward of the sampled answers (the
    partial credit the training reward gives, which moves before whole problems flip to solved). With more
    than one held-out dataset, a last row pools them: the whole test split. Where the evaluate stage recorded
    summaries per verl data_source (a test file mixing sources), each source has rows of its own in both."""
    ks = run.config.evaluate.k
    results = Table(title="held-out evaluation (95% bootstrap intervals: problems or families, and samples)")
    for column in ["checkpoint", "dataset", "prompts", "greedy", *[f"pass@{k}" for k in ks]]:
        results.add_column(column, no_wrap=column == "checkpoint")
    gains = Table(title="gain over the base model (paired 95% intervals)")
    for column in ["checkpoint", "dataset", "pass@1", "greedy", "reward"]:
        gains.add_column(column, no_wrap=column == "checkpoint")
    base_rows: dict[str, list[dict]] = {}
    base_by_source: dict[str, list[dict]] = {}
    prompts_rows = prompt_rows(run)
    clusters, sources = clusters_of(prompts_rows), data_sources_of(prompts_rows)
    for label, iteration, state in evaluated_checkpoints(run):
        rows = eval_rows(run, iteration)
        metrics = state.manifests[-1].metrics
        # the evaluate stage records per-data_source summaries only where they differ from the per-dataset ones
        by_source = {data_source_label(name): summary for name, summary in metrics.get("data_sources", {}).items()}
        for dataset, summary in [*sorted(metrics.items()), *by_source.items()]:
            if not (isinstance(summary, dict) and "prompts" in summary):
                continue
            prompts = f"{summary['prompts']:.0f}"
            if summary.get("clusters", summary["prompts"]) < summary["prompts"]:
                prompts += f" ({summary['clusters']:.0f} families)"
            results.add_row(label, dataset, prompts, _number(summary.get("greedy_accuracy")),
                            *[_with_interval(summary, f"pass@{k}") for k in ks])
        source_rows = [{**row, "dataset": data_source_label(sources.get(row["prompt_id"], row["dataset"]))}
                       for row in rows] if by_source else []
        if iteration == BASE:
            base_rows, base_by_source = by_dataset(rows), by_dataset(source_rows)
        else:
            compared = checkpoint_gains(base_rows, rows, clusters)
            if by_source:  # each source on its own; pooled, they are the datasets' "all held out" row
                compared += [gain for gain in checkpoint_gains(base_by_source, source_rows, clusters)
                             if gain[0] != POOLED]
            for dataset, gain in compared:
                gains.add_row(label, dataset, *[_signed(*gain[name]) if name in gain else ""
                                                for name in ("pass@1", "greedy", "reward")])
    return Group(results, gains) if gains.row_count else Group(results)


def multi_turn_table(run: Run) -> Table | None:
    """With generate.multi_turn on: turns, tool calls per answer and tool error rate of each iteration's rollouts
    (every generation round; the generate manifests' figures), then of each evaluated checkpoint per held-out
    dataset, with solved-after-retry (the eval manifests'); `n/a` where the mode or the stage has none."""
    mode = run.config.generate.multi_turn.mode
    if mode == "off":
        return None
    table = Table(title=f"multi-turn rollouts and evaluation ({mode} mode)")
    for column in ("checkpoint", "dataset", *MULTI_TURN_COLUMNS):
        table.add_column(column, no_wrap=column == "checkpoint")
    for k in range(run.config.iterations):
        for round_idx in [0, *extra_rounds(run, k)]:
            state = stage_state(run, instance("generate", k, round_idx))
            figures = state.manifests[-1].metrics.get("multi_turn") if state.done else None
            if figures:
                label = f"rollouts {k}.{round_idx}" if round_idx else f"rollouts {k}"
                table.add_row(label, "train", *multi_turn_cells(rollout_summary(figures), mode))
    for label, _, state in evaluated_checkpoints(run):
        for dataset, summary in sorted(state.manifests[-1].metrics.items()):
            if isinstance(summary, dict) and "prompts" in summary:
                table.add_row(label, dataset, *multi_turn_cells(summary, mode))
    return table


def rollout_summary(figures: dict[str, Any]) -> dict[str, Any]:
    """A generate manifest's `multi_turn` figures in an evaluation summary's terms (multi_turn_cells): tool calls
    per answer over the rows (every finish reason counted once). Training answers are graded after the stage, so
    there is no solved-after-retry."""
    answers = sum(figures.get("finish_reasons", {}).values())
    return {"mean_turns": figures["mean_turns"], "tool_error_rate": figures.get("tool_error_rate"),
            "tool_calls_per_answer": figures["tool_calls"] / answers if answers else None}


def evaluated_checkpoints(run: Run) -> Iterator[tuple[str, int, StageState]]:
    """(label, iteration, state) of each checkpoint whose evaluation is done: the base model first."""
    checkpoints = [("base", "evaluate_base", BASE)]
    checkpoints += [(f"iter {k}", "evaluate", k) for k in range(run.config.iterations)]
    for label, stage, iteration in checkpoints:
        state = stage_state(run, instance(stage, iteration))
        if state.done:
            yield label, iteration, state


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _with_interval(summary: dict, metric: str) -> str:
    if metric not in summary:
        return ""
    interval = f" [{summary[metric + '_ci_low']:.3f}, {summary[metric + '_ci_high']:.3f}]" if (
        metric + "_ci_low" in summary) else ""
    return f"{summary[metric]:.3f}{interval}"


def prompt_rows(run: Run) -> list[dict]:
    """The run's prompts table as rows (none before its prompts stage ran), wherever its manifest says it is."""
    path = located(run.fs, run.layout.prompts_path)
    return read_table(run.fs, path, TABLES["prompts"]).to_pylist() if run.fs.exists(path) else []


def eval_rows(run: Run, iteration: int) -> list[dict]:
    """The eval table of `iteration` (BASE: the base model's) as rows, wherever its manifest says it is."""
    return read_table(run.fs, located(run.fs, run.layout.table_path("eval", iteration)), TABLES["eval"]).to_pylist()


def by_dataset(rows: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["dataset"], []).append(row)
    return grouped


POOLED = "all held out"  # the gains row of every held-out problem together


def checkpoint_gains(
    base_rows: dict[str, list[dict]], rows: list[dict], clusters: dict[str, str]
) -> list[tuple[str, dict[str, tuple[float, float, float]]]]:
    """(dataset, `paired_gains`) of a checkpoint's eval rows over the base model's, for each dataset both
    evaluated; then, with more than one, ("all held out", the gains pooled over every held-out problem): the
    whole test split, as a problem is in one source only (stages/data/sources.py refuses duplicates)."""
    compared = sorted(set(base_rows) & {row["dataset"] for row in rows})
    per_dataset = [(dataset, paired_gains(base_rows[dataset], [row for row in rows if row["dataset"] == dataset],
                                          clusters)) for dataset in compared]
    if len(compared) < 2:
        return per_dataset
    pooled_base = [row for dataset in compared for row in base_rows[dataset]]
    pooled = [row for row in rows if row["dataset"] in compared]
    return [*per_dataset, (POOLED, paired_gains(pooled_base, pooled, clusters))]


def _signed(gain: float, low: float, high: float) -> str:
    return f"{gain:+.3f} [{low:+.3f}, {high:+.3f}]"


def extra_rounds(run: Run, iteration: int) -> list[int]:
    """The dynamic-sampling rounds r >= 1 of `iteration` that left a manifest of any of their stages."""
    if run.config.advantage.target_groups is None:
        return []
    outputs = [spec.outputs for spec in STAGES.values() if spec.per_round]
    cap = run.config.advantage.round_cap
    found = []
    for r in range(1, cap) if cap is not None else itertools.count(1):
        if any(run.fs.exists(output.manifest_path(run.layout)) for of in outputs for output in of(iteration, r)):
            found.append(r)
        elif cap is None:  # unlimited rounds (max_generation_rounds 0) are made one after another from 1
            break
    return found
