"""`generate.engines`: several vLLM engines in a stage, without starting vLLM (the real engines:
tests/generation/test_engines_stage.py).

What is checked: the refusals at config load naming the field (hf backend, a `cuda:N` stage with more than one
GPU's worth, the replaced `vllm_data_parallel_size`), `auto` and the GPU count at stage start, the split by prompt
group against hand-made cases, each engine's devices and cores, and a ReplicatedBackend over engine loops
(`replicas.serve`, the engine process's own loop) run in threads around a recording engine: answers merged in
request order, progress passed on, reload / sleep / wake-up reaching every engine, an engine's error raised once
the others have answered.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from schemas.config import ConfigError, load_config
from stages.generation.base import GenerationRequest, Sample, SamplingSpec, sessions
from stages.generation.replicas import (
    Replica,
    ReplicatedBackend,
    replica_environments,
    resolve_engines,
    serve,
    split_by_group,
)
from stages.generation.server import send_message


@pytest.mark.parametrize(("overrides", "named"), [
    (["generate.backend=hf", "generate.engines=2"], "generate.engines=2 needs the vLLM backend"),
    (["device=cuda:1", "generate.engines=2"], "generate.engines=2 x generate.vllm_tensor_parallel_size=1"),
    (["generate.vllm_data_parallel_size=2"], "generate.vllm_data_parallel_size is now generate.engines"),
    (["generate.engines=0"], "generate.engines"),
])
def test_bad_engine_counts_are_refused_at_load_naming_the_field(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


def test_an_older_config_with_vllm_data_parallel_size_1_still_loads() -> None:
    assert load_config(None, ["generate.vllm_data_parallel_size=1"]).generate.engines == "auto"
    assert load_config(None, ["generate.backend=hf", "generate.engines=1"]).generate.engines == 1


def test_auto_is_gpus_over_tp_on_gpu_and_one_on_cpu() -> None:
    assert resolve_engines("auto", on_gpu=False, tensor_parallel_size=1, visible_gpus=0) == 1
    assert resolve_engines(2, on_gpu=False, tensor_parallel_size=1, visible_gpus=0) == 2
    assert resolve_engines("auto", on_gpu=True, tensor_parallel_size=2, visible_gpus=8) == 4
    assert resolve_engines("auto", on_gpu=True, tensor_parallel_size=4, visible_gpus=6) == 1
    assert resolve_engines(3, on_gpu=True, tensor_parallel_size=2, visible_gpus=6) == 3
    with pytest.raises(ConfigError, match=r"generate\.engines=3 x generate\.vllm_tensor_parallel_size=2 needs 6 GPUs"):
        resolve_engines(3, on_gpu=True, tensor_parallel_size=2, visible_gpus=4)
    # One engine too wide for the GPUs is the platform check's to name (generate.vllm_tensor_parallel_size).
    assert resolve_engines("auto", on_gpu=True, tensor_parallel_size=2, visible_gpus=0) == 1


def requests_of(group_sizes: list[int]) -> list[GenerationRequest]:
    """Group g's requests: prompt [g], seeds numbered through all requests."""
    prompts = [[g] for g, size in enumerate(group_sizes) for _ in range(size)]
    return [GenerationRequest(prompt, seed) for seed, prompt in enumerate(prompts)]


@pytest.mark.parametrize(("group_sizes", "engines", "expected"), [
    ([2, 2, 2, 2], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([3, 1, 1, 3], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # the share ends where 4 of 8 requests are passed
    ([4, 1, 1, 1, 1], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([5, 1], 2, [[0, 1, 2, 3, 4], [5]]),  # a group is never split, even when the shares come out uneven
    ([2], 2, [[0, 1], []]),  # fewer groups than engines: an engine gets nothing
    ([1, 1, 1], 3, [[0], [1], [2]]),
    ([2, 2, 2], 1, [[0, 1, 2, 3, 4, 5]]),
])
def test_requests_are_split_by_prompt_group_in_order(group_sizes: list[int], engines: int,
                                                     expected: list[list[int]]) -> None:
    assert split_by_group(requests_of(group_sizes), engines) == expected


def test_each_gpu_engine_gets_its_slice_of_the_visible_devices() -> None:
    narrowed = replica_environments(2, 2, on_gpu=True, gpus=4, environ={"CUDA_VISIBLE_DEVICES": "3,5,6,7", "X": "1"})
    assert [(env["CUDA_VISIBLE_DEVICES"], env["X"], cores) for env, cores in narrowed] == [
        ("3,5", "1", None), ("6,7", "1", None)]
    every = replica_environments(4, 1, on_gpu=True, gpus=4, environ={})
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in every] == ["0", "1", "2", "3"]


def test_each_cpu_engine_is_pinned_to_its_cores_when_there_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6, 7})
    two = replica_environments(2, 1, on_gpu=False, gpus=0, environ={"VLLM_CPU_OMP_THREADS_BIND": "4-7"})
    assert [(env["VLLM_CPU_OMP_THREADS_BIND"], cores) for env, cores in two] == [("4,5", [4, 5]), ("6,7", [6, 7])]
    tensor_parallel = replica_environments(2, 2, on_gpu=False, gpus=0, environ={})
    assert [env["VLLM_CPU_OMP_THREADS_BIND"] for env, _ in tensor_parallel] == ["4|5", "6|7"]  # one list per rank
    shared = replica_environments(3, 2, on_gpu=False, gpus=0, environ={"A": "b"})
    assert shared == [({"A": "b"}, None)] * 3  # fewer cores than ranks: every engine on every core


