"""`rlpipe show` renders a multi-turn rollout turn by turn: roles, each model turn's tokens and reward, the
tool calls, errors and seconds; a single-turn row keeps its plain response panel. A dropped group says what its
filter judged, apart from the shaped reward whose std it shows."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from flows.cli.inspect import render_story, run_filter_metric
from schemas.config import load_config
from storage.run import Run

BASE_ROW = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "p1", "sample_idx": 0, "policy_version": "ab",
            "num_tokens": 30, "finish_reason": "max_turns", "seed": 1, "backend": "hf", "reward": 0.0,
            "passed": 0, "total": 1, "status": "fail", "tests": "[]", "code": None, "messages": "[]",
            "response_text": "WHOLE RESPONSE"}


def rendered(row: dict, width: int = 120) -> str:
    console = Console(record=True, width=width)
    console.print(render_story(row))
    return console.export_text()


def test_a_conversation_is_shown_turn_by_turn() -> None:
    conversation = [{"role": "assistant", "content": "first try"}, {"role": "user", "content": "test_a failed"},
                    {"role": "assistant", "content": "second try"}]
    text = rendered({**BASE_ROW, "conversation": json.dumps(conversation), "turn_spans": [[0, 12], [20, 30]],
                     "turn_rewards": [0.0, 0.5], "num_turns": 2, "tool_calls": 0, "tool_errors": 0,
                     "tool_seconds": 0.0})
    assert "conversation · 2 turns · 0 tool calls, 0 errors" in text
    first, feedback, second = (text.index(s) for s in ("assistant, turn 1 (12 tokens, reward 0)",
                                                       "user (feedback):", "assistant, turn 2 (10 tokens, reward 0.5)"))
    assert first < text.index("first try") < feedback < text.index("test_a failed") < second < text.index("second try")
    assert "WHOLE RESPONSE" not in text


def test_tool_outputs_and_a_single_turn_row() -> None:
    conversation = [{"role": "assistant", "content": "```python\nprint(2)\n```"}, {"role": "tool", "content": "2"},
                    {"role": "assistant", "content": "\\boxed{2}"}]
    text = rendered({**BASE_ROW, "conversation": json.dumps(conversation), "turn_spans": [[0, 9], [15, 20]],
                     "turn_rewards": None, "num_turns": 2, "tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.25})
    assert "1 tool calls, 1 errors, 0.25 s in the tool" in text
    assert text.index("assistant, turn 1 (9 tokens)") < text.index("tool output:") < text.index("assistant, turn 2")
    assert "WHOLE RESPONSE" in rendered({**BASE_ROW, "conversation": None})


def test_a_dropped_group_says_what_its_filter_judged(tmp_path: Path) -> None:
    """The issue's case: "dropped, zero_variance" beside a group whose shaped rewards have std 0.05: the filter
    judged correctness (acc), which was the same for every sample; the std shown is the shaped reward's."""
    row = {**BASE_ROW, "trained_into": "iter=0000", "kept": False, "drop_reason": "zero_variance", "advantage": 0.0,
           "shaped_reward": 0.9, "group_size": 4, "group_mean": 0.85, "group_std": 0.05}
    text = rendered({**row, "filter_metric": "acc"}, width=300)
    assert ("not in the loss: dropped, zero_variance: every sample of the group had the same correctness (acc: 1 "
            "when every test passed)") in text
    assert "group of 4, its shaped rewards' mean 0.85, std 0.05" in text
    text = rendered({**row, "filter_metric": "reward", "drop_reason": "success_rate_out_of_range"}, width=300)
    assert "success_rate_out_of_range: the group's mean shaped reward (reward) is outside" in text
    layout = Run.start(load_config(None, ["run_id=f", "advantage.filter_metric=seq_reward"]), str(tmp_path)).layout
    assert run_filter_metric(layout) == "seq_reward"
