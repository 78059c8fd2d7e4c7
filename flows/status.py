"""`rlpipe status RUN`: a table of iteration × stage with done/missing, rows and seconds.

Extra dynamic-sampling rounds of an iteration (generate and score, `iter=k/round=RR/`) get a row of their
own under it, `k.r`, for every round that left any output, finished or not.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from schemas.config import RunConfig
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, stage_state
from storage.layout import BASE, RunLayout


def _cell(layout: RunLayout, config: RunConfig, stage: str, iteration: int, round_idx: int = 0) -> str:
    state = stage_state(layout.fs, layout, config, STAGES[stage], iteration, round_idx)
    if not state.done:
        return f"[yellow]{state.reason}[/]"
    main = state.manifests[-1]
    size = f"{main.rows} rows" if main.rows is not None else f"{main.bytes / 1e6:.0f} MB"
    return f"[green]done[/] {size} {main.seconds:.0f}s"


def status_table(layout: RunLayout, config: RunConfig) -> Group:
    run_table = Table(title=f"run {layout.run_id} ({layout.run_dir})")
    for stage in RUN_STAGES:
        run_table.add_column(stage)
    run_table.add_row(*[_cell(layout, config, stage, BASE) for stage in RUN_STAGES])
    table = Table()
    table.add_column("iteration")
    for stage in ITERATION_STAGES:
        table.add_column(stage)
    for k in range(config.iterations):
        table.add_row(str(k), *[_cell(layout, config, stage, k) for stage in ITERATION_STAGES])
        for r in extra_rounds(layout, config, k):
            table.add_row(f"{k}.{r}", *[_cell(layout, config, s, k, r) if STAGES[s].per_round else ""
                                         for s in ITERATION_STAGES])
    return Group(run_table, table, held_out_table(layout, config))


def held_out_table(layout: RunLayout, config: RunConfig) -> Table:
    """Held-out results of the base model and of each evaluated checkpoint (from the eval manifests): greedy
    accuracy and pass@k per dataset, so base and trained stand side by side."""
    metric_names = ["greedy_accuracy", *[f"pass@{k}" for k in config.evaluate.k], "mean_num_tokens"]
    table = Table(title="held-out evaluation")
    for column in ["checkpoint", "dataset", "prompts", *metric_names]:
        table.add_column(column)
    checkpoints = [("base", "evaluate_base", BASE)] + [(f"iter {k}", "evaluate", k) for k in range(config.iterations)]
    for label, stage, iteration in checkpoints:
        state = stage_state(layout.fs, layout, config, STAGES[stage], iteration)
        if not state.done:
            continue
        for dataset, summary in sorted(state.manifests[-1].metrics.items()):
            if isinstance(summary, dict) and "prompts" in summary:
                values = [f"{summary[name]:.3f}" if name in summary else "" for name in metric_names]
                table.add_row(label, dataset, f"{summary['prompts']:.0f}", *values)
    return table


def extra_rounds(layout: RunLayout, config: RunConfig, iteration: int) -> list[int]:
    """The dynamic-sampling rounds r >= 1 of `iteration` that left a manifest of any of their stages."""
    if config.advantage.target_groups is None:
        return []
    outputs = [spec.outputs for spec in STAGES.values() if spec.per_round]
    return [
        r for r in range(1, config.advantage.max_generation_rounds)
        if any(layout.fs.exists(output.manifest_path(layout)) for of in outputs for output in of(iteration, r))
    ]


def stage_states(layout: RunLayout, config: RunConfig) -> dict[tuple[str, int], bool]:
    """(stage, iteration) -> done, for scripts and tests."""
    states = {(stage, BASE): stage_state(layout.fs, layout, config, STAGES[stage], BASE).done for stage in RUN_STAGES}
    for k in range(config.iterations):
        for stage in ITERATION_STAGES:
            states[(stage, k)] = stage_state(layout.fs, layout, config, STAGES[stage], k).done
    return states
