"""What each stage reads, writes and depends on: the wiring of the pipeline in one table.

This module imports nothing heavy (no torch, no Prefect) because both the flow process (to decide what is
done) and every stage process (to stamp its manifest) compute stage keys from it.

Run-level stages run once per run; iteration stages run once per iteration k:

    prompts        data section          -> prompts.parquet
    base_model     model section         -> checkpoints/base (a manifest pointing at the base model dir)
    evaluate_base  prompts, base_model   -> base/eval.parquet
    generate  k    prompts, policy k-1   -> iter=k/rollouts.parquet     (policy -1 is the base model)
    score     k    prompts, rollouts k   -> iter=k/scores.parquet
    advantage k    rollouts k, scores k  -> iter=k/batch.parquet
    train     k    batch k, rollouts k, policy k-1, base_model (KL reference)
                                         -> checkpoints/iter=k + iter=k/train_metrics.parquet
    evaluate  k    prompts, checkpoint k -> iter=k/eval.parquet
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from schemas.config import RunConfig
from storage.layout import BASE, RunLayout, manifest_path_for
from storage.manifest import Manifest, config_hash, output_damage, output_intact, read_manifest, stage_key


@dataclass(frozen=True)
class Output:
    """One thing a stage writes: a table (by schema name) or a checkpoint directory."""

    name: str  # table name, or "checkpoint"
    iteration: int  # where it lives (BASE for run-level)

    @property
    def kind(self) -> str:
        return "checkpoint" if self.name == "checkpoint" else "table"

    def path(self, layout: RunLayout) -> str:
        if self.kind == "checkpoint":
            return layout.checkpoint_dir(self.iteration)
        return layout.table_path(self.name, self.iteration)

    def manifest_path(self, layout: RunLayout) -> str:
        return manifest_path_for(self.path(layout), self.kind)


def policy_output(iteration: int) -> Output:
    """The checkpoint that iteration `iteration` generates with: the previous iteration's, or the base."""
    return Output("checkpoint", iteration - 1 if iteration > 0 else BASE)


@dataclass(frozen=True)
class StageSpec:
    name: str
    run_level: bool
    config_payload: Callable[[RunConfig], dict[str, Any]]
    inputs: Callable[[int], dict[str, Output]]
    outputs: Callable[[int], list[Output]]


def _sections(*names: str) -> Callable[[RunConfig], dict[str, Any]]:
    def payload(config: RunConfig) -> dict[str, Any]:
        dumped = config.model_dump(mode="json")
        values: dict[str, Any] = {}
        for name in names:
            section, _, field = name.partition(".")
            values[name] = dumped[section][field] if field else dumped[section]
        return values

    return payload


PROMPTS = Output("prompts", BASE)

STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in [
        StageSpec(
            "prompts", True, _sections("data"),
            inputs=lambda k: {},
            outputs=lambda k: [PROMPTS],
        ),
        StageSpec(
            "base_model", True, _sections("model"),
            inputs=lambda k: {},
            outputs=lambda k: [Output("checkpoint", BASE)],
        ),
        StageSpec(
            "evaluate_base", True, _sections("evaluate", "score", "generate.backend", "seed"),
            inputs=lambda k: {"prompts": PROMPTS, "policy": Output("checkpoint", BASE)},
            outputs=lambda k: [Output("eval", BASE)],
        ),
        StageSpec(
            "generate", False, _sections("generate", "seed"),
            inputs=lambda k: {"prompts": PROMPTS, "policy": policy_output(k)},
            outputs=lambda k: [Output("rollouts", k)],
        ),
        StageSpec(
            "score", False, _sections("score"),
            inputs=lambda k: {"prompts": PROMPTS, "rollouts": Output("rollouts", k)},
            outputs=lambda k: [Output("scores", k)],
        ),
        StageSpec(
            "advantage", False, _sections("advantage"),
            inputs=lambda k: {"rollouts": Output("rollouts", k), "scores": Output("scores", k)},
            outputs=lambda k: [Output("batch", k)],
        ),
        StageSpec(
            # Train recomputes logprobs at the sampling temperature, and uses the base model as KL reference.
            "train", False, _sections("train", "threads", "generate.temperature"),
            inputs=lambda k: {
                "batch": Output("batch", k), "rollouts": Output("rollouts", k), "policy": policy_output(k),
                "reference": Output("checkpoint", BASE),
            },
            outputs=lambda k: [Output("checkpoint", k), Output("train_metrics", k)],
        ),
        StageSpec(
            "evaluate", False, _sections("evaluate", "score", "generate.backend", "seed"),
            inputs=lambda k: {"prompts": PROMPTS, "policy": Output("checkpoint", k)},
            outputs=lambda k: [Output("eval", k)],
        ),
    ]
}

RUN_STAGES = ["prompts", "base_model", "evaluate_base"]
ITERATION_STAGES = ["generate", "score", "advantage", "train", "evaluate"]


class MissingInput(RuntimeError):
    pass


def input_manifests(
    fs: fsspec.AbstractFileSystem, layout: RunLayout, spec: StageSpec, iteration: int
) -> dict[str, Manifest]:
    manifests: dict[str, Manifest] = {}
    for name, output in spec.inputs(iteration).items():
        manifest = read_manifest(fs, output.manifest_path(layout))
        if manifest is None:
            raise MissingInput(
                f"stage {spec.name} (iteration {iteration}) needs {name} at {output.path(layout)}, "
                "which has no valid manifest: run the upstream stage first"
            )
        if (damage := output_damage(fs, manifest)) is not None:
            raise MissingInput(
                f"stage {spec.name} (iteration {iteration}) needs {name} at {output.path(layout)}, which is "
                f"damaged: {damage}; rerun stage {manifest.stage} to rebuild it"
            )
        manifests[name] = manifest
    return manifests


def expected_key(
    fs: fsspec.AbstractFileSystem, layout: RunLayout, config: RunConfig, spec: StageSpec, iteration: int
) -> tuple[str, dict[str, str]]:
    """The key the stage's outputs must carry, and its input hashes; raises MissingInput."""
    input_hashes = {name: m.sha256 for name, m in input_manifests(fs, layout, spec, iteration).items()}
    return stage_key(spec.name, spec.config_payload(config), input_hashes), input_hashes


def stage_config_hash(config: RunConfig, spec: StageSpec) -> str:
    return config_hash(spec.config_payload(config))


@dataclass(frozen=True)
class StageState:
    done: bool
    reason: str  # "done" | "missing" | "stale key" | "output changed" | "inputs missing"
    manifests: list[Manifest]


def stage_state(
    fs: fsspec.AbstractFileSystem, layout: RunLayout, config: RunConfig, spec: StageSpec, iteration: int
) -> StageState:
    manifests = [read_manifest(fs, output.manifest_path(layout)) for output in spec.outputs(iteration)]
    present = [m for m in manifests if m is not None]
    if len(present) < len(manifests):
        return StageState(False, "missing", present)
    try:
        key, _ = expected_key(fs, layout, config, spec, iteration)
    except MissingInput:
        return StageState(False, "inputs missing", present)
    if any(m.key != key for m in present):
        return StageState(False, "stale key", present)
    if not all(output_intact(fs, m) for m in present):
        return StageState(False, "output changed", present)
    return StageState(True, "done", present)


def is_done_now(layout: RunLayout, config: RunConfig, stage: str, iteration: int) -> bool:
    """Whether `stage` is done, asked of the storage itself: its outputs are written by other processes (other
    machines), so a listing cached earlier is never trusted."""
    layout.fs.invalidate_cache()
    return stage_state(layout.fs, layout, config, STAGES[stage], iteration).done
