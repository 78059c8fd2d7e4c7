"""Peer comparison: TRL's GRPOTrainer against a finished rlpipe run, same job, same wall-clock budget.

The rlpipe side is a run that already finished (e.g. `rlpipe run --config deployments/configs/humaneval-cpu.yaml`);
its config fixes everything the peer gets, so the two differ only in the trainer: the same model, training
prompts, reward (our sandbox with the run's `score` section), group size, prompts per generation batch,
optimizer steps per batch, sampling, learning rate, clip range, KL coefficient and loss aggregation (mapped to
TRL's `loss_type`), the same wall-clock budget (the run's first rollout to the end of its last evaluation, or
`--budget-minutes` where the run's clock does not give it),
and the same held-out evaluation (rlpipe's `evaluate_base` stage on TRL's final model). TRL generates with
Hugging Face `generate`, `use_cache` on (TRL's default turns it off: ~8x slower steps on this CPU).

Prints both reward curves against wall-clock minutes, held-out pass@1 and pass@k with bootstrap 95%
intervals before and after for each side, and the ratio of pass@1 gain per wall-minute (rlpipe / TRL):
on 2026-11-29, seeds 1-3 of humaneval-cpu, 3.86, 10.15 and 4.12 over all held-out problems, 5.2 for the mean
gains (docs/measurements.md, "Peer, same budget").

Install the peer first (benchmarks only, not a dependency of rlpipe): `make bench-deps`; then
`.venv/bin/python -m benchmarks.peer_trl --run humaneval-cpu [--root ./rlpipe-data]`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from stages.registry import instance
from storage.run import Run

LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none", "mean_centered": "none"}


@dataclass
class Side:
    name: str
    minutes: list[float] = field(default_factory=list)  # wall minutes since training started
    rewards: list[float] = field(default_factory=list)  # mean reward of the rollouts at that point
    budget_s: float = 0.0
    before: dict[str, dict[str, Any]] = field(default_factory=dict)  # dataset -> base model's held-out summary
    after: dict[str, dict[str, Any]] = field(default_factory=dict)  # ... and the trained model's
    after_rows: list[dict] = field(default_factory=list)  # the trained model's eval table


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def eval_summaries(manifest: Any) -> dict[str, dict[str, Any]]:  # noqa: ANN401 - a Manifest
    """dataset -> the held-out summary (pass@k, intervals, greedy) an eval manifest records for it."""
    return {name: dict(value) for name, value in manifest.metrics.items()
            if isinstance(value, dict) and "pass@1" in value}


def eval_rows(layout: Any, iteration: int) -> list[dict]:  # noqa: ANN401 - a RunLayout
    import pyarrow.parquet as pq

    columns = ["dataset", "prompt_id", "mode", "correct", "reward"]
    return pq.read_table(layout.table_path("eval", iteration), columns=columns).to_pylist()


def rlpipe_side(root: str, run_id: str) -> tuple[Side, Any, list[dict]]:
    """The finished run's reward curve, budget and held-out results (and the base model's eval table), from
    its manifests and tables."""
    import pyarrow.parquet as pq

    from stages.registry import is_scheduled, stage_state
    from storage.layout import BASE
    from storage.manifest import read_manifest

    run = Run.open(root, run_id)
    layout, config, fs = run.layout, run.config, run.fs
    last = config.iterations - 1
    for k in range(config.iterations):
        for stage in ("generate", "score", "train", "evaluate"):
            if is_scheduled(config, stage, k) and not stage_state(run, instance(stage, k)).done:
                raise SystemExit(f"run {run_id}: stage {stage} of iteration {k} is not done; finish the run first")
    side = Side("rlpipe")
    first = read_manifest(fs, layout.table_path("rollouts", 0) + ".manifest.json")
    started = _seconds(first.started_at)
    for k in range(config.iterations):
        scores = pq.read_table(layout.table_path("scores", k), columns=["reward"]).column("reward").to_pylist()
        trained = read_manifest(fs, layout.table_path("train_metrics", k) + ".manifest.json")
        side.minutes.append((_seconds(trained.ended_at) - started) / 60)
        side.rewards.append(sum(scores) / len(scores))
    last_eval = read_manifest(fs, layout.table_path("eval", last) + ".manifest.json")
    side.budget_s = _seconds(last_eval.ended_at) - started
    base_eval = read_manifest(fs, layout.table_path("eval", BASE) + ".manifest.json")
    side.before = eval_summaries(base_eval)
    side.after = eval_summaries(last_eval)
    side.after_rows = eval_rows(layout, last)
    return side, config, eval_rows(layout, BASE)


def run_clusters(root: str, run_id: str) -> dict[str, str]:
    """prompt_id -> the family the bootstrap resamples it with (stages/eval_metrics.clusters_of)."""
    import pyarrow.parquet as pq

    from stages.evaluation.metrics import clusters_of
    from storage.layout import RunLayout

    return clusters_of(pq.read_table(RunLayout.create(root, run_id).prompts_path).to_pylist())


def train_with_trl(config: Any, root: str, run_id: str, budget_s: float, out_dir: Path) -> Side:  # noqa: ANN401
    """GRPOTrainer on the run's train prompts with our sandbox as the reward, stopped at the budget."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages.generation.models import resolve_model
    from stages.sandbox import Sandbox, ScoreJob
    from storage.layout import RunLayout

    layout = RunLayout.create(root, run_id)
    prompts = [row for row in pq.read_table(layout.prompts_path).to_pylist() if row["split"] == "train"]
    dataset = Dataset.from_list([
        {"prompt": json.loads(row["messages"]), "reward_spec": row["reward_spec"]} for row in prompts
    ])
    gen, train, adv = config.generate, config.train, config.advantage
    sandbox = Sandbox.from_config(config.score).start()

    def sandbox_reward(completions: list, reward_spec: list[str], **_: Any) -> list[float]:  # noqa: ANN401
        jobs = [ScoreJob(completion[-1]["content"], json.loads(spec))
                for completion, spec in zip(completions, reward_spec, strict=True)]
        return [result.reward for result in sandbox.score(jobs)]

    side = Side("TRL GRPOTrainer", budget_s=budget_s)
    started = time.monotonic()

    class Budget(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if logs and "reward" in logs:
                side.minutes.append((time.monotonic() - started) / 60)
                side.rewards.append(float(logs["reward"]))

        last_step_end = started
        generation_step_s = 0.0  # the last step that began with a generation batch, generation included

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            now = time.monotonic()
            if (state.global_step - 1) % train.minibatches == 0:
                self.generation_step_s = now - self.last_step_end
            self.last_step_end = now
            # Stop at the budget, or before a step that starts a new generation batch and would not end
            # within it (a batch takes about as long as the last one), so TRL never runs past rlpipe's time.
            next_generates = state.global_step % train.minibatches == 0
            if now - started >= budget_s or (next_generates and now - started + self.generation_step_s > budget_s):
                control.should_training_stop = True
            return control

    completions_per_batch = gen.prompts_per_iteration * gen.n_samples
    # One optimizer step per rlpipe minibatch, in micro-batches of at most 8 sequences: TRL holds the
    # full-vocabulary logits of a whole micro-batch, and with 16 sequences of ~500 tokens the process reached
    # 21.7 GB and was OOM-killed on this 24 GiB machine. Accumulation keeps 16 sequences per step.
    per_step = completions_per_batch // train.minibatches
    micro_batch = max(d for d in range(1, min(8, per_step) + 1) if per_step % d == 0)
    accumulation = per_step // micro_batch
    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"), use_cpu=True, bf16=False, seed=config.seed, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=10**6, num_train_epochs=1000,
        learning_rate=train.lr, weight_decay=train.weight_decay, adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2, adam_epsilon=train.adam_eps, max_grad_norm=train.max_grad_norm,
        lr_scheduler_type="constant", warmup_steps=train.warmup_steps,
        num_generations=gen.n_samples, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, steps_per_generation=train.minibatches * accumulation,
        num_iterations=train.epochs,
        max_completion_length=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
        top_k=gen.top_k if gen.top_k > 0 else 0, generation_kwargs={"use_cache": True},
        gradient_checkpointing=False, beta=train.kl_coef, epsilon=train.clip_low, epsilon_high=train.clip_high,
        loss_type=LOSS_TYPES.get(train.loss_aggregation, "dapo"), scale_rewards=SCALE_REWARDS.get(adv.estimator,
                                                                                                   "group"),
        mask_truncated_completions=adv.mask_truncated, disable_dropout=True,
    )
    model_dir = resolve_model(config.model)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=sandbox_reward, args=args, train_dataset=dataset,
                          callbacks=[Budget()])
    try:
        trainer.train()
    finally:
        sandbox.close()
    side.budget_s = time.monotonic() - started
    trainer.save_model(str(out_dir / "model"))
    trainer.processing_class.save_pretrained(str(out_dir / "model"))
    return side


