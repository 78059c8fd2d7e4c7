"""A tiny random Llama (the SmolLM2 architecture, 2 layers, width 32) for tests that need a real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.stages import run_stage_at


def make_tiny_model(vocab_size: int = 16, seed: int = 0):  # noqa: ANN201 - a transformers model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture
def tiny_model():  # noqa: ANN201
    torch.set_num_threads(1)
    return make_tiny_model()


@pytest.fixture
def run_layout(tmp_path: Path):  # noqa: ANN201
    """make(*overrides) -> a started run with prompts and the tiny base model; and the model dir."""
    from schemas.config import load_config
    from stages import base_model
    from storage.layout import BASE
    from tests.support.stages import start_run

    from .pipeline_helpers import save_tiny_model, write_prompts

    model_dir = save_tiny_model(tmp_path / "tiny-model")
    overrides = [
        "run_id=t",
        f"model.name_or_path={model_dir}",
        "iterations=3",
        "threads=1",
        "train.lr=1e-2",
        "generate.max_new_tokens=8",
    ]

    def make(*extra: str):  # noqa: ANN202 - a RunLayout
        layout = start_run(load_config(None, [*overrides, *extra]), str(tmp_path / "root"))
        run_stage_at("prompts", layout, BASE, write_prompts)
        run_stage_at("base_model", layout, BASE, base_model.run)
        return layout

    return make, model_dir
