"""Backend `hf`: sampling with a Hugging Face causal LM in our own token-by-token loop.

The fallback where vLLM is not installed, and the backend CI exercises everywhere. It does not use
`model.generate`, which returns raw scores and shares one generator across the batch: here one
`torch.Generator` per row makes a sample depend only on its seed and prompt, and the stored logprob is the
drawn token's under the processed distribution (logits / temperature, top-k, top-p, renormalised), as the
rollouts table promises (stages/generation/base.py).

The loop is a plain KV-cache decode: left-padded batch, one forward for the prompts, then one per new token.
Finished rows (eos/pad, a stop string, `max_new_tokens`) leave the batch and the cache, so a straggler does
not drag them through every step; progress is reported as each row finishes (stages/generation/base.py). On a
GPU (`device`) the loop, and each row's generator, live there, with one host transfer per step. Output
conventions, shared with the vLLM backend: `token_ids` include the token that ended the sample (the model's
decision to stop, scored like any action); `text` is the decoded response without special tokens, cut before
the first stop string; `finish_reason` is "stop" or "length".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.generation import base
from stages.generation.base import GenerationRequest, ProgressCallback, Sample, SamplingSpec

# The machines this runs on have 2 cores shared with other jobs; more threads than cores only thrash.
TORCH_THREADS = 2


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution a token is sampled from, for a [rows, vocab] logits tensor.

    Same order and rules as vLLM's sampler, so both backends (and the mismatch check) mean the same
    thing: divide by temperature, keep the top-k logits (ties with the k-th are kept), then keep the
    smallest set of most likely tokens whose probability reaches top_p (a token is dropped when the
    probability mass of the tokens less likely than it, itself included, is at most 1 - top_p; the most
    likely token always stays), and renormalise. Filtered tokens get -inf. Temperature 0 means greedy:
    the log-softmax of the raw logits, with no filtering.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:  # noqa: ANN001 - any HF tokenizer
    """Every id that ends a sample: the generation config's eos ids, the tokenizer's eos and pad."""
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    for candidate in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        if candidate is not None:
            ids.add(int(candidate))
    return ids


def find_stop(text: str, stops: list[str]) -> int:
    """Index of the earliest stop string in `text`, or -1."""
    found = [i for i in (text.find(stop) for stop in stops if stop) if i >= 0]
    return min(found) if found else -1


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a left-padded batch: every prompt ends in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def batch_order(requests: list[GenerationRequest]) -> list[int]:
    """Request indices sorted by prompt length (less padding), ties by position: a pure function of the list."""
    return sorted(range(len(requests)), key=lambda i: (len(requests[i].prompt_token_ids), i))


@dataclass
class _Row:
    """One request's state inside the decode loop."""

    index: int  # position in the caller's request list
    generator: torch.Generator
    tokens: list[int]
    logprobs: list[float]
    text: str | None = None  # set when a stop string cut the response; otherwise decoded at the end
    finish_reason: str | None = None


