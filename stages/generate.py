"""Stage `generate`: sample n responses per training prompt with the current policy.

Iteration k generates with checkpoint k-1-N (N = pipeline.max_staleness; the base model while that is < 0:
stages/registry.py `sampler_output`) and stamps every row with that checkpoint's content hash (`policy_version`)
and its train steps (`policy_step`: 0 the base, j + 1 checkpoint j; also in the manifest). Which prompts an
iteration uses is a deterministic function of (run seed, iteration): the training set is shuffled once per
epoch by a hash and walked in order, so a rerun picks the same prompts and every prompt is seen once per epoch.
An extra dynamic-sampling round r >= 1 (advantage.target_groups) draws `prompts_per_iteration` more prompts
that no earlier round of the iteration used, by a hash shuffle of (run seed, iteration, round), written to
iter=k/round=RR/. Each sample's seed is derived from (run seed, iteration, round, prompt, sample index), never
from batch position, so a rerun of the stage on the same machine with a deterministic backend reproduces the
table byte for byte.

With `generate.multi_turn.mode` tool or feedback each sample is a conversation rolled out by the agent loop
(stages/generation/agent_loop.py) with the score stage's sandbox as its interpreter or judge; the rollouts row
then holds the whole conversation after the prompt and its multi-turn columns (schemas/tables.py).
With `advantage.estimator: remax` each prompt also gets one greedy (temperature 0) rollout, sample_idx -1,
generated after the sampled ones: remax's baseline, scored like any rollout and left out of the batch.

Sharded (pipeline.shards.generate), shard k generates the k-th contiguous range of the selected prompts and `merge`
puts the parts back into the unsharded table's row order: per-sample seeds make the rows the same.

The table is written once, at the end, atomically. Engine start time is recorded apart from generation
time in the manifest, and so is the sampler/trainer logprob mismatch on the first few samples
(`logprob_mismatch`, see stages/generation/mismatch.py), measured after the engine is closed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import ConfigError, batched_shards_problem
from schemas.errors import InputError
from schemas.tables import BASELINE_SAMPLE_IDX, SINGLE_TURN_ROLLOUT
from stages.generation.agent_loop import (
    ConversationStart,
    conversation_sample,
    roll_out,
    template_tools,
    uses_continuous_batching,
)
from stages.generation.base import GenerationRequest, Sample, SamplingSpec, sample_seed
from stages.generation.client import open_stage_engine
from stages.generation.device import Device, backend_device_record, claim_device, resolve_dtype
from stages.generation.models import load_tokenizer
from stages.generation.sampling import GenerationResult, encode_prompts, generate_with_progress
from stages.harness import StageContext, concatenate_parts, exit_with, trailing_rows_last
from stages.registry import policy_step
from stages.rl.advantages import ESTIMATORS
from stages.sandbox.rewards import RewardInput
from storage.manifest import Manifest


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


def greedy_spec(ctx: StageContext) -> SamplingSpec:
    """remax's baseline response: greedy (temperature 0; verl's do_sample=False), same length limit and stops."""
    cfg = ctx.config.generate
    return SamplingSpec(temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop))


def single_turn_columns(sample: Sample) -> dict[str, Any]:
    """A single-turn rollout's columns beyond the key and the tokens."""
    return {"finish_reason": sample.finish_reason, "truncated": sample.finish_reason == "length", **SINGLE_TURN_ROLLOUT}


