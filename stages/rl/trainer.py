"""The policy update: one batch of scored samples in, optimizer steps and one metrics row per step out.

The train stage without its I/O, so the toy-problem tests, the benchmark and the DeepSpeed worker run exactly
the stage's code. `PolicyTrainer.train` on a batch: (1) old-policy logprobs, recomputed in a no-grad pass
only when the batch gets more than one optimizer step or the correction needs them before the first backward
(for a single step the training forward pass's detached logprobs are the old policy; with
`bypass_old_logprobs` the sampler's are); (2) reference logprobs of the frozen base model when kl_coef > 0;
(3) `epochs` seeded shuffles, each cut into `minibatches` optimizer steps; each step first fixes its rollout
correction over the whole minibatch (`_correction`: rejection, M2PO, normalised weights), then packs the
minibatch into micro-batches by token budget with gradients accumulated, every loss term aggregated with the
minibatch's totals (`losses.aggregate`) so the gradient is the minibatch loss's whatever the packing (with
`train.share_prompts` the samples of a group share a forward row: stages/rl/logprobs.py);
(4) clipping, `lr_at(global_step)`, the step.

Multi-turn samples carry a `loss_mask` (0 at tool / environment observation tokens): the micro-batch's
`response_mask_BT` includes it, so the policy loss, KL terms, entropy, importance weights, rejection and every
loss denominator count model tokens only, while the forward covers the whole sequence (observations are context).

Dropout is forced off: PPO's ratio and the single-step fast path need a deterministic policy. The optimizer
side is behind `Stepper` (plain torch here, DeepSpeed in stages/rl/deepspeed_backend.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from schemas.config import TrainConfig
from stages.generation.device import resolve_dtype
from stages.rl.critic import NO_CRITIC, CriticSample, CriticTrainer
from stages.rl.logprobs import (
    MicroBatch,
    ResponseLogprobs,
    build_micro_batch,
    micro_logprobs,
    plan_micro_batches,
    takes_shared_prompts,
)
from stages.rl.losses import (
    PolicyLossOutput,
    aggregate,
    cispo_loss,
    gspo_loss,
    kl_estimate,
    m2po_mask,
    ppo_clip_loss,
    reinforce_loss,
    rejection_mask,
    sapo_loss,
    sequence_skip_mask,
    step_stat_metrics,
    step_stat_sums,
    truncated_is_weights,
)
from stages.rl.schedule import lr_at
from storage.process import release_freed_memory


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # the sampler's, one per response token
    advantage: float
    # GAE's per response token (the batch table's lists): the advantages the policy gets instead of `advantage`,
    # and the critic's old values and returns
    token_advantages: list[float] | None = None
    values: list[float] | None = None
    returns: list[float] | None = None
    # Multi-turn: 1 per model token, 0 per observation token (out of every loss term); None: all the model's
    loss_mask: list[int] | None = None

    @property
    def model_tokens(self) -> int:
        """Response tokens the loss sees: the model's (all of them without a loss mask)."""
        return len(self.response_ids) if self.loss_mask is None else int(sum(self.loss_mask))

    def model_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(T,) float 1 at model tokens, 0 at observations."""
        if self.loss_mask is None:
            return torch.ones(len(self.response_ids), device=device)
        return torch.tensor(self.loss_mask, dtype=torch.float32, device=device)

    def __post_init__(self) -> None:
        if len(self.behaviour_logprobs) != len(self.response_ids):
            raise ValueError(
                f"{len(self.response_ids)} response tokens but "
                f"{len(self.behaviour_logprobs)} sampler logprobs"
            )
        if not math.isfinite(self.advantage):
            raise ValueError(f"advantage {self.advantage} is not finite")
        for name in ("token_advantages", "values", "returns"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(f"{len(self.response_ids)} response tokens but {len(values)} {name}")
            if values is not None and not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name} are not all finite")
        if self.loss_mask is not None:
            if len(self.loss_mask) != len(self.response_ids):
                raise ValueError(f"{len(self.response_ids)} response tokens but {len(self.loss_mask)} loss mask values")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("loss_mask values must be 0 (observation) or 1 (model token)")


def optimizer_steps(cfg: TrainConfig, samples: int) -> int:
    """Optimizer steps of one `train` call: epochs x minibatches (at most one minibatch per sample)."""
    return cfg.epochs * min(cfg.minibatches, samples)


class Stepper(Protocol):
    """What the trainer needs from an optimizer backend."""

    rank: int
    world_size: int

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, lr: float) -> float: ...  # returns the pre-clip gradient norm

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


class TorchStepper:
    """Plain torch: loss.backward(), clip_grad_norm_, optimizer.step(). One process."""

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        # A non-finite gradient would write NaN into every weight: skip the update (the row records it).
        if math.isfinite(grad_norm):
            step_freeing_grads(self.optimizer, self.params)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return values


def step_freeing_grads(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """`optimizer.step()` one parameter at a time, each gradient freed once its parameter is updated.

    Same update (AdamW's state and arithmetic are per parameter; a step skips parameters without a gradient), but
    the step's peak memory is parameters + the optimizer state + the gradients not yet applied (at most 3 x the
    parameters' bytes on a first step, plus one parameter's temporaries) instead of 4 x plus foreach's whole-model
    temporaries: on SmolLM2-135M ~0.5-1 GB less, the step being the stage's peak once activations are checkpointed.
    With ~270 parameters the extra `step()` calls cost milliseconds."""
    pending = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in pending:
        p.grad = None
    while pending:
        p, grad = pending.pop(0)
        p.grad = grad
        del grad
        optimizer.step()
        p.grad = None


def make_adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=True: one fused kernel per parameter group instead of a Python loop over ~270 tensors.
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        foreach=True,
    )


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


# A micro-batch's statistics that add over micro-batches (weighted by the micro-batch's loss weight) and ranks.
_WEIGHTED_FIELDS = (
    "loss", "policy_loss", "kl_ref_sum", "entropy_sum", "approx_kl_sum", "clip_low", "clip_high", "clip_dual",
    "loss_tokens", "response_tokens", "rejected", "tokens", "forwarded_tokens", "padded_tokens",
)  # fmt: skip
# Importance-ratio sums: every response token counted once (a weight-0 padding repeat adds nothing).
_RATIO_FIELDS = ("w_sum", "w_sq_sum", "w_count")
# Per-step sums that are all-reduced across ranks, then turned into the metrics row.
_SUM_FIELDS = (*_WEIGHTED_FIELDS, *_RATIO_FIELDS)


@dataclass
class TrainBatch:
    """A batch's samples with their per-token logprobs under each policy, one tensor per sample."""

    samples: list[TrainSample]
    behaviour: list[torch.Tensor]  # pi_b, the sampler's
    old: list[torch.Tensor] | None  # pi_old; None: the training forward's own, detached (the one-step fast path)
    ref: list[torch.Tensor] | None  # pi_ref, when kl_coef > 0
    longest: int  # the longest response: seq-mean-token-sum-norm's length when the caller gives none

    @property
    def critic_samples(self) -> list[CriticSample]:
        """What the critic trains on (GAE's samples carry values and returns)."""
        return [CriticSample(s.prompt_ids, s.response_ids, s.values or [], s.returns or [], s.loss_mask)
                for s in self.samples]


