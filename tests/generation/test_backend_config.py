"""The generate section's backend settings reach the backend they belong to, without starting an engine.

`dtype` is the HF backend's precision and `vllm_dtype` the vLLM engine's ("auto": fp32 and eager on CPU, bf16 and
compiled on GPU, as measured). Several engines (`generate.engines`): tests/generation/test_engines.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas.config import ConfigError, GenerateConfig, load_config


class RecordingBackend:
    """Stands in for a backend class: records the arguments it was started with."""

    started: list[dict[str, Any]] = []

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        RecordingBackend.started.append({"model_dir": model_dir, **kwargs})


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import stages.generation.hf_backend as hf_backend
    import stages.generation.vllm_backend as vllm_backend

    RecordingBackend.started = []
    monkeypatch.setattr(vllm_backend, "VLLMBackend", RecordingBackend)
    monkeypatch.setattr(hf_backend, "HFBackend", RecordingBackend)
    return RecordingBackend.started


def test_defaults_are_fp32_for_hf_on_cpu_and_per_platform_for_vllm() -> None:
    from stages.generation.device import resolve_dtype

    cfg = GenerateConfig()
    assert (cfg.dtype, cfg.vllm_dtype, cfg.vllm_compile, cfg.engines) == ("auto", "auto", "auto", "auto")
    assert (resolve_dtype(cfg.dtype, "cpu"), resolve_dtype(cfg.dtype, "cuda:0")) == ("float32", "bfloat16")


@pytest.mark.parametrize(("dtype", "compile", "on_cpu", "expected"), [
    ("auto", "auto", True, ("float32", True)),  # CPU: fp32, eager (measured faster to start and to run)
    ("auto", "auto", False, ("bfloat16", False)),  # GPU: bf16, compiled
    ("bfloat16", True, True, ("bfloat16", False)),  # explicit settings win on either platform
    ("float32", False, False, ("float32", True)),
])
def test_auto_engine_settings_resolve_per_platform(
    dtype: str, compile: str | bool, on_cpu: bool, expected: tuple[str, bool]
) -> None:
    from stages.generation.vllm_backend import engine_kwargs, resolve_engine_settings

    assert resolve_engine_settings(dtype, compile, on_cpu) == expected
    kwargs = engine_kwargs(Path("/m"), expected[0], 2048, 1, on_cpu, enforce_eager=expected[1])
    assert (kwargs["dtype"], kwargs["enforce_eager"]) == expected


def test_each_backend_gets_its_own_dtype(recorded: list[dict[str, Any]]) -> None:
    from stages.generation import make_backend

    cfg = GenerateConfig(dtype="float32", vllm_dtype="bfloat16", max_prompt_tokens=3000, max_new_tokens=100,
                         vllm_kv_cache_gib=3, vllm_tensor_parallel_size=2, batch_size=5)
    make_backend("vllm", Path("/m"), cfg)
    make_backend("hf", Path("/m"), cfg)
    assert recorded == [
        {"model_dir": Path("/m"), "dtype": "bfloat16", "compiled": "auto", "max_model_len": 3100,
         "kv_cache_gib": 3, "tensor_parallel_size": 2, "device": "cpu", "gpu_memory_utilization": 0.9,
         "max_num_seqs": None, "kv_cache_dtype": "auto", "sleep_mode": False},
        {"model_dir": Path("/m"), "dtype": "float32", "batch_size": 5, "device": "cpu"},
    ]
    make_backend("vllm", Path("/m"), GenerateConfig(vllm_dtype="auto", dtype="bfloat16"))
    assert recorded[-1]["dtype"] == "auto"  # resolved by the engine per platform; `dtype` does not leak in


def test_unknown_vllm_dtype_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"generate\.vllm_dtype"):
        load_config(None, ["generate.vllm_dtype=float16"])


@pytest.mark.parametrize(("override", "expected"), [
    ("generate.vllm_compile=auto", "auto"), ("generate.vllm_compile=true", True),
    ("generate.vllm_compile=on", True), ("generate.vllm_compile=off", False),  # YAML's booleans
])
def test_vllm_compile_takes_auto_or_a_boolean(override: str, expected: str | bool) -> None:
    assert load_config(None, [override]).generate.vllm_compile == expected
    with pytest.raises(ConfigError, match=r"generate\.vllm_compile"):
        load_config(None, ["generate.vllm_compile=sometimes"])
