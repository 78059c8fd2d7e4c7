"""A tiny random Llama (the SmolLM2 architecture, 2 layers, width 32) for tests that need a real model."""

from __future__ import annotations

import pytest
import torch


def make_tiny_model(vocab_size: int = 16, seed: int = 0):  # noqa: ANN201 - a transformers model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture
def tiny_model():  # noqa: ANN201
    torch.set_num_threads(1)
    return make_tiny_model()
