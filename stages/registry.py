"""What each stage reads, writes and depends on: the wiring of the pipeline in one table.

Imports nothing heavy (no torch, no Prefect): the flow process (to decide what is done) and every stage
process (to stamp its manifest) compute stage keys from it. Run-level stages run once per run, iteration
stages once per iteration k (the table with inputs, outputs and hashed sections: docs/architecture.md):

    prompts, base_model, evaluate_base               -> prompts.parquet, checkpoints/base, base/eval.parquet
    generate k -> score k -> advantage k -> train k -> evaluate k      (generate k uses checkpoint k-1-N)

N = pipeline.max_staleness (0: strict order). Generate k samples with `sampler_output(config, k)`, the checkpoint
of iteration k-1-N, fixed by (config, k) and not by what happens to be newest when the stage starts, so an
overlapped run (generate of k+1 beside train k) is reproducible and its resume exact. Train k starts from
checkpoint k-1 (`policy_output`), decoupled PPO's proximal policy; the sampler's logprobs are the behaviour's.

Dynamic sampling (advantage.target_groups): `generate` and `score` are per-round stages, round r >= 1 its own
instance writing iter=k/round=RR/. `advantage` and `train` take, besides round 0, each round r whose generate
and score are done for the current config and policy (`round_inputs`, inputs named `rollouts@round=RR`), so
their keys change when a round is added and a stale round is never mixed in. The flow decides which rounds
exist (flows/runner/process.py), adding one while the batch manifest says `groups_needed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from schemas.config import RunConfig
from stages.rl.advantages import ESTIMATORS
from storage.layout import BASE, RunLayout, Shard, StageInstance, manifest_path_for, part_path, round_name
from storage.manifest import Manifest, output_damage, output_intact, read_manifest, stage_key
from storage.run import Run


@dataclass(frozen=True)
class Output:
    """One thing a stage writes: a table (by schema name) or a checkpoint directory."""

    name: str  # table name, or "checkpoint"
    iteration: int  # where it lives (BASE for run-level)
    round_idx: int = 0  # generation round (rollouts and scores of dynamic-sampling rounds r >= 1)
    shard: Shard | None = None  # a shard's part of the table (pipeline.shards), beside the table in `.parts/`

    @property
    def kind(self) -> str:
        return "checkpoint" if self.name == "checkpoint" else "table"

    @property
    def whole(self) -> Output:
        """The table this part is a part of (itself when it is no part)."""
        return replace(self, shard=None)

    def path(self, layout: RunLayout) -> str:
        if self.kind == "checkpoint":
            return layout.checkpoint_dir(self.iteration)
        path = layout.table_path(self.name, self.iteration, self.round_idx)
        return part_path(path, self.shard) if self.shard else path

    def manifest_path(self, layout: RunLayout) -> str:
        return manifest_path_for(self.path(layout), self.kind)


def policy_output(iteration: int) -> Output:
    """The checkpoint that train of iteration `iteration` starts from: the previous iteration's, or the base."""
    return Output("checkpoint", iteration - 1 if iteration > 0 else BASE)


def sampler_output(config: RunConfig, iteration: int) -> Output:
    """The checkpoint that iteration `iteration` generates with: iteration k-1-N's (N = pipeline.max_staleness),
    the base model while k-1-N < 0. With N = 0 it is `policy_output(k)`."""
    return policy_output(iteration - config.pipeline.max_staleness)


def policy_step(checkpoint: Output) -> int:
    """How many train stages the policy in `checkpoint` has had: the base 0, iteration j's checkpoint j + 1."""
    return 0 if checkpoint.iteration == BASE else checkpoint.iteration + 1


@dataclass(frozen=True)
class StageSpec:
    name: str
    run_level: bool
    config_payload: Callable[[RunConfig], dict[str, Any]]
    inputs: Callable[..., dict[str, Output]]  # (iteration, round=0) -> inputs of that instance
    outputs: Callable[..., list[Output]]  # (iteration, round=0) -> outputs of that instance
    per_round: bool = False  # one instance per generation round (generate, score)
    reads_rounds: tuple[str, ...] = ()  # tables it also reads from every extra round (see round_inputs)
    # (config, iteration) -> the inputs only some configs need (the advantage stage's models)
    config_inputs: Callable[[RunConfig, int], dict[str, Output]] = lambda config, k: {}


