"""Fixtures for the generation backends: the default model (SmolLM2-135M-Instruct) and chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import ModelConfig

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


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [encode_chat(tokenizer, text) for text in PROMPTS]
