"""Loading a policy for training and writing the trained one back as a Hugging Face directory.

A checkpoint directory is what vLLM, transformers and the next train stage all read:

    config.json, generation_config.json, model.safetensors   the policy, fp32 (save_pretrained)
    tokenizer files, chat template                           copied byte for byte from the input policy
    optimizer.pt                                             AdamW state (moments), torch.save
    trainer_state.json                                       {"global_step", "iteration", "lora"}

The optimizer state and the global step carry over from one iteration to the next, so Adam's moments and
the learning-rate schedule continue as in one long training run. With LoRA the adapters are merged into
the weights before saving (every consumer wants plain weights); the next iteration starts fresh adapters
on the merged weights, so LoRA optimizer state is saved for the record but not resumed.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from schemas.config import TrainConfig
from storage.checkpoints import HashWhileWriting

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
# Written by save_pretrained (or by us); everything else in a policy directory is carried over as is.
MODEL_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "config.json",
    "generation_config.json",
    OPTIMIZER_FILE,
    STATE_FILE,
    "manifest.json",
)


@dataclass
class TrainerState:
    global_step: int = 0
    iteration: int = -1
    lora: bool = False


def read_state(policy_dir: Path) -> TrainerState:
    path = Path(policy_dir) / STATE_FILE
    if not path.is_file():  # the base model: no training has happened yet
        return TrainerState()
    values = json.loads(path.read_text())
    return TrainerState(int(values["global_step"]), int(values["iteration"]), bool(values.get("lora", False)))


# Bytes of activations the backward keeps per token, layer and hidden unit (fp32): 3.8 GB for a 2048-token
# micro-batch of SmolLM2-135M (30 layers, hidden 576), measured by RSS sampling (benchmarks/train.py's batch).
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 27 * 4


def activation_checkpointing(model: torch.nn.Module, cfg: TrainConfig) -> bool:
    """`train.gradient_checkpointing`, `auto` resolved: on when a full micro-batch's activations
    (micro_batch_tokens x layers x hidden x 108 B) would exceed the weights + gradients (2 x parameters x 4 B)."""
    if cfg.gradient_checkpointing != "auto":
        return bool(cfg.gradient_checkpointing)
    config = model.config
    per_token = config.num_hidden_layers * config.hidden_size * ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN
    weights_and_grads = 2 * 4 * sum(p.numel() for p in model.parameters())
    return cfg.micro_batch_tokens * per_token > weights_and_grads


def load_policy(policy_dir: Path, cfg: TrainConfig, device: str = "cpu") -> torch.nn.Module:
    """The policy in fp32 on `device` in train mode, with gradient checkpointing (activation checkpointing) and
    LoRA adapters as configured. bf16 is autocast around it (the trainer), so weights and Adam stay fp32."""
    from stages.generation.models import load_model

    model = load_model(policy_dir, "float32", device, train=True)
    model.config.use_cache = False
    if activation_checkpointing(model, cfg):
        # Non-reentrant: works with inputs that do not require grad and with our chunked LM head.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.train()
    return model


def load_reference(model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    """A frozen fp32 copy of a model on `device` for the KL penalty (run under the trainer's autocast)."""
    from stages.generation.models import load_model

    model = load_model(model_dir, "float32", device)
    model.requires_grad_(False)
    return model


def load_optimizer_state(optimizer: torch.optim.Optimizer, policy_dir: Path, cfg: TrainConfig) -> bool:
    """Resume AdamW moments from the input policy when there are any and they fit; True if loaded."""
    path = Path(policy_dir) / OPTIMIZER_FILE
    if cfg.lora_rank > 0 or not path.is_file():
        return False
    state = torch.load(path, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state)
    return True


def copy_non_model_files(source: Path, destination: Path) -> None:
    """Tokenizer, chat template and any other file of the policy dir that save_pretrained does not write."""
    for path in sorted(Path(source).iterdir()):
        if path.name.startswith(".") or any(fnmatch.fnmatch(path.name, p) for p in MODEL_PATTERNS):
            continue
        if path.is_file():
            shutil.copy2(path, destination / path.name)


def save_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    source_dir: Path,
    out_dir: Path,
    state: TrainerState,
) -> float:
    """Write the trained policy (merged if LoRA) + tokenizer files + optimizer state + trainer state; returns
    the seconds the save waited for its files' content hashes."""
    from stages.generation.models import quiet_model_io

    out_dir.mkdir(parents=True, exist_ok=True)
    to_save = model
    if hasattr(model, "merge_and_unload"):  # peft
        to_save = model.merge_and_unload()
    to_save.config.use_cache = True
    # Each file is hashed while the next is written (the harness's content hash then reads none of them).
    with HashWhileWriting(out_dir) as hashes:
        with quiet_model_io():
            to_save.save_pretrained(out_dir, safe_serialization=True)
        copy_non_model_files(source_dir, out_dir)
        hashes.hash_written()
        if optimizer is not None:
            with hashes.open(OPTIMIZER_FILE) as handle:
                torch.save(optimizer.state_dict(), handle)
        (out_dir / STATE_FILE).write_text(json.dumps(state.__dict__, sort_keys=True) + "\n")
        hashes.hash_written()
    return hashes.waited_seconds


def copy_policy(source_dir: Path, out_dir: Path, state: TrainerState) -> None:
    """A skipped step's checkpoint: the input policy's files unchanged (weights, tokenizer, optimizer)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with HashWhileWriting(out_dir) as hashes:  # a copy keeps its source's content hash
        for path in sorted(Path(source_dir).iterdir()):
            if (
                path.is_file()
                and not path.name.startswith(".")
                and path.name not in ("manifest.json", STATE_FILE)
            ):
                shutil.copy2(path, out_dir / path.name)
                hashes.copied(path, path.name)
        (out_dir / STATE_FILE).write_text(json.dumps(state.__dict__, sort_keys=True) + "\n")
        hashes.hash_written()
