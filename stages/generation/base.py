"""The contract every generation backend meets: token ids in, sampled token ids and their logprobs out.

Backends take already chat-formatted, already tokenized prompts, so that the prompt tokens stored in the
rollouts table are exactly what the model saw, whatever the backend. Each request carries its own seed,
derived from (run seed, iteration, prompt, sample), so a rerun of the stage reproduces its table on the same
machine where the backend can promise that (`Backend.deterministic`).

`Sample.logprobs` are the sampler's log-probabilities of each sampled token under the distribution the
token was actually drawn from: logits / temperature, then top-k and top-p filtering and renormalisation.
For greedy decoding (temperature 0) they are the log-softmax of the raw logits.

A backend may also offer continuous batching (`Backend.session()`, see `TurnSession`): requests enter the
engine one at a time while others decode, and each leaves as soon as it is finished. The multi-turn agent loop
uses it so that a conversation's next turn need not wait for the other conversations' turns (`sessions`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    seed: int


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (eos or a stop string) | "length"


# Called with (requests finished, tokens generated) since the last call: whenever a request finishes, and every
# PROGRESS_INTERVAL_S between (a batch whose requests all run to max_new_tokens finishes in one step).
ProgressCallback = Callable[[int, int], None]
PROGRESS_INTERVAL_S = 0.5


class Backend(Protocol):
    name: str
    deterministic: bool
    engine_start_seconds: float
    # What the engine actually ran with, "auto" settings resolved (precision, compiled or eager): recorded in
    # the manifests of the stages that generate.
    engine_settings: dict[str, object]
    # GPUs the engine runs on (0 on CPU), and for an engine in another process (vLLM's on a GPU) the memory its
    # GPUs held at the end of generation, as the driver reports it; None where torch's own peak in this
    # process says it (stages/generation/device.py).
    gpus: int
    gpu_memory_used_mb: float | None

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingSpec,
        progress: ProgressCallback | None = None,
    ) -> list[Sample]: ...

    def close(self) -> None: ...


class TurnSession(Protocol):
    """Continuous batching on a running engine: `submit` adds one request (its own sampling) while others are
    decoding, `step` runs one engine step and returns the requests it finished, by the caller's key."""

    def submit(self, key: int, request: GenerationRequest, sampling: SamplingSpec, ignore_eos: bool = False) -> None:
        """`ignore_eos`: sample exactly `sampling.max_new_tokens` (benchmarks compare equal lengths with it)."""
        ...

    def step(self) -> list[tuple[int, Sample]]: ...

    @property
    def running(self) -> int:
        """Requests submitted and not yet returned by `step`."""
        ...


def sessions(backend: Backend) -> Callable[[], AbstractContextManager[TurnSession]] | None:
    """The backend's continuous-batching capability (`backend.session`, a context manager factory), or None for a
    backend that only generates whole batches (HF, several vLLM engines: generate.engines > 1)."""
    session = getattr(backend, "session", None)
    return session if callable(session) else None


def sample_seed(run_seed: int, iteration: int, prompt_id: str, sample_idx: int, round_idx: int = 0) -> int:
    """A 63-bit seed that depends only on what identifies the sample, never on batch order."""
    text = f"{run_seed}:{iteration}:{round_idx}:{prompt_id}:{sample_idx}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
