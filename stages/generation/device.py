"""Which device and precision a model stage runs on, and what its manifest records about them.

The config's `device` (auto | cpu | cuda | cuda:N) is resolved by each model stage on the machine it runs on
(`claim_device`): `auto` is the first visible GPU when there is one, the CPU otherwise. Choices:

- GPUs are counted with `torch.cuda.device_count()`, which asks NVML and, unlike `torch.cuda.is_available()`,
  does not initialise CUDA in the stage process: vLLM's engine process and DeepSpeed's ranks start after it,
  and a process that initialised CUDA before forking leaves its children unable to use it.
- `cuda:N` narrows the stage process to that one GPU (CUDA_VISIBLE_DEVICES) before anything touches CUDA, so
  torch, vLLM's engine and the DeepSpeed launcher all see it, as `cuda:0`: one mechanism for every engine.
- A device the machine does not have is a ConfigError naming `device`: the stage exits 2 with one line.
- Precision `auto` is bfloat16 on CUDA (tensor cores, half the memory) and float32 on CPU (the CPU defaults
  and figures stay what they were measured with; a CPU without native bf16 runs it through conversions).
- On CUDA, attention is PyTorch's SDPA (flash / memory-efficient kernels) wherever transformers offers it;
  on CPU the loader keeps transformers' own default.
- Every model stage's manifest records `device_record(...)`: device, GPU name and count, dtype and the peak
  GPU memory torch allocated in the process(es) that ran the model (`torch.cuda.max_memory_allocated`).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

from schemas.config import ConfigError
from stages.generation.base import Backend

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Device:
    """A stage's device: `name` as the config means it ("cpu", "cuda:N" of the GPUs visible at stage start),
    `torch` as torch calls it in this process ("cuda:0" once the process is narrowed to GPU N), and `gpus`, the
    GPUs the stage may use (0 on CPU, 1 for cuda:N, every visible one for auto / cuda: DeepSpeed's ranks)."""

    name: str
    torch: str
    gpus: int

    @property
    def type(self) -> str:
        return "cpu" if self.name == "cpu" else "cuda"

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"


def visible_gpu_count() -> int:
    """CUDA devices this process may use (0 with a CPU build of torch), counted without initialising CUDA."""
    import torch

    return int(torch.cuda.device_count())


def resolve_device(setting: str, gpus: int) -> str:
    """"cpu" or "cuda:N" for the config's `device` on a machine with `gpus` visible GPUs; a ConfigError naming
    the field when it asks for a GPU that is not there."""
    if setting == "cpu" or (setting == "auto" and gpus == 0):
        return "cpu"
    if setting == "auto":
        return "cuda:0"
    index = 0 if setting == "cuda" else int(setting.removeprefix("cuda:"))
    if gpus == 0:
        raise ConfigError(
            f"device: {setting}, but this machine has no CUDA device (torch.cuda.device_count() is 0, torch "
            f"{_torch_build()}); set device: auto or cpu"
        )
    if index >= gpus:
        raise ConfigError(
            f"device: {setting}, but only {gpus} CUDA device(s) are visible (cuda:0..cuda:{gpus - 1}); "
            "set device: auto, cuda or an index below that"
        )
    return f"cuda:{index}"


def _torch_build() -> str:
    import torch

    return f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}"


def narrowed_visible_devices(index: int, current: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES value that leaves only the `index`-th currently visible GPU."""
    if current is None or not current.strip():
        return str(index)
    return [entry.strip() for entry in current.split(",")][index]


def claim_device(setting: str) -> Device:
    """Resolve `setting` for this stage process; `cuda:N` narrows the process to GPU N (see module docstring).

    `auto` and `cuda` leave every visible GPU to the stage (DeepSpeed's ranks take one each; one-process work
    uses the first). When CUDA is already initialised in the process (a caller that used it before), narrowing
    would not take effect, so torch uses `cuda:N` itself.
    """
    import torch

    visible = visible_gpu_count()
    name = resolve_device(setting, visible)
    if name == "cpu":
        return Device("cpu", "cpu", 0)
    if torch.cuda._is_in_bad_fork():
        raise ConfigError(
            f"device: {setting}, but this stage was forked from a process that had initialised CUDA, which a "
            "forked child cannot use; run stages as fresh processes (RLPIPE_STAGE_FORK=0)"
        )
    if not setting.startswith("cuda:"):
        return Device(name, name, visible)
    if torch.cuda.is_initialized():
        return Device(name, name, 1)
    index = int(name.removeprefix("cuda:"))
    os.environ[VISIBLE_DEVICES] = narrowed_visible_devices(index, os.environ.get(VISIBLE_DEVICES))
    return Device(name, "cuda:0", 1)


def resolve_dtype(setting: str, device: str) -> str:
    """The precision a dtype field means on `device`: `auto` is bfloat16 on CUDA, float32 on CPU."""
    if setting != "auto":
        return setting
    return "float32" if device == "cpu" else "bfloat16"


def attention_implementation(device: str) -> str | None:
    """`sdpa` on CUDA; None on CPU, which leaves transformers' default (the CPU figures were measured so)."""
    return None if device == "cpu" else "sdpa"


def release_memory(device: str) -> None:
    """Return freed GPU memory to the driver (the stage process ends soon anyway; a long-lived caller may not)."""
    gc.collect()
    if device != "cpu":
        import torch

        torch.cuda.empty_cache()


def peak_memory_mb(device: str) -> float | None:
    """`torch.cuda.max_memory_allocated` of `device` in this process, in MB; None on CPU."""
    if device == "cpu":
        return None
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 1e6, 1)


def gpu_memory_used_mb(indices: range) -> float:
    """Memory in use on the visible GPUs `indices`, as the driver reports it (NVML, every process together), in MB:
    how much an engine running in another process (vLLM's) holds. Does not initialise CUDA here."""
    import torch

    return round(sum(torch.cuda.device_memory_used(index) for index in indices) / 1e6, 1)


def gpu_name(device: str) -> str | None:
    if device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_name(device)


def device_record(
    device: Device, dtype: str, gpus_used: int | None = None, peak_gpu_memory_mb: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """What a model stage's manifest says about where it ran (`metrics["device"]`): device, GPU name and count
    (the GPUs the stage used), dtype, and the peak GPU memory (this process's, unless a caller measured it
    elsewhere and passes it, e.g. the DeepSpeed ranks' maximum). Read when the stage ends: the GPU name
    initialises CUDA, which must not happen before vLLM's engine process starts."""
    record: dict[str, Any] = {
        "device": device.name,
        "gpu_name": gpu_name(device.torch),
        "gpu_count": 0 if not device.is_cuda else (1 if gpus_used is None else gpus_used),
        "dtype": dtype,
        "peak_gpu_memory_mb": peak_gpu_memory_mb if peak_gpu_memory_mb is not None else peak_memory_mb(device.torch),
    }
    return {**record, **extra}


def backend_device_record(device: Device, backend: Backend) -> dict[str, Any]:
    """`device_record` of a stage that generated with `backend`: the engine's dtype and GPUs; the peak is the
    larger of torch's in this process (the HF backend, the mismatch pass) and the driver's figure for an engine
    that runs in its own process (vLLM's on a GPU, which also holds its KV-cache pool)."""
    peaks = [mb for mb in (peak_memory_mb(device.torch), backend.gpu_memory_used_mb) if mb is not None]
    return device_record(device, str(backend.engine_settings["dtype"]), backend.gpus, max(peaks) if peaks else None)
