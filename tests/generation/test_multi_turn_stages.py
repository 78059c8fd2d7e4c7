"""The generate, score and evaluate stages with generate.multi_turn on (tool mode, the HF backend, the shipped
ReTool math set, 1 prompt x 2 samples): the rollouts table holds v2 multi-turn rows that pass the contract, the
score stage grades the final answer, the eval table and its manifest carry the multi-turn figures."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from flows.cli.status import multi_turn_table
from reports.html import collect, read_config, render
from schemas.config import load_config
from stages.registry import instance, stage_state
from storage.catalog import Catalog
from storage.layout import BASE
from storage.run import Run
from tests.support.stages import run_stage_at, start_run

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[2] / "deployments" / "data" / "retool-math.jsonl"


def test_tool_mode_through_the_stages(tmp_path: Path) -> None:
    from stages import base_model, evaluate, generate, prompts, score

    overrides = [
        "run_id=mt", f"data.train={DATA}", f"data.test={DATA}", "data.max_test_prompts=1", "iterations=1",
        "generate.backend=hf", "generate.prompts_per_iteration=1", "generate.n_samples=2", "generate.max_new_tokens=24",
        "generate.mismatch_samples=1", "generate.multi_turn.mode=tool", "generate.multi_turn.max_turns=2",
        "generate.multi_turn.max_response_tokens=60", "evaluate.n_samples=1", "evaluate.k=[1]", "evaluate.greedy=false",
        "evaluate.max_new_tokens=24", "score.workers=1",
    ]
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    for stage, work in (("prompts", prompts.run), ("base_model", base_model.run)):
        run_stage_at(stage, layout, BASE, work)
    run_stage_at("generate", layout, 0, generate.run)
    run_stage_at("score", layout, 0, score.run)
    run_stage_at("evaluate_base", layout, BASE, evaluate.run)
    run = Run.open(layout.root, layout.run_id)

    rollouts = pq.read_table(layout.table_path("rollouts", 0)).to_pylist()
    assert len(rollouts) == 2
    for row in rollouts:
        assert row["num_tokens"] == len(row["response_token_ids"]) == len(row["loss_mask"]) <= 60
        assert [span[0] for span in row["turn_spans"]][0] == 0 and len(row["turn_spans"]) == row["num_turns"]
        for (start, end) in row["turn_spans"]:
            assert row["loss_mask"][start:end] == [1] * (end - start)
        assert sum(row["loss_mask"]) == sum(end - start for start, end in row["turn_spans"])
        assert all(lp == 0.0 for lp, m in zip(row["response_logprobs"], row["loss_mask"], strict=True) if not m)
        messages = json.loads(row["conversation"])
        assert [m["role"] for m in messages][::2] == ["assistant"] * row["num_turns"]
        assert row["tool_calls"] == sum(m["role"] == "tool" for m in messages) >= row["tool_errors"]
        assert row["truncated"] == (row["finish_reason"] in ("length", "budget"))
    metrics = stage_state(run, instance("generate", 0)).manifests[-1].metrics
    assert metrics["multi_turn"]["tool_calls"] == sum(r["tool_calls"] for r in rollouts)
    assert metrics["generated_tokens"] == sum(sum(r["loss_mask"]) for r in rollouts)  # model tokens only

    scores = pq.read_table(layout.table_path("scores", 0)).to_pylist()
    for row, scored in zip(rollouts, scores, strict=True):
        final = [m for m in json.loads(row["conversation"]) if m["role"] == "assistant"][-1]["content"]
        from stages.sandbox import extract_answer

        assert scored["code"] == extract_answer(final)  # math: the graded answer comes from the final turn

    ev = pq.read_table(layout.table_path("eval", BASE)).to_pylist()
    assert len(ev) == 1 and ev[0]["num_turns"] >= 1 and ev[0]["first_answer_correct"] == ev[0]["correct"]
    eval_metrics = stage_state(run, instance("evaluate_base", BASE)).manifests[-1].metrics
    (dataset,) = {r["dataset"] for r in ev}
    assert eval_metrics[dataset]["mean_turns"] == ev[0]["num_turns"]
    assert eval_metrics[dataset]["tool_calls_per_answer"] == ev[0]["tool_calls"]

    # `rlpipe status` shows both: the iteration's rollouts and the evaluated base model, from the tables' rows
    console = Console(width=200, record=True)
    console.print(multi_turn_table(run))
    cells = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[3:-1]]
             for line in console.export_text().splitlines() if line.count("│") == 7}
    errors = sum(r["tool_errors"] for r in rollouts)
    calls = sum(r["tool_calls"] for r in rollouts)
    assert cells["rollouts 0"][:3] == [f"{sum(r['num_turns'] for r in rollouts) / 2:.2f}", f"{calls / 2:.3f}",
                                       f"{errors / calls:.3f}" if calls else "n/a"]
    assert cells["base"][:2] == [f"{ev[0]['num_turns']:.2f}", f"{ev[0]['tool_calls']:.3f}"]

    # the HTML report draws the same per-iteration figures, read through the catalog
    with Catalog(layout.root, ["mt"]) as catalog:
        data = collect(catalog, "mt", read_config(layout))
    assert data.multi_turn == [{"iteration": 0, "turns": pytest.approx(sum(r["num_turns"] for r in rollouts) / 2),
                                "tool_calls": pytest.approx(calls / 2),
                                "tool_error_rate": pytest.approx(errors / calls) if calls else None}]
    assert "chart-multi-turn" in render(data)
