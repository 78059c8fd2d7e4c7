"""`rlpipe show` renders a multi-turn rollout turn by turn: roles, each model turn's tokens and reward, the
tool calls, errors and seconds; a single-turn row keeps its plain response panel."""

from __future__ import annotations

import json

from rich.console import Console

from flows.cli.inspect import render_story

BASE_ROW = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "p1", "sample_idx": 0, "policy_version": "ab",
            "num_tokens": 30, "finish_reason": "max_turns", "seed": 1, "backend": "hf", "reward": 0.0,
            "passed": 0, "total": 1, "status": "fail", "tests": "[]", "code": None, "messages": "[]",
            "response_text": "WHOLE RESPONSE"}


def rendered(row: dict) -> str:
    console = Console(record=True, width=120)
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
