"""Stage `evaluate` (and `evaluate_base`): held-out pass@1, pass@k and greedy accuracy of one checkpoint.

Evaluates checkpoint k on the test split with the same generation backend and sandbox as training:
one greedy sample per prompt (greedy accuracy) and n sampled ones (pass@k by the unbiased estimator of
Chen et al. 2021). `evaluate_base` is the same stage on the base model, run once per run, stored as
iteration -1 in `base/eval.parquet`. A sample is correct when every test passed (status "ok").

The manifest's metrics hold one summary per dataset (keyed by dataset name; its intervals resample whole
problem families where the prompts name one, see stages/evaluation/metrics.py) beside the engine figures the
generate stage also records: backend, `deterministic`, `engine_start_seconds` apart from
`generation_seconds`, tokens/s, and the overlong-prompt counts.
"""

from __future__ import annotations

import json

import pyarrow as pa

from stages.evaluation.metrics import aggregate, clusters_of
from stages.generation.base import GenerationRequest, SamplingSpec, sample_seed
from stages.generation.client import open_stage_engine
from stages.generation.device import backend_device_record, claim_device
from stages.generation.models import load_tokenizer
from stages.generation.sampling import encode_prompts, generate_with_progress
from stages.harness import StageContext, StageInputError, exit_with
from stages.sandbox import ScoreJob
from stages.sandbox.rewards import RewardInput
from stages.score import score_with_progress


def run(ctx: StageContext) -> None:
    ev = ctx.config.evaluate
    gen = ctx.config.generate
    prompts = [row for row in ctx.read_input("prompts").to_pylist() if row["split"] == "test"]
    if not prompts:
        raise StageInputError(f"{ctx.inputs['prompts'].path}: no test prompts")
    by_id = {row["prompt_id"]: row for row in prompts}
    device = claim_device(ctx.config.device)
    model_dir = ctx.policy_dir()
    encoded = encode_prompts(
        load_tokenizer(model_dir), list(by_id), [row["messages"] for row in by_id.values()],
        gen.max_prompt_tokens, gen.overlong_prompt,
    )

    engine = open_stage_engine(gen, model_dir, device, ctx.config.device, ctx.inputs["policy"].sha256,
                               ctx.layout.run_dir)
    backend = engine.backend
    plan: list[tuple[str, str, int]] = []  # (prompt_id, mode, sample_idx) per generated sample
    samples = []
    generation_seconds, generated_tokens = 0.0, 0
    try:
        for mode, n, spec in [
            ("greedy", 1 if ev.greedy else 0, SamplingSpec(temperature=0.0, max_new_tokens=ev.max_new_tokens)),
            ("sampled", ev.n_samples, SamplingSpec(
                temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=ev.max_new_tokens)),
        ]:
            requests = []
            for prompt_id, token_ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True):
                for sample_idx in range(n):
                    # Evaluation seeds do not depend on the iteration: every checkpoint is judged on the
                    # same random draws, which removes sampling noise from the before/after comparison.
                    seed = sample_seed(ctx.config.seed, -1, prompt_id, sample_idx)
                    requests.append(GenerationRequest(token_ids, seed))
                    plan.append((prompt_id, mode, sample_idx))
            if requests:
                label = f"{ctx.spec.name} {mode}"
                result = generate_with_progress(backend, requests, spec, label)
                samples += result.samples
                generation_seconds += result.seconds
                generated_tokens += result.tokens
    finally:
        backend.close()

    jobs = [
        ScoreJob(sample.text, json.loads(by_id[pid]["reward_spec"]))
        for (pid, _, _), sample in zip(plan, samples, strict=True)
    ]
    inputs = [RewardInput.of_prompt(by_id[pid]) for pid, _, _ in plan]
    results = score_with_progress(ctx, jobs, f"{ctx.spec.name} score", inputs)
    rows = [
        {
            "run_id": ctx.run_id, "iteration": ctx.iteration, "policy_version": ctx.inputs["policy"].sha256,
            "dataset": by_id[pid]["dataset"], "prompt_id": pid, "mode": mode, "sample_idx": sample_idx,
            "correct": result.status == "ok", "reward": result.reward, "status": result.status,
            "num_tokens": len(sample.token_ids), "response_text": sample.text,
        }
        for (pid, mode, sample_idx), sample, result in zip(plan, samples, results, strict=True)
    ]
    # The same engine figures as the generate stage's manifest: start apart from generation (greedy and
    # sampled together), and whether a rerun on this machine reproduces the samples.
    metrics: dict[str, object] = {
        "backend": backend.name,
        "deterministic": backend.deterministic,
        "engine": backend.engine_settings,
        "device": backend_device_record(device, backend),
        "engine_start_seconds": round(backend.engine_start_seconds, 3),
        "warm_engine": engine.manifest_record(),
        "generation_seconds": round(generation_seconds, 3),
        "generated_tokens": generated_tokens,
        "tokens_per_second": round(generated_tokens / generation_seconds, 2) if generation_seconds > 0 else 0.0,
        "prompts_skipped_overlong": encoded.skipped,
        "prompts_truncated": encoded.truncated,
    }
    clusters = clusters_of(prompts)  # the intervals resample whole problem families where prompts name one
    for dataset in sorted({row["dataset"] for row in rows}):
        metrics[dataset] = aggregate([row for row in rows if row["dataset"] == dataset], ev.k, clusters)
    ctx.write_table("eval", pa.Table.from_pylist(rows), metrics)


if __name__ == "__main__":
    exit_with("evaluate", run)
