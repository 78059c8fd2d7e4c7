"""`rlpipe status`'s iteration table: an evaluation that `evaluate.every` leaves out reads "not scheduled",
never "missing", so a finished run does not look unfinished."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flows.cli.status import status_table
from schemas.config import load_config
from storage.failure import record_failure
from storage.layout import StageInstance
from storage.run import Run
from tests.support.stages import stage_states, start_run


def test_unscheduled_evaluations_read_not_scheduled(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=t", "iterations=3", "evaluate.every=2"])
    layout = start_run(config, str(tmp_path))
    console = Console(width=200, record=True)
    console.print(status_table(Run(layout, config)))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") > 5 and line.split("│")[1].strip() in {"0", "1", "2"}}
    assert rows["0"].split("│")[-2].strip() == "not scheduled"
    assert rows["1"].split("│")[-2].strip() == "missing"
    assert rows["2"].split("│")[-2].strip() == "missing"  # the last iteration is always evaluated
    states = stage_states(Run(layout, config))
    assert ("evaluate", 0) not in states and ("evaluate", 1) in states and ("train", 0) in states


def test_the_failed_stage_reads_failed_with_its_reason(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=t", "iterations=2"])
    layout = start_run(config, str(tmp_path))
    record_failure(layout, StageInstance("generate", 1), 1, "RuntimeError: CUDA out of memory")
    console = Console(width=250, record=True)
    console.print(status_table(Run(layout, config)))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line.split("│")[2:-1] for line in text.splitlines()
            if line.count("│") > 5 and line.split("│")[1].strip() in {"0", "1"}}
    assert rows["1"][0].strip() == "failed (exit code 1)" and rows["0"][0].strip() == "missing"
    assert "✗ failed at generate iter=1 (exit code 1): RuntimeError: CUDA out of memory" in text


def _eval_rows(dataset: str, solved: dict[str, int], samples: int = 4) -> list[dict]:
    """Eval rows of one dataset: per problem, `solved[p]` of `samples` sampled answers correct; greedy wrong."""
    rows = [{"dataset": dataset, "prompt_id": p, "mode": "greedy", "sample_idx": 0, "correct": False, "reward": 0.0}
            for p in solved]
    rows += [{"dataset": dataset, "prompt_id": p, "mode": "sampled", "sample_idx": i, "correct": i < c,
              "reward": float(i < c)} for p, c in solved.items() for i in range(samples)]
    return rows


def test_gains_pool_every_held_out_problem_when_there_are_several_datasets() -> None:
    """Per dataset, then "all held out": pass@1 gain 0.5 on 2 problems and 0 on 6 pool to 2/8 * 0.5 = 0.125."""
    from flows.cli.status import checkpoint_gains

    base = {"a": _eval_rows("a", {"a1": 0, "a2": 0}), "b": _eval_rows("b", {f"b{i}": 2 for i in range(6)})}
    after = _eval_rows("a", {"a1": 2, "a2": 2}) + _eval_rows("b", {f"b{i}": 2 for i in range(6)})
    gains = dict(checkpoint_gains(base, after, clusters={}))
    assert list(gains) == ["a", "b", "all held out"]
    assert gains["a"]["pass@1"][0] == 0.5
    assert gains["b"]["pass@1"][0] == 0.0
    assert gains["all held out"]["pass@1"][0] == 0.125
    _, low, high = gains["all held out"]["pass@1"]
    assert low < 0.125 < high  # resampling problems and each problem's 4 samples
    # One dataset: no pooled row.
    assert [name for name, _ in checkpoint_gains({"a": base["a"]}, after, clusters={})] == ["a"]


def test_a_multi_turn_run_shows_its_multi_turn_table(tmp_path: Path) -> None:
    for name, overrides in (("tool", ["generate.multi_turn.mode=tool"]), ("single", [])):
        config = load_config(None, [f"run_id={name}", "iterations=1", *overrides])
        console = Console(width=200, record=True)
        console.print(status_table(Run(start_run(config, str(tmp_path / name)), config)))
        assert ("multi-turn rollouts and evaluation (tool mode)" in console.export_text()) is bool(overrides)
