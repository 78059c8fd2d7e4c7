"""Training on GPUs, everything of it that runs without one: DeepSpeed's backend and rank selection, its ZeRO-Offload
config, the trainer's device and precision, the refusals (through a real train stage process: `device: cuda` on
this CPU machine exits 2 with one line naming the field), and the device record every model stage's manifest
carries, as `rlpipe status`, the report and benchmarks/gpu_smoke.py read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from schemas.config import ConfigError, TrainConfig, load_config
from stages.rl.deepspeed_backend import (
    deepspeed_config,
    dist_backend,
    hostfile_slots,
    launcher_resources,
    node_resources,
    rank_device,
    resolve_processes,
    write_hostfile,
)
from stages.rl.trainer import PolicyTrainer, TorchStepper, make_adamw
from storage.layout import BASE
from tests.reliability import helpers as h
from tests.support.stages import run_stage_at

from .pipeline_helpers import fake_generate, fake_score, run_iteration

CPU_RECORD = {"device": "cpu", "gpu_name": None, "gpu_count": 0, "dtype": "float32", "peak_gpu_memory_mb": None}


@pytest.mark.parametrize(("setting", "device_type", "gpus", "expected"), [
    ("auto", "cpu", 0, 1), (3, "cpu", 0, 3),  # gloo ranks on the CPU, any number, as before
    ("auto", "cuda", 4, 4), (2, "cuda", 4, 2), (1, "cuda", 1, 1),  # one rank per GPU
])
def test_ranks_are_one_per_gpu_on_cuda(setting: int | str, device_type: str, gpus: int, expected: int) -> None:
    assert resolve_processes(setting, device_type, gpus) == expected


def test_more_ranks_than_gpus_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as error:
        resolve_processes(5, "cuda", 4)
    message = str(error.value)
    assert message.startswith("train.processes=5, but the train stage has 4 GPU(s)") and "\n" not in message


def test_backend_and_device_of_each_rank() -> None:
    assert (dist_backend("cuda"), dist_backend("cpu")) == ("nccl", "gloo")
    assert (rank_device("cuda", 3), rank_device("cpu", 3)) == ("cuda:3", "cpu")


@pytest.mark.parametrize(("device_type", "processes", "visible", "expected"), [
    ("cpu", 2, None, ["--num_gpus", "2"]),
    ("cuda", 2, None, ["--include", "localhost:0,1"]),
    ("cuda", 2, "2,5,7", ["--include", "localhost:2,5"]),  # physical ids: the launcher drops the variable
    ("cuda", 1, "3", ["--include", "localhost:3"]),  # a stage narrowed to GPU 3 (device: cuda:3)
])
def test_launcher_arguments_choose_the_ranks(
    device_type: str, processes: int, visible: str | None, expected: list[str]
) -> None:
    assert launcher_resources(device_type, processes, visible) == expected


def test_each_node_of_a_multi_node_job_runs_its_own_launcher_on_one_hostfile(tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path / "hostfile", nodes=2, processes=4)
    assert hostfile.read_text() == "node0 slots=4\nnode1 slots=4\n"  # DeepSpeed's format; names are only keys
    assert hostfile_slots(hostfile) == 4
    assert node_resources(hostfile, 1, "10.0.0.5") == [
        "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.5"]


def test_gpus_named_by_uuid_are_refused_for_the_launcher() -> None:
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES=GPU-a,GPU-b names GPUs by UUID"):
        launcher_resources("cuda", 1, "GPU-a,GPU-b")


def test_zero_offload_config() -> None:
    plain = deepspeed_config(TrainConfig(backend="deepspeed", zero_stage=2), 4, on_cuda=True)
    assert plain["zero_optimization"] == {"stage": 2} and "optimizer" not in plain  # our torch AdamW, as before
    cfg = TrainConfig(backend="deepspeed", zero_stage=2, zero_offload=True, lr=3e-6, adam_beta1=0.8,
                      adam_beta2=0.95, adam_eps=1e-7, weight_decay=0.01)
    offload = deepspeed_config(cfg, 4, on_cuda=True)
    assert offload["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert offload["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-6, "betas": [0.8, 0.95], "eps": 1e-7,
                                                                "weight_decay": 0.01}}
    stage3 = deepspeed_config(cfg.model_copy(update={"zero_stage": 3}), 2, on_cuda=False)
    assert stage3["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False}}


def test_train_fields_are_checked_at_load() -> None:
    assert load_config(None).train.processes == "auto"
    assert load_config(None, ["train.processes=4"]).train.processes == 4
    with pytest.raises(ConfigError, match=r"train\.zero_offload needs train\.backend=deepspeed"):
        load_config(None, ["train.zero_offload=true"])
    with pytest.raises(ConfigError, match=r"zero_stage >= 1 \(got backend=deepspeed, zero_stage=0\)"):
        load_config(None, ["train.backend=deepspeed", "train.zero_stage=0", "train.zero_offload=true"])
    with pytest.raises(ConfigError, match=r"train\.nodes=2: several train nodes need train\.backend=deepspeed"):
        load_config(None, ["train.nodes=2", "train.master_addr=10.0.0.5"])
    with pytest.raises(ConfigError, match=r"train\.nodes=2 needs train\.master_addr, the address of node 0"):
        load_config(None, ["train.backend=deepspeed", "train.nodes=2"])
    two_nodes = load_config(None, ["train.backend=deepspeed", "train.nodes=2", "train.master_addr=10.0.0.5"]).train
    assert (two_nodes.nodes, two_nodes.master_addr, two_nodes.master_port) == (2, "10.0.0.5", 29500)
    with pytest.raises(ConfigError, match=r"train\.processes"):
        load_config(None, ["train.processes=0"])


def test_trainer_takes_the_models_device_and_auto_precision_is_fp32_on_cpu(tiny_model: torch.nn.Module) -> None:
    cfg = TrainConfig()
    trainer = PolicyTrainer(tiny_model, cfg, TorchStepper(tiny_model, make_adamw(tiny_model, cfg), 1.0))
    assert (trainer.device, trainer.dtype) == (torch.device("cpu"), "float32")
    bf16 = TrainConfig(dtype="bfloat16")
    trainer = PolicyTrainer(tiny_model, bf16, TorchStepper(tiny_model, make_adamw(tiny_model, bf16), 1.0),
                            device="cpu")
    assert trainer.dtype == "bfloat16"


def test_device_cuda_on_this_machine_stops_the_train_stage_with_exit_2(run_layout) -> None:  # noqa: ANN001
    make, _ = run_layout
    layout = make("device=cuda")
    run_stage_at("generate", layout, 0, fake_generate)  # stand-ins: the train stage is the one under test
    run_stage_at("score", layout, 0, fake_score(False))
    from stages import advantage

    run_stage_at("advantage", layout, 0, advantage.run)
    result = h.run(h.stage_command(layout, "train"), layout.root)
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "✗" in line]
    assert line.startswith("✗ train: device: cuda, but this machine has no CUDA device"), line
    assert "set device: auto or cpu" in line


def test_model_stage_manifests_record_the_device(run_layout) -> None:  # noqa: ANN001
    from benchmarks.gpu_smoke import check_records
    from flows.cli.status import device_table
    from reports.html import collect
    from stages.registry import instance, stage_state
    from storage.catalog import Catalog
    from storage.run import Run

    make, _ = run_layout
    layout = make()
    run_iteration(layout, 0)
    run = Run.open(layout.root, layout.run_id)
    metrics = stage_state(run, instance("train", 0)).manifests[-1].metrics
    assert metrics["device"] == CPU_RECORD and metrics["tokens_per_second"] > 0

    console = Console(record=True, width=200)
    console.print(device_table(run))
    [row] = [line for line in console.export_text().splitlines() if line.lstrip("│ ").startswith("train")]
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:6] == ["train", "0", "cpu", "-", "float32", "-"]

    devices = collect(Catalog(layout.root), layout.run_id, run.config).devices
    assert [(d["stage"], d["iteration"], d["device"], d["dtype"]) for d in devices] == [("train", 0, "cpu", "float32")]

    records = {"train": metrics, "evaluate": None}
    assert check_records(records, "cpu") == ["evaluate: not done"]
    assert check_records(records, "cuda") == ["train: ran on cpu, not cuda", "evaluate: not done"]
    assert stage_state(run, instance("evaluate_base", BASE)).done is False


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_zero_offload_trains_like_plain_torch(tmp_path) -> None:  # noqa: ANN001
    """ZeRO-Offload for real on the CPU (gloo, one rank): DeepSpeed builds its own AdamW from the config (its CPU
    Adam, compiled on first use, ~1.5 min) in place of our torch AdamW; two off-policy steps must give plain
    torch's losses and weights (the tolerances of test_deepspeed.py), and the same checkpoint files."""
    from safetensors.torch import load_file

    from stages.rl.deepspeed_backend import launch
    from stages.rl.session import run_job

    from .pipeline_helpers import save_tiny_model
    from .test_deepspeed import make_job

    policy = save_tiny_model(tmp_path / "policy")
    train = {"zero_stage": 2, "minibatches": 2}
    torch_rows, _ = run_job(make_job(tmp_path, "torch", policy, **train))
    job = make_job(tmp_path, "ds", policy, backend="deepspeed", processes=1, zero_offload=True, **train)
    ds_rows, metrics = launch(job, tmp_path / "job.json", processes=1, timeout_s=1000)
    assert (metrics["zero_offload"], metrics["peak_gpu_memory_mb"], len(ds_rows)) == (True, None, 2)
    for a, b in zip(torch_rows, ds_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    expected = load_file(tmp_path / "torch" / "model.safetensors")
    got = load_file(tmp_path / "ds" / "model.safetensors")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
