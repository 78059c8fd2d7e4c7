"""The evaluate stage's multi-turn figures by hand (stages/evaluation/metrics.multi_turn_summary)."""

from __future__ import annotations

import pytest

from stages.evaluation.metrics import multi_turn_summary


def row(turns: int, calls: int, errors: int, correct: bool, first: bool | None) -> dict:
    return {"num_turns": turns, "tool_calls": calls, "tool_errors": errors, "correct": correct,
            "first_answer_correct": first}


def test_turns_tool_calls_errors_and_solved_after_retry() -> None:
    rows = [row(1, 0, 0, True, True), row(2, 1, 1, True, False), row(3, 2, 0, False, False), row(2, 1, 1, True, False)]
    summary = multi_turn_summary(rows)
    assert summary["mean_turns"] == pytest.approx(8 / 4)
    assert summary["tool_calls_per_answer"] == pytest.approx(4 / 4)
    assert summary["tool_error_rate"] == pytest.approx(2 / 4)
    assert summary["solved_after_retry"] == pytest.approx(2 / 3)  # 3 first answers failed, 2 fixed later
    # no tool call: no error rate; no failed first answer (or unknown, a v1 row): no retry rate
    assert set(multi_turn_summary([row(1, 0, 0, True, None)])) == {"mean_turns", "tool_calls_per_answer"}
    assert multi_turn_summary([]) == {}
