"""The training reward by iteration that `rlpipe run` prints at its end (and `rlpipe status` shows), on a run made
by the real stage harness (a tiny Llama, generate and score stand-ins: tests/rl/pipeline_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console

from flows.cli.status import status_table, training_table
from storage.run import Run
from tests.rl.pipeline_helpers import run_iteration, start_tiny_run


def test_training_reward_by_iteration(tmp_path: Path) -> None:
    layout = start_tiny_run(tmp_path, "t", iterations=3)
    run_iteration(layout, 0)
    run_iteration(layout, 1, equal_rewards=True)  # iteration 2 is not run yet: no row
    console = Console(width=200, record=True)
    console.print(training_table(Run.at(layout)))
    lines = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
             for line in console.export_text().splitlines() if line.count("│") == 6}
    assert set(lines) == {"0", "1"}
    for k in (0, 1):
        scores = pq.read_table(Path(layout.table_path("scores", k)))
        solved = pc.sum(pc.equal(scores["status"], "ok")).as_py() / scores.num_rows
        assert lines[str(k)][:3] == [str(scores.num_rows), f"{pc.mean(scores['reward']).as_py():.3f}", f"{solved:.3f}"]
    assert lines["0"][3] == "2/2" and lines["1"][3] == "0/2"  # equal rewards: no group has variance
    status = Console(width=200, record=True)
    status.print(status_table(Run.at(layout)))
    assert "training reward by iteration" in status.export_text()
