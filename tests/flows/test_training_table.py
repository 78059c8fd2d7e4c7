"""The training reward by iteration that `rlpipe run` prints at its end (and `rlpipe status` shows), on a run made
by the real stage harness (a tiny Llama, generate and score stand-ins: tests/rl/pipeline_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console

from flows.cli.status import status_table, training_table
from schemas.config import load_config
from stages import base_model
from storage.layout import BASE
from storage.run import Run
from tests.rl.pipeline_helpers import run_iteration, save_tiny_model, write_prompts
from tests.support.stages import run_stage_at, start_run


def test_training_reward_by_iteration(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    config = load_config(None, ["run_id=t", f"model.name_or_path={model_dir}", "iterations=3", "threads=1",
                                "generate.max_new_tokens=8"])
    layout = start_run(config, str(tmp_path / "root"))
    run_stage_at("prompts", layout, BASE, write_prompts)
    run_stage_at("base_model", layout, BASE, base_model.run)
    run_iteration(layout, 0)
    run_iteration(layout, 1, equal_rewards=True)  # iteration 2 is not run yet: no row
    console = Console(width=200, record=True)
    console.print(training_table(Run(layout, config)))
    lines = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
             for line in console.export_text().splitlines() if line.count("│") == 6}
    assert set(lines) == {"0", "1"}
    for k in (0, 1):
        scores = pq.read_table(Path(layout.table_path("scores", k)))
        solved = pc.sum(pc.equal(scores["status"], "ok")).as_py() / scores.num_rows
        assert lines[str(k)][:3] == [str(scores.num_rows), f"{pc.mean(scores['reward']).as_py():.3f}", f"{solved:.3f}"]
    assert lines["0"][3] == "2/2" and lines["1"][3] == "0/2"  # equal rewards: no group has variance
    status = Console(width=200, record=True)
    status.print(status_table(Run(layout, config)))
    assert "training reward by iteration" in status.export_text()
