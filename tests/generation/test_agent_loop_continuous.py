"""The continuous agent loop (continuous batching across turns, vLLM sessions) on the real engine and sandbox:
its conversations are the per-turn loop's on the same seeds, line up by hand (turn 0 is single-turn generation
with the code stop, the observation is the interpreter's output), and a hanging tool call does not hold up the
other conversations: they finish before the hang's timeout has elapsed, which the per-turn loop cannot do (its
next turn waits for every tool call of the turn before). The warm engine (generation server) gives the same
conversations through its socket session."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from schemas.config import GenerateConfig, MultiTurnConfig, ScoreConfig
from stages.generation.agent_loop import (
    Conversation,
    ConversationStart,
    SandboxTool,
    ToolResult,
    ends_inside_block,
    run_conversations,
    uses_continuous_batching,
)
from stages.generation.base import GenerationRequest, SamplingSpec, sessions
from stages.sandbox import Sandbox

from .conftest import encode_chat

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

CODE_PROMPT = "Use Python: print(17+25). Write only the code block."
SAMPLING = SamplingSpec(temperature=0.5, max_new_tokens=48)
HANG_TIMEOUT_S = 30.0
SEEDS = range(11, 17)


@pytest.fixture(scope="module")
def sandbox():  # noqa: ANN201
    with Sandbox.from_config(ScoreConfig(workers=2, timeout_s=2.0)) as started:
        yield started


def starts_of(tokenizer, seeds: range) -> list[ConversationStart]:  # noqa: ANN001
    ids = encode_chat(tokenizer, CODE_PROMPT)
    return [ConversationStart([{"role": "user", "content": CODE_PROMPT}], ids, seed) for seed in seeds]


class TimedSession:
    """A vLLM session, noting when each request comes back (a spy, not a stand-in)."""

    def __init__(self, inner, finished_at: dict[int, float]) -> None:  # noqa: ANN001
        self.inner, self.finished_at = inner, finished_at

    def __enter__(self) -> TimedSession:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    @property
    def running(self) -> int:
        return self.inner.running

    def submit(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.inner.submit(*args, **kwargs)

    def step(self):  # noqa: ANN201
        finished = self.inner.step()
        for key, _ in finished:
            self.finished_at[key] = time.monotonic()
        return finished


class TimedBackend:
    """The vLLM backend whose sessions note each conversation's last turn's end (a spy, not a stand-in)."""

    def __init__(self, backend) -> None:  # noqa: ANN001
        self.backend, self.finished_at = backend, {}
        self.name, self.deterministic = backend.name, backend.deterministic

    def generate(self, requests, sampling, progress=None):  # noqa: ANN001, ANN201
        return self.backend.generate(requests, sampling, progress)

    def session(self) -> TimedSession:
        return TimedSession(self.backend.session(), self.finished_at)


class HangingTool(SandboxTool):
    """The real sandbox tool whose first call runs code that sleeps past the tool timeout (a real hang)."""

    def __init__(self, sandbox, timeout_s: float) -> None:  # noqa: ANN001
        super().__init__(sandbox, timeout_s, 200)
        self.lock, self.hang_started = threading.Lock(), None

    def run_one(self, code: str) -> ToolResult:
        with self.lock:
            hang = self.hang_started is None
            if hang:
                self.hang_started = time.monotonic()
        return super().run_one("import time\ntime.sleep(120)\n" if hang else code)


def test_sessions_are_the_capability(vllm_backend) -> None:  # noqa: ANN001
    cfg = MultiTurnConfig(mode="tool")
    assert sessions(vllm_backend) is not None and uses_continuous_batching(vllm_backend, cfg)
    assert not uses_continuous_batching(vllm_backend, cfg.model_copy(update={"continuous_batching": False}))


TOOL_LOOP = MultiTurnConfig(mode="tool", max_turns=3, max_response_tokens=200)


@pytest.fixture(scope="module")
def per_turn(vllm_backend, tokenizer, sandbox: Sandbox) -> list[Conversation]:  # noqa: ANN001
    """The per-turn loop's conversations of six samples of CODE_PROMPT (seeds 11-16)."""
    conversations, figures = run_conversations(
        vllm_backend, tokenizer, TOOL_LOOP.model_copy(update={"continuous_batching": False}),
        starts_of(tokenizer, SEEDS), SAMPLING, "per turn", tool=SandboxTool(sandbox, 2.0, 200))
    assert figures["continuous_batching"] == 0
    return conversations


