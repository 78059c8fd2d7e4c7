"""The generation server's parts that need no vLLM engine (stages/generation/server.py, client.py).

- the wire format over a real socket pair: exact floats, messages larger than one read, a cut-off message;
- `EngineHost`, the server's engine logic, on real checkpoint directories with a stand-in engine that records
  the calls it gets (vLLM's sleep mode needs a GPU this machine lacks, so its call sequence is what can be
  tested here): the engine starts at the first load, the same checkpoint is not reloaded, another one is
  swapped in with `reload_weights`, a checkpoint whose hash is not the expected one or whose tokenizer differs
  is refused, and with sleep mode the engine sleeps after every request and wakes before the next;
- the hash the server confirms is the checkpoint content hash as storage/checkpoints.py documents it
  (recomputed here from the files);
- a client refuses a server that confirms another checkpoint (a lying server: a fault that cannot be caused
  with the real one, so a socket answering with the protocol stands in);
- the memory rule of `auto` on CPU, on hand-computed figures;
- a real server process (no engine yet): found by ping, a SIGKILLed one is replaced, `stop_server` and the idle
  timeout end it, and the flow's address for a run is the stage's; it follows the run's driver through the run
  lease (a released lease leaves it up, a new driver is followed) and ends soon after that driver is killed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from schemas.config import GenerateConfig, RunConfig
from stages.generation.base import GenerationRequest, Sample, SamplingSpec
from stages.generation.client import (
    GIB,
    ServerAddress,
    UntrustedServer,
    WarmEngine,
    available_memory_bytes,
    memory_refusal,
    ping,
    server_address,
    start_server,
    stop_server,
)
from stages.generation.server import (
    RUN_LEASE_POLL_S,
    EngineHost,
    RequestRefused,
    ServerGone,
    encode_requests,
    handle,
    receive_message,
    send_message,
)
from storage.layout import RunLayout
from tests.support.processes import start_run_driver

# ---------------------------------------------------------------------------------------------------------
# Wire format


def test_messages_cross_a_socket_exactly_also_when_larger_than_one_read() -> None:
    left, right = socket.socketpair()
    logprobs = [-0.1, -1e-300, -math.inf, -2.0 / 3.0, -123.456789012345678]
    big = {"samples": [[list(range(3000)), logprobs, "é\u2028 text", "stop"]] * 200}  # ~3 MB of JSON
    sender = threading.Thread(target=lambda: (send_message(left, {"op": "ping"}), send_message(left, big)))
    sender.start()
    assert receive_message(right) == {"op": "ping"}
    received = receive_message(right)
    sender.join()
    assert received == big
    assert [float.hex(x) for x in received["samples"][0][1]] == [float.hex(x) for x in logprobs]  # bit-exact
    left.close()
    assert receive_message(right) is None  # closed between messages


def test_a_message_cut_off_is_an_error_not_a_short_message() -> None:
    left, right = socket.socketpair()
    left.sendall((100).to_bytes(8, "big") + b'{"op": ')
    left.close()
    with pytest.raises(ServerGone):
        receive_message(right)


# ---------------------------------------------------------------------------------------------------------
# EngineHost with a recording stand-in engine


def write_checkpoint(directory: Path, weights: bytes, tokenizer: str = "{}", transformers_version: str = "5.0") -> Path:
    directory.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "transformers_version": transformers_version,
              "use_cache": True}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (directory / "tokenizer.json").write_text(tokenizer)
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "optimizer.pt").write_bytes(b"not part of the policy")
    return directory


def documented_hash(directory: Path) -> str:
    """storage/checkpoints.py's content hash, from its docstring: sha256 of the sorted (path, file sha256) lines of
    the weights, config and tokenizer files (optimizer state left out)."""
    policy = ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors")
    lines = "".join(f"{name}\t{hashlib.sha256((directory / name).read_bytes()).hexdigest()}\n"
                    for name in sorted(policy))
    return hashlib.sha256(lines.encode()).hexdigest()


class RecordingEngine:
    """Stands in for a VLLMBackend: records start, reload, sleep and wake-up calls."""

    engine_settings = {"dtype": "float32"}
    deterministic = True
    gpus = 0
    gpu_memory_used_mb = None

    def __init__(self, model_dir: Path, calls: list[str]) -> None:
        self.calls = calls
        calls.append(f"start {model_dir.name}")

    def reload_weights(self, model_dir: Path) -> None:
        self.calls += [f"reload_weights {model_dir.name}", "reset_prefix_cache"]

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep level={level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def generate(self, requests: list[GenerationRequest], sampling: SamplingSpec, progress: Any = None
                 ) -> list[Sample]:
        self.calls.append(f"generate {len(requests)}")
        for i, _ in enumerate(requests):  # as vLLM's step loop: a report as each request finishes, i + 1 tokens
            if progress is not None:
                progress(1, i + 1)
        return [Sample([1], [-0.5], "x", "stop") for _ in requests]

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def checkpoints(tmp_path: Path) -> dict[str, Path]:
    return {
        "base": write_checkpoint(tmp_path / "base", b"weights-0"),
        "iter0": write_checkpoint(tmp_path / "iter0", b"weights-1", transformers_version="5.1"),
        "other_tokenizer": write_checkpoint(tmp_path / "other_tokenizer", b"weights-2", tokenizer='{"v": 2}'),
    }


def host_with(calls: list[str], sleep_mode: bool) -> EngineHost:
    return EngineHost(lambda model_dir: RecordingEngine(model_dir, calls), sleep_mode=sleep_mode)


def serve_request(host: EngineHost, model_dir: Path, expected: str) -> None:
    """What the server does for one generate request: load, generate, then idle until the next."""
    host.load(model_dir, expected)
    host.generate([GenerationRequest([1, 2], 0)], SamplingSpec(), None)
    host.idle()


def test_the_server_streams_a_progress_frame_per_report_before_its_answer(checkpoints: dict[str, Path]) -> None:
    """A warm-engine generate: each progress report of the engine reaches the stage as its own frame, in order, while
    the request runs (before the answer), so the stage's bar advances per finished request as in-process."""
    from dataclasses import asdict

    host = host_with([], sleep_mode=False)
    base = checkpoints["base"]
    message = {"op": "generate", "model_dir": str(base), "checkpoint_sha256": documented_hash(base),
               "requests": encode_requests([GenerationRequest([1, 2], seed) for seed in range(3)]),
               "sampling": asdict(SamplingSpec())}
    server_end, stage_end = socket.socketpair()
    with server_end, stage_end:
        serving = threading.Thread(target=handle, args=(server_end, message, host))
        serving.start()
        frames = []
        while "ok" not in (frame := receive_message(stage_end)):
            frames.append(frame)
        serving.join()
    assert frames == [{"progress": [1, 1]}, {"progress": [1, 2]}, {"progress": [1, 3]}]
    assert frame["ok"] and len(frame["samples"]) == 3


