"""The agent loop on the vLLM engine (the `auto` backend where vLLM imports): turn 0 is what single-turn
generation with the code stop draws for the same requests, every conversation's tokens, logprobs, loss mask and
spans line up, and a code block's output comes back as the interpreter observation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from schemas.config import GenerateConfig, MultiTurnConfig, ScoreConfig
from stages.generation.agent_loop import ConversationStart, SandboxTool, run_conversations
from stages.generation.base import GenerationRequest, SamplingSpec
from stages.sandbox import Sandbox

from .conftest import encode_chat

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def test_tool_loop_on_vllm(model_dir: Path, tokenizer) -> None:  # noqa: ANN001
    from stages.generation import make_backend
    from stages.generation.vllm_backend import vllm_available

    if not vllm_available():
        pytest.skip("vllm does not import (see ENVIRONMENT.md: remove torchvision/torchaudio/torchcodec)")
    text = "Use Python: print(17+25). Write only the code block."
    starts = [ConversationStart([{"role": "user", "content": text}], encode_chat(tokenizer, text), seed)
              for seed in (11, 12, 13, 14)]
    cfg = MultiTurnConfig(mode="tool", max_turns=3, max_response_tokens=200)
    backend = make_backend("vllm", model_dir, GenerateConfig(backend="vllm", vllm_kv_cache_gib=1, multi_turn=cfg))
    try:
        with Sandbox.from_config(ScoreConfig(workers=2, timeout_s=2.0)) as sandbox:
            conversations, _ = run_conversations(backend, tokenizer, cfg, starts,
                                                 SamplingSpec(temperature=0.5, max_new_tokens=48), "vllm",
                                                 tool=SandboxTool(sandbox, 2.0, 200))
        first = backend.generate([GenerationRequest(s.prompt_token_ids, s.seed) for s in starts],
                                 SamplingSpec(temperature=0.5, max_new_tokens=48, stop=["\n```\n"]))
    finally:
        backend.close()
    observation = tokenizer("<interpreter>\n42\n</interpreter>\n", add_special_tokens=False)["input_ids"]
    answered = 0
    for c, turn0 in zip(conversations, first, strict=True):
        n0 = len(turn0.token_ids)
        assert c.token_ids[:n0] == turn0.token_ids and c.turn_spans[0] == [0, n0]
        assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask) <= 200
        assert sum(c.loss_mask) == sum(end - start for start, end in c.turn_spans)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m)
        if c.tool_calls and c.messages[1]["content"] == "42":
            assert c.token_ids[n0:n0 + len(observation)] == observation
            answered += 1
    assert answered >= 1  # one of four samples at least prints 42 (two did when this was written)
