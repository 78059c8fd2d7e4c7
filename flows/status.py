"""`rlpipe status RUN`: a table of iteration × stage with done/missing, rows and seconds."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from schemas.config import RunConfig
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, stage_state
from storage.layout import BASE, RunLayout


def _cell(layout: RunLayout, config: RunConfig, stage: str, iteration: int) -> str:
    state = stage_state(layout.fs, layout, config, STAGES[stage], iteration)
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
    return Group(run_table, table)


def stage_states(layout: RunLayout, config: RunConfig) -> dict[tuple[str, int], bool]:
    """(stage, iteration) -> done, for scripts and tests."""
    states = {(stage, BASE): stage_state(layout.fs, layout, config, STAGES[stage], BASE).done for stage in RUN_STAGES}
    for k in range(config.iterations):
        for stage in ITERATION_STAGES:
            states[(stage, k)] = stage_state(layout.fs, layout, config, STAGES[stage], k).done
    return states
