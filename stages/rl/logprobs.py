"""Log-probabilities (and entropies) of the sampled response tokens, without the full-vocabulary tensor.

The memory of an RL step on a small model is dominated by logits: 49,152 vocabulary entries x 6,144 tokens x
4 bytes is 1.2 GB per copy, and a plain `log_softmax(logits).gather(...)` keeps several copies alive for
backward. Here the decoder's hidden states are computed once, only the positions that predict a response
token are selected, and the LM head + log-softmax runs over chunks of `chunk_tokens` of them. Each chunk is
wrapped in activation checkpointing, so backward keeps only the chunk's hidden states (tokens x hidden) and
recomputes its logits when it needs them: the logits that exist at any time are one chunk's (chunk x vocab).
The cost is one extra LM-head matmul per token in backward (about 15% of SmolLM2-135M's forward FLOPs).

Shared prompts (`train.share_prompts`): the samples of a micro-batch with equal prompt token ids share ONE forward
row [prompt, response_1, ..., response_m] with a 4D mask (response k sees the prompt and itself causally, never
another response) and position ids (each response continues from the prompt's length): a group's prompt is
forwarded once, its gradient is the sum over the responses as before, only rounding differs. So _RL tensors are
forward rows, _BT ones one row per sample; `hidden_rows_N` / `positions_N` say which hidden state predicts a token
(a row's first response tokens all come from the prompt's last). transformers 5.x passes a 4D mask through as is
(bool for SDPA, additive float for eager); tested on Llama (SmolLM2) with sdpa and eager, `auto`'s scope.

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
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

# Where a prepared 4D mask is known to reach the attention as is (transformers' masking_utils returns a 4D mask
# unchanged; sdpa and eager apply it): the architectures the shared layout was tested on, and the attention
# implementations it builds masks for.
SHARED_PROMPT_MODEL_TYPES = ("llama",)
SHARED_PROMPT_ATTENTION = ("sdpa", "eager")


@dataclass
class MicroBatch:
    """Sequences (prompt + response) in R right-padded forward rows (R, L), with the response positions.

    Without sharing each sequence has its row (R = B); with it, a row holds a prompt and the responses of the
    sequences that share it, and `position_ids_RL` / `segments_RL` are set (None: plain causal rows)."""

    indices: list[int]  # positions of these sequences in the caller's list: the rows of the _BT tensors
    input_ids_RL: torch.Tensor
    attention_mask_RL: torch.Tensor
    response_lengths_B: torch.Tensor
    # One entry per response token, flattened: forward row and position of the hidden state that predicts it,
    # row and column in _BT, the token
    hidden_rows_N: torch.Tensor
    positions_N: torch.Tensor
    rows_N: torch.Tensor
    columns_N: torch.Tensor
    targets_N: torch.Tensor
    # Per response token (flattened like targets_N): 1 a model token, 0 an observation; None: every token the model's
    loss_mask_N: torch.Tensor | None = None
    # Shared rows: each token's position id, and its segment (0 the prompt, k the row's k-th response, -1 padding)
    position_ids_RL: torch.Tensor | None = None
    segments_RL: torch.Tensor | None = None
    # Prompt + response tokens of the micro-batch's sequences, each counted (what one row per sequence forwards)
    sample_tokens: int = 0

    @property
    def width(self) -> int:
        """T: the widest response, the width of this micro-batch's _BT tensors."""
        return int(self.response_lengths_B.max().item()) if len(self.indices) else 0

    @property
    def tokens(self) -> int:
        """Non-padding tokens forwarded (prompt + response; a shared prompt once per row)."""
        return int(self.attention_mask_RL.sum().item())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids_RL.numel())

    def response_mask_BT(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, T) 1 at the response tokens the loss sees: not padding, and a model token (loss mask 1)."""
        if self.loss_mask_N is not None:
            return self.to_BT(self.loss_mask_N.to(dtype))
        columns_T = torch.arange(self.width, device=self.response_lengths_B.device)
        return (columns_T[None, :] < self.response_lengths_B[:, None]).to(dtype)

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device` (itself when they are there already)."""
        if self.input_ids_RL.device == device:
            return self
        tensors = ("input_ids_RL", "attention_mask_RL", "response_lengths_B", "hidden_rows_N", "positions_N",
                   "rows_N", "columns_N", "targets_N", "loss_mask_N", "position_ids_RL", "segments_RL")
        moved = {name: getattr(self, name).to(device) for name in tensors if getattr(self, name) is not None}
        return replace(self, **moved)

    def to_BT(self, values_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter flat per-token values into (B, T) (differentiable)."""
        out_BT = values_N.new_full((len(self.indices), self.width), fill)
        return out_BT.index_put((self.rows_N, self.columns_N), values_N)

    def forward_inputs(self) -> tuple[torch.Tensor, ...]:
        """What `ResponseLogprobs` / `ValueModel` take, in order: the rows, the hidden-state indices, the layout."""
        return (self.input_ids_RL, self.attention_mask_RL, self.hidden_rows_N, self.positions_N,
                self.position_ids_RL, self.segments_RL)


def build_micro_batch(
    rows: Sequence[int | Sequence[int]],
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int = 0,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> MicroBatch:
    """Right-pad the sequences of `rows` of (prompts, responses) into one micro-batch. An entry of `rows` is a
    sequence index (its own row) or a list of indices whose prompts are equal (one shared row); the micro-batch's
    sequences (`indices`, the _BT rows) are `rows` flattened. With no row of two or more sequences the layout is
    plain causal rows. `loss_masks` (aligned with `responses`; an entry None = all model tokens): the multi-turn
    loss mask, kept only when one of the sequences has one, so a single-turn micro-batch is what it was without."""
    row_lists = [[entry] if isinstance(entry, int) else list(entry) for entry in rows]
    indices = [i for row in row_lists for i in row]
    shared = any(len(row) > 1 for row in row_lists)
    lengths = [len(prompts[row[0]]) + sum(len(responses[i]) for i in row) for row in row_lists]
    width = max(lengths)
    input_ids_RL = torch.full((len(row_lists), width), pad_id, dtype=torch.long)
    attention_mask_RL = torch.zeros((len(row_lists), width), dtype=torch.long)
    position_ids_RL = torch.zeros((len(row_lists), width), dtype=torch.long)
    segments_RL = torch.full((len(row_lists), width), -1, dtype=torch.long)
    hidden_rows, positions, targets = [], [], []
    for r, row in enumerate(row_lists):
        prompt = prompts[row[0]]
        if not prompt:
            raise ValueError(f"sequence {row[0]} has an empty prompt: the first response token has no context")
        for i in row[1:]:
            if prompts[i] != prompt:
                raise ValueError(f"sequences {row[0]} and {i} share a row but their prompt token ids differ")
        tokens, segments, position_ids = list(prompt), [0] * len(prompt), list(range(len(prompt)))
        for k, i in enumerate(row, start=1):
            response, start = responses[i], len(tokens)
            # response token j is predicted by the hidden state before it: the prompt's last for j = 0 (shared by
            # every response of the row), else the response's own token j - 1 at start + j - 1
            hidden_rows.extend([r] * len(response))
            positions.extend(([len(prompt) - 1] + list(range(start, start + len(response) - 1)))[: len(response)])
            targets.extend(response)
            tokens.extend(response)
            segments.extend([k] * len(response))
            position_ids.extend(range(len(prompt), len(prompt) + len(response)))
        input_ids_RL[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask_RL[r, : len(tokens)] = 1
        position_ids_RL[r, : len(tokens)] = torch.tensor(position_ids, dtype=torch.long)
        segments_RL[r, : len(tokens)] = torch.tensor(segments, dtype=torch.long)
    rows_N = torch.tensor([b for b, i in enumerate(indices) for _ in responses[i]], dtype=torch.long)
    columns_N = torch.tensor([j for i in indices for j in range(len(responses[i]))], dtype=torch.long)
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
        indices=indices,
        input_ids_RL=input_ids_RL,
        attention_mask_RL=attention_mask_RL,
        response_lengths_B=torch.tensor([len(responses[i]) for i in indices], dtype=torch.long),
        hidden_rows_N=torch.tensor(hidden_rows, dtype=torch.long),
        positions_N=torch.tensor(positions, dtype=torch.long),
        rows_N=rows_N,
        columns_N=columns_N,
        targets_N=torch.tensor(targets, dtype=torch.long),
        loss_mask_N=loss_mask_N,
        position_ids_RL=position_ids_RL if shared else None,
        segments_RL=segments_RL if shared else None,
        sample_tokens=sum(len(prompts[i]) + len(responses[i]) for i in indices),
    )


def shared_attention_mask(segments_RL: torch.Tensor, implementation: str = "sdpa") -> torch.Tensor:
    """(R, 1, L, L) mask of shared rows: query q attends key k iff k <= q, neither is padding, and k is in the
    prompt (segment 0) or in q's own response (same segment); a padding query attends itself only (a row with no
    key would give SDPA NaN, which backward would spread). Bool (True = attend) for SDPA; for eager, which adds the
    mask to the scores, 0 where attended and the float32 minimum elsewhere."""
    length = segments_RL.shape[1]
    query_RL1, key_R1L = segments_RL[:, :, None], segments_RL[:, None, :]
    causal_LL = torch.ones(length, length, dtype=torch.bool, device=segments_RL.device).tril()
    same_RLL = (key_R1L == 0) | (key_R1L == query_RL1)
    allowed_RLL = causal_LL & same_RLL & (query_RL1 >= 0) & (key_R1L >= 0)
    allowed_RLL = allowed_RLL | torch.eye(length, dtype=torch.bool, device=segments_RL.device)
    if implementation == "eager":
        blocked = torch.finfo(torch.float32).min
        return torch.zeros(allowed_RLL.shape, dtype=torch.float32, device=segments_RL.device).masked_fill(
            ~allowed_RLL, blocked)[:, None]
    return allowed_RLL[:, None]


def attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def takes_shared_prompts(model: torch.nn.Module, setting: Literal["auto"] | bool = "auto") -> bool:
    """`train.share_prompts` resolved for `model`: false never; true where its attention takes the 4D mask
    (sdpa, eager); auto also only on the tested architectures. Elsewhere one row per sample (today's layout)."""
    if setting is False:
        return False
    config = getattr(model, "config", None)
    if attention_implementation(model) not in SHARED_PROMPT_ATTENTION:
        return False
    return setting is True or getattr(config, "model_type", None) in SHARED_PROMPT_MODEL_TYPES


def decoder_hidden_states(
    model: torch.nn.Module,
    input_ids_RL: torch.Tensor,
    attention_mask_RL: torch.Tensor,
    position_ids_RL: torch.Tensor | None = None,
    segments_RL: torch.Tensor | None = None,
) -> torch.Tensor:
    """(R, L, H) last hidden states of a causal LM's decoder over a micro-batch's forward rows, plain or shared."""
    decoder = model.get_decoder()
    if segments_RL is None:
        return decoder(input_ids=input_ids_RL, attention_mask=attention_mask_RL, use_cache=False)[0]
    mask_R1LL = shared_attention_mask(segments_RL, attention_implementation(model) or "sdpa")
    return decoder(input_ids=input_ids_RL, attention_mask=mask_R1LL, position_ids=position_ids_RL, use_cache=False)[0]


def shared_rows(indices: Sequence[int], prompts: list[list[int]], responses: list[list[int]],
                token_budget: int) -> list[list[int]]:
    """The rows of the shared layout: the sequences of `indices` with equal prompt token ids in one row, in
    order of first appearance; a group whose row [prompt, responses...] would exceed `token_budget` is cut into
    sub-groups in index order, each repeating the prompt (a sequence longer than the budget gets a row alone)."""
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for i in indices:
        rows = groups.setdefault(tuple(prompts[i]), [[]])
        row = rows[-1]
        if row and len(prompts[i]) + sum(len(responses[j]) for j in row) + len(responses[i]) > token_budget:
            row = []
            rows.append(row)
        row.append(i)
    return [row for rows in groups.values() for row in rows]


def plan_micro_batches(
    indices: Sequence[int], prompts: list[list[int]], responses: list[list[int]], token_budget: int, share: bool
) -> list[list[list[int]]]:
    """The micro-batches of the sequences `indices`: each a list of forward rows (lists of sequence indices),
    packed by the rows' lengths with `pack_by_tokens`. Without `share` every row is one sequence."""
    rows = shared_rows(indices, prompts, responses, token_budget) if share else [[i] for i in indices]
    lengths = [len(prompts[row[0]]) + sum(len(responses[i]) for i in row) for row in rows]
    return [[rows[k] for k in batch] for batch in pack_by_tokens(lengths, token_budget)]


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
        input_ids_RL: torch.Tensor,
        attention_mask_RL: torch.Tensor,
        hidden_rows_N: torch.Tensor,
        positions_N: torch.Tensor,
        position_ids_RL: torch.Tensor | None,
        segments_RL: torch.Tensor | None,
        targets_N: torch.Tensor,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.model.get_output_embeddings()
        hidden_RLH = decoder_hidden_states(self.model, input_ids_RL, attention_mask_RL, position_ids_RL, segments_RL)
        hidden_NH = hidden_RLH[hidden_rows_N, positions_N]
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
    logp_N, entropy_N = policy(*micro.forward_inputs(), micro.targets_N, entropy_grad)
    return micro.to_BT(logp_N), micro.to_BT(entropy_N)


def all_response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    token_budget: int,
    chunk_tokens: int = 512,
    share: bool = False,
) -> list[torch.Tensor]:
    """The logprobs of every response's tokens under `model` (no grad, on the model's device), micro-batched by
    `token_budget` (`share`: the shared-prompt layout): for a stage that needs one policy's logprobs without a
    trainer (the advantage stage's reference pass for the KL in the reward). Padding-free per response, in input
    order, on the CPU."""
    device = next(model.parameters()).device
    policy = ResponseLogprobs(model, temperature, chunk_tokens)
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    model.eval()
    for rows in plan_micro_batches(range(len(prompts)), prompts, responses, token_budget, share):
        micro = build_micro_batch(rows, prompts, responses).to(device)
        with torch.no_grad():
            logp_BT, _ = micro_logprobs(policy, micro)
        for b, i in enumerate(micro.indices):
            out[i] = logp_BT[b, : len(responses[i])].float().cpu()
    return out
