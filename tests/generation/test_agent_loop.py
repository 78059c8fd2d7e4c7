"""The multi-turn agent loop on the real HF backend and the real sandbox: tokens, loss masks, turn spans and
seeds checked against independent single-turn generations of the same backend; the chat template's observation
tokens by hand; the conversation budget cuts and marks; feedback mode records each turn's reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import MultiTurnConfig, ScoreConfig
from stages.generation.agent_loop import (
    ConversationStart,
    ObservationTokens,
    SandboxTool,
    cap,
    feedback_message,
    run_conversations,
    sandbox_judge,
    tool_code,
    turn_seed,
)
from stages.generation.base import GenerationRequest, SamplingSpec
from stages.generation.hf_backend import HFBackend
from stages.sandbox import Sandbox
from stages.sandbox.rewards import RewardInput

from .conftest import encode_chat

CODE_PROMPT = "Use Python: print(17+25). Write only the code block."
SAMPLING = SamplingSpec(temperature=0.5, max_new_tokens=24)


class CountingBackend:
    """The HF backend, counting `generate` calls and the requests in each (a spy, not a stand-in)."""

    def __init__(self, backend: HFBackend) -> None:
        self.backend, self.calls = backend, []
        self.name, self.deterministic = backend.name, backend.deterministic

    def generate(self, requests, sampling, progress=None):  # noqa: ANN001, ANN201
        self.calls.append(len(requests))
        return self.backend.generate(requests, sampling, progress)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> HFBackend:
    return HFBackend(model_dir, dtype="float32", batch_size=4)


@pytest.fixture(scope="module")
def sandbox():  # noqa: ANN201
    with Sandbox.from_config(ScoreConfig(workers=2, timeout_s=2.0, memory_mb=512, output_limit_kb=64)) as started:
        yield started


def start(tokenizer, text: str, seed: int) -> ConversationStart:  # noqa: ANN001
    return ConversationStart([{"role": "user", "content": text}], encode_chat(tokenizer, text), seed)


def test_helpers_by_hand(tokenizer) -> None:  # noqa: ANN001
    assert turn_seed(123, 0) == 123
    assert len({turn_seed(123, t) for t in range(4)}) == 4 and all(0 <= turn_seed(5, t) < 2**63 for t in range(3))
    assert cap("abcdef", 3) == "abc\n... [cut at 3 characters]"
    assert tool_code("Let me compute.\n```python\nprint(1)\n```\n", "markdown") == "print(1)\n"
    assert tool_code("x <code>\nprint(2)\n</code>", "code_tags") == "print(2)\n"
    assert tool_code("```\n", "markdown") is None
    message = feedback_message([{"name": "t1", "passed": True, "status": "ok", "message": ""},
                                {"name": "t2", "passed": False, "status": "fail", "message": "expected 3, got 4"}],
                               "fail", 100)
    assert message == ("Your answer failed these tests:\n- t2: fail: expected 3, got 4\n"
                       "Fix the code and give the whole corrected solution.")
    assert feedback_message([], "no_code", 100).startswith("Your answer failed these tests:\nNo code block")


def test_observation_tokens_are_the_template_rendering(tokenizer) -> None:  # noqa: ANN001
    """SmolLM2's ChatML template: after the model's own <|im_end|> a user turn is the rest of the closing line
    and the new message; after a turn that stopped at a code fence the closing is added; no tool role -> auto
    picks interpreter text."""
    messages = [{"role": "user", "content": "hi"}]
    observe = ObservationTokens(tokenizer, MultiTurnConfig(mode="feedback"))
    assert not observe.tool_role  # the template does not mention a tool role
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert observe.templated(messages, [{"role": "user", "content": "fix it"}], im_end) == (
        "\n<|im_start|>user\nfix it<|im_end|>\n<|im_start|>assistant\n")
    tool_role = ObservationTokens(tokenizer, MultiTurnConfig(mode="tool", observation_format="tool_role"))
    comma = tokenizer.convert_tokens_to_ids(",")
    tokens = tool_role.tool(messages, "42", comma)
    assert tokenizer.decode(tokens) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert tokens[0] == im_end  # the special token is one token, not its characters
    assert observe.tool(messages, "42", comma) == tokenizer("<interpreter>\n42\n</interpreter>\n",
                                                            add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_tool_conversation_by_hand(backend: HFBackend, tokenizer, sandbox: Sandbox) -> None:  # noqa: ANN001
    """Two samples of one prompt, two turns: each turn is one batched generate call; the tokens are exactly
    turn 0 (the sample's seed, what single-turn generation with the fence stop draws), the interpreter
    observation, then turn 1 (the derived seed, on prompt + everything before)."""
    cfg = MultiTurnConfig(mode="tool", max_turns=2, max_tool_calls=2, max_response_tokens=200)
    starts = [start(tokenizer, CODE_PROMPT, seed) for seed in (11, 12)]
    counting = CountingBackend(backend)
    conversations, figures = run_conversations(counting, tokenizer, cfg, starts, SAMPLING, "test",
                                               tool=SandboxTool(sandbox, 2.0, 200))
    stop_spec = SamplingSpec(temperature=0.5, max_new_tokens=24, stop=["\n```\n"])
    first = backend.generate([GenerationRequest(s.prompt_token_ids, s.seed) for s in starts], stop_spec)
    observation = tokenizer("<interpreter>\n42\n</interpreter>\n", add_special_tokens=False)["input_ids"]
    cuts = [len(turn0.token_ids) + len(observation) for turn0 in first]
    second = backend.generate([  # the same batch of two as the loop's second call: same padding, same numbers
        GenerationRequest(s.prompt_token_ids + c.token_ids[:n1], turn_seed(s.seed, 1))
        for s, c, n1 in zip(starts, conversations, cuts, strict=True)
    ], stop_spec)
    for c, turn0, n1, turn1 in zip(conversations, first, cuts, second, strict=True):
        n0 = len(turn0.token_ids)
        assert c.token_ids[:n0] == turn0.token_ids and c.logprobs[:n0] == turn0.logprobs
        assert "```python" in c.messages[0]["content"], "the model is expected to answer this prompt with code"
        assert c.messages[1] == {"role": "tool", "content": "42"}
        assert c.token_ids[n0:n1] == observation
        assert c.token_ids[n1:] == turn1.token_ids and c.logprobs[n1:] == pytest.approx(turn1.logprobs, abs=1e-5)
        assert c.logprobs[n0:n1] == [0.0] * len(observation)
        assert c.loss_mask == [1] * n0 + [0] * len(observation) + [1] * len(turn1.token_ids)
        assert c.turn_spans == [[0, n0], [n1, n1 + len(turn1.token_ids)]]
        assert (c.num_turns, c.tool_calls, c.tool_errors) == (2, 1, 0)
        ended_at_code = turn1.finish_reason == "stop" and "\n```\n" in tokenizer.decode(turn1.token_ids)
        expected = "max_turns" if ended_at_code else {"stop": "stop", "length": "length"}[turn1.finish_reason]
        assert c.finish_reason == expected
        assert c.columns()["truncated"] == (expected == "length")
    assert counting.calls == [2, 2]  # one call per turn for both samples
    assert figures["generated_tokens"] == sum(sum(c.loss_mask) for c in conversations)


@pytest.mark.slow
def test_budget_cuts_and_marks_the_conversation(backend: HFBackend, tokenizer, sandbox: Sandbox) -> None:  # noqa: ANN001
    starts = [start(tokenizer, CODE_PROMPT, 11)]
    (turn0,) = backend.generate([GenerationRequest(starts[0].prompt_token_ids, 11)],
                                SamplingSpec(temperature=0.5, max_new_tokens=24, stop=["\n```\n"]))
    budget = len(turn0.token_ids) + 3  # the observation (8 tokens) does not fit
    cfg = MultiTurnConfig(mode="tool", max_turns=3, max_response_tokens=budget)
    (c,), _ = run_conversations(backend, tokenizer, cfg, starts, SAMPLING, "test", tool=SandboxTool(sandbox, 2.0, 200))
    assert len(c.token_ids) == budget and c.loss_mask == [1] * len(turn0.token_ids) + [0, 0, 0]
    assert c.finish_reason == "budget" and c.columns()["truncated"] and c.num_turns == 1


@pytest.mark.slow
def test_feedback_mode_retries_with_the_failures(backend: HFBackend, tokenizer, sandbox: Sandbox) -> None:  # noqa: ANN001
    """A test no answer can pass (add(1, 2) == 4): every turn is scored (reward 0 each), the failure comes back
    as a user turn rendered by the template, and the conversation ends at max_turns."""
    text = "Write a Python function add(a, b) that returns a + b, in a ```python block."
    spec = {"kind": "code_tests", "entry_point": "add", "preamble": "",
            "test": "def check(candidate):\n    assert candidate(1, 2) == 4\n"}
    cfg = MultiTurnConfig(mode="feedback", max_turns=2, max_response_tokens=400)
    row = RewardInput([{"role": "user", "content": text}], {}, "t")
    judge = sandbox_judge(sandbox, ScoreConfig(workers=2, timeout_s=2.0), [spec], [row], cfg.feedback_chars)
    sampling = SamplingSpec(temperature=0.0, max_new_tokens=48)
    (c,), figures = run_conversations(backend, tokenizer, cfg, [start(tokenizer, text, 3)], sampling, "test",
                                      judge=judge)
    assert c.turn_rewards == [0.0, 0.0] and c.turn_passed == [False, False]
    assert c.finish_reason in ("max_turns", "length") and c.num_turns == 2
    assert [m["role"] for m in c.messages] == ["assistant", "user", "assistant"]
    feedback = c.messages[1]["content"]
    assert feedback.startswith("Your answer failed these tests:\n")
    (s0, e0), (s1, _) = c.turn_spans
    last = c.token_ids[e0 - 1]
    closing = "\n" if last == tokenizer.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>\n"
    expected = tokenizer(f"{closing}<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]
    assert c.token_ids[e0:s1] == expected and c.loss_mask[e0:s1] == [0] * len(expected)
    assert figures["judge_seconds"] > 0
