"""The train stage's progress bar over optimizer steps: loss, KL and tokens/s, also from DeepSpeed's rank 0."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.rl.deepspeed_backend import PROGRESS_SUFFIX, launch
from stages.train import following

from .pipeline_helpers import run_iteration, save_tiny_model


def test_following_hands_over_each_complete_line_once(tmp_path: Path) -> None:
    path = tmp_path / f"job.json{PROGRESS_SUFFIX}"
    rows = [{"step": i, "loss": 0.5 * i} for i in range(5)]
    seen: list[dict] = []

    def write() -> None:
        for row in rows[:4]:
            text = json.dumps(row) + "\n"
            with open(path, "a") as handle:  # half a line, then (a poll later) the rest
                handle.write(text[:5])
            time.sleep(0.03)
            with open(path, "a") as handle:
                handle.write(text[5:])
            time.sleep(0.02)

    with following(path, seen.append, poll_s=0.01):
        writer = threading.Thread(target=write)
        writer.start()
        writer.join()
        time.sleep(0.05)
        assert seen == rows[:4]  # handed over while the block runs, each line whole
        with open(path, "a") as handle:
            handle.write(json.dumps(rows[4]) + "\n")
    assert seen == rows  # the last line, written just before the block ended


def test_train_stage_shows_its_steps_with_loss_kl_and_tokens_per_second(run_layout, capsys) -> None:
    make, _ = run_layout
    layout = make("train.minibatches=2")
    capsys.readouterr()
    run_iteration(layout, 0)
    out = capsys.readouterr().out
    rows = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert len(rows) == 2
    [bar] = [line for line in out.splitlines() if "train" in line and "tok/s" in line]
    assert "2/2" in bar
    last = rows[-1]
    rate = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    assert f"loss {last['loss']:+.4f} · KL {last['approx_kl']:.2e} · {rate:.0f} tok/s" in bar


@pytest.mark.slow
def test_deepspeed_rank_zero_reports_each_step_once(tmp_path: Path) -> None:
    from .test_deepspeed import make_job

    policy = save_tiny_model(tmp_path / "policy")
    job = make_job(tmp_path, "ds", policy, backend="deepspeed", processes=2, minibatches=2)
    seen: list[dict] = []
    job_path = tmp_path / "job.json"
    with following(Path(f"{job_path}{PROGRESS_SUFFIX}"), seen.append):
        rows, _ = launch(job, job_path, processes=2, timeout_s=500)
    assert len(rows) == 2 and seen == json.loads(json.dumps(rows))  # one line per step, not one per rank