@dataclass
class StepCorrection:
    """A minibatch's rollout correction, fixed for its optimizer step, per sample index: the loss mask after
    rejection and M2PO, and the importance weights when they were computed over the minibatch (normalised)
    rather than in each micro-batch's forward; and the loss denominators those masks give."""

    keep: dict[int, torch.Tensor] | None  # None: every response token is in the loss
    weights: dict[int, torch.Tensor] | None  # None: computed in the forward (or none configured)
    norm: dict[str, float | None]


@dataclass
class MicroBatchLoss:
    """A micro-batch's part of the minibatch loss (what backward sees) and its statistics (detached floats):
    the `_SUM_FIELDS` and the importance-ratio extremes `w_min` / `w_max`."""

    loss: torch.Tensor
    stats: dict[str, float]


class StepTotals:
    """A step's statistics: micro-batch stats added with their loss weight, then all-reduced across ranks
    (sums add; `w_min` / `w_max` reduce by min / max)."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(_SUM_FIELDS, 0.0)
        self.w_min, self.w_max = math.inf, -math.inf

    def add(self, stats: dict[str, float], weight: float) -> None:
        for name in _WEIGHTED_FIELDS:
            self.sums[name] += weight * stats[name]
        if weight > 0 and stats["w_count"]:
            for name in _RATIO_FIELDS:
                self.sums[name] += stats[name]
            self.w_min, self.w_max = min(self.w_min, stats["w_min"]), max(self.w_max, stats["w_max"])

    def all_reduce(self, stepper: Stepper) -> dict[str, float]:
        reduced = stepper.all_reduce(torch.tensor([self.sums[k] for k in _SUM_FIELDS], dtype=torch.float64))
        totals = dict(zip(_SUM_FIELDS, reduced.tolist(), strict=True))
        totals["w_min"] = float(stepper.all_reduce(torch.tensor([self.w_min], dtype=torch.float64), "min")[0])
        totals["w_max"] = float(stepper.all_reduce(torch.tensor([self.w_max], dtype=torch.float64), "max")[0])
        return totals


def metrics_row(totals: dict[str, float], kl_ref_on: bool) -> dict[str, float | int]:
    """The train_metrics columns a step's all-reduced totals give. With n = loss tokens (after rejection, >= 1):

      loss, policy_loss = the minibatch loss and its policy term (what was back-propagated)
      approx_kl = sum k3(pi_old || pi_theta) / n;  kl_ref = sum kl_estimator(pi_theta || pi_ref) / n (0 if off)
      entropy = sum H(pi_theta) / n;  the clip / rejection / importance-ratio columns: losses.step_stat_metrics
      tokens = the sequences' prompt + response tokens (each sequence's prompt counted, so tokens/s compares with
        and without train.share_prompts);  loss_tokens = loss tokens;  padding_frac = 1 - forwarded / padded, over
        the tokens the forward rows hold (a shared prompt once per row)
    `PolicyTrainer._step` adds step, epoch, skipped, grad_norm (before clipping), lr, sequences, seconds.
    """
    loss_tokens = max(totals["loss_tokens"], 1.0)
    return {
        "loss": totals["loss"],
        "policy_loss": totals["policy_loss"],
        "approx_kl": totals["approx_kl_sum"] / loss_tokens,
        "kl_ref": totals["kl_ref_sum"] / loss_tokens if kl_ref_on else 0.0,
        "entropy": totals["entropy_sum"] / loss_tokens,
        **step_stat_metrics(totals),
        "tokens": int(totals["tokens"]),
        "loss_tokens": int(totals["loss_tokens"]),
        "padding_frac": 1.0 - totals["forwarded_tokens"] / max(totals["padded_tokens"], 1.0),
    }


class PolicyTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        stepper: Stepper,
        *,
        temperature: float = 1.0,
        norm_length: int | None = None,
        ref_model: torch.nn.Module | None = None,
        global_step: int = 0,
        policy: torch.nn.Module | None = None,
        device: str | torch.device | None = None,
        critic: CriticTrainer | None = None,
    ):
        """`policy`: the module the forward passes go through; default ResponseLogprobs(model), a DeepSpeed
        engine wrapping one in the DeepSpeed backend. `device`: where the batch tensors go (default: the model's
        first parameter's); `train.dtype` "auto" resolves on it (bf16 autocast on CUDA, fp32 on CPU). `critic`:
        PPO's critic, stepped on each minibatch after the policy (stages/rl/critic.py)."""
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.model = model
        self.cfg = cfg
        self.stepper = stepper
        self.temperature = temperature
        self.norm_length = norm_length
        self.ref_model = ref_model
        self.global_step = global_step
        self.critic = critic
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = resolve_dtype(cfg.dtype, str(self.device))
        self.policy = (
            policy if policy is not None else ResponseLogprobs(model, temperature, cfg.logprob_chunk_tokens)
        )
        self.ref_policy = (
            ResponseLogprobs(ref_model, temperature, cfg.logprob_chunk_tokens) if ref_model else None
        )
        # Each group's prompt forwarded once per row (train.share_prompts, stages/rl/logprobs.py)
        self.share = takes_shared_prompts(model, cfg.share_prompts)
        disable_dropout(model)

    # ----------------------------------------------------------------------------------------------------

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.dtype == "bfloat16":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                yield
        else:
            yield

    def _micro(self, samples: list[TrainSample], rows: list[list[int]]) -> MicroBatch:
        micro = build_micro_batch(rows, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                  loss_masks=[s.loss_mask for s in samples])
        return micro.to(self.device)

    def _plan(self, samples: list[TrainSample], indices: list[int], token_budget: int) -> list[list[list[int]]]:
        """Micro-batches (lists of forward rows of sample indices) of the samples `indices`."""
        return plan_micro_batches(indices, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                  token_budget, self.share)

    def sequence_logprobs(self, policy: torch.nn.Module, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Logprobs of every sample's response tokens under `policy`, no grad (old policy / reference)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        model = self.model
        was_training = model.training
        model.eval()
        try:
            # No activations are kept without grad, so twice the training budget fits the same memory.
            for rows in self._plan(samples, list(range(len(samples))), 2 * self.cfg.micro_batch_tokens):
                micro = self._micro(samples, rows)
                with torch.no_grad(), self._autocast():
                    logp_BT, _ = micro_logprobs(policy, micro)
                for b, i in enumerate(micro.indices):
                    out[i] = logp_BT[b, : len(samples[i].response_ids)].float().clone()
        finally:
            model.train(was_training)
        return out

    # ----------------------------------------------------------------------------------------------------

    def train(
        self, samples: list[TrainSample], iteration: int = 0, on_step: Callable[[dict], None] | None = None
    ) -> list[dict]:
        """Run the configured optimizer steps on `samples`; one metrics dict per step, also handed to `on_step`
        as each step ends (the train stage's progress bar)."""
        cfg = self.cfg
        if not samples:
            raise ValueError("no samples to train on")
        # Filters can leave fewer samples than minibatches: then each minibatch is one sample, none empty.
        minibatches = min(cfg.minibatches, len(samples))
        total_steps = optimizer_steps(cfg, len(samples))
        behaviour = [torch.tensor(s.behaviour_logprobs, dtype=torch.float32, device=self.device) for s in samples]
        # The fast path: one step, trainer logprobs recomputed in the training forward itself (nothing needs
        # them before the first backward: no rejection, M2PO or weight normalisation over the minibatch).
        self.fast_old = total_steps == 1 and not cfg.bypass_old_logprobs and not self._corrects_minibatch()
        if cfg.bypass_old_logprobs:
            old = behaviour
        elif self.fast_old:
            old = None
        else:
            old = self.sequence_logprobs(self.policy, samples)
        ref = self.sequence_logprobs(self.ref_policy, samples) if self.ref_policy is not None else None

        batch = TrainBatch(samples, behaviour, old, ref, max(len(s.response_ids) for s in samples))
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + iteration)
        rows = []
        self.model.train()
        for epoch in range(cfg.epochs):
            # One step: keep the order. Otherwise shuffle, so minibatches differ between epochs.
            order = list(range(len(samples)))
            if total_steps > 1:
                order = torch.randperm(len(samples), generator=generator).tolist()
            for minibatch in np.array_split(np.array(order), minibatches):
                rows.append(self._step([int(i) for i in minibatch], batch, epoch))
                if on_step is not None:
                    on_step(rows[-1])
        self.model.eval()
        return rows

    def _rank_micro_batches(
        self, samples: list[TrainSample], minibatch: list[int]
    ) -> list[tuple[list[list[int]], float]]:
        """This rank's micro-batches (forward rows of global sample indices) and loss weights (0 for padding
        repeats)."""
        packed = self._plan(samples, minibatch, self.cfg.micro_batch_tokens)
        world, rank = self.stepper.world_size, self.stepper.rank
        mine = [(group, 1.0) for k, group in enumerate(packed) if k % world == rank]
        # Every rank runs the same number of forward/backward passes (ZeRO-3 gathers parameters in
        # collectives): a rank with fewer micro-batches repeats one with weight 0.
        rounds = math.ceil(len(packed) / world)
        while len(mine) < rounds:
            mine.append((packed[0], 0.0))
        return mine

    def _corrects_minibatch(self) -> bool:
        """Whether the correction needs every token of the minibatch at once (rejection changes the loss's
        denominators, M2PO's and the weight normalisation's statistics are over the minibatch)."""
        cfg = self.cfg
        normalises = cfg.is_batch_normalize and self._applies_weights()
        return bool(cfg.rejection) or cfg.m2po_threshold is not None or normalises

    def _applies_weights(self) -> bool:
        """Whether importance weights enter the loss: always when configured, except a ratio loss under bypass,
        whose ratio pi_theta / pi_sampler corrects already (verl's bypass_mode: weights only for reinforce)."""
        cfg = self.cfg
        return cfg.is_level != "none" and (not cfg.bypass_old_logprobs or cfg.policy_loss == "reinforce")

    def _correction(self, minibatch: list[int], batch: TrainBatch) -> StepCorrection:
        """The step's rollout correction from pi_ratio / pi_b over the whole minibatch: pi_ratio = pi_old
        (pi_theta at the step's start under bypass, from a no-grad pass: verl computes it in the loss's own
        forward). In order: rejection (`rejection_mask`, verl's rollout_rs), M2PO (`m2po_mask`) on what is left,
        the truncated importance weights over every response token (`truncated_is_weights`; rejected tokens
        count, as in verl), normalised to mean 1 over the minibatch if `is_batch_normalize`."""
        cfg, samples = self.cfg, batch.samples
        lengths = [len(samples[i].response_ids) for i in minibatch]
        if not self._corrects_minibatch():
            model_tokens = [samples[i].model_tokens for i in minibatch]
            num_sequences, num_tokens = float(sum(1 for n in model_tokens if n > 0)), float(sum(model_tokens))
            norm = {"num_sequences": num_sequences, "num_tokens": num_tokens, "norm_length": self._norm_length(batch)}
            return StepCorrection(None, None, norm)
        if cfg.bypass_old_logprobs:
            ratio_logp = self.sequence_logprobs(self.policy, [samples[i] for i in minibatch])
        else:
            assert batch.old is not None  # the minibatch correction forces the old-logprob pass
            ratio_logp = [batch.old[i] for i in minibatch]
        pad = torch.nn.utils.rnn.pad_sequence
        ratio_BT = pad(ratio_logp, batch_first=True)
        behaviour_BT = pad([batch.behaviour[i] for i in minibatch], batch_first=True)
        mask_BT = pad([samples[i].model_mask(ratio_BT.device) for i in minibatch], batch_first=True)
        keep_BT = rejection_mask(ratio_BT, behaviour_BT, mask_BT, cfg.rejection_rules()) if cfg.rejection else mask_BT
        if cfg.m2po_threshold is not None:
            keep_BT = keep_BT * m2po_mask(ratio_BT, behaviour_BT, keep_BT, cfg.m2po_threshold)
        weights = None
        if self._applies_weights():
            weights_BT = truncated_is_weights(ratio_BT, behaviour_BT, mask_BT, cfg.is_level, cfg.is_threshold)
            if cfg.is_batch_normalize:
                weights_BT = weights_BT / normaliser(weights_BT, mask_BT, cfg.is_level)
            weights = {i: weights_BT[row, :n] for row, (i, n) in enumerate(zip(minibatch, lengths, strict=True))}
        keep = {i: keep_BT[row, :n] for row, (i, n) in enumerate(zip(minibatch, lengths, strict=True))}
        norm = {
            "num_sequences": float((keep_BT.sum(-1) > 0).sum()),
            "num_tokens": float(keep_BT.sum()),
            "norm_length": self._norm_length(batch),
        }
        return StepCorrection(keep, weights, norm)

    def _norm_length(self, batch: TrainBatch) -> float:
        """seq-mean-token-sum-norm's constant: the caller's (the stage: generate.max_new_tokens), else the batch's
        longest response, the same for every micro-batch packing."""
        return float(self.norm_length or batch.longest)

    def _step(self, minibatch: list[int], batch: TrainBatch, epoch: int) -> dict:
        """One optimizer step on `minibatch` (sample indices): loss and backward per micro-batch of this rank,
        then the update; returns the step's metrics row."""
        started = time.monotonic()
        world = self.stepper.world_size
        # The correction and the denominators of the minibatch loss, known before any backward (losses.aggregate).
        correction = self._correction(minibatch, batch)
        totals = StepTotals()
        for rows, weight in self._rank_micro_batches(batch.samples, minibatch):
            micro = self.micro_batch_loss(rows, batch, correction)
            release_freed_memory()
            # DeepSpeed averages gradients over ranks; each rank holds a part of a sum, so scale by world.
            self.stepper.backward(micro.loss * (weight * world))
            totals.add(micro.stats, weight)
            release_freed_memory()
        lr = lr_at(self.global_step, self.cfg)
        grad_norm = self.stepper.step(lr)
        release_freed_memory()
        self.global_step += 1
        row = metrics_row(totals.all_reduce(self.stepper), kl_ref_on=batch.ref is not None)
        critic_row = NO_CRITIC if self.critic is None else self.critic.step(batch.critic_samples, minibatch)
        return {
            "step": self.global_step - 1, "epoch": epoch, "skipped": False, **row, "grad_norm": grad_norm,
            "lr": lr, "sequences": len(minibatch), "seconds": time.monotonic() - started, **critic_row,
        }  # fmt: skip

    def micro_batch_loss(
        self, rows: list[list[int]], batch: TrainBatch, correction: StepCorrection
    ) -> MicroBatchLoss:
        """The loss of the micro-batch of forward rows `rows` (sample indices), aggregated with the minibatch's
        denominators (so micro-batch losses add up to the minibatch loss): policy loss (+ kl_coef KL to the reference)
        (- entropy_coef entropy), over the tokens the step's `correction` keeps, and its statistics."""
        cfg = self.cfg
        micro = self._micro(batch.samples, rows)
        indices = micro.indices
        with self._autocast():
            logp_BT, entropy_BT = micro_logprobs(self.policy, micro, entropy_grad=cfg.entropy_coef > 0)
        logp_BT = logp_BT.float()
        mask_BT = micro.response_mask_BT()
        behaviour_BT = micro.to_BT(torch.cat([batch.behaviour[i] for i in indices]))
        old_BT = logp_BT.detach() if batch.old is None else micro.to_BT(torch.cat([batch.old[i] for i in indices]))
        keep_BT = mask_BT if correction.keep is None else micro.to_BT(torch.cat([correction.keep[i] for i in indices]))
        weights_BT = None
        if correction.weights is not None:
            weights_BT = micro.to_BT(torch.cat([correction.weights[i] for i in indices]))
        elif self._applies_weights():  # per sample: from this forward (pi_old = pi_theta on the fast path)
            ratio_logp_BT = logp_BT.detach() if cfg.bypass_old_logprobs else old_BT
            weights_BT = truncated_is_weights(ratio_logp_BT, behaviour_BT, mask_BT, cfg.is_level, cfg.is_threshold)
        advantages_BT = self._advantages_BT(micro, batch.samples, indices).expand_as(logp_BT)
        out = self.policy_loss(logp_BT, old_BT, advantages_BT, mask_BT, weights_BT)
        token_loss_BT = out.loss_BT
        if weights_BT is not None and cfg.policy_loss != "reinforce":  # reinforce took them as its w
            token_loss_BT = token_loss_BT * weights_BT
        loss_keep_BT = keep_BT
        if cfg.skip_threshold is not None:  # out of the numerator only: the denominators stay the step's
            loss_keep_BT = keep_BT * sequence_skip_mask(logp_BT.detach(), old_BT, mask_BT, cfg.skip_threshold)
        norm = correction.norm
        policy_loss = aggregate(token_loss_BT, loss_keep_BT, cfg.loss_aggregation, **norm)
        loss = policy_loss
        kl_ref_sum = 0.0
        if batch.ref is not None:
            ref_BT = micro.to_BT(torch.cat([batch.ref[i] for i in indices]))
            kl_BT = kl_estimate(logp_BT, ref_BT, cfg.kl_estimator)
            loss = loss + cfg.kl_coef * aggregate(kl_BT, keep_BT, cfg.loss_aggregation, **norm)
            kl_ref_sum = float((kl_BT.detach() * keep_BT).sum())
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy_BT.float(), keep_BT, cfg.loss_aggregation, **norm)

        with torch.no_grad():
            # sampler/trainer mismatch: pi_old / pi_b (pi_theta / pi_b in bypass mode, the PPO ratio)
            ratio_base_BT = logp_BT.detach() if cfg.bypass_old_logprobs else old_BT
            stats = {
                "loss": float(loss),
                "policy_loss": float(policy_loss),
                "kl_ref_sum": kl_ref_sum,
                "entropy_sum": float((entropy_BT.detach().float() * keep_BT).sum()),
                # approx KL(pi_old || pi_theta), k3 estimator with samples from pi_old
                "approx_kl_sum": float((kl_estimate(old_BT, logp_BT.detach(), "k3") * keep_BT).sum()),
                **step_stat_sums(out, keep_BT, mask_BT, ratio_base_BT, behaviour_BT),
                "tokens": float(micro.sample_tokens),
                "forwarded_tokens": float(micro.tokens),
                "padded_tokens": float(micro.padded_tokens),
            }
        return MicroBatchLoss(loss, stats)

    def _advantages_BT(self, micro: MicroBatch, samples: list[TrainSample], indices: list[int]) -> torch.Tensor:
        """(B, T) advantages: GAE's per token when the samples have them, else each sample's broadcast ((B, 1))."""
        if samples[indices[0]].token_advantages is not None:
            flat = [a for i in indices for a in samples[i].token_advantages]
            return micro.to_BT(torch.tensor(flat, dtype=torch.float32, device=self.device))
        advantages_B = [samples[i].advantage for i in indices]
        return torch.tensor(advantages_B, dtype=torch.float32, device=self.device)[:, None]

    def policy_loss(
        self,
        logp_BT: torch.Tensor,
        old_BT: torch.Tensor,
        advantages_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        weights_BT: torch.Tensor | None,
    ) -> PolicyLossOutput:
        """The per-token policy loss `train.policy_loss` names (stages/rl/losses.py)."""
        cfg = self.cfg
        if cfg.policy_loss == "ppo_clip":
            return ppo_clip_loss(logp_BT, old_BT, advantages_BT, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        if cfg.policy_loss == "reinforce":
            return reinforce_loss(logp_BT, old_BT, advantages_BT, weights_BT)
        if cfg.policy_loss == "cispo":
            return cispo_loss(logp_BT, old_BT, advantages_BT, cfg.clip_high)
        if cfg.policy_loss == "sapo":
            return sapo_loss(logp_BT, old_BT, advantages_BT, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        if cfg.policy_loss == "gspo":
            return gspo_loss(logp_BT, old_BT, advantages_BT, mask_BT, cfg.clip_low, cfg.clip_high)
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r}")


def normaliser(weights_BT: torch.Tensor, mask_BT: torch.Tensor, level: str) -> torch.Tensor:
    """verl's rollout_is_batch_normalize: the mean weight over response tokens (token level) or over sequences
    (sequence level, one weight each); 1 when it is ~0."""
    mask_BT = mask_BT.to(weights_BT.dtype)
    if level == "token":
        mean = (weights_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0)
    else:
        seq_B = (weights_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        has_B = (mask_BT.sum(-1) > 0).to(weights_BT.dtype)
        mean = (seq_B * has_B).sum() / has_B.sum().clamp(min=1.0)
    return mean if float(mean) > 1e-8 else torch.ones_like(mean)