def run(ctx: StageContext) -> None:
    cfg = ctx.config.generate
    round_idx = ctx.round_idx
    prompts = ctx.read_input("prompts").to_pylist()
    train = {row["prompt_id"]: row for row in prompts if row["split"] == "train"}
    selected = select_round_prompts(list(train), ctx.config.seed, ctx.iteration, cfg.prompts_per_iteration, round_idx)
    if not selected:
        if round_idx == 0:
            raise InputError(f"{ctx.inputs['prompts'].path}: no train prompts")
        raise InputError(
            f"{ctx.inputs['prompts'].path}: dynamic sampling round {round_idx} of iteration {ctx.iteration} found no "
            f"train prompt left that earlier rounds did not use ({len(train)} in all): the batch cannot reach "
            "advantage.target_groups; lower it or add training prompts"
        )
    selected = ctx.shard_groups(selected)  # all, or this shard's contiguous range (pipeline.shards.generate)

    device = claim_device(ctx.config.device)
    model_dir = ctx.policy_dir()
    tokenizer = load_tokenizer(model_dir)
    tools = template_tools(cfg.multi_turn)
    encoded = encode_prompts(
        tokenizer, selected, [train[pid]["messages"] for pid in selected], cfg.max_prompt_tokens,
        cfg.overlong_prompt, tools,
    )
    requests, keys = [], []
    for prompt_id, token_ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True):
        for sample_idx in range(cfg.n_samples):
            seed = sample_seed(ctx.config.seed, ctx.iteration, prompt_id, sample_idx, round_idx)
            requests.append(GenerationRequest(token_ids, seed))
            keys.append((prompt_id, sample_idx, seed))
    # remax: one greedy rollout per prompt (sample_idx -1), the group's baseline; scored, never trained on
    baseline_requests, baseline_keys = [], []
    if ESTIMATORS[ctx.config.advantage.estimator].needs_greedy_baseline:
        for prompt_id, token_ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True):
            seed = sample_seed(ctx.config.seed, ctx.iteration, prompt_id, BASELINE_SAMPLE_IDX, round_idx)
            baseline_requests.append(GenerationRequest(token_ids, seed))
            baseline_keys.append((prompt_id, BASELINE_SAMPLE_IDX, seed))

    # The run's warm engine (loaded with this checkpoint in place) or one of the stage's own (client.py).
    ctx.route_engine_logs()  # vLLM's lines to the stage's log file, unless --verbose
    engine = open_stage_engine(cfg, model_dir, device, ctx.config.device, ctx.inputs["policy"].sha256,
                               ctx.layout.run_dir, ctx.layout.lock_path())
    backend = engine.backend
    if ctx.instance.shard and (problem := batched_shards_problem(ctx.config, "generate", backend.name)):
        backend.close()
        raise ConfigError(problem)  # backend `auto` became hf here
    multi_turn = cfg.multi_turn.mode != "off"
    loop_figures: dict[str, Any] = {}
    greedy: GenerationResult | None = None
    try:
        label = ctx.instance.label
        if multi_turn:
            starts = [ConversationStart(json.loads(train[pid]["messages"]), r.prompt_token_ids, r.seed)
                      for r, (pid, _, _) in zip(requests, keys, strict=True)]
            specs = [json.loads(train[pid]["reward_spec"]) for pid, _, _ in keys]
            inputs = [RewardInput.of_prompt(train[pid]) for pid, _, _ in keys]
            conversations, loop_figures = roll_out(backend, tokenizer, cfg.multi_turn, ctx.config.score, starts,
                                                   sampling_spec(ctx), specs, inputs, label, tools=tools)
            result = GenerationResult([conversation_sample(c, tokenizer) for c in conversations],
                                      loop_figures.pop("generation_seconds"), loop_figures.pop("generated_tokens"))
            extra = [c.columns() for c in conversations]
        else:
            result = generate_with_progress(backend, requests, sampling_spec(ctx), label)
            extra = [single_turn_columns(s) for s in result.samples]
            if baseline_requests:
                greedy = generate_with_progress(backend, baseline_requests, greedy_spec(ctx), f"{label} greedy")
    finally:
        backend.close()
    mismatch = sampler_trainer_mismatch(ctx, model_dir, requests, result.samples, device,
                                        [row["loss_mask"] for row in extra])
    if greedy is not None:  # after the mismatch pass, which compares sampled responses at the sampling temperature
        requests, keys = requests + baseline_requests, keys + baseline_keys
        extra += [single_turn_columns(s) for s in greedy.samples]
        result = GenerationResult(result.samples + greedy.samples, result.seconds + greedy.seconds,
                                  result.tokens + greedy.tokens)

    policy_version, step = ctx.inputs["policy"].sha256, policy_step(ctx.sources["policy"])
    rows = []
    for request, (prompt_id, sample_idx, seed), sample, columns in zip(requests, keys, result.samples, extra,
                                                                       strict=True):
        rows.append({
            "run_id": ctx.run_id, "iteration": ctx.iteration, "round": round_idx,
            "prompt_id": prompt_id, "sample_idx": sample_idx, "policy_version": policy_version,
            "prompt_token_ids": request.prompt_token_ids, "response_token_ids": sample.token_ids,
            "response_logprobs": sample.logprobs, "response_text": sample.text,
            "num_tokens": len(sample.token_ids), "seed": seed, "backend": backend.name,
            **columns, "policy_step": step,
        })
    ctx.write_table("rollouts", pa.Table.from_pylist(rows), {
        "backend": backend.name,
        "policy_step": step,
        # the continuous multi-turn loop's batches depend on when tool calls return (agent_loop.py)
        "deterministic": backend.deterministic and not (multi_turn
                                                        and uses_continuous_batching(backend, cfg.multi_turn)),
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
        **({"greedy_baselines": len(baseline_requests)} if baseline_requests else {}),
        **({"logprob_mismatch": mismatch} if mismatch else {}),
        **({"multi_turn": multi_turn_summary(rows, loop_figures)} if multi_turn else {}),
    })


