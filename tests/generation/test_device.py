"""The `device` setting and the precision it implies (stages/generation/device.py), on this CPU machine.

Resolution is a function of the setting and the GPU count, checked against hand-written tables; a GPU the
machine lacks is a ConfigError naming `device` (the stage exits 2: tests/rl/test_gpu_paths.py runs one);
`cuda:N` narrows the stage process to that GPU through CUDA_VISIBLE_DEVICES. GPUs cannot be had here, so
the narrowing tests give `claim_device` a GPU count (the one thing faked); CUDA itself is never touched.
"""

from __future__ import annotations

import os

import pytest

from schemas.config import ConfigError, load_config
from stages.generation import device as device_module
from stages.generation.device import (
    Device,
    attention_implementation,
    claim_device,
    device_record,
    narrowed_visible_devices,
    resolve_device,
    resolve_dtype,
)


@pytest.mark.parametrize(("setting", "gpus", "expected"), [
    ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cpu", 0, "cpu"), ("cpu", 4, "cpu"),
    ("cuda", 1, "cuda:0"), ("cuda:0", 1, "cuda:0"), ("cuda:3", 4, "cuda:3"),
])
def test_device_resolves_by_setting_and_gpu_count(setting: str, gpus: int, expected: str) -> None:
    assert resolve_device(setting, gpus) == expected


def test_a_gpu_the_machine_lacks_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as none:
        resolve_device("cuda", 0)
    assert str(none.value).startswith("device: cuda, but this machine has no CUDA device")
    assert "set device: auto or cpu" in str(none.value) and "\n" not in str(none.value)
    with pytest.raises(ConfigError, match=r"^device: cuda:2, but only 2 CUDA device\(s\) are visible \(cuda:0\.\."):
        resolve_device("cuda:2", 2)


def test_this_machine_has_no_gpu_so_auto_is_the_cpu_and_cuda_is_refused() -> None:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert claim_device("auto") == Device("cpu", "cpu", 0)
    assert claim_device("cpu") == Device("cpu", "cpu", 0)
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"^device: {setting}, but this machine has no CUDA device"):
            claim_device(setting)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


@pytest.mark.parametrize(("index", "visible", "expected"), [
    (1, None, "1"), (0, "", "0"), (1, "2,3,5", "3"), (2, "2, 3, 5", "5"), (0, "GPU-aa,GPU-bb", "GPU-aa"),
])
def test_narrowing_keeps_the_nth_visible_gpu(index: int, visible: str | None, expected: str) -> None:
    assert narrowed_visible_devices(index, visible) == expected


def test_cuda_n_narrows_the_process_to_that_gpu_and_auto_keeps_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "visible_gpu_count", lambda: 4)  # no GPU here: the count is given
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert claim_device("auto") == Device("cuda:0", "cuda:0", 4)
    assert claim_device("cuda") == Device("cuda:0", "cuda:0", 4)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert claim_device("cuda:2") == Device("cuda:2", "cuda:0", 1)  # named by the config, used as torch's cuda:0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert claim_device("cuda:0") == Device("cuda:0", "cuda:0", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(("setting", "device", "expected"), [
    ("auto", "cpu", "float32"), ("auto", "cuda:0", "bfloat16"), ("auto", "cuda:3", "bfloat16"),
    ("float32", "cuda:0", "float32"), ("bfloat16", "cpu", "bfloat16"),
])
def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu(setting: str, device: str, expected: str) -> None:
    assert resolve_dtype(setting, device) == expected


def test_cpu_defaults_stay_fp32_and_sdpa_is_asked_for_on_cuda_only() -> None:
    config = load_config(None)
    assert (config.device, config.generate.dtype, config.train.dtype) == ("auto", "auto", "auto")
    assert resolve_dtype(config.generate.dtype, "cpu") == resolve_dtype(config.train.dtype, "cpu") == "float32"
    assert attention_implementation("cpu") is None  # transformers' own default, as the CPU figures were measured
    assert attention_implementation("cuda:0") == "sdpa"


def test_device_setting_is_checked_when_the_config_loads() -> None:
    assert load_config(None, ["device=cuda:12"]).device == "cuda:12"
    for bad in ("gpu", "cuda:x", "cuda:-1", "mps"):
        with pytest.raises(ConfigError, match=r"device: Value error, must be auto, cpu, cuda or cuda:N"):
            load_config(None, [f"device={bad}"])


def test_cpu_record_says_cpu_and_has_no_gpu_figures() -> None:
    assert device_record(Device("cpu", "cpu", 0), "float32") == {
        "device": "cpu", "gpu_name": None, "gpu_count": 0, "dtype": "float32", "peak_gpu_memory_mb": None,
    }
