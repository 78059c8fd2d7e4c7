"""Stage `evaluate` (and `evaluate_base`): held-out pass@1, pass@k and greedy accuracy of one checkpoint.

Evaluates checkpoint k on the test split with the same generation backend and sandbox as training:
one greedy sample per prompt (greedy accuracy) and n sampled ones (pass@k by the unbiased estimator of
Chen et al. 2021). `evaluate_base` is the same stage on the base model, run once per run, stored as
iteration -1 in `base/eval.parquet`. A sample is correct when every test passed (status "ok").

The manifest's metrics hold one summary per dataset (keyed by dataset name; its intervals resample whole
problem families where the prompts name one, see stages/evaluation/metrics.py; with generate.multi_turn also
turns, tool calls per answer, tool error rate and solved-after-retry, grading each conversation's final
answer), and under `data_sources` one per verl `data_source` where the test prompts mix sources within a file
(`splits_by_data_source`: verl reports validation per source), beside the engine figures the
generate stage also records: backend, `deterministic`, `engine_start_seconds` apart from
`generation_seconds`, tokens/s, and the overlong-prompt counts. Sharded (pipeline.shards.evaluate), each shard
evaluates a contiguous range of the test prompts and `merge` rebuilds the unsharded table and its summaries.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import ConfigError, batched_shards_problem
from schemas.errors import InputError
from stages.evaluation.metrics import aggregate, clusters_of, multi_turn_summary, splits_by_data_source
from stages.generation.agent_loop import (
    Conversation,
    ConversationStart,
    conversation_sample,
    roll_out,
    template_tools,
    uses_continuous_batching,
)
from stages.generation.base import GenerationRequest, SamplingSpec, sample_seed
from stages.generation.client import open_stage_engine
from stages.generation.device import backend_device_record, claim_device
from stages.generation.models import load_tokenizer
from stages.generation.sampling import GenerationResult, encode_prompts, generate_with_progress
from stages.harness import StageContext, concatenate_parts, exit_with, trailing_rows_last
from stages.sandbox import ScoreJob
from stages.sandbox.rewards import RewardInput, account_for, combine_reward_metrics, score_with_progress
from storage.manifest import Manifest


def run(ctx: StageContext) -> None:
    ev = ctx.config.evaluate
    gen = ctx.config.generate
    prompts = test_prompts(ctx)
    groups = set(ctx.shard_groups([row["prompt_id"] for row in prompts]))  # all, or this shard's (pipeline.shards)
    prompts = [row for row in prompts if row["prompt_id"] in groups]
    by_id = {row["prompt_id"]: row for row in prompts}
    device = claim_device(ctx.config.device)
    model_dir = ctx.policy_dir()
    tokenizer = load_tokenizer(model_dir)
    mt = gen.multi_turn
    tools = template_tools(mt)
    encoded = encode_prompts(
        tokenizer, list(by_id), [row["messages"] for row in by_id.values()],
        gen.max_prompt_tokens, gen.overlong_prompt, tools,
    )
    multi_turn = mt.mode != "off"
    answers: list[str] = []  # what is graded: the response, or a conversation's final answer
    turns: list[dict[str, object]] = []  # multi-turn: each sample's turn columns
    tool_seconds = 0.0

    ctx.route_engine_logs()  # vLLM's lines to the stage's log file, unless --verbose
    engine = open_stage_engine(gen, model_dir, device, ctx.config.device, ctx.inputs["policy"].sha256,
                               ctx.layout.run_dir, ctx.layout.lock_path())
    backend = engine.backend
    if ctx.instance.shard and (problem := batched_shards_problem(ctx.config, ctx.spec.name, backend.name)):
        backend.close()
        raise ConfigError(problem)  # backend `auto` became hf here
    plan: list[tuple[str, str, int]] = []  # (prompt_id, mode, sample_idx) per generated sample
    samples = []
    generation_seconds, generated_tokens = 0.0, 0
    try:
        for mode, n, spec in [
            ("greedy", 1 if ev.greedy else 0, SamplingSpec(temperature=0.0, max_new_tokens=ev.max_new_tokens)),
            ("sampled", ev.n_samples, SamplingSpec(
                temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=ev.max_new_tokens)),
        ]:
            requests, ids = [], []
            for prompt_id, token_ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True):
                for sample_idx in range(n):
                    # Evaluation seeds do not depend on the iteration: every checkpoint is judged on the
                    # same random draws, which removes sampling noise from the before/after comparison.
                    seed = sample_seed(ctx.config.seed, -1, prompt_id, sample_idx)
                    requests.append(GenerationRequest(token_ids, seed))
                    plan.append((prompt_id, mode, sample_idx))
                    ids.append(prompt_id)
            if not requests:
                continue
            label = f"{ctx.spec.name} {mode}"
            if multi_turn:
                starts = [ConversationStart(json.loads(by_id[pid]["messages"]), r.prompt_token_ids, r.seed)
                          for r, pid in zip(requests, ids, strict=True)]
                conversations, figures = roll_out(
                    backend, tokenizer, mt, ctx.config.score, starts, spec,
                    [json.loads(by_id[pid]["reward_spec"]) for pid in ids],
                    [RewardInput.of_prompt(by_id[pid]) for pid in ids], label, held_out=True, tools=tools)
                result = GenerationResult([conversation_sample(c, tokenizer) for c in conversations],
                                          figures["generation_seconds"], figures["generated_tokens"])
                turns += [turn_columns(c, mt.mode) for c in conversations]
                answers += [c.final_answer for c in conversations]
                tool_seconds += sum(c.tool_seconds for c in conversations)
            else:
                result = generate_with_progress(backend, requests, spec, label)
                answers += [sample.text for sample in result.samples]
            samples += result.samples
            generation_seconds += result.seconds
            generated_tokens += result.tokens
    finally:
        backend.close()

    jobs = [
        ScoreJob(answer, json.loads(by_id[pid]["reward_spec"]))
        for (pid, _, _), answer in zip(plan, answers, strict=True)
    ]
    inputs = [RewardInput.of_prompt(by_id[pid]) for pid, _, _ in plan]
    results = score_with_progress(ctx.config.score, jobs, f"{ctx.spec.name} score", inputs)
    reward_functions = account_for(ctx.config.score, results)  # as the score stage: printed, bounded
    rows = [
        {
            "run_id": ctx.run_id, "iteration": ctx.iteration, "policy_version": ctx.inputs["policy"].sha256,
            "dataset": by_id[pid]["dataset"], "prompt_id": pid, "mode": mode, "sample_idx": sample_idx,
            "correct": result.status == "ok", "reward": result.reward, "status": result.status,
            "num_tokens": len(sample.token_ids), "response_text": sample.text,
            **(turns[i] if multi_turn else {"num_turns": 1, "tool_calls": 0, "tool_errors": 0}),
        }
        for i, ((pid, mode, sample_idx), sample, result) in enumerate(zip(plan, samples, results, strict=True))
    ]
    for row in rows:  # one answer (single-turn, tool mode): the first answer is the final one
        if row.get("first_answer_correct") is None:
            row["first_answer_correct"] = row["correct"]
    # The same engine figures as the generate stage's manifest: start apart from generation (greedy and
    # sampled together), and whether a rerun on this machine reproduces the samples.
    metrics: dict[str, object] = {
        "backend": backend.name,
        # the continuous multi-turn loop's batches depend on when tool calls return (agent_loop.py)
        "deterministic": backend.deterministic and not (multi_turn and uses_continuous_batching(backend, mt)),
        "engine": backend.engine_settings,
        "device": backend_device_record(device, backend),
        "engine_start_seconds": round(backend.engine_start_seconds, 3),
        "warm_engine": engine.manifest_record(),
        "generation_seconds": round(generation_seconds, 3),
        "generated_tokens": generated_tokens,
        "tokens_per_second": round(generated_tokens / generation_seconds, 2) if generation_seconds > 0 else 0.0,
        "prompts_skipped_overlong": encoded.skipped,
        "prompts_truncated": encoded.truncated,
        "reward_functions": reward_functions,
    }
    if multi_turn:
        metrics["tool_seconds"] = round(tool_seconds, 3)
    ctx.write_table("eval", pa.Table.from_pylist(rows), metrics | summaries(ctx, rows, prompts))


def test_prompts(ctx: StageContext) -> list[dict[str, Any]]:
    prompts = [row for row in ctx.read_input("prompts").to_pylist() if row["split"] == "test"]
    if not prompts:
        raise InputError(f"{ctx.inputs['prompts'].path}: no test prompts")
    return prompts


def summaries(ctx: StageContext, rows: list[dict[str, Any]], prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's figures of the eval rows: one summary per dataset and, where the prompts mix verl
    data_sources, one per source (`data_sources`)."""
    ev, mode = ctx.config.evaluate, ctx.config.generate.multi_turn.mode
    clusters = clusters_of(prompts)  # the intervals resample whole problem families where prompts name one
    figures: dict[str, Any] = {}
    for dataset in sorted({row["dataset"] for row in rows}):
        figures[dataset] = aggregate([row for row in rows if row["dataset"] == dataset], ev.k, clusters)
        if mode != "off":
            figures[dataset].update(multi_turn_summary([row for row in rows if row["dataset"] == dataset], mode))
    if (sources := splits_by_data_source(prompts)) is not None:  # verl's val-core/<data_source>/... figures
        figures["data_sources"] = {
            source: aggregate([row for row in rows if sources[row["prompt_id"]] == source], ev.k, clusters)
            for source in sorted(set(sources.values()))}
    return figures


