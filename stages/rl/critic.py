"""PPO's critic: a value model, its checkpoint beside the policy's, and its update.

`ValueModel` is a causal LM's decoder with a scalar head: V(s_t) for every response token t, read at the
position that predicts the token (the hidden state the policy's logprob of t comes from; verl's dp_critic
reads values[:, -L - 1 : -1]). It starts from the policy being trained (or `train.critic_model`) with a
zero head, so the first values are exactly 0 and the first GAE is the discounted reward-to-go: the advantage
stage of iteration 0 needs no critic to compute them. It lives in `<checkpoint>/critic/` (the backbone as a
Hugging Face directory, the head, AdamW's state, its step count), is read by the advantage stage (values for
GAE) and the train stage of the next iteration, and is resumed like the policy. `CriticTrainer.step` runs one
optimizer step of verl's clipped value loss (`value_loss`) on a minibatch, beside each policy step, with its
own learning rate and schedule (`train.critic_lr`, `critic_warmup_steps`, `critic_lr_schedule`). The critic
trains in fp32 on the torch backend only (TrainConfig refuses a critic with DeepSpeed). A multi-turn sample's
loss mask keeps observation tokens out of the value loss and its statistics, as out of the policy's. The critic
packs its micro-batches like the policy (`train.share_prompts`: a group's prompt forwarded once per row).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from schemas.config import TrainConfig
from stages.rl.logprobs import (
    MicroBatch,
    build_micro_batch,
    decoder_hidden_states,
    plan_micro_batches,
    takes_shared_prompts,
)
from stages.rl.schedule import lr_at

CRITIC_DIR = "critic"
HEAD_FILE = "value_head.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "critic_state.json"


class ValueModel(torch.nn.Module):
    """A causal LM's decoder + a linear head to one number: forward gives V at the positions `positions_N`."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(
        self,
        input_ids_RL: torch.Tensor,
        attention_mask_RL: torch.Tensor,
        hidden_rows_N: torch.Tensor,
        positions_N: torch.Tensor,
        position_ids_RL: torch.Tensor | None = None,
        segments_RL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_RLH = decoder_hidden_states(self.backbone, input_ids_RL, attention_mask_RL, position_ids_RL,
                                           segments_RL)
        return self.head(hidden_RLH[hidden_rows_N, positions_N].float()).squeeze(-1)

    def values_BT(self, micro: MicroBatch) -> torch.Tensor:
        """(B, T) values of a micro-batch's response tokens (plain or shared rows), 0 on padding."""
        return micro.to_BT(self(*micro.forward_inputs()))


def critic_dir(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / CRITIC_DIR


def load_value_model(checkpoint_dir: Path | None, init_dir: Path, device: str = "cpu") -> tuple[ValueModel, int]:
    """The critic of `checkpoint_dir` (its `critic/`) and its step count; without one, a new critic from the
    model in `init_dir` with a zero head (V = 0 everywhere) and step 0."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.generation.models import quiet_model_io

    saved = critic_dir(checkpoint_dir) if checkpoint_dir is not None else None
    source = saved if saved is not None and saved.is_dir() else Path(init_dir)
    with quiet_model_io():
        backbone = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    backbone.config.use_cache = False
    head = torch.nn.Linear(backbone.config.hidden_size, 1)
    step = 0
    if source == saved:
        head.load_state_dict(load_file(saved / HEAD_FILE))
        step = int(json.loads((saved / STATE_FILE).read_text())["global_step"])
    else:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return ValueModel(backbone, head).to(device), step


def save_value_model(
    model: ValueModel, optimizer: torch.optim.Optimizer | None, global_step: int, checkpoint_dir: Path
) -> None:
    """Write the critic into `<checkpoint_dir>/critic/`."""
    from safetensors.torch import save_file

    from stages.generation.models import quiet_model_io

    out = critic_dir(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_model_io():
        model.backbone.save_pretrained(out, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, out / HEAD_FILE)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    (out / STATE_FILE).write_text(json.dumps({"global_step": global_step}) + "\n")


def copy_value_model(source_checkpoint: Path, out_checkpoint: Path) -> None:
    """A skipped step's critic: the input checkpoint's, unchanged (nothing when it has none)."""
    if critic_dir(source_checkpoint).is_dir():
        shutil.copytree(critic_dir(source_checkpoint), critic_dir(out_checkpoint), dirs_exist_ok=True)


def critic_lr_at(step: int, cfg: TrainConfig) -> float:
    """The critic's learning rate at its optimizer step `step`: the policy's schedule (schedule.lr_at) with
    critic_lr, critic_warmup_steps and critic_lr_schedule (lr_decay_steps and lr_min_ratio shared)."""
    return lr_at(step, cfg.model_copy(update={
        "lr": cfg.critic_lr, "warmup_steps": cfg.critic_warmup_steps, "lr_schedule": cfg.critic_lr_schedule,
    }))  # fmt: skip


def value_loss(
    values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and where the clip was active (verl's compute_value_loss):

      V_clip = clip(V, V_old - c, V_old + c);  L = 0.5 * max((V - R)^2, (V_clip - R)^2)
      clipped where (V_clip - R)^2 > (V - R)^2
    The 0.5 is verl's; `clip` None: L = 0.5 (V - R)^2. Aggregated token-mean by the caller (verl's default).
    """
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        return 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT)
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    clipped_BT = (clipped_values_BT - returns_BT) ** 2
    return 0.5 * torch.maximum(unclipped_BT, clipped_BT), (clipped_BT > unclipped_BT).to(values_BT.dtype).detach()