class RecordingEngine:
    """A VLLMBackend stand-in for one engine: each sample's token is its request's seed, the engine's number its
    text; records reload, sleep and wake-up; a request with seed -1 fails."""

    gpu_memory_used_mb = None

    def __init__(self, number: int, calls: list[str]) -> None:
        self.number, self.calls = number, calls

    def generate(self, requests: list[GenerationRequest], sampling: SamplingSpec, progress: Any = None
                 ) -> list[Sample]:
        if any(r.seed == -1 for r in requests):
            raise RuntimeError("a broken request")
        self.calls.append(f"{self.number} generate {[r.seed for r in requests]}")
        progress(len(requests), 10 * len(requests))
        return [Sample([r.seed], [-0.5], str(self.number), "stop") for r in requests]

    def reload_weights(self, model_dir: Path) -> None:
        self.calls.append(f"{self.number} reload {model_dir.name}")

    def sleep(self, level: int) -> None:
        self.calls.append(f"{self.number} sleep {level}")

    def wake_up(self) -> None:
        self.calls.append(f"{self.number} wake_up")

    def abort_unfinished(self) -> None:
        self.calls.append(f"{self.number} abort")


class ThreadProcess:
    """Stands in for an engine's Popen: its loop runs in a thread."""

    pid = 0

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def poll(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> int:
        self.thread.join(timeout)
        return 0

    def kill(self) -> None:
        pass


def thread_replica(number: int, calls: list[str]) -> Replica:
    """An engine as replicas.main runs it (say it is ready, then `serve`), in a thread."""
    parent, child = socket.socketpair()

    def engine_loop() -> None:
        with child:
            send_message(child, {"ok": True, "ready": {"engine_settings": {"dtype": "float32"}, "deterministic": True,
                                                       "gpus": 0, "gpu_memory_used_mb": None}})
            serve(child, RecordingEngine(number, calls))

    thread = threading.Thread(target=engine_loop, daemon=True)
    thread.start()
    return Replica(number, parent, ThreadProcess(thread))


@pytest.fixture
def replicated() -> tuple[ReplicatedBackend, list[str]]:
    calls: list[str] = []
    backend = ReplicatedBackend([thread_replica(0, calls), thread_replica(1, calls)])
    yield backend, calls
    backend.close()


def test_answers_come_back_in_request_order_each_group_on_one_engine(replicated) -> None:  # noqa: ANN001
    backend, calls = replicated
    assert backend.engine_settings == {"dtype": "float32", "engines": 2} and backend.deterministic
    assert sessions(backend) is None  # the multi-turn loop then runs one batched generate per turn
    requests = requests_of([1, 3, 2, 2])  # seeds 0..7; 4 of 8 requests end with the second group
    reports: list[tuple[int, int]] = []
    samples = backend.generate(requests, SamplingSpec(), lambda done, tokens: reports.append((done, tokens)))
    assert [s.token_ids for s in samples] == [[seed] for seed in range(8)]
    assert [s.text for s in samples] == ["0"] * 4 + ["1"] * 4
    assert sorted(calls) == ["0 generate [0, 1, 2, 3]", "1 generate [4, 5, 6, 7]"]
    assert sorted(reports) == [(4, 40), (4, 40)]


def test_reload_sleep_and_wake_up_reach_every_engine(replicated) -> None:  # noqa: ANN001
    backend, calls = replicated
    backend.reload_weights(Path("/ckpt/iter0"))
    backend.sleep(1)
    backend.wake_up()
    assert sorted(calls) == ["0 reload iter0", "0 sleep 1", "0 wake_up", "1 reload iter0", "1 sleep 1", "1 wake_up"]


def test_an_engine_error_is_raised_after_the_others_answered_and_the_next_call_works(replicated) -> None:  # noqa: ANN001
    backend, calls = replicated
    broken = [GenerationRequest([0], 5), GenerationRequest([1], -1)]
    with pytest.raises(RuntimeError, match="(?s)vLLM engine 1: .*a broken request"):
        backend.generate(broken, SamplingSpec())
    assert sorted(calls) == ["0 generate [5]", "1 abort"]  # engine 0 answered; read before the error is raised
    samples = backend.generate(requests_of([1, 1]), SamplingSpec())
    assert [(s.token_ids, s.text) for s in samples] == [([0], "0"), ([1], "1")]


def test_gpu_check_fails_a_generating_stage_with_another_engine_count() -> None:
    from benchmarks.gpu_smoke import check_records, expected_engines

    on_cuda = {"device": "cuda:0", "gpu_name": "H100", "peak_gpu_memory_mb": 900.0}
    records = {"generate": {"device": on_cuda, "engine": {"dtype": "bfloat16", "compiled": True, "engines": 2}},
               "train": {"device": on_cuda}}
    assert check_records(records, "cuda", engines=2) == []
    assert check_records(records, "cuda", engines=1) == ["generate: 2 vLLM engine(s), not 1"]
    records["generate"]["engine"].pop("engines")  # one engine's record names no count
    assert check_records(records, "cuda", engines=2) == ["generate: 1 vLLM engine(s), not 2"]
    assert expected_engines("cuda", ["train.lr=1e-5", "generate.engines=2"]) == 2  # what --set asks for
    assert expected_engines("cpu", []) == 1


def test_after_a_broken_off_generate_abort_unfinished_leaves_the_engines_clean(replicated) -> None:  # noqa: ANN001
    backend, calls = replicated

    def client_gone(done: int, tokens: int) -> None:  # the server's progress frame to a client that went away
        raise BrokenPipeError

    with pytest.raises(BrokenPipeError):
        backend.generate(requests_of([1, 1]), SamplingSpec(), client_gone)
    backend.abort_unfinished()  # what the server's EngineHost does then
    samples = backend.generate(requests_of([2, 2]), SamplingSpec())
    assert [(s.token_ids, s.text) for s in samples] == [([0], "0"), ([1], "0"), ([2], "1"), ([3], "1")]
