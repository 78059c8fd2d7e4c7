"""Names people already know: rlpipe's config fields beside TRL's GRPOConfig and verl's keys.

One table (`NAMES`) serves two purposes: docs/names.md is generated from it (`python -m schemas.names >
docs/names.md`; tests/schemas/test_names.py fails when they disagree), and a config or `--set` key that rlpipe
does not know but a peer does gets a hint naming rlpipe's field (`num_generations` -> "did you mean
generate.n_samples"). rlpipe does not accept the peer's key as an alias: one name per setting, and some peer
keys differ in units or meaning (the `note` says how), which a silent alias would hide. A second table
(`METRICS`) puts the trackers' metric names (flows/trackers.py) beside the names TRL and verl log for the same
number; it only documents, nothing is looked up in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Name:
    rlpipe: str  # the dotted config field
    trl: str = ""  # GRPOConfig field ("" when TRL has none)
    verl: str = ""  # verl's Hydra key ("" when verl has none)
    note: str = ""  # where meaning or units differ


NAMES: tuple[Name, ...] = (
    Name("model.name_or_path", "model (GRPOTrainer's first argument)", "actor_rollout_ref.model.path"),
    Name("data.train", "train_dataset (GRPOTrainer)", "data.train_files"),
    Name("data.test", "eval_dataset (GRPOTrainer)", "data.val_files"),
    Name("iterations", "max_steps", "trainer.total_training_steps",
         "an rlpipe iteration is one generate-score-train round, which may take several optimizer steps"),
    Name("run_id", "run_name", "trainer.experiment_name"),
    Name("seed", "seed", "data.seed"),
    Name("generate.n_samples", "num_generations", "actor_rollout_ref.rollout.n"),
    Name("generate.prompts_per_iteration", "", "data.train_batch_size",
         "TRL's batch is per_device_train_batch_size x devices x steps_per_generation completions, not prompts"),
    Name("generate.temperature", "temperature", "actor_rollout_ref.rollout.temperature"),
    Name("generate.top_p", "top_p", "actor_rollout_ref.rollout.top_p"),
    Name("generate.top_k", "top_k", "actor_rollout_ref.rollout.top_k"),
    Name("generate.max_new_tokens", "max_completion_length", "data.max_response_length"),
    Name("generate.max_prompt_tokens", "max_prompt_length", "data.max_prompt_length"),
    Name("generate.vllm_tensor_parallel_size", "vllm_tensor_parallel_size",
         "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    Name("generate.engines", "", "",
         "verl has no key for it: its rollout replicas are trainer.n_gpus_per_node x trainer.nnodes / "
         "actor_rollout_ref.rollout.tensor_model_parallel_size (its rollout.data_parallel_size is data parallelism "
         "inside one engine); OpenRLHF: --vllm_num_engines; TRL's server mode: trl vllm-serve --data_parallel_size"),
    Name("generate.vllm_kv_cache_gib", "vllm_gpu_memory_utilization",
         "actor_rollout_ref.rollout.gpu_memory_utilization", "GiB of KV cache here, a fraction of GPU memory there"),
    Name("score.rewards", "reward_funcs / reward_weights", "custom_reward_function.path + .name",
         "a list of {fn, weight}; fn takes either peer's signature"),
    Name("score.math_answer", "", "",
         "verl's gsm8k reward takes `method`: strict (its answer format only) or flexible (the last number); "
         "rlpipe's strict answer is the last \\boxed{} or <answer>"),
    Name("advantage.estimator", "scale_rewards / loss_type", "algorithm.adv_estimator",
         "rlpipe names the estimator (grpo, dr_grpo, rloo, ...); TRL's dr_grpo is scale_rewards=false"),
    Name("advantage.drop_zero_variance_groups", "", "algorithm.filter_groups.enable",
         "defaults: rlpipe null, as the estimator needs (on for the outcome estimators that compare a group's "
         "samples, off for gae, turn_gae, remax, reinforce_pp, turn_rloo); verl false (DAPO's recipe: true); TRL has "
         "no filter and trains every group, an all-equal one with advantage 0"),
    Name("advantage.max_generation_rounds", "", "algorithm.filter_groups.max_num_gen_batches"),
    Name("advantage.filter_metric", "", "algorithm.filter_groups.metric",
         "defaults: rlpipe seq_reward (keeps partial credit), verl acc (DAPO's recipe: acc); rlpipe's reward "
         "is the shaped reward (verl's seq_final_reward, near enough)"),
    Name("advantage.gamma", "", "algorithm.gamma"),
    Name("advantage.lam", "", "algorithm.lam"),
    Name("advantage.use_kl_in_reward", "", "algorithm.use_kl_in_reward"),
    Name("advantage.kl_penalty", "", "algorithm.kl_penalty", "k1 = kl, k2 = mse, k3 = low_var_kl"),
    Name("advantage.kl_ctrl", "", "algorithm.kl_ctrl.type"),
    Name("advantage.kl_coef", "", "algorithm.kl_ctrl.kl_coef"),
    Name("advantage.kl_target", "", "algorithm.kl_ctrl.target_kl"),
    Name("advantage.kl_horizon", "", "algorithm.kl_ctrl.horizon"),
    Name("advantage.mask_truncated", "mask_truncated_completions", ""),
    Name("advantage.overlong_buffer", "", "reward_model.overlong_buffer.len"),
    Name("advantage.overlong_penalty_factor", "", "reward_model.overlong_buffer.penalty_factor"),
    Name("train.lr", "learning_rate", "actor_rollout_ref.actor.optim.lr"),
    Name("train.weight_decay", "weight_decay", "actor_rollout_ref.actor.optim.weight_decay"),
    Name("train.warmup_steps", "warmup_steps", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    Name("train.lr_schedule", "lr_scheduler_type", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    Name("train.adam_beta1", "adam_beta1", ""),
    Name("train.adam_beta2", "adam_beta2", ""),
    Name("train.adam_eps", "adam_epsilon", ""),
    Name("train.max_grad_norm", "max_grad_norm", "actor_rollout_ref.actor.grad_clip"),
    Name("train.epochs", "num_iterations", "actor_rollout_ref.actor.ppo_epochs"),
    Name("train.minibatches", "steps_per_generation", "actor_rollout_ref.actor.ppo_mini_batch_size",
         "rlpipe counts optimizer steps per batch; verl gives the minibatch's size in prompts"),
    Name("train.micro_batch_tokens", "", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    Name("train.clip_low", "epsilon", "actor_rollout_ref.actor.clip_ratio_low"),
    Name("train.clip_high", "epsilon_high", "actor_rollout_ref.actor.clip_ratio_high"),
    Name("train.dual_clip", "", "actor_rollout_ref.actor.clip_ratio_c"),
    Name("train.loss_aggregation", "loss_type", "actor_rollout_ref.actor.loss_agg_mode",
         "values as verl's (token-mean, seq-mean-token-sum, ...); TRL names losses (grpo, bnpo, dr_grpo, dapo)"),
    Name("train.kl_coef", "beta", "actor_rollout_ref.actor.kl_loss_coef"),
    Name("train.kl_estimator", "", "actor_rollout_ref.actor.kl_loss_type", "k1 = kl, k2 = mse, k3 = low_var_kl"),
    Name("train.entropy_coef", "", "actor_rollout_ref.actor.entropy_coeff"),
    Name("train.policy_loss", "", "actor_rollout_ref.actor.policy_loss.loss_mode",
         "vanilla = ppo_clip; TRL's cispo and sapo are loss_type values there"),
    Name("train.is_level", "", "algorithm.rollout_correction.rollout_is"),
    Name("train.is_threshold", "vllm_importance_sampling_cap", "algorithm.rollout_correction.rollout_is_threshold"),
    Name("train.is_batch_normalize", "", "algorithm.rollout_correction.rollout_is_batch_normalize"),
    Name("train.rejection", "", "algorithm.rollout_correction.rollout_rs", "a list, not a comma-separated string"),
    Name("train.rejection_thresholds", "", "algorithm.rollout_correction.rollout_rs_threshold",
         "a list of quoted strings, one per rule or one for all"),
    Name("train.bypass_old_logprobs", "", "algorithm.rollout_correction.bypass_mode"),
    Name("train.sapo_temperature_pos", "sapo_temperature_pos", ""),
    Name("train.sapo_temperature_neg", "sapo_temperature_neg", ""),
    Name("train.critic_model", "", "critic.model.path"),
    Name("train.critic_lr", "", "critic.optim.lr"),
    Name("train.value_clip", "", "critic.cliprange_value"),
    Name("train.gradient_checkpointing", "gradient_checkpointing",
         "actor_rollout_ref.model.enable_gradient_checkpointing"),
    Name("train.lora_rank", "", "actor_rollout_ref.model.lora_rank", "TRL takes a peft_config (LoraConfig r)"),
    Name("train.lora_alpha", "", "actor_rollout_ref.model.lora_alpha"),
    Name("train.dtype", "bf16", "actor_rollout_ref.actor.fsdp_config.mixed_precision"),
    Name("train.nodes", "", "trainer.nnodes", "TRL runs under accelerate: its config's num_machines; node R >= 1 "
         "(accelerate's machine_rank, torchrun's node_rank) runs `rlpipe train-node RUN --node-rank R`"),
    Name("train.processes", "", "trainer.n_gpus_per_node", "DeepSpeed ranks per node; accelerate's num_processes "
         "counts every node's"),
    Name("train.keep_checkpoints", "save_total_limit", "trainer.max_actor_ckpt_to_keep / "
         "trainer.max_critic_ckpt_to_keep", "rlpipe also keeps the base model, every evaluated checkpoint and any "
         "an unfinished stage reads; the critic is in the checkpoint; defaults: rlpipe 1 (a checkpoint every "
         "iteration), verl and TRL keep all (null here)"),
    Name("train.keep_optimizer_states", "", "",
         "default 1: only the newest checkpoint keeps its optimizer state (TRL's save_only_model drops it from all)"),
    Name("evaluate.every", "eval_steps", "trainer.test_freq"),
)


# Tracker metric names: the rlpipe name, TRL's GRPOTrainer log key, verl's metric key, a note.
METRICS: tuple[Name, ...] = (
    Name("train/reward_mean", "reward", "critic/score/mean", "the policy's samples' mean reward, all terms summed"),
    Name("reward/<function>/mean", "rewards/<name>/mean", "",
         "one score.rewards term's mean value before its weight; `<function>` is the function's name (with its file's "
         "stem where two share one) or a built-in's"),
    Name("reward/<function>/error_frac", "", "",
         "the share of the function's calls that failed (raised, timed out, NaN, not a number); TRL stops at the "
         "first, verl logs it: see `score.max_reward_error_fraction`"),
    Name("length/mean", "completions/mean_length", "response_length/mean", "tokens per response"),
    Name("eval/<data_source>/pass_at_1", "", "val-core/<data_source>/reward/mean@N",
         "held-out pass@1 per verl data_source, logged where a test file mixes sources (else `eval/<dataset>/...`, "
         "the same figures); `/` in a source's name becomes `_`"),
    Name("train/<data_source>/reward_mean", "", "",
         "the training reward per data_source, logged with two or more sources"),
)


def _keys(text: str) -> list[str]:
    """The keys a table cell names: `a / b` alternatives, without `(...)` remarks or `+ .more` parts."""
    return [part.split(" (")[0].split(" + ")[0].strip() for part in text.split(" / ") if part.strip()]


TRL_KEYS = {key: name for name in NAMES for key in _keys(name.trl)}
VERL_KEYS = {key: name for name in NAMES for key in _keys(name.verl)}


def hint_for(dotted: str, fields: list[str]) -> str:
    """A hint for a config key rlpipe does not know: the rlpipe field a peer's name stands for (a verl key
    as written or its dotted tail, a TRL name as the last part), else the field of that name in another
    section or a close spelling among `fields` (rlpipe's dotted fields); '' when nothing fits."""
    import difflib

    last = dotted.rsplit(".", 1)[-1]
    verl = next((key for key in VERL_KEYS if key == dotted or ("." in dotted and key.endswith("." + dotted))), None)
    if verl is not None:
        name, peer = VERL_KEYS[verl], f"{verl} is verl's name for it"
    elif last in TRL_KEYS:
        name, peer = TRL_KEYS[last], f"{last} is TRL's GRPOConfig name for it"
    else:
        moved = [field for field in fields if field.rsplit(".", 1)[-1] == last and field != dotted]
        close = moved or difflib.get_close_matches(dotted, fields, n=1, cutoff=0.75)
        return f"did you mean {close[0]}?" if close else ""
    note = f"; {name.note}" if name.note else ""
    return f"did you mean {name.rlpipe}? ({peer}{note})"


def _cell(text: str) -> str:
    """Keys in backticks, remarks after them: `a` / `b` (remark)."""
    if not text:
        return "-"
    parts = []
    for part in text.split(" / "):
        key = part.split(" (")[0]
        parts.append(f"`{key}`{part[len(key):]}")
    return " / ".join(parts)


def names_markdown() -> str:
    rows = [
        "# Names people already know",
        "",
        "rlpipe's config fields beside TRL's `GRPOConfig` and verl's Hydra keys. rlpipe takes only its own names;",
        "a peer's name in a config file or in `rlpipe run --set` is refused with a hint naming rlpipe's field,",
        "e.g. `--set num_generations=8` -> `did you mean generate.n_samples?`. Generated from schemas/names.py",
        "(`python -m schemas.names > docs/names.md`).",
        "",
        *_peer_table("TRL (GRPOConfig)", NAMES),
        "",
        "## Metric names",
        "",
        "What the trackers (`log.trackers`) log, beside the name TRL's GRPOTrainer and verl log the same number",
        "under. The catalog has the per-function figures too: the `reward_functions` view (docs/usage.md).",
        "",
        *_peer_table("TRL (GRPOTrainer)", METRICS),
    ]
    return "\n".join(rows) + "\n"


def _peer_table(trl_heading: str, names: tuple[Name, ...]) -> list[str]:
    """A markdown table of rlpipe's names beside TRL's and verl's."""
    rows = [f"| rlpipe | {trl_heading} | verl | note |", "|---|---|---|---|"]
    return rows + ["| " + " | ".join([f"`{name.rlpipe}`", _cell(name.trl), _cell(name.verl), name.note]) + " |"
                   for name in names]


if __name__ == "__main__":
    print(names_markdown(), end="")
