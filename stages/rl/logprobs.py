"""Log-probabilities (and entropies) of the sampled response tokens, without the full-vocabulary tensor.

The memory of an RL step on a small model is dominated by logits: 49,152 vocabulary entries x 6,144 tokens x
4 bytes is 1.2 GB per copy, and a plain `log_softmax(logits).gather(...)` keeps several copies alive for
backward. Here the decoder's hidden states are computed once, only the positions that predict a response
token are selected, and the LM head + log-softmax runs over chunks of `chunk_tokens` of them. Each chunk is
wrapped in activation checkpointing, so backward keeps only the chunk's hidden states (tokens x hidden) and
recomputes its logits when it needs them: the logits that exist at any time are one chunk's (chunk x vocab).
The cost is one extra LM-head matmul per token in backward (about 15% of SmolLM2-135M's forward FLOPs).

Log-probs follow the sampler: logits are divided by the sampling temperature (the behaviour policy's
logprobs in the rollouts table are "after temperature"), so pi_old / pi_b compares like with like. Top-p /
top-k truncation is not reproduced: the trainer's policy is the untruncated tempered softmax.

Multi-turn rollouts: a response holds tool / environment observation tokens between the model's turns. Every
response token is forwarded and gets a logprob (observations are context), but `response_mask_BT` (the one mask
the trainer uses for every loss term and statistic) is the response mask times the per-token loss mask, built
once with the micro-batch: observation tokens are 0 there like padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class MicroBatch:
    """Sequences (prompt + response) right-padded into one (B, L) tensor, with the response positions."""

    indices: list[int]  # positions of these sequences in the caller's list
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    response_lengths_B: torch.Tensor
    # One entry per response token, flattened: row, hidden position that predicts it, column in _BT, token
    rows_N: torch.Tensor
    positions_N: torch.Tensor
    columns_N: torch.Tensor
    targets_N: torch.Tensor
    # Per response token (flattened like targets_N): 1 a model token, 0 an observation; None: every token the model's
    loss_mask_N: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """T: the widest response, the width of this micro-batch's _BT tensors."""
        return int(self.response_lengths_B.max().item()) if len(self.indices) else 0

    @property
    def tokens(self) -> int:
        """Non-padding tokens forwarded (prompt + response)."""
        return int(self.attention_mask_BL.sum().item())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids_BL.numel())

    def response_mask_BT(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, T) 1 at the response tokens the loss sees: not padding, and a model token (loss mask 1)."""
        if self.loss_mask_N is not None:
            return self.to_BT(self.loss_mask_N.to(dtype))
        columns_T = torch.arange(self.width, device=self.response_lengths_B.device)
        return (columns_T[None, :] < self.response_lengths_B[:, None]).to(dtype)

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device` (itself when they are there already)."""
        if self.input_ids_BL.device == device:
            return self
        tensors = ("input_ids_BL", "attention_mask_BL", "response_lengths_B", "rows_N", "positions_N", "columns_N",
                   "targets_N")
        mask = {} if self.loss_mask_N is None else {"loss_mask_N": self.loss_mask_N.to(device)}
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors}, **mask)

    def to_BT(self, values_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter flat per-token values into (B, T) (differentiable)."""
        out_BT = values_N.new_full((len(self.indices), self.width), fill)
        return out_BT.index_put((self.rows_N, self.columns_N), values_N)


def build_micro_batch(
    indices: list[int],
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int = 0,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> MicroBatch:
    """Right-pad the sequences `indices` of (prompts, responses) into one micro-batch. `loss_masks` (aligned with
    `responses`; an entry None = all model tokens): the multi-turn loss mask, kept only when one of `indices` has
    one, so a single-turn micro-batch is exactly what it was without it."""
    lengths = [len(prompts[i]) + len(responses[i]) for i in indices]
    width = max(lengths)
    input_ids_BL = torch.full((len(indices), width), pad_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((len(indices), width), dtype=torch.long)
    rows, positions, columns, targets = [], [], [], []
    for row, i in enumerate(indices):
        prompt, response = prompts[i], responses[i]
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt: the first response token has no context")
        sequence = list(prompt) + list(response)
        input_ids_BL[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask_BL[row, : len(sequence)] = 1
        # response token j sits at position P + j and is predicted by the hidden state at P + j - 1
        start = len(prompt)
        rows.extend([row] * len(response))
        positions.extend(range(start - 1, start - 1 + len(response)))
        columns.extend(range(len(response)))
        targets.extend(response)
    loss_mask_N = None
    if loss_masks is not None and any(loss_masks[i] is not None for i in indices):
        flat_mask: list[int] = []
        for i in indices:
            mask = [1] * len(responses[i]) if loss_masks[i] is None else list(loss_masks[i])
            if len(mask) != len(responses[i]):
                raise ValueError(f"sequence {i}: {len(responses[i])} response tokens but {len(mask)} loss mask values")
            flat_mask.extend(mask)
        loss_mask_N = torch.tensor(flat_mask, dtype=torch.float32)
    return MicroBatch(
        indices=list(indices),
        input_ids_BL=input_ids_BL,
        attention_mask_BL=attention_mask_BL,
        response_lengths_B=torch.tensor([len(responses[i]) for i in indices], dtype=torch.long),
        rows_N=torch.tensor(rows, dtype=torch.long),
        positions_N=torch.tensor(positions, dtype=torch.long),
        columns_N=torch.tensor(columns, dtype=torch.long),
        targets_N=torch.tensor(targets, dtype=torch.long),
        loss_mask_N=loss_mask_N,
    )


def pack_by_tokens(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size (count x longest) fits `token_budget`.

    Sequences are sorted by length (longest first, ties by index, so the packing is deterministic) and cut
    greedily: a micro-batch is closed when one more sequence would exceed the budget. Neighbours in sorted
    order have similar lengths, so the padding per micro-batch is at most (count - 1) x (longest - shortest)
    of that micro-batch; the caller reports the padded fraction. A sequence longer than the budget gets a
    micro-batch of its own (it cannot be split without changing the math).
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _chunk_logprobs(
    hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: torch.nn.Module, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NV = head(hidden_NH).float()
    if inv_temperature != 1.0:
        logits_NV = logits_NV * inv_temperature
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
    # entropy H = lse - sum_v p_v * logit_v (one pass over the chunk's logits, no extra tensor kept)
    entropy_N = lse_N - (torch.softmax(logits_NV, dim=-1) * logits_NV).sum(-1)
    return logp_N, entropy_N


class ResponseLogprobs(torch.nn.Module):
    """The policy as a module whose forward returns (logp_N, entropy_N) of a micro-batch's response tokens.

    A module rather than a function so that DeepSpeed can wrap it: under ZeRO-3 the engine's forward hooks
    gather partitioned parameters, which only works if the forward goes through the engine.
    """

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0, chunk_tokens: int = 512):
        super().__init__()
        self.model = model
        self.inv_temperature = 1.0 / temperature if temperature > 0 else 1.0
        self.chunk_tokens = chunk_tokens

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        rows_N: torch.Tensor,
        positions_N: torch.Tensor,
        targets_N: torch.Tensor,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        hidden_BLH = decoder(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False)[0]
        hidden_NH = hidden_BLH[rows_N, positions_N]
        use_checkpoint = torch.is_grad_enabled() and hidden_NH.requires_grad
        logps, entropies = [], []
        for start in range(0, hidden_NH.shape[0], self.chunk_tokens):
            chunk_NH = hidden_NH[start : start + self.chunk_tokens]
            chunk_targets_N = targets_N[start : start + self.chunk_tokens]
            if use_checkpoint:
                logp_N, entropy_N = checkpoint(
                    _chunk_logprobs,
                    chunk_NH,
                    chunk_targets_N,
                    head,
                    self.inv_temperature,
                    use_reentrant=False,
                )
            else:
                logp_N, entropy_N = _chunk_logprobs(chunk_NH, chunk_targets_N, head, self.inv_temperature)
            logps.append(logp_N)
            entropies.append(entropy_N if entropy_grad else entropy_N.detach())
        if not logps:
            empty_N = hidden_NH.new_zeros((0,), dtype=torch.float32)
            return empty_N, empty_N
        return torch.cat(logps), torch.cat(entropies)


def micro_logprobs(
    policy: torch.nn.Module, micro: MicroBatch, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT) of `micro` through a ResponseLogprobs module (or a DeepSpeed engine on one)."""
    logp_N, entropy_N = policy(
        micro.input_ids_BL,
        micro.attention_mask_BL,
        micro.rows_N,
        micro.positions_N,
        micro.targets_N,
        entropy_grad,
    )
    return micro.to_BT(logp_N), micro.to_BT(entropy_N)


def response_logprobs(
    model: torch.nn.Module,
    micro: MicroBatch,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT) of the response tokens of `micro` under `model`; padding entries are 0.

    Gradients flow into logp_BT when grad mode is on; into entropy_BT only if `entropy_grad` (an entropy
    bonus), otherwise entropy is a detached metric.
    """
    return micro_logprobs(ResponseLogprobs(model, temperature, chunk_tokens), micro, entropy_grad)


def full_softmax_logprobs(
    model: torch.nn.Module, micro: MicroBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation (full logits, full log_softmax) used by tests to check `response_logprobs`."""
    logits_BLV = model(input_ids=micro.input_ids_BL, attention_mask=micro.attention_mask_BL).logits.float()
    if temperature > 0:
        logits_BLV = logits_BLV / temperature
    logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
    logp_N = logp_BLV[micro.rows_N, micro.positions_N].gather(-1, micro.targets_N[:, None]).squeeze(-1)
    entropy_N = -(logp_BLV.exp() * logp_BLV)[micro.rows_N, micro.positions_N].sum(-1)
    return micro.to_BT(logp_N), micro.to_BT(entropy_N)


def all_response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    token_budget: int,
    chunk_tokens: int = 512,
) -> list[torch.Tensor]:
    """The logprobs of every response's tokens under `model` (no grad, on the model's device), micro-batched by
    `token_budget`: for a stage that needs one policy's logprobs without a trainer (the advantage stage's
    reference pass for the KL in the reward). Padding-free per response, in input order, on the CPU."""
    device = next(model.parameters()).device
    policy = ResponseLogprobs(model, temperature, chunk_tokens)
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    model.eval()
    for indices in pack_by_tokens(lengths, token_budget):
        micro = build_micro_batch(indices, prompts, responses).to(device)
        with torch.no_grad():
            logp_BT, _ = micro_logprobs(policy, micro)
        for row, i in enumerate(indices):
            out[i] = logp_BT[row, : len(responses[i])].float().cpu()
    return out