def test_engine_starts_once_then_swaps_weights_in_place(checkpoints: dict[str, Path]) -> None:
    calls: list[str] = []
    host = host_with(calls, sleep_mode=False)
    base, iter0 = checkpoints["base"], checkpoints["iter0"]
    first = host.load(base, documented_hash(base))
    assert (first.engine_started, first.reloaded, first.checkpoint_sha256) == (True, False, documented_hash(base))
    again = host.load(base, documented_hash(base))
    assert (again.engine_started, again.reloaded) == (False, False)
    swapped = host.load(iter0, documented_hash(iter0))  # config differs only in transformers_version
    assert (swapped.engine_started, swapped.reloaded) == (False, True)
    assert swapped.checkpoint_sha256 == documented_hash(iter0)
    assert host.describe()["loaded_sha256"] == documented_hash(iter0)
    assert calls == ["start base", "reload_weights iter0", "reset_prefix_cache"]


def test_a_checkpoint_that_is_not_the_expected_one_is_refused_and_nothing_loaded(
    checkpoints: dict[str, Path]
) -> None:
    calls: list[str] = []
    host = host_with(calls, sleep_mode=False)
    base, iter0 = checkpoints["base"], checkpoints["iter0"]
    with pytest.raises(RequestRefused) as refused:
        host.load(base, documented_hash(iter0))
    assert refused.value.kind == "hash_mismatch" and calls == []
    host.load(base, documented_hash(base))
    with pytest.raises(RequestRefused) as refused:
        host.load(iter0, documented_hash(base))
    assert refused.value.kind == "hash_mismatch"
    assert calls == ["start base"] and host.describe()["loaded_sha256"] == documented_hash(base)


