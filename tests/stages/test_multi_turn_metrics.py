"""The evaluate stage's multi-turn figures by hand (stages/evaluation/metrics.multi_turn_summary)."""

from __future__ import annotations

import pytest

from stages.evaluation.metrics import multi_turn_summary


def row(turns: int, calls: int, errors: int, correct: bool, first: bool | None) -> dict:
    return {"num_turns": turns, "tool_calls": calls, "tool_errors": errors, "correct": correct,
            "first_answer_correct": first}


def test_turns_tool_calls_errors_and_solved_after_retry() -> None:
    """Feedback mode: of the 4 answers whose first attempt failed, 3 got a retry (the last one's budget ended it
    after its first turn) and 2 of those 3 passed in the end: 2 / 3, not 2 / 4."""
    rows = [row(1, 0, 0, True, True), row(2, 0, 0, True, False), row(3, 0, 0, False, False), row(2, 0, 0, True, False),
            row(1, 0, 0, False, False)]
    summary = multi_turn_summary(rows, "feedback")
    assert summary == {"mean_turns": pytest.approx(9 / 5), "tool_calls_per_answer": 0.0, "retried_answers": 3,
                       "solved_after_retry": pytest.approx(2 / 3)}
    assert multi_turn_summary([row(1, 0, 0, False, False)], "feedback") == {
        "mean_turns": 1.0, "tool_calls_per_answer": 0.0, "retried_answers": 0}  # nobody retried: no rate


def test_tool_mode_has_no_retries() -> None:
    """Tool mode: turns, calls per answer and the error rate (2 errors of 4 calls); its first answer is its only
    one, so there is no solved-after-retry (not 0.0) even where an answer with several turns failed."""
    rows = [row(1, 0, 0, True, True), row(2, 1, 1, True, True), row(3, 2, 0, False, False), row(2, 1, 1, False, False)]
    assert multi_turn_summary(rows, "tool") == {"mean_turns": 2.0, "tool_calls_per_answer": 1.0,
                                                "tool_error_rate": 0.5}
    assert set(multi_turn_summary([row(1, 0, 0, True, True)], "tool")) == {"mean_turns", "tool_calls_per_answer"}
    assert multi_turn_summary([], "tool") == {}
