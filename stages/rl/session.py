"""One training session: load the policy, run `PolicyTrainer`, save the checkpoint. No run layout, no tables.

`TrainJob` is everything a training process needs, as plain JSON, so that the train stage can run it in its
own process (the default torch backend) or hand it to the DeepSpeed launcher, whose worker processes
(stages/rl/deepspeed_backend.py) read the same job file and run the same code.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from schemas.config import TrainConfig
from stages.rl.checkpoint import (
    TrainerState,
    load_optimizer_state,
    load_policy,
    load_reference,
    read_state,
    save_policy,
)
from stages.rl.critic import OPTIMIZER_FILE as CRITIC_OPTIMIZER_FILE
from stages.rl.critic import CriticTrainer, critic_dir, load_value_model, save_value_model
from stages.rl.trainer import PolicyTrainer, TorchStepper, TrainSample, make_adamw


@dataclass
class TrainJob:
    policy_dir: str
    out_dir: str
    train: dict[str, Any]  # TrainConfig.model_dump()
    iteration: int
    temperature: float = 1.0
    norm_length: int | None = None
    reference_dir: str | None = None  # needed when train.kl_coef > 0
    threads: int = 1
    samples: list[dict[str, Any]] = field(default_factory=list)  # TrainSample fields
    # Where to train, as torch names it: "cpu" or "cuda:N" (torch backend); the DeepSpeed ranks take the GPU of
    # their local rank when it names CUDA (stages/rl/deepspeed_backend.py).
    device: str = "cpu"
    critic: bool = False  # PPO's critic (advantage.estimator gae): resumed from policy_dir/critic, saved beside

    @property
    def cfg(self) -> TrainConfig:
        return TrainConfig.model_validate(self.train)

    def train_samples(self) -> list[TrainSample]:
        return [TrainSample(**s) for s in self.samples]

    def dump(self, path: Path) -> None:
        """Write the job file whole or not at all (a rename): other nodes' launchers take it as it appears."""
        partial = Path(f"{path}.partial")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrainJob:
        return cls(**json.loads(Path(path).read_text()))


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def seed_everything(cfg: TrainConfig, iteration: int) -> None:
    # Seeds LoRA initialisation and anything else that draws from torch's global generator; the minibatch
    # shuffle has its own generator (PolicyTrainer.train).
    torch.manual_seed(cfg.seed * 1_000_003 + iteration)


def run_job(job: TrainJob, on_step: Callable[[dict], None] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Train in this process with the plain torch backend; returns (metrics rows, session metrics)."""
    cfg = job.cfg
    torch.set_num_threads(job.threads)
    seed_everything(cfg, job.iteration)
    started = time.monotonic()
    policy_dir = Path(job.policy_dir)
    model = load_policy(policy_dir, cfg, job.device)
    optimizer = make_adamw(model, cfg)
    resumed = load_optimizer_state(optimizer, policy_dir, cfg)
    state = read_state(policy_dir)
    ref = load_reference(Path(job.reference_dir), job.device) if cfg.kl_coef > 0 and job.reference_dir else None
    critic = load_critic(job) if job.critic else None
    loaded = time.monotonic()
    cpu_started = time.process_time()
    trainer = PolicyTrainer(
        model,
        cfg,
        TorchStepper(model, optimizer, cfg.max_grad_norm),
        temperature=job.temperature,
        norm_length=job.norm_length,
        ref_model=ref,
        global_step=state.global_step,
        device=job.device,
        critic=critic,
    )
    rows = trainer.train(job.train_samples(), job.iteration, on_step)
    trained = time.monotonic()
    cpu_seconds = time.process_time() - cpu_started
    hash_wait_s = save_policy(
        model,
        optimizer if cfg.save_optimizer else None,
        policy_dir,
        Path(job.out_dir),
        TrainerState(trainer.global_step, job.iteration, cfg.lora_rank > 0),
    )
    if critic is not None:
        save_value_model(critic.model, critic.optimizer if cfg.save_optimizer else None, critic.global_step,
                         Path(job.out_dir))
    saved = time.monotonic()
    metrics = session_metrics(rows, loaded - started, trained - loaded, saved - trained, resumed, "torch", 1)
    # CPU seconds of the update (all threads): a load-independent measure of its work on a shared machine.
    metrics["train_cpu_seconds"] = round(cpu_seconds, 3)
    # The part of the save spent waiting for the checkpoint's content hashes (benchmarks/overhead.py counts it).
    metrics["checkpoint_hash_wait_seconds"] = round(hash_wait_s, 3)
    return rows, metrics


def load_critic(job: TrainJob) -> CriticTrainer:
    """The critic of the input checkpoint with its AdamW state, or a new one (zero head) on train.critic_model or
    the input policy; its optimizer steps count on from the checkpoint's."""
    cfg = job.cfg
    policy_dir = Path(job.policy_dir)
    model, step = load_value_model(policy_dir, Path(cfg.critic_model or policy_dir), job.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.critic_lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, foreach=True)
    saved = critic_dir(policy_dir) / CRITIC_OPTIMIZER_FILE
    if saved.is_file():
        optimizer.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))
    return CriticTrainer(model, cfg, optimizer, step, job.device)


def session_metrics(
    rows: list[dict],
    load_s: float,
    train_s: float,
    save_s: float,
    resumed: bool,
    backend: str,
    processes: int,
) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in rows)
    return {
        "backend": backend,
        "processes": processes,
        "steps": len(rows),
        "tokens": tokens,
        "load_seconds": round(load_s, 3),
        "train_seconds": round(train_s, 3),
        "save_seconds": round(save_s, 3),
        "tokens_per_second": round(tokens / train_s, 2) if train_s > 0 else 0.0,
        "optimizer_resumed": resumed,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