def test_a_checkpoint_with_another_tokenizer_cannot_be_swapped_in(checkpoints: dict[str, Path]) -> None:
    calls: list[str] = []
    host = host_with(calls, sleep_mode=False)
    host.load(checkpoints["base"], documented_hash(checkpoints["base"]))
    other = checkpoints["other_tokenizer"]
    with pytest.raises(RequestRefused, match="tokenizer.json") as refused:
        host.load(other, documented_hash(other))
    assert refused.value.kind == "incompatible" and calls == ["start base"]


def test_sleep_mode_sleeps_after_every_request_and_wakes_before_the_next(checkpoints: dict[str, Path]) -> None:
    calls: list[str] = []
    host = host_with(calls, sleep_mode=True)
    base, iter0 = checkpoints["base"], checkpoints["iter0"]
    serve_request(host, base, documented_hash(base))  # e.g. evaluate_base
    serve_request(host, base, documented_hash(base))  # generate 0 (same checkpoint: no reload)
    serve_request(host, iter0, documented_hash(iter0))  # evaluate 0, after train 0 ran while the engine slept
    assert calls == [
        "start base", "generate 1", "sleep level=1",
        "wake_up", "generate 1", "sleep level=1",
        "wake_up", "reload_weights iter0", "reset_prefix_cache", "generate 1", "sleep level=1",
    ]
    host.idle()  # already asleep: no second sleep
    assert calls[-1] == "sleep level=1" and calls.count("sleep level=1") == 3


def test_without_sleep_mode_the_engine_never_sleeps(checkpoints: dict[str, Path]) -> None:
    calls: list[str] = []
    host = host_with(calls, sleep_mode=False)
    base = checkpoints["base"]
    serve_request(host, base, documented_hash(base))
    serve_request(host, base, documented_hash(base))
    assert calls == ["start base", "generate 1", "generate 1"]


# ---------------------------------------------------------------------------------------------------------
# The client's trust check, against a server that confirms another checkpoint


def lying_server(path: Path, confirmed: str) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            receive_message(connection)
            send_message(connection, {"ok": True, "load": {
                "checkpoint_sha256": confirmed, "engine_started": False, "reloaded": False, "hash_seconds": 0.0,
                "engine_start_seconds": 0.0, "reload_seconds": 0.0, "engine_start_cpu_seconds": 0.0,
            }, "server": {"pid": 1, "engine_id": "e", "loaded_sha256": confirmed, "sleep_mode": False}})

    thread = threading.Thread(target=answer_once)
    thread.start()
    return thread


def test_a_server_that_confirms_another_checkpoint_is_not_trusted(tmp_path: Path) -> None:
    address = ServerAddress("liar", tmp_path)
    thread = lying_server(address.socket_path, confirmed="b" * 64)
    with pytest.raises(UntrustedServer, match="not the stage's checkpoint"):
        WarmEngine(address, GenerateConfig(), "cpu", tmp_path, checkpoint_sha256="a" * 64)
    thread.join()


# ---------------------------------------------------------------------------------------------------------
# Memory rule of `auto` on CPU


MEMINFO = "MemTotal:       24684084 kB\nMemFree:        16714952 kB\nMemAvailable:   10485760 kB\n"  # 10 GiB


def test_available_memory_is_meminfo_or_the_cgroup_headroom_when_smaller() -> None:
    assert available_memory_bytes(MEMINFO, None, None) == 10 * GIB
    assert available_memory_bytes(MEMINFO, 12 * GIB, 5 * GIB) == 7 * GIB
    assert available_memory_bytes(MEMINFO, 64 * GIB, 1 * GIB) == 10 * GIB


def test_memory_allows_a_warm_engine_only_with_the_reserve_left() -> None:
    assert memory_refusal(10 * GIB, 4 * GIB, min_free_gib=6.0) is None  # 6 GiB left: exactly enough
    refusal = memory_refusal(10 * GIB, 4 * GIB, min_free_gib=6.5)
    assert refusal is not None
    assert "10.0 GiB available" in refusal and "~4.0 GiB" in refusal and "6.0 < " in refusal
    assert "warm_engine_min_free_gib=6.5" in refusal


# ---------------------------------------------------------------------------------------------------------
# A real server process (no engine: none of these requests loads a model)