def evaluate_with_rlpipe(config: Any, root: str, model_dir: Path, run_id: str) -> tuple[dict, list[dict]]:  # noqa: ANN401
    """The held-out evaluation rlpipe gives its own checkpoints, given to `model_dir` (a run of its own):
    (dataset -> summary, eval table rows)."""
    from flows.runner.process import run_stage_process
    from stages.registry import RUN_STAGES
    from storage.layout import BASE
    from storage.manifest import read_manifest

    values = config.model_dump(mode="json") | {"run_id": run_id}
    values["model"] = values["model"] | {"name_or_path": str(model_dir)}
    # One stage, run by hand: an engine of its own, not a warm server left idling for `warm_engine_idle_s` after.
    values["generate"] = values["generate"] | {"warm_engine": "off"}
    peer_config = type(config).model_validate(values)
    run = Run.start(peer_config, root)
    layout = run.layout
    for stage in RUN_STAGES:
        run_stage_process(run, instance(stage))
    manifest = read_manifest(layout.fs, layout.table_path("eval", BASE) + ".manifest.json")
    return eval_summaries(manifest), eval_rows(layout, BASE)


def held_out_gains(side: Side, base_rows: list[dict], clusters: dict[str, str]) -> dict[str, dict]:
    """dataset (and "all held out" with several) -> paired gains of the side's final model over the base model."""
    from flows.cli.status import checkpoint_gains

    by_dataset = {dataset: [r for r in base_rows if r["dataset"] == dataset] for dataset in side.after}
    return dict(checkpoint_gains(by_dataset, side.after_rows, clusters))


