"""Stage `advantage`: turn scored rollouts into the training batch (advantages, shaping, filters).

Reads this iteration's rollouts and scores (every generation round), joins and checks them, adds the columns the
models give (the KL to the base model with `use_kl_in_reward`, the critic's values for an estimator that needs
one), builds the batch (stages/rl/batch.py: shaped rewards, group filters, dynamic sampling's target, advantages
by the configured estimator, the truncation mask, the skip rule) and writes it: one row per rollout, `kept` saying
whether it enters the loss and `drop_reason` why not. A shortfall of kept groups is the manifest's
`groups_needed`, for the flow to generate another round.

Multi-turn rollouts: the KL in the reward counts model tokens only (0 at observation tokens, whose sampler
logprob means nothing); the turn-level estimators read the turn spans and per-turn rewards.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.tables import ROLLOUT_KEY
from stages.harness import StageContext, exit_with
from stages.rl.advantages import ESTIMATORS
from stages.rl.batch import build_batch, model_masks, samples_of


def kl_in_reward_coef(ctx: StageContext) -> float:
    """This iteration's KL-in-reward beta: advantage.kl_coef, or under the adaptive controller the coefficient
    the previous iteration's batch manifest handed on (kl_coef at iteration 0)."""
    cfg = ctx.config.advantage
    if not cfg.use_kl_in_reward:
        return 0.0
    if cfg.kl_ctrl == "fixed" or "previous_batch" not in ctx.inputs:
        return cfg.kl_coef
    return float(ctx.inputs["previous_batch"].metrics.get("kl_in_reward_next_coef", cfg.kl_coef))


def with_model_columns(ctx: StageContext, samples: pa.Table) -> pa.Table:
    """`samples` with the per-token columns the models give: `kl` (use_kl_in_reward: the estimate
    kl_penalty(pi_sampler, pi_ref) of each response token, the reference at the sampling temperature; verl
    takes the actor's recomputed pi_old, the sampler's logprobs stand in for it here) and `values` (GAE: the
    critic in the rollouts' checkpoint; none before the first critic exists)."""
    import torch

    from stages.generation.device import claim_device
    from stages.rl.checkpoint import load_reference
    from stages.rl.critic import critic_dir, load_value_model, predict_values
    from stages.rl.logprobs import all_response_logprobs, takes_shared_prompts
    from stages.rl.losses import kl_estimate

    cfg, train = ctx.config.advantage, ctx.config.train
    prompts = [list(ids) for ids in samples["prompt_token_ids"].to_pylist()]
    responses = [list(ids) for ids in samples["response_token_ids"].to_pylist()]
    budget = 2 * train.micro_batch_tokens  # no activations kept without grad
    device = claim_device(ctx.config.device).torch
    if cfg.use_kl_in_reward:
        reference = load_reference(ctx.policy_dir("reference"), device)
        ref_logp = all_response_logprobs(
            reference, prompts, responses, ctx.config.generate.temperature, budget, train.logprob_chunk_tokens,
            share=takes_shared_prompts(reference, train.share_prompts),
        )
        del reference
        sampler = samples["response_logprobs"].to_pylist()
        kl = [kl_estimate(torch.tensor(old, dtype=torch.float32), ref, cfg.kl_penalty).double().numpy()
              for old, ref in zip(sampler, ref_logp, strict=True)]
        # multi-turn: observation tokens are context, not the model's (their sampler logprob is a placeholder)
        kl = [k * m for k, m in zip(kl, model_masks(samples, kl), strict=True)]
        samples = samples.append_column("kl", pa.array([k.tolist() for k in kl], pa.list_(pa.float64())))
    if ESTIMATORS[cfg.estimator].needs_critic and "policy" in ctx.inputs:
        checkpoint = ctx.policy_dir("policy")
        if critic_dir(checkpoint).is_dir():
            critic, _ = load_value_model(checkpoint, checkpoint, device)
            values = predict_values(critic, prompts, responses, budget, device,
                                    share=takes_shared_prompts(critic.backbone, train.share_prompts))
            samples = samples.append_column("values", pa.array([v.tolist() for v in values], pa.list_(pa.float64())))
    return samples


def run(ctx: StageContext) -> None:
    cfg = ctx.config.advantage
    record = ESTIMATORS[cfg.estimator]
    model_passes = cfg.use_kl_in_reward or (record.needs_critic and "policy" in ctx.inputs)
    token_columns = ["prompt_token_ids", "response_token_ids", "response_logprobs"] if model_passes else []
    # multi-turn: the loss mask for the KL in the reward and GAE, the turns for the turn-level estimators
    if record.level == "turn":
        token_columns += ["loss_mask", "turn_spans", "turn_rewards"]
    elif cfg.use_kl_in_reward or record.level == "token":
        token_columns += ["loss_mask"]
    # Every generation round of the iteration (round 0, plus the rounds dynamic sampling asked for).
    rollouts = ctx.read_rounds("rollouts", [*ROLLOUT_KEY, "num_tokens", "truncated", *token_columns])
    scores = ctx.read_rounds("scores", [*ROLLOUT_KEY, "reward", "status"])
    rollouts_paths = ", ".join(ctx.inputs[name].path for name in ctx.round_input_names("rollouts"))
    scores_paths = ", ".join(ctx.inputs[name].path for name in ctx.round_input_names("scores"))
    samples, baselines = samples_of(rollouts, scores, ctx.config.generate.n_samples, record.needs_greedy_baseline,
                                    token_columns, rollouts_paths, scores_paths)
    if model_passes:
        samples = with_model_columns(ctx, samples)
    # the overlong buffer ends at the longest response: max_new_tokens, or a multi-turn conversation's budget
    batch, metrics = build_batch(samples, cfg, ctx.config.generate.response_token_limit, kl_in_reward_coef(ctx),
                                 baselines)
    ctx.write_table("batch", batch, metrics)


if __name__ == "__main__":
    exit_with("advantage", run)
