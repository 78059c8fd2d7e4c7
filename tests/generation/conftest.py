"""Fixtures for the generation backends: the default model (SmolLM2-135M-Instruct) and chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import GenerateConfig, ModelConfig

PROMPTS = [
    "Write a Python function `add(a, b)` that returns the sum of a and b.",
    "What is 7 times 8? Answer briefly.",
    "Write a Python function that reverses a string.",
    "Name three colours.",
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from stages.generation.models import resolve_model

    return resolve_model(ModelConfig())


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    from stages.generation.models import load_tokenizer

    return load_tokenizer(model_dir)


def encode_chat(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="module")
def vllm_backend(model_dir: Path):  # noqa: ANN201 - a VLLMBackend
    """The vLLM engine with the generate stage's settings (the config's "auto": fp32 and eager on CPU), one per
    test module (a start costs 10 s to minutes)."""
    from stages.generation import make_backend
    from stages.generation.vllm_backend import vllm_available

    if not vllm_available():
        pytest.skip("vllm does not import (see ENVIRONMENT.md: remove torchvision/torchaudio/torchcodec)")
    backend = make_backend("vllm", model_dir, GenerateConfig(backend="vllm", vllm_kv_cache_gib=1))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [encode_chat(tokenizer, text) for text in PROMPTS]
