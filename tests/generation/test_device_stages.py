"""The generation stages record where they ran: generate and evaluate_base on the Hugging Face backend (the
default model, 1 prompt x 2 samples x 8 tokens, in this process), on this CPU machine.

Each manifest's `device` is the CPU record (no GPU name, count 0, no peak GPU memory) with the dtype the
backend resolved from `auto` (float32 on CPU), beside the tokens/s the stage measured; the generate stage's
mismatch pass (the trainer's forward on the stage's device) still runs. With `device: cuda` the generate stage
stops before it loads anything, as a ConfigError naming the field (the stage process exits 2 on it:
tests/rl/test_gpu_paths.py runs one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import ConfigError, load_config
from stages.registry import instance, stage_state
from storage.layout import BASE, RunLayout
from storage.run import Run
from tests.reliability import helpers as h
from tests.support.stages import run_stage_at

pytestmark = pytest.mark.slow

CPU_RECORD = {"device": "cpu", "gpu_name": None, "gpu_count": 0, "dtype": "float32", "peak_gpu_memory_mb": None}


def start(tmp_path: Path, *extra: str) -> RunLayout:
    from stages import base_model, prompts
    from tests.support.stages import start_run

    overrides = h.run_overrides(
        tmp_path / "sources", "generate.backend=hf", "generate.prompts_per_iteration=1", "generate.n_samples=2",
        "generate.max_new_tokens=8", "generate.mismatch_samples=2", "evaluate.n_samples=1", "evaluate.k=[1]",
        "evaluate.max_new_tokens=8", "data.max_test_prompts=1", "score.workers=1", *extra,
    )
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    run_stage_at("base_model", layout, BASE, base_model.run)
    return layout


def test_generate_and_evaluate_record_the_cpu_and_their_speed(tmp_path: Path) -> None:
    from stages import evaluate, generate

    layout = start(tmp_path)
    run_stage_at("generate", layout, 0, generate.run)
    run_stage_at("evaluate_base", layout, BASE, evaluate.run)
    run = Run.open(layout.root, layout.run_id)
    for stage, iteration in (("generate", 0), ("evaluate_base", BASE)):
        metrics = stage_state(run, instance(stage, iteration)).manifests[-1].metrics
        assert metrics["device"] == CPU_RECORD, stage
        assert metrics["engine"] == {"dtype": "float32"} and metrics["deterministic"] is True
        assert metrics["tokens_per_second"] > 0
    # evaluate scores as the score stage does: one greedy and one sampled answer, by the one default verifier
    functions = stage_state(run, instance("evaluate_base", BASE)).manifests[-1].metrics["reward_functions"]
    assert list(functions) == ["code_tests"]
    assert (functions["code_tests"]["calls"], functions["code_tests"]["errors"]) == (2, 0)
    generate_metrics = stage_state(run, instance("generate", 0)).manifests[-1].metrics
    # the sampler (HF fp32) and the trainer's forward (fp32) are the same computation: only batch rounding differs
    assert generate_metrics["logprob_mismatch"]["max_abs"] < 1e-3


def test_device_cuda_stops_generate_before_it_loads_the_model(tmp_path: Path) -> None:
    from stages import generate

    layout = start(tmp_path, "device=cuda:1")
    with pytest.raises(ConfigError, match=r"^device: cuda:1, but this machine has no CUDA device"):
        run_stage_at("generate", layout, 0, generate.run)
    assert not stage_state(Run.open(layout.root, layout.run_id), instance("generate", 0)).manifests