def assert_same(continuous: list[Conversation], per_turn: list[Conversation]) -> None:
    for c, p in zip(continuous, per_turn, strict=True):
        assert (c.token_ids, c.messages, c.turn_spans, c.loss_mask, c.finish_reason) == (
            p.token_ids, p.messages, p.turn_spans, p.loss_mask, p.finish_reason)
        assert c.logprobs == pytest.approx(p.logprobs, abs=1e-4)


def test_continuous_loop_reproduces_the_per_turn_loop(vllm_backend, tokenizer, sandbox: Sandbox,  # noqa: ANN001
                                                      per_turn: list[Conversation]) -> None:
    starts = starts_of(tokenizer, SEEDS)
    continuous, figures = run_conversations(vllm_backend, tokenizer, TOOL_LOOP, starts, SAMPLING, "continuous",
                                            tool=SandboxTool(sandbox, 2.0, 200))
    assert figures["continuous_batching"] == 1
    first = vllm_backend.generate([GenerationRequest(s.prompt_token_ids, s.seed) for s in starts],
                             SamplingSpec(temperature=0.5, max_new_tokens=48, stop=["\n```\n"]))
    observation = tokenizer("<interpreter>\n42\n</interpreter>\n", add_special_tokens=False)["input_ids"]
    answered = 0
    for c, turn0 in zip(continuous, first, strict=True):
        assert c.token_ids[:len(turn0.token_ids)] == turn0.token_ids
        text0 = tokenizer.decode(turn0.token_ids, skip_special_tokens=True)
        if "\n```\n" in text0 and ends_inside_block(text0):  # stopped at a bare opening fence: the turn went on
            assert c.turn_spans[0][1] > len(turn0.token_ids)
        else:
            assert c.turn_spans[0] == [0, len(turn0.token_ids)]
        n0 = c.turn_spans[0][1]
        assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask) <= 200
        assert sum(c.loss_mask) == sum(end - begin for begin, end in c.turn_spans)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m)
        if c.tool_calls and c.messages[1]["content"] == "42":
            assert c.token_ids[n0:n0 + len(observation)] == observation
            assert c.loss_mask[n0:n0 + len(observation)] == [0] * len(observation)
            assert c.turn_spans[1][0] == n0 + len(observation)
            answered += 1
    assert answered >= 1 and sum(c.num_turns for c in continuous) > len(starts), "expected tool calls to follow"
    assert_same(continuous, per_turn)
    assert figures["generated_tokens"] == sum(sum(c.loss_mask) for c in continuous)


def test_the_warm_engine_batches_continuously_too(model_dir: Path, tokenizer, sandbox: Sandbox,  # noqa: ANN001
                                                  per_turn: list[Conversation], tmp_path_factory) -> None:  # noqa: ANN001
    """The generation server's engine through its socket session: the same conversations as in-process."""
    from stages.generation.client import WarmEngine, server_address, stop_server
    from storage.checkpoints import checkpoint_digest

    cfg = GenerateConfig(backend="vllm", vllm_kv_cache_gib=1)
    address = server_address(str(tmp_path_factory.mktemp("warm-run")), cfg, "cpu")
    try:
        warm = WarmEngine(address, cfg, "cpu", model_dir, checkpoint_digest(model_dir)[0])
        assert uses_continuous_batching(warm, TOOL_LOOP)
        continuous, figures = run_conversations(warm, tokenizer, TOOL_LOOP, starts_of(tokenizer, SEEDS), SAMPLING,
                                                "warm", tool=SandboxTool(sandbox, 2.0, 200))
        assert figures["continuous_batching"] == 1 and warm.record()["generation_cpu_seconds"] > 0
    finally:
        stop_server(address)
    assert_same(continuous, per_turn)