def explained_variance(sums: dict[str, float]) -> float:
    """1 - Var(R - V) / Var(R) over tokens from the sums of R, R^2, R - V, (R - V)^2 and the count (verl's
    critic/vf_explained_var): 1 a perfect critic, 0 one no better than the mean return, < 0 worse."""
    n = sums["count"]
    if n < 1:
        return 0.0
    var_returns = sums["r_sq"] / n - (sums["r"] / n) ** 2
    var_error = sums["e_sq"] / n - (sums["e"] / n) ** 2
    return 1.0 - var_error / var_returns if var_returns > 1e-12 else 0.0


# The critic's columns of a train_metrics row when there is no critic.
NO_CRITIC = {"value_loss": 0.0, "vf_clip_frac": 0.0, "vf_explained_var": 0.0}


@dataclass
class CriticSample:
    """What the critic trains on for one sample: its tokens, the values it gave them (V_old), the returns."""

    prompt_ids: list[int]
    response_ids: list[int]
    values: list[float]
    returns: list[float]
    loss_mask: list[int] | None = None  # multi-turn: 0 at observation tokens (no value loss there)


class CriticTrainer:
    """One optimizer step of the critic per policy step, on the same minibatch (verl updates the critic on the
    batch the actor trains on, epochs and minibatches alike)."""

    def __init__(self, model: ValueModel, cfg: TrainConfig, optimizer: torch.optim.Optimizer, global_step: int = 0,
                 device: str | torch.device = "cpu"):
        self.model = model
        self.cfg = cfg
        self.optimizer = optimizer
        self.global_step = global_step
        self.device = torch.device(device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.share = takes_shared_prompts(model.backbone, cfg.share_prompts)

    def step(self, samples: list[CriticSample], minibatch: list[int]) -> dict[str, float]:
        """Backward the token-mean clipped value loss of `minibatch` micro-batch by micro-batch, step; the row's
        value_loss, vf_clip_frac and vf_explained_var (of the values before the update)."""
        cfg = self.cfg
        masks = [s.loss_mask for s in samples]
        tokens = float(sum(len(samples[i].response_ids) if masks[i] is None else sum(masks[i]) for i in minibatch))
        prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        sums = dict.fromkeys(("loss", "clipped", "r", "r_sq", "e", "e_sq", "count"), 0.0)
        self.model.train()
        for rows in plan_micro_batches(minibatch, prompts, responses, cfg.micro_batch_tokens, self.share):
            micro = build_micro_batch(rows, prompts, responses, loss_masks=masks).to(self.device)
            indices = micro.indices
            mask_BT = micro.response_mask_BT()
            old_BT = micro.to_BT(torch.tensor([v for i in indices for v in samples[i].values], device=self.device))
            returns_BT = micro.to_BT(torch.tensor([r for i in indices for r in samples[i].returns], device=self.device))
            values_BT = self.model.values_BT(micro)
            loss_BT, clipped_BT = value_loss(values_BT, old_BT, returns_BT, cfg.value_clip)
            loss = (loss_BT * mask_BT).sum() / max(tokens, 1.0)
            loss.backward()
            with torch.no_grad():
                error_BT = (returns_BT - values_BT.detach()) * mask_BT
                sums["loss"] += float(loss)
                sums["clipped"] += float((clipped_BT * mask_BT).sum())
                sums["r"] += float((returns_BT * mask_BT).sum())
                sums["r_sq"] += float((returns_BT**2 * mask_BT).sum())
                sums["e"] += float(error_BT.sum())
                sums["e_sq"] += float((error_BT**2).sum())
                sums["count"] += float(mask_BT.sum())
        for group in self.optimizer.param_groups:
            group["lr"] = critic_lr_at(self.global_step, cfg)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        if math.isfinite(grad_norm):  # a non-finite gradient would write NaN into every weight
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.model.eval()
        return {
            "value_loss": sums["loss"],
            "vf_clip_frac": sums["clipped"] / max(sums["count"], 1.0),
            "vf_explained_var": explained_variance(sums),
        }


def predict_values(model: ValueModel, prompts: list[list[int]], responses: list[list[int]], token_budget: int,
                   device: str | torch.device = "cpu", share: bool = False) -> list[np.ndarray]:
    """V(s_t) of every response token of every (prompt, response), no grad, micro-batched by `token_budget`
    (`share`: the shared-prompt layout)."""
    out: list[np.ndarray] = [np.zeros(0)] * len(prompts)
    model.eval()
    for rows in plan_micro_batches(range(len(prompts)), prompts, responses, token_budget, share):
        micro = build_micro_batch(rows, prompts, responses).to(torch.device(device))
        with torch.no_grad():
            values_BT = model.values_BT(micro)
        for b, i in enumerate(micro.indices):
            out[i] = values_BT[b, : len(responses[i])].double().cpu().numpy()
    return out