def merge(ctx: StageContext, parts: list[pa.Table], manifests: list[Manifest]) -> tuple[pa.Table, dict[str, Any]]:
    """The shards' parts as the unsharded stage writes the table: every group's samples in prompt order, then remax's
    greedy rows; throughput over the longest shard's generation time (the shards ran at once)."""
    counts = {"generated_tokens", "prompts", "prompts_skipped_overlong", "prompts_truncated", "greedy_baselines",
              "logprob_mismatch.samples"}
    table, metrics = concatenate_parts(ctx, parts, manifests, counts)
    table = trailing_rows_last(table, pc.equal(table["sample_idx"], BASELINE_SAMPLE_IDX))
    seconds = metrics["generation_seconds"]
    metrics["tokens_per_second"] = round(metrics["generated_tokens"] / seconds, 2) if seconds else 0.0
    if "multi_turn" in metrics:  # figures of the rows over all of them; the loop's times as combined
        metrics["multi_turn"] |= multi_turn_summary(table.to_pylist(), {})
    return table, metrics


def multi_turn_summary(rows: list[dict[str, Any]], figures: dict[str, Any]) -> dict[str, Any]:
    """The manifest's multi-turn figures: turns, tool calls and errors, finish reasons, tool and judge time."""
    n = max(len(rows), 1)
    calls = sum(r["tool_calls"] for r in rows)
    return {
        "mean_turns": round(sum(r["num_turns"] for r in rows) / n, 3),
        "tool_calls": calls,
        "tool_errors": sum(r["tool_errors"] for r in rows),
        "tool_error_rate": round(sum(r["tool_errors"] for r in rows) / calls, 4) if calls else None,
        "tool_seconds": round(sum(r["tool_seconds"] for r in rows), 3),
        "observation_tokens": sum(len(r["loss_mask"]) - sum(r["loss_mask"]) for r in rows),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
        **{key: round(value, 3) for key, value in figures.items()},
    }


def sampler_trainer_mismatch(
    ctx: StageContext, model_dir: Path, requests: list[GenerationRequest], samples: list[Sample], device: Device,
    loss_masks: list[list[int] | None] | None = None,
) -> dict[str, Any] | None:
    """|sampler - trainer| logprob per token over the first `generate.mismatch_samples` samples, recomputed
    after the engine is closed (so the two models are never in memory at once)."""
    checked = min(ctx.config.generate.mismatch_samples, len(samples))
    if checked == 0:
        return None
    from stages.generation.mismatch import logprob_mismatch

    started = time.monotonic()
    stats = logprob_mismatch(model_dir, requests[:checked], samples[:checked], sampling_spec(ctx),
                             dtype=resolve_dtype(ctx.config.train.dtype, device.torch), device=device.torch,
                             loss_masks=loss_masks[:checked] if loss_masks else None)
    return {**stats, "samples": checked, "seconds": round(time.monotonic() - started, 3)}


if __name__ == "__main__":
    exit_with("generate", run, merge)
