"""The learning-rate schedule shared by the policy's and the critic's optimizers: warmup, then constant,
linear or cosine decay to a floor, counted in optimizer steps over the whole run."""

from __future__ import annotations

import math

from schemas.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based, counted over the whole run).

    warmup: lr * (step + 1) / warmup_steps for step < warmup_steps; then, with p = progress of the decay
    from warmup_steps to lr_decay_steps clipped to [0, 1] and m = lr_min_ratio:
    constant lr;  linear lr * (1 - (1 - m) p);  cosine lr * (m + (1 - m) (1 + cos(pi p)) / 2).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(cfg.lr_decay_steps - cfg.warmup_steps, 1)
    progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    floor = cfg.lr_min_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1.0 - (1.0 - floor) * progress)
    return cfg.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
