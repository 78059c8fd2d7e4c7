"""What generate and evaluate share: chat-formatting and length-limiting prompts, and running a backend
with a progress bar.

Prompts are tokenized here, once, with the model's chat template, so the token ids stored in the rollouts
table are exactly what the backend was given. A prompt longer than `max_prompt_tokens` is skipped or cut
from the left (keeping the end, where the instruction and the generation prompt are) and counted; it never
fails the stage half-way. `tools` (hermes tool calls) are the tool schemas the template lists.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from stages.generation.base import Backend, GenerationRequest, Sample, SamplingSpec
from storage.progress import progress_bar


@dataclass
class EncodedPrompts:
    prompt_ids: list[str]  # ids of the prompts kept, in order
    token_ids: list[list[int]]
    skipped: int
    truncated: int


def encode_prompts(
    tokenizer,  # noqa: ANN001 - any Hugging Face tokenizer with a chat template
    prompt_ids: list[str],
    messages_json: list[str],
    max_prompt_tokens: int,
    overlong: str,
    tools: list[dict] | None = None,
) -> EncodedPrompts:
    kept_ids, kept_tokens, skipped, truncated = [], [], 0, 0
    for prompt_id, messages in zip(prompt_ids, messages_json, strict=True):
        ids = tokenizer.apply_chat_template(json.loads(messages), add_generation_prompt=True, tokenize=True,
                                          tools=tools)
        if hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            if overlong == "skip":
                skipped += 1
                continue
            ids = ids[-max_prompt_tokens:]
            truncated += 1
        kept_ids.append(prompt_id)
        kept_tokens.append(ids)
    return EncodedPrompts(kept_ids, kept_tokens, skipped, truncated)


@dataclass
class GenerationResult:
    samples: list[Sample]
    seconds: float
    tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def generate_with_progress(
    backend: Backend, requests: list[GenerationRequest], sampling: SamplingSpec, label: str
) -> GenerationResult:
    started = time.monotonic()
    generated = 0
    with progress_bar(label, len(requests)) as advance:

        def on_progress(done: int, tokens: int) -> None:
            nonlocal generated
            generated += tokens
            elapsed = time.monotonic() - started
            # the tokens move before any request finishes (a batch that runs to max_new_tokens ends in one step)
            advance(done, f"{generated:,} tok, {generated / max(elapsed, 1e-9):.0f} tok/s")

        samples = backend.generate(requests, sampling, progress=on_progress)
    if len(samples) != len(requests):
        raise RuntimeError(f"backend {backend.name} returned {len(samples)} samples for {len(requests)} requests")
    tokens = sum(len(s.token_ids) for s in samples)
    return GenerationResult(samples, time.monotonic() - started, tokens)