def test_one_address_per_run_and_engine_whatever_the_warm_engine_fields() -> None:
    cfg = GenerateConfig()
    a = server_address("/root/runs/a", cfg, "auto")
    assert server_address("/root/runs/a", GenerateConfig(warm_engine="on", warm_engine_idle_s=5), "auto") == a
    assert server_address("/root/runs/b", cfg, "auto").key != a.key
    assert server_address("/root/runs/a", GenerateConfig(vllm_kv_cache_gib=3), "auto").key != a.key
    assert server_address("/root/runs/a", cfg, "cpu").key != a.key


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
            os.kill(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running after {timeout_s} s")


@pytest.mark.slow
def test_a_killed_server_is_replaced_and_stop_ends_it(tmp_path: Path) -> None:
    run = RunConfig(run_id="engine-lifecycle", device="cpu")
    address = server_address(str(tmp_path / "runs" / run.run_id), run.generate, run.device)
    assert ping(address) is None
    first = start_server(address, run.generate, "cpu", idle_timeout_s=None)
    assert first is not None
    assert start_server(address, run.generate, "cpu", idle_timeout_s=None) is None  # one listens: not another
    described = ping(address)  # waits for the server's imports
    assert described is not None and described["pid"] == first.pid and described["engine_id"] is None
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert address.socket_path.exists() and ping(address) is None  # a dead server's socket: nobody answers
    second = start_server(address, run.generate, "cpu", idle_timeout_s=None)
    assert second is not None and ping(address)["pid"] == second.pid != first.pid

    from flows.runner.generation_server import stop_run_server
    from storage.run import Run

    layout = RunLayout.create(str(tmp_path), run.run_id)
    assert stop_run_server(Run(layout, run)) is True  # the flow finds the stage's server by the same address
    second.wait(timeout=30)
    assert not address.socket_path.exists() and ping(address) is None
    assert stop_server(address) is False
    assert "ends: shutdown" in address.log_path.read_text()


@pytest.mark.slow
def test_an_idle_server_ends_by_itself(tmp_path: Path) -> None:
    cfg = GenerateConfig()
    address = server_address(str(tmp_path / "runs" / "idle"), cfg, "cpu")
    process = start_server(address, cfg, "cpu", idle_timeout_s=2.0)
    assert process is not None and ping(address)["pid"] == process.pid
    assert process.wait(timeout=60) == 0
    assert ping(address) is None and "ends: idle" in address.log_path.read_text()


@pytest.mark.slow
def test_a_server_follows_its_run_driver_and_ends_soon_after_it_is_killed(tmp_path: Path) -> None:
    """The server is given the run lease (as a stage gives it). Its first driver releases the lease as a run
    that ends does: the server stays (the idle timeout is in charge then); a second driver (a resumed run) takes
    the lease and the server, still up after two reads of it, serves it; SIGKILL of that driver, as of a flow
    process, ends the server within 60 s (the issue's bound; one read of the lease, RUN_LEASE_POLL_S, here)."""
    cfg = GenerateConfig()
    layout = RunLayout.create(str(tmp_path), "r")
    first = start_run_driver(str(tmp_path), "r")
    address = server_address(layout.run_dir, cfg, "cpu")
    server = start_server(address, cfg, "cpu", idle_timeout_s=None, run_lock=layout.lock_path())
    assert server is not None
    try:
        pid = ping(address)["pid"]  # waits for the server's imports; it read the lease (held) as it began serving
        assert first.communicate("release\n", timeout=30)[0].strip() == "released" and first.returncode == 0
        time.sleep(RUN_LEASE_POLL_S + 2)
        second = start_run_driver(str(tmp_path), "r")
        time.sleep(RUN_LEASE_POLL_S + 2)
        assert ping(address)["pid"] == pid == server.pid
        second.kill()
        second.wait()
        killed = time.monotonic()
        assert server.wait(timeout=60) == 0
        print(f"the server ended {time.monotonic() - killed:.1f} s after its run's driver was killed")
        assert "ends: run gone" in address.log_path.read_text()
    finally:
        server.kill()
        server.wait()


def test_warm_engine_reads_a_bare_yaml_on_and_off() -> None:
    from schemas.config import load_config

    assert [load_config(None, [f"generate.warm_engine={v}"]).generate.warm_engine for v in ("on", "off", "auto")] == [
        "on", "off", "auto"]
