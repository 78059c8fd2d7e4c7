"""benchmarks/multi_turn_learning.py's held-out figures, against numbers worked by hand."""

from __future__ import annotations

import math

from benchmarks.multi_turn_learning import first_answers, of_dataset, pass_at_1, retry_gain


def row(prompt: str, correct: bool, first: bool | None = None, mode: str = "sampled", dataset: str = "d") -> dict:
    return {"prompt_id": prompt, "mode": mode, "correct": correct, "first_answer_correct": first, "dataset": dataset}


def test_pass_at_1_is_the_mean_over_problems_of_their_sampled_answers() -> None:
    rows = [row("a", True), row("a", True), row("a", False), row("b", False), row("b", False), row("b", False),
            row("b", True, mode="greedy")]  # greedy answers are not pass@1's
    assert math.isclose(pass_at_1(rows), (2 / 3 + 0) / 2)


def test_the_first_answer_is_graded_instead_of_the_final_one() -> None:
    # a retry fixed a's second answer: final 2/2, first 1/2; b never passed
    rows = [row("a", True, first=True), row("a", True, first=False), row("b", False, first=False, dataset="e")]
    assert math.isclose(pass_at_1(rows), 0.5) and math.isclose(pass_at_1(first_answers(rows)), 0.25)
    assert math.isclose(pass_at_1(of_dataset(first_answers(rows), "d")), 0.5)


def test_the_retry_gain_holds_the_answers_fixed() -> None:
    # a: first answers 1 of 2 right, finals 2 of 2; b: never. Per-problem rates 0.5 -> 1 and 0 -> 0: gain 0.25,
    # and with both problems in one cluster every resample is the whole set: no spread
    rows = [row("a", True, first=True), row("a", True, first=False), row("b", False, first=False),
            row("b", False, first=False)]
    first, final, (gain, low, high) = retry_gain(rows, {"a": "f", "b": "f"})
    assert (first, final) == (0.25, 0.5) and gain == low == high == 0.25