def describe(side: Side, ks: list[int], gains: dict[str, dict]) -> None:
    """The side's reward curve, then per held-out dataset: pass@k before -> after with the evaluate stage's
    bootstrap intervals, and the paired gains over the base model (pass@1, greedy, reward); then the gains
    pooled over the whole test split."""
    print(f"\n{side.name}: budget {side.budget_s / 60:.1f} min")
    for minutes, reward in zip(side.minutes, side.rewards, strict=True):
        print(f"  {minutes:7.1f} min  mean reward {reward:.3f}")
    for dataset in sorted(side.after):
        before, after = side.before[dataset], side.after[dataset]
        print(f"  held-out {dataset} ({after['prompts']:.0f} problems):")
        for k in ks:
            metric = f"pass@{k}"
            interval = ""
            if f"{metric}_ci_low" in after:
                lo_hi = (f"[{m[f'{metric}_ci_low']:.3f}, {m[f'{metric}_ci_high']:.3f}]" for m in (before, after))
                interval = "  (95% CI before {}, after {})".format(*lo_hi)
            print(f"    {metric}: {before[metric]:.3f} -> {after[metric]:.3f}{interval}")
        print("    paired gain over base: " + _gains_line(gains[dataset]))
    if "all held out" in gains:
        print("  all held out, paired gain over base: " + _gains_line(gains["all held out"]))


def _gains_line(gains: dict[str, tuple[float, float, float]]) -> str:
    return ", ".join(f"{name} {gain:+.3f} [{low:+.3f}, {high:+.3f}]" for name, (gain, low, high) in gains.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a finished rlpipe run (the recipe's)")
    parser.add_argument("--root", default=os.environ.get("RLPIPE_ROOT", "./rlpipe-data"))
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="both sides' budget where the run's own clock does not give it (a fork, whose first "
                             "rollout is its parent's; a run slowed by other work); default: the rlpipe run's")
    parser.add_argument("--out", default=None, help="where TRL's model goes (default: <root>/peer-trl/<run>)")
    args = parser.parse_args()

    ours, config, base_rows = rlpipe_side(args.root, args.run)
    if args.budget_minutes:
        ours.budget_s = args.budget_minutes * 60
    out_dir = Path(args.out or Path(args.root) / "peer-trl" / args.run)
    load_before = os.getloadavg()[0]
    peer = train_with_trl(config, args.root, args.run, ours.budget_s, out_dir)
    peer.before = ours.before  # the same base model, prompts and seeds: one evaluation serves both
    peer.after, peer.after_rows = evaluate_with_rlpipe(config, args.root, out_dir / "model", f"{args.run}-peer-trl")
    load_after = os.getloadavg()[0]

    clusters = run_clusters(args.root, args.run)
    gains = {side.name: held_out_gains(side, base_rows, clusters) for side in (ours, peer)}
    for side in (ours, peer):
        describe(side, config.evaluate.k, gains[side.name])
    print(f"\nheld-out pass@1 gain per wall-minute (load average {load_before:.1f} -> {load_after:.1f}):")
    for dataset in gains[ours.name]:
        ours_gain, peer_gain = (gains[side.name][dataset]["pass@1"][0] / (side.budget_s / 60) for side in (ours, peer))
        ratio = f"{ours_gain / peer_gain:.2f}" if peer_gain > 0 else "n/a (the peer did not improve)"
        print(f"  {dataset}: rlpipe {ours_gain:+.5f}, TRL {peer_gain:+.5f}; ratio rlpipe / TRL: {ratio}")


if __name__ == "__main__":
    main()
