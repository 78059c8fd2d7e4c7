"""The Hugging Face backend: seeds, processed logprobs, stop strings, greedy decoding, progress."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import stages.generation.base
from stages.generation import make_backend, resolve_backend_name
from stages.generation.base import GenerationRequest, SamplingSpec
from stages.generation.hf_backend import HFBackend, batch_order, find_stop, processed_logprobs
from stages.generation.mismatch import summarize
from tests.support.logprobs import recompute_logprobs, response_logprobs

SAMPLED = SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> HFBackend:
    return HFBackend(model_dir, dtype="float32", batch_size=4)


def requests_for(prompt_ids: list[list[int]], seeds: list[int]) -> list[GenerationRequest]:
    return [GenerationRequest(prompt, seed) for prompt in prompt_ids for seed in seeds]


# --------------------------------------------------------------------------------------------------------
# Pure functions, number by number


def test_processed_logprobs_temperature_top_k_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    full = torch.log_softmax(logits, dim=-1)
    # Temperature 0 is greedy: the raw distribution, nothing filtered.
    assert torch.allclose(processed_logprobs(logits, 0.0, 1, 0.1), full)
    # Temperature 2 halves the logits.
    assert torch.allclose(processed_logprobs(logits, 2.0, -1, 1.0), torch.log_softmax(logits / 2, dim=-1))
    # Top-k 2 keeps the two largest, renormalised: log(e^2 / (e^2 + e^1)) = -0.3133.
    top2 = processed_logprobs(logits, 1.0, 2, 1.0)
    assert top2[0, 0].item() == pytest.approx(-0.31326, abs=1e-5)
    assert top2[0, 1].item() == pytest.approx(-1.31326, abs=1e-5)
    assert math.isinf(top2[0, 2].item()) and math.isinf(top2[0, 3].item())
    # Probabilities 0.644, 0.237, 0.087, 0.032; top-p 0.7 needs the first two (0.644 < 0.7), vLLM's rule.
    nucleus = processed_logprobs(logits, 1.0, -1, 0.7)
    assert torch.equal(torch.isfinite(nucleus), torch.tensor([[True, True, False, False]]))
    assert nucleus[0, :2].exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    # top-p 0.6 is reached by the most likely token alone, which is always kept.
    assert processed_logprobs(logits, 1.0, -1, 0.6)[0, 0].item() == pytest.approx(0.0, abs=1e-6)


def test_find_stop_and_batch_order() -> None:
    assert find_stop("abc\n\ndef", ["\n\n", "def"]) == 3
    assert find_stop("abc", ["x", ""]) == -1
    requests = [GenerationRequest([1, 2, 3], 0), GenerationRequest([1], 1), GenerationRequest([4, 5, 6], 2)]
    assert batch_order(requests) == [1, 0, 2]


def test_summarize_counts_and_skips_filtered_tokens() -> None:
    stats = summarize([[-1.0, -2.0, -0.5]], [[-1.1, -2.0, float("-inf")]])
    assert stats["tokens"] == 2 and stats["outside_filter"] == 1
    assert stats["mean_abs"] == pytest.approx(0.05)
    assert stats["max_abs"] == pytest.approx(0.1)
    assert stats["mean_signed"] == pytest.approx(0.05)


def test_factory_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.generation import vllm_backend

    assert resolve_backend_name("hf") == "hf"
    # "auto" asks whether vLLM imports; stubbed here because a real import of vLLM takes ~30 s.
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    assert resolve_backend_name("auto") == "hf"
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    assert resolve_backend_name("auto") == "vllm"
    with pytest.raises(ValueError, match="unknown generation backend"):
        resolve_backend_name("tgi")


# --------------------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct, fp32)


def test_same_seeds_same_tokens_whatever_the_batch(
    backend: HFBackend, model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    requests = requests_for(prompt_ids[:2], [11, 12])
    first = backend.generate(requests, SAMPLED)
    again = backend.generate(requests, SAMPLED)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.logprobs for s in first] == [s.logprobs for s in again]
    # Two seeds for the same prompt give two different samples.
    assert first[0].token_ids != first[1].token_ids or first[2].token_ids != first[3].token_ids
    # Per-row generators: a request alone in its batch samples the same tokens as inside a batch of 4.
    alone = HFBackend(model_dir, dtype="float32", batch_size=1).generate(requests[1:2], SAMPLED)
    assert alone[0].token_ids == first[1].token_ids


def test_logprobs_are_the_processed_distribution(backend: HFBackend, prompt_ids: list[list[int]]) -> None:
    requests = requests_for(prompt_ids, [5])
    samples = backend.generate(requests, SAMPLED)
    for sample in samples:
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.logprobs)
        assert sample.finish_reason in ("stop", "length")
    # A fresh full forward pass over prompt + response, same processing, gives the same numbers.
    recomputed = recompute_logprobs(backend.model, requests, samples, SAMPLED)
    stats = summarize([s.logprobs for s in samples], recomputed)
    assert stats["outside_filter"] == 0
    assert stats["tokens"] == sum(len(s.token_ids) for s in samples)
    assert stats["max_abs"] < 1e-4, stats


def test_mismatch_also_reports_the_gap_the_trainer_sees_under_top_k_top_p(
    backend: HFBackend, model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    """Proves: with top-k / top-p sampling, the mismatch figure keeps isolating numerics (same processing:
    < 1e-4) and adds `as_trained`, the gap against the logprobs the trainer itself computes (temperature
    alone, `ResponseLogprobs`): token for token the sampler's logprob is higher by
    -log(filtered mass), so its signed mean equals its absolute mean and is the mean of sampler - trainer.
    Without a filter there is nothing more to report."""
    from stages.generation.mismatch import logprob_mismatch
    from stages.rl.logprobs import build_micro_batch

    requests = requests_for(prompt_ids[:2], [1, 2])
    samples = backend.generate(requests, SAMPLED)
    stats = logprob_mismatch(model_dir, requests, samples, SAMPLED)
    assert stats["max_abs"] < 1e-4 and stats["outside_filter"] == 0, stats

    micro = build_micro_batch(list(range(len(samples))), [r.prompt_token_ids for r in requests],
                              [s.token_ids for s in samples], pad_id=backend.pad_id)
    with torch.inference_mode():
        trainer_BT, _ = response_logprobs(backend.model, micro, temperature=SAMPLED.temperature)
    gaps = [a - trainer_BT[row, column].item() for row, sample in enumerate(samples)
            for column, a in enumerate(sample.logprobs)]
    trained = stats["as_trained"]
    assert trained["tokens"] == len(gaps) and trained["outside_filter"] == 0
    assert min(gaps) > -1e-4  # renormalising over a subset only raises a token's logprob
    assert trained["mean_signed"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)
    assert trained["mean_abs"] == pytest.approx(trained["mean_signed"], abs=1e-4)
    assert trained["max_abs"] == pytest.approx(max(gaps), abs=1e-4) and trained["max_abs"] > 100 * stats["max_abs"]

    unfiltered = SamplingSpec(temperature=0.7, max_new_tokens=16)
    plain = backend.generate(requests, unfiltered)
    assert "as_trained" not in logprob_mismatch(model_dir, requests, plain, unfiltered)


def test_stop_string_trims_text_and_tokens(backend: HFBackend, prompt_ids: list[list[int]]) -> None:
    spec = SamplingSpec(temperature=0.0, max_new_tokens=24, stop=["\n"])
    stopped = backend.generate([GenerationRequest(prompt_ids[0], 0)], spec)[0]
    free = backend.generate([GenerationRequest(prompt_ids[0], 0)],
                            SamplingSpec(temperature=0.0, max_new_tokens=24))[0]
    assert "\n" in backend.tokenizer.decode(free.token_ids), "the prompt must lead to a newline"
    assert stopped.finish_reason == "stop"
    assert "\n" not in stopped.text
    # The response stops at the token that completed the stop string, and that token is kept.
    decode = backend.tokenizer.decode
    assert "\n" in decode(stopped.token_ids) and "\n" not in decode(stopped.token_ids[:-1])
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
    full_text = decode(stopped.token_ids, skip_special_tokens=True)
    assert stopped.text == full_text[:full_text.index("\n")]


def test_greedy_equals_transformers_generate(backend: HFBackend, prompt_ids: list[list[int]]) -> None:
    spec = SamplingSpec(temperature=0.0, max_new_tokens=16)
    prompts = prompt_ids[:3]  # three prompts of different lengths: the batch is left-padded
    samples = backend.generate([GenerationRequest(p, 0) for p in prompts], spec)
    for prompt, sample in zip(prompts, samples, strict=True):
        with torch.inference_mode():
            out = backend.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                         pad_token_id=backend.pad_id)
        expected = out[0, len(prompt):].tolist()
        assert sample.token_ids == expected[:len(sample.token_ids)]
        if sample.finish_reason == "length":
            assert len(sample.token_ids) == 16
        else:
            assert sample.token_ids[-1] in backend.stop_ids
    # Greedy logprobs are the raw log-softmax of the chosen (most likely) token.
    recomputed = recompute_logprobs(backend.model, [GenerationRequest(p, 0) for p in prompts], samples, spec)
    assert summarize([s.logprobs for s in samples], recomputed)["max_abs"] < 1e-4


def test_progress_moves_as_each_request_finishes(backend: HFBackend, prompt_ids: list[list[int]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With no time-based report, the bar moves at each step where a row finishes: expected calls worked out from
    the samples' lengths alone (a row of length L finishes at step L; tokens since the last report are each row's
    tokens between the two steps)."""
    monkeypatch.setattr(stages.generation.base, "PROGRESS_INTERVAL_S", float("inf"))
    calls: list[tuple[int, int]] = []
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, stop=["e"])  # a stop string: rows end at many steps
    requests = requests_for(prompt_ids, [1, 2])  # 8 requests, batch size 4
    samples = backend.generate(requests, spec, progress=lambda done, tokens: calls.append((done, tokens)))
    order = batch_order(requests)
    expected = []
    for start in range(0, len(order), 4):
        lengths = [len(samples[i].token_ids) for i in order[start:start + 4]]
        previous = 0
        for length in sorted(set(lengths)):
            tokens = sum(min(n, length) - min(n, previous) for n in lengths)
            expected.append((lengths.count(length), tokens))
            previous = length
    assert len({len(s.token_ids) for s in samples}) > 2  # rows finish at different steps: more calls than batches
    assert calls == expected
    assert sum(done for done, _ in calls) == 8


def test_make_backend_hf(model_dir: Path) -> None:
    from schemas.config import GenerateConfig

    backend = make_backend("hf", model_dir, GenerateConfig(batch_size=2))
    try:
        assert backend.name == "hf" and backend.deterministic
        assert backend.engine_start_seconds > 0
        assert backend.engine_settings == {"dtype": "float32"}
    finally:
        backend.close()