# Fields that decide when a stage runs, not what it computes: never part of a stage key, so changing them
# (or adding them to an older config) does not make finished stages stale. The warm_engine fields say which
# engine process generates, not what (the same tokens on CPU: tests/generation/test_warm_engine_stage.py), and
# `engines` how many engines share the requests (the same tokens for any count:
# tests/generation/test_engines_stage.py); the keep_* fields which checkpoints are pruned afterwards
# (stages/retention.py); master_addr/port where a multi-node train job's ranks meet.
SCHEDULING_FIELDS = {"evaluate": ("every",),
                     "generate": ("warm_engine", "warm_engine_min_free_gib", "warm_engine_idle_s", "engines"),
                     "train": ("keep_checkpoints", "keep_optimizer_states", "master_addr", "master_port")}
# Fields added after runs existed, at the value that computes what the code did before them: left out of the key
# at that value, so an older run's finished stages stay finished after an upgrade (any other value is in it).
UNKEYED_DEFAULTS = {"score": {"math_answer": "strict"}}


def _sections(*names: str) -> Callable[[RunConfig], dict[str, Any]]:
    def payload(config: RunConfig) -> dict[str, Any]:
        dumped = config.model_dump(mode="json")
        values: dict[str, Any] = {}
        for name in names:
            section, _, field = name.partition(".")
            value = dumped[section][field] if field else dumped[section]
            if name in SCHEDULING_FIELDS:
                value = {k: v for k, v in value.items() if k not in SCHEDULING_FIELDS[name]}
            if name in UNKEYED_DEFAULTS:
                value = {k: v for k, v in value.items() if UNKEYED_DEFAULTS[name].get(k, object()) != v}
            values[name] = value
        return values

    return payload


# The generate settings the evaluate stages also use (engine, precision, prompt length rule): changing one
# reruns evaluation. Sampling settings are not among them: evaluation has its own (the evaluate section).
EVALUATE_GENERATE_FIELDS = ("generate.backend", "generate.dtype", "generate.vllm_dtype", "generate.vllm_compile",
                            "generate.vllm_kv_cache_dtype", "generate.max_prompt_tokens", "generate.overlong_prompt")

PROMPTS = Output("prompts", BASE)


def advantage_payload(config: RunConfig) -> dict[str, Any]:
    """The advantage section; with the KL in the reward also the sampling temperature its reference logprobs
    are taken at (a run without it keeps the key it had)."""
    names = ("advantage", "generate.temperature") if config.advantage.use_kl_in_reward else ("advantage",)
    return _sections(*names)(config)


def advantage_model_inputs(config: RunConfig, iteration: int) -> dict[str, Output]:
    """The advantage stage's model inputs: with GAE the checkpoint that generated the rollouts (`sampler_output`),
    whose `critic/` gives the values (none while that is the base model: a new critic's values are 0); with the
    KL in the reward the base model (the reference) and, for the adaptive controller, the previous batch (its
    manifest carries the coefficient)."""
    advantage = config.advantage
    inputs: dict[str, Output] = {}
    sampler = sampler_output(config, iteration)
    if ESTIMATORS[advantage.estimator].needs_critic and sampler.iteration != BASE:  # the critic's values
        inputs["policy"] = sampler
    if advantage.use_kl_in_reward:
        inputs["reference"] = Output("checkpoint", BASE)
        if advantage.kl_ctrl == "adaptive" and iteration > 0:
            inputs["previous_batch"] = Output("batch", iteration - 1)
    return inputs

STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in [
        StageSpec(
            "prompts", True, _sections("data"),
            inputs=lambda k, r=0: {},
            outputs=lambda k, r=0: [PROMPTS],
        ),
        StageSpec(
            "base_model", True, _sections("model"),
            inputs=lambda k, r=0: {},
            outputs=lambda k, r=0: [Output("checkpoint", BASE)],
        ),
        StageSpec(
            "evaluate_base", True, _sections("evaluate", "score", *EVALUATE_GENERATE_FIELDS, "seed"),
            inputs=lambda k, r=0: {"prompts": PROMPTS, "policy": Output("checkpoint", BASE)},
            outputs=lambda k, r=0: [Output("eval", BASE)],
        ),
        StageSpec(
            "generate", False, _sections("generate", "seed"),
            inputs=lambda k, r=0: {"prompts": PROMPTS},
            outputs=lambda k, r=0: [Output("rollouts", k, r)],
            per_round=True,
            config_inputs=lambda config, k: {"policy": sampler_output(config, k)},
        ),
        StageSpec(
            "score", False, _sections("score"),
            inputs=lambda k, r=0: {"prompts": PROMPTS, "rollouts": Output("rollouts", k, r)},
            outputs=lambda k, r=0: [Output("scores", k, r)],
            per_round=True,
        ),
        StageSpec(
            "advantage", False, advantage_payload,
            inputs=lambda k, r=0: {"rollouts": Output("rollouts", k), "scores": Output("scores", k)},
            outputs=lambda k, r=0: [Output("batch", k)],
            reads_rounds=("rollouts", "scores"),
            config_inputs=advantage_model_inputs,
        ),
        StageSpec(
            # Train recomputes logprobs at the sampling temperature, and uses the base model as KL reference; a
            # critic trains when the estimator is GAE.
            "train", False, _sections("train", "threads", "generate.temperature", "advantage.estimator"),
            inputs=lambda k, r=0: {
                "batch": Output("batch", k), "rollouts": Output("rollouts", k), "policy": policy_output(k),
                "reference": Output("checkpoint", BASE),
            },
            outputs=lambda k, r=0: [Output("checkpoint", k), Output("train_metrics", k)],
            reads_rounds=("rollouts",),
        ),
        StageSpec(
            "evaluate", False, _sections("evaluate", "score", *EVALUATE_GENERATE_FIELDS, "seed"),
            inputs=lambda k, r=0: {"prompts": PROMPTS, "policy": Output("checkpoint", k)},
            outputs=lambda k, r=0: [Output("eval", k)],
        ),
    ]
}

RUN_STAGES = ["prompts", "base_model", "evaluate_base"]
ITERATION_STAGES = ["generate", "score", "advantage", "train", "evaluate"]


def is_scheduled(config: RunConfig, stage: str, iteration: int) -> bool:
    """Whether `stage` runs in `iteration` at all. Every stage does, except `evaluate`: it judges the
    checkpoint of every `evaluate.every`-th iteration and always the last one's, since on a small machine
    evaluating a checkpoint can cost as much as making it."""
    if stage != "evaluate":
        return True
    return (iteration + 1) % config.evaluate.every == 0 or iteration == config.iterations - 1


def iteration_stages(config: RunConfig, iteration: int) -> list[str]:
    """The stages that run in `iteration`, in order."""
    return [stage for stage in ITERATION_STAGES if is_scheduled(config, stage, iteration)]


class MissingInput(RuntimeError):
    pass


def instance(stage: str, iteration: int = BASE, round_idx: int = 0, shard: Shard | None = None) -> StageInstance:
    """The instance of `stage` in `iteration` and generation round (or one shard of it): run-level stages have BASE,
    whatever asked."""
    if stage not in STAGES:
        raise KeyError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    return StageInstance(stage, BASE if STAGES[stage].run_level else iteration, round_idx, shard)


def outputs_of(target: StageInstance) -> list[Output]:
    """What the instance writes; a shard of it writes its part of each table (`Output.shard`)."""
    outputs = STAGES[target.stage].outputs(target.iteration, target.round_idx)
    return [replace(output, shard=target.shard) for output in outputs] if target.shard else outputs


def shards_of(config: RunConfig, target: StageInstance) -> list[StageInstance]:
    """The shard runs of `target` under pipeline.shards, in order; [] when it is not sharded (one process)."""
    count = config.pipeline.shards_of(target.stage)
    return [target.part(index, count) for index in range(count)] if count > 1 else []


def round_inputs(run: Run, stage: str, iteration: int) -> dict[str, Output]:
    """The extra-round inputs of a stage that reads every round: `<table>@round=RR` for r = 1, 2, ... while
    round r is complete, i.e. both of its per-round stages (`generate` and `score`) are done for the current
    config and policy. A round made by another policy is stale and ends the sequence, so it is never mixed
    in; a round whose score did not finish (a crash between the two) is not an input yet, so the stages
    downstream still run on the rounds before it and the flow's dynamic-sampling loop finishes that round."""
    spec, config = STAGES[stage], run.config
    extra: dict[str, Output] = {}
    if not spec.reads_rounds or config.advantage.target_groups is None:  # rounds are dynamic sampling's only
        return extra
    per_round = [s.name for s in STAGES.values() if s.per_round]
    round_idx, cap = 1, config.advantage.round_cap
    while (cap is None or round_idx < cap) and all(
        stage_state(run, StageInstance(name, iteration, round_idx)).done for name in per_round
    ):
        for table in spec.reads_rounds:
            extra[f"{table}@{round_name(round_idx)}"] = Output(table, iteration, round_idx)
        round_idx += 1
    return extra


