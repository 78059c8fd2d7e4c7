"""`rlpipe status`'s iteration table: an evaluation that `evaluate.every` leaves out reads "not scheduled",
never "missing", so a finished run does not look unfinished."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flows.cli import start_run
from flows.status import stage_states, status_table
from schemas.config import load_config


def test_unscheduled_evaluations_read_not_scheduled(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=t", "iterations=3", "evaluate.every=2"])
    layout = start_run(config, str(tmp_path))
    console = Console(width=200, record=True)
    console.print(status_table(layout, config))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") > 5 and line.split("│")[1].strip() in {"0", "1", "2"}}
    assert rows["0"].split("│")[-2].strip() == "not scheduled"
    assert rows["1"].split("│")[-2].strip() == "missing"
    assert rows["2"].split("│")[-2].strip() == "missing"  # the last iteration is always evaluated
    states = stage_states(layout, config)
    assert ("evaluate", 0) not in states and ("evaluate", 1) in states and ("train", 0) in states