def merge(ctx: StageContext, parts: list[pa.Table], manifests: list[Manifest]) -> tuple[pa.Table, dict[str, Any]]:
    """The shards' parts as the unsharded stage writes the table (every greedy row, then every sampled one, each
    block in prompt order), with the summaries over all the test prompts and the shards' reward figures combined."""
    counts = {"generated_tokens", "prompts_skipped_overlong", "prompts_truncated"}
    table, metrics = concatenate_parts(ctx, parts, manifests, counts)
    table = trailing_rows_last(table, pc.not_equal(table["mode"], "greedy"))
    seconds = metrics["generation_seconds"]
    metrics["tokens_per_second"] = round(metrics["generated_tokens"] / seconds, 2) if seconds else 0.0
    metrics["reward_functions"] = combine_reward_metrics([m.metrics["reward_functions"] for m in manifests])
    return table, metrics | summaries(ctx, table.to_pylist(), test_prompts(ctx))


def turn_columns(c: Conversation, mode: str) -> dict[str, object]:
    """A conversation's eval columns; feedback mode knows whether the first answer passed, tool mode has one."""
    first = c.turn_passed[0] if mode == "feedback" and c.turn_passed else None
    return {"num_turns": c.num_turns, "tool_calls": c.tool_calls, "tool_errors": c.tool_errors,
            "first_answer_correct": first}


if __name__ == "__main__":
    exit_with("evaluate", run, merge)