def test_a_hanging_tool_call_does_not_stall_the_others(vllm_backend, tokenizer,  # noqa: ANN001
                                                       sandbox: Sandbox) -> None:
    timed = TimedBackend(vllm_backend)
    tool = HangingTool(sandbox, HANG_TIMEOUT_S)
    cfg = MultiTurnConfig(mode="tool", max_turns=2, max_response_tokens=200, tool_timeout_s=HANG_TIMEOUT_S)
    # short turns, so that the others' second turns end well within the hang's timeout on a loaded machine too
    conversations, _ = run_conversations(timed, tokenizer, cfg, starts_of(tokenizer, range(21, 29)),
                                         SamplingSpec(temperature=0.5, max_new_tokens=24), "hang", tool=tool)
    hung = [i for i, c in enumerate(conversations) if c.tool_calls and "TimeoutError" in c.messages[1]["content"]]
    assert len(hung) == 1, [c.messages for c in conversations]
    others = [i for i, c in enumerate(conversations) if c.tool_calls and i not in hung]
    assert others and all(conversations[i].num_turns == 2 for i in others), "no other conversation called a tool"
    deadline = tool.hang_started + HANG_TIMEOUT_S
    # every other conversation, a second turn after its own tool call included, ended while the hang went on
    assert max(timed.finished_at[i] for i in range(len(conversations)) if i not in hung) < deadline
    assert timed.finished_at[hung[0]] > deadline and conversations[hung[0]].num_turns == 2


def test_feedback_mode_continuous_is_the_per_turn_loop(vllm_backend, tokenizer,  # noqa: ANN001
                                                       sandbox: Sandbox) -> None:
    """A test no answer can pass (add(1, 2) == 4): in the continuous loop too every answer is judged (reward 0
    each), the failures come back as a user turn, each conversation ends at max_turns, and the conversations are
    the per-turn loop's on the same seeds."""
    from stages.generation.agent_loop import sandbox_judge
    from stages.sandbox.rewards import RewardInput

    text = "Write a Python function add(a, b) that returns a + b, in a ```python block."
    spec = {"kind": "code_tests", "entry_point": "add", "preamble": "",
            "test": "def check(candidate):\n    assert candidate(1, 2) == 4\n"}
    cfg = MultiTurnConfig(mode="feedback", max_turns=3, max_response_tokens=600)
    starts = [ConversationStart([{"role": "user", "content": text}], encode_chat(tokenizer, text), seed)
              for seed in (3, 4, 5)]
    rows = [RewardInput(s.messages, {}, "t") for s in starts]
    judge = sandbox_judge(sandbox, ScoreConfig(workers=2, timeout_s=2.0), [spec] * 3, rows, cfg.feedback_chars)
    sampling = SamplingSpec(temperature=0.7, max_new_tokens=40)
    continuous, figures = run_conversations(vllm_backend, tokenizer, cfg, starts, sampling, "feedback", judge=judge)
    per_turn, _ = run_conversations(vllm_backend, tokenizer, cfg.model_copy(update={"continuous_batching": False}),
                                    starts, sampling, "feedback per turn", judge=judge)
    assert figures["continuous_batching"] == 1
    for c in continuous:
        assert c.turn_rewards == [0.0, 0.0, 0.0] and c.turn_passed == [False, False, False]
        assert [m["role"] for m in c.messages] == ["assistant", "user", "assistant", "user", "assistant"]
        assert c.messages[1]["content"].startswith("Your answer failed these tests:\n")
        assert c.finish_reason in ("max_turns", "length") and c.num_turns == 3
    assert_same(continuous, per_turn)
