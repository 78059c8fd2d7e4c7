"""Training throughput: the train stage's update vs a bare torch forward/backward/step loop, same batch.

Both sides train SmolLM2-135M-Instruct (fp32, torch AdamW, one optimizer step over the whole batch, token-mean
PPO-clip loss) on the same synthetic batch: `--sequences` sequences in groups of `--group-size` sharing a prompt,
as the stage sees a GRPO batch (generate.n_samples responses per prompt, 4 by default). (a) bare: the loop a
user would write (one row per sequence, `model(input_ids).logits`, full `log_softmax`, `gather`, loss,
`backward`, clip, step) on the stage's micro-batches; (b) stage: `stages.rl.session.run_job`, the function the
train stage calls (defaults: activation checkpointing `auto`, shared prompts `auto`). Tokens/s is the batch's
tokens (each sample's prompt + response: the same work on both sides, whatever each forwards) per second of the
update (load and save left out), by wall clock and per CPU-second (on a shared machine CPU time is the steadier
figure). Each measurement runs in a fresh process (its own peak RSS); the sides alternate `--repeats` times,
with the load average before and after. The ratio is printed for `--group-size` and for 1: the headline is the
group size, since a GRPO batch always has groups and the stage forwards each group's prompt once
(`train.share_prompts`); group size 1 has no prompt to share (the stage's figure before sharing).

Run: `.venv/bin/python -m benchmarks.train` (`--help` for the knobs). Targets (issue 22): peak RSS (b) / (a) <=
0.5 at tok/s (b) / (a) >= 1.0. On 2026-11-25, `--repeats 2`, other engineers' jobs running (load 5.6 -> 4.2,
7.2 at most): group size 4: memory 0.40 (2,310 vs 5,844 MB) at speed 1.57 wall / 1.41 per CPU-second (1,682
tokens forwarded for the batch's 3,218): both targets met; group size 1: memory 0.40 at 1.20 wall (noise of the
load) / 0.88 per CPU-second, as before sharing (docs/measurements.md, "train").
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any


def synthetic_samples(
    n: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int, group_size: int = 1
) -> list[dict]:
    """`n` samples in groups of `group_size` consecutive samples sharing a prompt (a GRPO batch: n_samples
    responses per prompt), responses of response_tokens / 2 to response_tokens tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    samples = []
    prompt: list[int] = []
    for i in range(n):
        if i % group_size == 0:
            prompt = rng.integers(10, vocab, size=prompt_tokens).tolist()
        length = int(rng.integers(response_tokens // 2, response_tokens + 1))
        samples.append(
            {
                "prompt_ids": list(prompt),
                "response_ids": rng.integers(10, vocab, size=length).tolist(),
                "behaviour_logprobs": [-3.0] * length,
                "advantage": 1.0 if i % 2 else -1.0,
            }
        )
    return samples


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bare(model_dir: str, samples: list[dict], threads: int, budget: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.logprobs import build_micro_batch, pack_by_tokens

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    loaded = time.monotonic()
    cpu_started = time.process_time()
    prompts = [s["prompt_ids"] for s in samples]
    responses = [s["response_ids"] for s in samples]
    advantages = torch.tensor([s["advantage"] for s in samples])
    total_tokens = sum(len(r) for r in responses)
    tokens = 0
    for indices in pack_by_tokens([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)], budget):
        micro = build_micro_batch(indices, prompts, responses)
        logits = model(input_ids=micro.input_ids_RL, attention_mask=micro.attention_mask_RL).logits
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp_BT = micro.to_BT(
            logp_all[micro.hidden_rows_N, micro.positions_N].gather(-1, micro.targets_N[:, None])[:, 0]
        )
        mask_BT = micro.response_mask_BT()
        ratio = torch.exp(logp_BT - logp_BT.detach())
        adv_BT = advantages[indices][:, None]
        loss_BT = torch.maximum(-adv_BT * ratio, -adv_BT * ratio.clamp(0.8, 1.2))
        ((loss_BT * mask_BT).sum() / total_tokens).backward()
        tokens += micro.tokens
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trained = time.monotonic()
    return {
        "tokens": tokens,
        "train_seconds": trained - loaded,
        "train_cpu_seconds": time.process_time() - cpu_started,
        "load_seconds": loaded - started,
        "save_seconds": 0.0,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_stage(model_dir: str, samples: list[dict], threads: int, budget: int) -> dict[str, Any]:
    from schemas.config import TrainConfig
    from stages.rl.logprobs import plan_micro_batches
    from stages.rl.session import TrainJob, run_job

    cfg = TrainConfig(lr=1e-6, micro_batch_tokens=budget)
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as out:
        job = TrainJob(
            policy_dir=model_dir,
            out_dir=out,
            train=cfg.model_dump(mode="json"),
            iteration=0,
            threads=threads,
            samples=samples,
        )
        rows, metrics = run_job(job)
    prompts, responses = [s["prompt_ids"] for s in samples], [s["response_ids"] for s in samples]
    plan = plan_micro_batches(range(len(samples)), prompts, responses, budget, share=True)
    return {
        "tokens": sum(r["tokens"] for r in rows),
        # the tokens the stage's forward rows hold: a shared prompt once per row (share_prompts is on by `auto`)
        "forwarded_tokens": sum(len(prompts[row[0]]) + sum(len(responses[i]) for i in row)
                                for batch in plan for row in batch),
        "train_seconds": metrics["train_seconds"],
        "train_cpu_seconds": metrics["train_cpu_seconds"],
        "load_seconds": metrics["load_seconds"],
        "save_seconds": metrics["save_seconds"],
        "peak_rss_mb": metrics["peak_rss_mb"],
    }


def _child(name: str, args: tuple, queue: multiprocessing.Queue) -> None:
    queue.put((run_bare if name == "bare" else run_stage)(*args))


def measure(name: str, args: tuple) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    samples = args[1]
    load_before = os.getloadavg()[0]
    process = context.Process(target=_child, args=(name, args, queue))
    process.start()
    result = queue.get()
    process.join()
    result.update(name=name, load_before=load_before, load_after=os.getloadavg()[0])
    # The same work on both sides: the batch's tokens (each sample's prompt + response), whatever was forwarded
    # (with shared prompts the stage forwards each group's prompt once).
    result.setdefault("forwarded_tokens", result["tokens"])
    result["tokens"] = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    result["tokens_per_second"] = result["tokens"] / result["train_seconds"]
    result["tokens_per_cpu_second"] = result["tokens"] / result["train_cpu_seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="HF model dir (default: the converted SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--group-size", type=int, default=4,
        help="samples per prompt (generate.n_samples); the ratio is also printed for 1 (no prompt to share)",
    )
    args = parser.parse_args()

    if args.model is None:
        from schemas.config import ModelConfig
        from stages.generation.models import resolve_model

        args.model = str(resolve_model(ModelConfig()))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    ratios = {}
    for group_size in dict.fromkeys((args.group_size, 1)):
        samples = synthetic_samples(
            args.sequences, args.prompt_tokens, args.response_tokens, vocab, seed=0, group_size=group_size
        )
        print(f"--- group size {group_size}: {args.sequences // group_size} prompts x {group_size} samples")
        ratios[group_size] = compare(args, samples)
    print()
    for group_size, (wall, cpu, memory) in ratios.items():
        label = "headline" if group_size == args.group_size else "no shared prompt"
        print(
            f"group size {group_size} ({label}): ratio stage / bare {wall:.2f} wall-clock, {cpu:.2f} per CPU-second "
            f"(target >= 1.0); peak RSS {memory:.2f} (target <= 0.5)"
        )


def compare(args: argparse.Namespace, samples: list[dict]) -> tuple[float, float, float]:
    """Run bare and stage `args.repeats` times each, alternating; (wall, CPU, memory) ratios stage / bare."""
    child_args = (args.model, samples, args.threads, args.micro_batch_tokens)
    results: dict[str, list[dict]] = {"bare": [], "stage": []}
    for _ in range(args.repeats):
        for name in ("bare", "stage"):
            result = measure(name, child_args)
            results[name].append(result)
            print(
                f"{name:<6} {result['tokens']:>6} tok ({result['forwarded_tokens']:>6} forwarded) "
                f"{result['train_seconds']:>7.1f} s wall "
                f"{result['tokens_per_second']:>6.1f} tok/s  {result['train_cpu_seconds']:>7.1f} s CPU "
                f"{result['tokens_per_cpu_second']:>6.1f} tok/CPU-s  "
                f"peak RSS {result['peak_rss_mb']:>6.0f} MB  "
                f"load/save {result['load_seconds']:.1f}/{result['save_seconds']:.1f} s  "
                f"loadavg {result['load_before']:.1f} -> {result['load_after']:.1f}",
                flush=True,
            )
    print(
        f"batch: {args.sequences} sequences x ({args.prompt_tokens} prompt + <= {args.response_tokens} "
        f"response) tokens, {args.threads} threads, micro-batch budget {args.micro_batch_tokens} tokens"
    )
    summary = {}
    for name in ("bare", "stage"):
        runs = results[name]
        summary[name] = (
            statistics.median(r["tokens_per_second"] for r in runs),
            statistics.median(r["tokens_per_cpu_second"] for r in runs),
        )
        print(
            f"{name:<6} {summary[name][0]:6.1f} tok/s wall  {summary[name][1]:6.1f} tok/CPU-s  "
            f"peak RSS {max(r['peak_rss_mb'] for r in runs):.0f} MB  (median of {len(runs)})"
        )
    wall = summary["stage"][0] / summary["bare"][0]
    cpu = summary["stage"][1] / summary["bare"][1]
    memory = max(r["peak_rss_mb"] for r in results["stage"]) / max(r["peak_rss_mb"] for r in results["bare"])
    print(
        f"ratio stage / bare: {wall:.2f} wall-clock, {cpu:.2f} per CPU-second (target >= 1.0); "
        f"peak RSS {memory:.2f} (target <= 0.5)",
        flush=True,
    )
    return wall, cpu, memory


if __name__ == "__main__":
    main()