class HFBackend:
    """Hugging Face model, own sampling loop with per-request generators; see the module docstring."""

    name = "hf"

    def __init__(self, model_dir: Path, dtype: str = "float32", batch_size: int = 16, device: str = "cpu") -> None:
        from stages.generation.models import load_model, load_tokenizer

        started = time.monotonic()
        torch.set_num_threads(TORCH_THREADS)
        self.device = device
        # CUDA kernels may reduce in another order from run to run: only the CPU path is promised to repeat.
        self.deterministic = device == "cpu"
        self.gpus = 0 if device == "cpu" else 1
        self.gpu_memory_used_mb: float | None = None  # the model is in this process: torch's peak says it
        self.model = load_model(model_dir, dtype, device)
        self.tokenizer = load_tokenizer(model_dir)
        self.batch_size = batch_size
        self.engine_settings: dict[str, object] = {"dtype": dtype}
        self.stop_ids = eos_token_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.stop_ids))
        self.engine_start_seconds = time.monotonic() - started

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingSpec,
        progress: ProgressCallback | None = None,
    ) -> list[Sample]:
        samples: list[Sample | None] = [None] * len(requests)
        order = batch_order(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            done = self._generate_batch([requests[i] for i in chunk], chunk, sampling, progress)
            for sample_index, sample in zip(chunk, done, strict=True):
                samples[sample_index] = sample
        return [s for s in samples if s is not None]

    def close(self) -> None:
        from stages.generation.device import release_memory

        self.model = None  # type: ignore[assignment]
        release_memory(self.device)

    @torch.inference_mode()
    def _generate_batch(
        self, requests: list[GenerationRequest], indices: list[int], sampling: SamplingSpec,
        progress: ProgressCallback | None = None,
    ) -> list[Sample]:
        from transformers import DynamicCache

        # One generator per request on the model's device (torch.multinomial draws from a generator there).
        rows = [
            _Row(index, torch.Generator(self.device).manual_seed(request.seed), [], [])
            for index, request in zip(indices, requests, strict=True)
        ]
        input_ids, mask = (t.to(self.device) for t in left_pad([r.prompt_token_ids for r in requests], self.pad_id))
        # Positions count real tokens only, so a left-padded prompt sees the same positions as alone.
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache()
        active = list(range(len(rows)))  # batch row -> index into `rows`
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        next_position = positions[:, -1:] + 1
        reported, unreported_tokens = time.monotonic(), 0
        for step in range(sampling.max_new_tokens):
            logprobs = processed_logprobs(out.logits[:, -1, :], sampling.temperature, sampling.top_k,
                                          sampling.top_p)
            chosen = self._pick(logprobs, [rows[i].generator for i in active], sampling.temperature)
            # One transfer per step for the whole batch (on a GPU every element read would be a sync).
            tokens = chosen.tolist()
            token_logprobs = logprobs.gather(-1, chosen.view(-1, 1)).view(-1).tolist()
            keep: list[int] = []
            for batch_row, row_index in enumerate(active):
                row = rows[row_index]
                token = tokens[batch_row]
                row.tokens.append(token)
                row.logprobs.append(token_logprobs[batch_row])
                if self._finished(row, token, sampling, last_step=step == sampling.max_new_tokens - 1):
                    continue
                keep.append(batch_row)
            unreported_tokens += len(active)
            finished = len(active) - len(keep)
            if progress is not None and (finished or time.monotonic() - reported >= base.PROGRESS_INTERVAL_S):
                progress(finished, unreported_tokens)
                reported, unreported_tokens = time.monotonic(), 0
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows from the batch and the cache instead of decoding padding for them.
                selected = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(selected)
                mask, next_position, chosen = mask[selected], next_position[selected], chosen[selected]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=mask.device)], dim=-1)
            out = self.model(input_ids=chosen.view(-1, 1), attention_mask=mask, position_ids=next_position,
                             past_key_values=cache, use_cache=True)
            next_position = next_position + 1
        return [self._to_sample(row) for row in rows]

    @staticmethod
    def _pick(logprobs: torch.Tensor, generators: list[torch.Generator], temperature: float) -> torch.Tensor:
        if temperature <= 0:
            return logprobs.argmax(dim=-1)
        probs = logprobs.exp()
        # One draw per row from that row's own generator: the only way a sample depends on its seed alone.
        return torch.cat([
            torch.multinomial(probs[row], 1, generator=generator) for row, generator in enumerate(generators)
        ])

    def _finished(self, row: _Row, token: int, sampling: SamplingSpec, last_step: bool) -> bool:
        if token in self.stop_ids:
            row.finish_reason = "stop"
            return True
        if sampling.stop:
            # Decoding the whole response each step is O(n^2) characters, which at <= a few hundred tokens
            # costs far less than the forward pass, and it is exactly what the final text will be.
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            cut = find_stop(text, sampling.stop)
            if cut >= 0:
                row.text, row.finish_reason = text[:cut], "stop"
                return True
        if last_step:
            row.finish_reason = "length"
            return True
        return False

    def _to_sample(self, row: _Row) -> Sample:
        text = row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return Sample(token_ids=row.tokens, logprobs=row.logprobs, text=text,
                      finish_reason=row.finish_reason or "length")