def declared_inputs(config: RunConfig, target: StageInstance) -> dict[str, Output]:
    """The inputs an instance always has under `config` (its spec's fixed ones and its config-dependent ones),
    without the extra generation rounds, which depend on what is done (`round_inputs`)."""
    spec = STAGES[target.stage]
    return {**spec.inputs(target.iteration, target.round_idx), **spec.config_inputs(config, target.iteration)}


@dataclass(frozen=True)
class ResolvedInputs:
    """A stage instance's inputs, resolved once: where each lives, its manifest, and the stage key they give."""

    sources: dict[str, Output]
    manifests: dict[str, Manifest]
    key: str


def resolve_inputs(run: Run, target: StageInstance) -> ResolvedInputs:
    """Every input of one stage instance (the fixed ones, then those of the extra generation rounds) with a
    valid, intact manifest, and the key the instance's outputs must carry; raises MissingInput."""
    spec = STAGES[target.stage]
    sources = {**declared_inputs(run.config, target), **round_inputs(run, target.stage, target.iteration)}
    where = f"iteration {target.iteration}" + (f", round {target.round_idx}" if target.round_idx else "")
    manifests: dict[str, Manifest] = {}
    for name, output in sources.items():
        manifest = read_manifest(run.fs, output.manifest_path(run.layout))
        if manifest is None:
            raise MissingInput(
                f"stage {spec.name} ({where}) needs {name} at {output.path(run.layout)}, "
                "which has no valid manifest: run the upstream stage first"
            )
        if (damage := output_damage(run.fs, manifest)) is not None:
            raise MissingInput(
                f"stage {spec.name} ({where}) needs {name} at {output.path(run.layout)}, which is "
                f"damaged: {damage}; rerun stage {manifest.stage} to rebuild it"
            )
        manifests[name] = manifest
    key = stage_key(spec.name, spec.config_payload(run.config), {name: m.sha256 for name, m in manifests.items()})
    return ResolvedInputs(sources, manifests, key)


@dataclass(frozen=True)
class StageState:
    done: bool
    reason: str  # "done" | "missing" | "stale key" | "output changed" | "inputs missing"
    manifests: list[Manifest]


def stage_state(run: Run, target: StageInstance) -> StageState:
    manifests = [read_manifest(run.fs, output.manifest_path(run.layout)) for output in outputs_of(target)]
    present = [m for m in manifests if m is not None]
    if len(present) < len(manifests):
        return StageState(False, "missing", present)
    try:
        key = resolve_inputs(run, target).key
    except MissingInput:
        return StageState(False, "inputs missing", present)
    if any(m.key != key for m in present):
        return StageState(False, "stale key", present)
    if not all(output_intact(run.fs, m) for m in present):
        return StageState(False, "output changed", present)
    return StageState(True, "done", present)


def is_done_now(run: Run, target: StageInstance) -> bool:
    """Whether the instance is done, asked of the storage itself: its outputs are written by other processes
    (other machines), so a listing cached earlier is never trusted."""
    run.fs.invalidate_cache()
    return stage_state(run, target).done


# The two lanes of an overlapped run (flows/runner/overlap.py), one stage at a time each, as on two machines:
# sampling and judging policies, and learning one. RLPIPE_LANE_CPUS pins each lane's stages to its cores.
LANES = {"rollout": ("prompts", "evaluate_base", "generate", "score", "evaluate"),
         "train": ("base_model", "advantage", "train")}


def lane_of(stage: str) -> str:
    return next(lane for lane, stages in LANES.items() if stage in stages)


def producer_of(output: Output) -> StageInstance:
    """The stage instance whose outputs contain `output`."""
    for spec in STAGES.values():
        candidate = instance(spec.name, output.iteration, output.round_idx if spec.per_round else 0)
        if output in outputs_of(candidate):
            return candidate
    raise KeyError(f"no stage writes {output}")


def upstream_instances(config: RunConfig, target: StageInstance) -> set[StageInstance]:
    """The stage instances that write `target`'s declared inputs under `config` (the extra generation rounds,
    decided while the run goes, are not among them)."""
    return {producer_of(output) for output in declared_inputs(config, target).values()}
