"""Stage `generate`: sample n responses per training prompt with the current policy.

Iteration k generates with checkpoint k-1 (iteration 0 with the base model) and stamps every row with that
checkpoint's content hash (`policy_version`). Which prompts an iteration uses is a deterministic function of
(run seed, iteration): the training set is shuffled once per epoch by a hash and walked in order, so a
rerun picks the same prompts and every prompt is seen once per epoch. An extra dynamic-sampling round r >= 1
(advantage.target_groups) draws `prompts_per_iteration` more prompts that no earlier round of the iteration
used, by a hash shuffle of (run seed, iteration, round), written to iter=k/round=RR/. Each sample's seed is
derived from
(run seed, iteration, round, prompt, sample index), never from batch position, so a rerun of the stage on the
same machine with a deterministic backend reproduces the table byte for byte.

The table is written once, at the end, atomically. Engine start time is recorded apart from generation
time in the manifest, and so is the sampler/trainer logprob mismatch on the first few samples
(`logprob_mismatch`, see stages/generation/mismatch.py), measured after the engine is closed.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.tables import SINGLE_TURN_ROLLOUT
from stages.generation.base import GenerationRequest, Sample, SamplingSpec, sample_seed
from stages.generation.client import open_stage_engine
from stages.generation.device import Device, backend_device_record, claim_device, resolve_dtype
from stages.generation.models import load_tokenizer
from stages.generation.sampling import encode_prompts, generate_with_progress
from stages.harness import StageContext, StageInputError, exit_with


def select_prompts(train_prompt_ids: list[str], run_seed: int, iteration: int, per_iteration: int) -> list[str]:
    """The prompts of one iteration: walk a per-epoch hash shuffle of the training set in order."""
    if not train_prompt_ids:
        return []
    ordered = sorted(set(train_prompt_ids))
    chosen: list[str] = []
    start = iteration * per_iteration
    for position in range(start, start + min(per_iteration, len(ordered))):
        epoch, offset = divmod(position, len(ordered))
        shuffled = sorted(
            ordered, key=lambda pid: hashlib.sha256(f"{run_seed}:{epoch}:{pid}".encode()).hexdigest()
        )
        chosen.append(shuffled[offset])
    return chosen


def select_round_prompts(
    train_prompt_ids: list[str], run_seed: int, iteration: int, per_iteration: int, round_idx: int
) -> list[str]:
    """The prompts of generation round `round_idx` of an iteration: round 0 is `select_prompts`; round r >= 1
    takes `per_iteration` prompts unused by rounds 0..r-1, in a hash order of (run seed, iteration, round).
    Fewer (or none) when the training set runs out."""
    chosen = select_prompts(train_prompt_ids, run_seed, iteration, per_iteration)
    used = set(chosen)
    for extra_round in range(1, round_idx + 1):
        unused = sorted(set(train_prompt_ids) - used)
        order = sorted(
            unused, key=lambda pid: hashlib.sha256(f"{run_seed}:{iteration}:{extra_round}:{pid}".encode()).hexdigest()
        )
        chosen = order[:per_iteration]
        used.update(chosen)
    return chosen


def sampling_spec(ctx: StageContext) -> SamplingSpec:
    cfg = ctx.config.generate
    return SamplingSpec(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
    )


def run(ctx: StageContext) -> None:
    cfg = ctx.config.generate
    round_idx = ctx.round_idx
    prompts = ctx.read_input("prompts").to_pylist()
    train = {row["prompt_id"]: row for row in prompts if row["split"] == "train"}
    selected = select_round_prompts(list(train), ctx.config.seed, ctx.iteration, cfg.prompts_per_iteration, round_idx)
    if not selected:
        if round_idx == 0:
            raise StageInputError(f"{ctx.inputs['prompts'].path}: no train prompts")
        raise StageInputError(
            f"{ctx.inputs['prompts'].path}: dynamic sampling round {round_idx} of iteration {ctx.iteration} found no "
            f"train prompt left that earlier rounds did not use ({len(train)} in all): the batch cannot reach "
            "advantage.target_groups; lower it or add training prompts"
        )

    device = claim_device(ctx.config.device)
    model_dir = ctx.policy_dir()
    tokenizer = load_tokenizer(model_dir)
    encoded = encode_prompts(
        tokenizer, selected, [train[pid]["messages"] for pid in selected], cfg.max_prompt_tokens,
        cfg.overlong_prompt,
    )
    requests, keys = [], []
    for prompt_id, token_ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True):
        for sample_idx in range(cfg.n_samples):
            seed = sample_seed(ctx.config.seed, ctx.iteration, prompt_id, sample_idx, round_idx)
            requests.append(GenerationRequest(token_ids, seed))
            keys.append((prompt_id, sample_idx, seed))

    # The run's warm engine (loaded with this checkpoint in place) or one of the stage's own (client.py).
    engine = open_stage_engine(cfg, model_dir, device, ctx.config.device, ctx.inputs["policy"].sha256,
                               ctx.layout.run_dir)
    backend = engine.backend
    try:
        label = ctx.instance.label
        result = generate_with_progress(backend, requests, sampling_spec(ctx), label)
    finally:
        backend.close()
    mismatch = sampler_trainer_mismatch(ctx, model_dir, requests, result.samples, device)

    policy_version = ctx.inputs["policy"].sha256
    rows = []
    for request, (prompt_id, sample_idx, seed), sample in zip(requests, keys, result.samples, strict=True):
        rows.append({
            "run_id": ctx.run_id, "iteration": ctx.iteration, "round": round_idx,
            "prompt_id": prompt_id, "sample_idx": sample_idx, "policy_version": policy_version,
            "prompt_token_ids": request.prompt_token_ids, "response_token_ids": sample.token_ids,
            "response_logprobs": sample.logprobs, "response_text": sample.text,
            "finish_reason": sample.finish_reason, "truncated": sample.finish_reason == "length",
            "num_tokens": len(sample.token_ids), "seed": seed, "backend": backend.name,
            **SINGLE_TURN_ROLLOUT,
        })
    ctx.write_table("rollouts", pa.Table.from_pylist(rows), {
        "backend": backend.name,
        "deterministic": backend.deterministic,
        "engine": backend.engine_settings,
        "device": backend_device_record(device, backend),
        "engine_start_seconds": round(backend.engine_start_seconds, 3),
        "warm_engine": engine.manifest_record(),
        "generation_seconds": round(result.seconds, 3),
        "generated_tokens": result.tokens,
        "tokens_per_second": round(result.tokens_per_second, 2),
        "prompts": len(encoded.prompt_ids),
        "prompts_skipped_overlong": encoded.skipped,
        "prompts_truncated": encoded.truncated,
        **({"logprob_mismatch": mismatch} if mismatch else {}),
    })


def sampler_trainer_mismatch(
    ctx: StageContext, model_dir: Path, requests: list[GenerationRequest], samples: list[Sample], device: Device
) -> dict[str, Any] | None:
    """|sampler - trainer| logprob per token over the first `generate.mismatch_samples` samples, recomputed
    after the engine is closed (so the two models are never in memory at once)."""
    checked = min(ctx.config.generate.mismatch_samples, len(samples))
    if checked == 0:
        return None
    from stages.generation.mismatch import logprob_mismatch

    started = time.monotonic()
    stats = logprob_mismatch(model_dir, requests[:checked], samples[:checked], sampling_spec(ctx),
                             dtype=resolve_dtype(ctx.config.train.dtype, device.torch), device=device.torch)
    return {**stats, "samples": checked, "seconds": round(time.monotonic() - started, 3)}


if __name__ == "__main__":
    exit_with("generate", run)
