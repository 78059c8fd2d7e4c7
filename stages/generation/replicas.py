"""Several vLLM engines in one stage (`generate.engines`): data-parallel replicas, each a process of its own.

vLLM's offline `LLM` runs data parallelism only with one process per rank (its offline data-parallel example
starts one `LLM` per process, each with its own devices), so each replica is `python -m stages.generation.replicas`
holding a plain `VLLMBackend` on `vllm_tensor_parallel_size` devices: on GPU its own slice of the stage's
CUDA_VISIBLE_DEVICES, on CPU its own share of the stage's cores (sched_setaffinity and vLLM's
VLLM_CPU_OMP_THREADS_BIND) when there is a core for each TP rank of every engine, else the cores shared. Nothing is
scheduled beyond the split: a call's requests are cut into runs of consecutive requests with the same prompt
(a prompt group: the stages put one prompt's samples together, so a group never crosses engines), the groups
dealt out in order in contiguous shares of about equal requests, and the answers merged back in the request
order. Frames on a socket pair are server.py's (8-byte length, JSON). Weight reloads, sleep and wake-up go to
every replica. Each sample keeps its own seed, so the tokens do not depend on the engine count; on CPU a
replica's batches are smaller, which may move an fp32 logprob by rounding (measured: one sample in 16 by 1.5e-5).
No continuous batching (`session`): the multi-turn loop runs one batched call per turn through `generate`.
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from schemas.config import ConfigError
from stages.generation.base import GenerationRequest, ProgressCallback, Sample, SamplingSpec
from stages.generation.server import (
    decode_requests,
    decode_samples,
    encode_requests,
    encode_samples,
    receive_message,
    send_message,
)
from storage.process import die_with_parent, release_freed_memory

if TYPE_CHECKING:
    from schemas.config import GenerateConfig

T = TypeVar("T")
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def resolve_engines(setting: int | str, on_gpu: bool, tensor_parallel_size: int, visible_gpus: int) -> int:
    """The engine count for `generate.engines`: `auto` is the stage's GPUs / TP on GPU, 1 on CPU. More engines x
    TP than the stage's GPUs is a ConfigError naming the field (stage exit 2); for one engine the platform check
    names the TP instead (vllm_backend.check_platform)."""
    if not on_gpu:
        return 1 if setting == "auto" else int(setting)
    engines = max(1, visible_gpus // tensor_parallel_size) if setting == "auto" else int(setting)
    if engines > 1 and engines * tensor_parallel_size > visible_gpus:
        raise ConfigError(
            f"generate.engines={setting} x generate.vllm_tensor_parallel_size={tensor_parallel_size} needs "
            f"{engines * tensor_parallel_size} GPUs, but this stage sees {visible_gpus} (device: cuda:N narrows it "
            "to one); lower generate.engines or set it to auto"
        )
    return engines


def prompt_groups(requests: list[GenerationRequest]) -> list[range]:
    """Runs of consecutive requests with the same prompt tokens, in order: the prompt groups."""
    groups: list[range] = []
    start = 0
    for i in range(1, len(requests) + 1):
        if i == len(requests) or requests[i].prompt_token_ids != requests[start].prompt_token_ids:
            groups.append(range(start, i))
            start = i
    return groups


def split_by_group(requests: list[GenerationRequest], engines: int) -> list[list[int]]:
    """Request indices per engine: whole groups, in order, each engine's share ending where the running count of
    requests passes its fair part (k/engines of them); an engine may get none when groups are few."""
    shares: list[list[int]] = [[] for _ in range(engines)]
    engine, total = 0, len(requests)
    for group in prompt_groups(requests):
        shares[engine].extend(group)
        while engine < engines - 1 and group.stop * engines >= (engine + 1) * total:
            engine += 1
    return shares


def device_slices(visible: list[T], engines: int, per_engine: int) -> list[list[T]]:
    """Each engine's devices: consecutive slices of `per_engine` of the `visible` ones (GPU ids, or cores)."""
    return [visible[i * per_engine:(i + 1) * per_engine] for i in range(engines)]


def core_binding(cores: list[int], tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine on `cores`: one list per TP rank, `|` between ranks."""
    per_rank = len(cores) // tensor_parallel_size
    return "|".join(",".join(str(c) for c in cores[r * per_rank:(r + 1) * per_rank])
                    for r in range(tensor_parallel_size))


def replica_environments(engines: int, tensor_parallel_size: int, on_gpu: bool, gpus: int,
                         environ: dict[str, str]) -> list[tuple[dict[str, str], list[int] | None]]:
    """(environment, cores to pin to or None) per engine. GPU: its slice of the visible devices. CPU: its share of
    this process's cores and a thread binding to them, when there is at least one core per TP rank of every
    engine; else every engine on every core, as one engine would be."""
    if on_gpu:
        current = environ.get(VISIBLE_DEVICES, "").strip()
        visible = [d.strip() for d in current.split(",")] if current else [str(i) for i in range(gpus)]
        return [({**environ, VISIBLE_DEVICES: ",".join(devices)}, None)
                for devices in device_slices(visible, engines, tensor_parallel_size)]
    cores = sorted(os.sched_getaffinity(0))
    per_engine = len(cores) // engines
    if per_engine < tensor_parallel_size:
        return [(dict(environ), None) for _ in range(engines)]
    return [({**environ, THREADS_BIND: core_binding(share, tensor_parallel_size)}, share)
            for share in device_slices(cores, engines, per_engine)]


class Replica:
    """One engine process (a Popen) and the parent's end of its socket pair."""

    def __init__(self, index: int, connection: socket.socket, process: Any) -> None:  # noqa: ANN401 - a Popen
        self.index, self.connection, self.process = index, connection, process
        self.settings: dict[str, Any] = {}

    @classmethod
    def start(cls, index: int, command: list[str], env: dict[str, str]) -> Replica:
        connection, child = socket.socketpair()
        with child:
            process = subprocess.Popen([*command, "--fd", str(child.fileno())], pass_fds=(child.fileno(),), env=env,
                                       stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(os.getpid()))
        return cls(index, connection, process)

    def send(self, message: dict[str, Any]) -> None:
        send_message(self.connection, message)

    def receive(self) -> dict[str, Any]:
        message = receive_message(self.connection)
        if message is None:
            raise RuntimeError(f"vLLM engine {self.index} (pid {self.process.pid}) ended: exit code "
                               f"{self.process.wait()} (its output is in the stage's log)")
        if not message.get("ok", True):
            raise RuntimeError(f"vLLM engine {self.index}: {message['error']}")
        return message

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.receive()

    def stop(self) -> None:
        try:
            self.send({"op": "shutdown"})
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            self.connection.close()


def answers(replicas: list[Replica]) -> selectors.DefaultSelector:
    selector = selectors.DefaultSelector()
    for replica in replicas:
        selector.register(replica.connection, selectors.EVENT_READ, replica)
    return selector


class ReplicatedBackend:
    """`engines` vLLM engines behind the `Backend` interface (see the module docstring); what the server's
    EngineHost calls on one engine (reload_weights, sleep, wake_up, abort_unfinished) reaches them all."""

    name = "vllm"

    def __init__(self, replicas: list[Replica]) -> None:
        """Wait for every started engine to say it is ready (they start together), closing all if one fails."""
        started = time.monotonic()
        self.replicas = replicas
        self.busy: dict[Replica, list[int]] = {}  # the request indices each engine is generating
        try:
            for replica in self.replicas:
                replica.settings = replica.receive()["ready"]
        except BaseException:
            self.close()
            raise
        first = self.replicas[0].settings
        self.engine_settings: dict[str, object] = {**first["engine_settings"], "engines": len(replicas)}
        if first.get("cores") is not None:  # on CPU: the cores each engine may use
            self.engine_settings["engine_cores"] = [r.settings["cores"] for r in self.replicas]
        self.deterministic = all(r.settings["deterministic"] for r in self.replicas)
        self.gpus = sum(int(r.settings["gpus"]) for r in self.replicas)
        self.gpu_memory_used_mb: float | None = None
        self.engine_start_seconds = time.monotonic() - started

    @classmethod
    def start(cls, model_dir: Path, cfg: GenerateConfig, engines: int, on_gpu: bool, gpus: int,
              sleep_mode: bool = False) -> ReplicatedBackend:
        """Start `engines` engine processes on `model_dir`, each on its devices (`replica_environments`)."""
        command = [sys.executable, "-m", "stages.generation.replicas", "--model-dir", str(model_dir),
                   "--generate-config", cfg.model_dump_json(), "--device", "cuda" if on_gpu else "cpu"]
        command += ["--sleep-mode"] if sleep_mode else []
        replicas: list[Replica] = []
        try:
            for index, (env, cores) in enumerate(replica_environments(
                    engines, cfg.vllm_tensor_parallel_size, on_gpu, gpus, dict(os.environ))):
                replicas.append(Replica.start(index, command + (["--cores", ",".join(map(str, cores))] if cores
                                                                else []), env))
        except BaseException:
            for replica in replicas:
                replica.stop()
            raise
        return cls(replicas)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingSpec,
                 progress: ProgressCallback | None = None) -> list[Sample]:
        shares = split_by_group(requests, len(self.replicas))
        for replica, share in zip(self.replicas, shares, strict=True):
            if share:
                replica.send({"op": "generate", "requests": encode_requests([requests[i] for i in share]),
                              "sampling": asdict(sampling)})
                self.busy[replica] = share
        merged: dict[int, Sample] = {}
        for share, message in self._answers(progress):
            merged.update(zip(share, decode_samples(message["samples"]), strict=True))
        memory = [r.settings["gpu_memory_used_mb"] for r in self.replicas if r.settings["gpu_memory_used_mb"]]
        self.gpu_memory_used_mb = sum(memory) if memory else None
        return [merged[i] for i in range(len(requests))]

    def _answers(self, progress: ProgressCallback | None) -> list[tuple[list[int], dict[str, Any]]]:
        """Every busy engine's (share, answer), passing their progress frames on as they come; an engine leaves
        `busy` as it answers. An engine's error is raised once the others have answered, so no answer is left
        behind for the next call to misread."""
        done: list[tuple[list[int], dict[str, Any]]] = []
        errors: list[BaseException] = []
        with answers(list(self.busy)) as selector:
            while self.busy:
                for key, _ in selector.select():
                    replica: Replica = key.data
                    try:
                        message = replica.receive()
                    except RuntimeError as error:
                        errors.append(error)
                        message = None
                    if message is not None and "progress" in message:
                        if progress is not None:
                            progress(*message["progress"])
                        continue
                    share = self.busy.pop(replica)
                    selector.unregister(replica.connection)
                    if message is not None:
                        replica.settings["gpu_memory_used_mb"] = message["gpu_memory_used_mb"]
                        done.append((share, message))
        if errors:
            raise errors[0]
        return done

    def broadcast(self, message: dict[str, Any]) -> None:
        for replica in self.replicas:
            replica.send(message)
        for replica in self.replicas:
            replica.receive()

    def reload_weights(self, model_dir: Path) -> None:
        self.broadcast({"op": "reload", "model_dir": str(model_dir)})

    def sleep(self, level: int) -> None:
        self.broadcast({"op": "sleep", "level": level})

    def wake_up(self) -> None:
        self.broadcast({"op": "wake_up"})

    def abort_unfinished(self) -> None:
        """After a broken-off generate: wait out the engines still generating and drop their answers (each
        engine finishes its share; the next call then finds them idle)."""
        self.busy = {replica: share for replica, share in self.busy.items() if replica.process.poll() is None}
        if self.busy:
            self._answers(None)

    def close(self) -> None:
        for replica in self.replicas:
            replica.stop()
        self.replicas = []


def serve(connection: socket.socket, backend: Any) -> None:  # noqa: ANN401 - a VLLMBackend
    """The engine process's loop: one request at a time from the parent until `shutdown` or its end."""
    while True:
        message = receive_message(connection)
        if message is None or message["op"] == "shutdown":
            return
        op = message["op"]
        try:
            if op == "generate":
                samples = backend.generate(
                    decode_requests(message["requests"]), SamplingSpec(**message["sampling"]),
                    lambda done, tokens: send_message(connection, {"progress": [done, tokens]}))
                answer: dict[str, Any] = {"samples": encode_samples(samples),
                                          "gpu_memory_used_mb": backend.gpu_memory_used_mb}
                release_freed_memory()  # a long-lived engine: what the request freed goes back to the OS
            elif op == "reload":
                backend.reload_weights(Path(message["model_dir"]))
                answer = {}
            elif op == "sleep":
                backend.sleep(int(message["level"]))
                answer = {}
            elif op == "wake_up":
                backend.wake_up()
                answer = {}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:  # noqa: BLE001 - the parent raises it; this engine stays up for the next request
            backend.abort_unfinished()
            send_message(connection, {"ok": False, "error": traceback.format_exc(limit=8)})
            continue
        send_message(connection, {"ok": True, **answer})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one vLLM engine of a stage's generate.engines")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the socket pair")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--generate-config", required=True, help="the generate section as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--sleep-mode", action="store_true")
    parser.add_argument("--cores", help="the cores this engine is pinned to, e.g. 0,1")
    args = parser.parse_args(argv)
    if args.cores:  # before vLLM and torch start their threads
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    connection = socket.socket(fileno=args.fd)
    backend = None
    try:
        from schemas.config import GenerateConfig
        from stages.generation import vllm_engine

        cfg = GenerateConfig.model_validate_json(args.generate_config)
        backend = vllm_engine(Path(args.model_dir), cfg, "cpu" if args.device == "cpu" else "cuda:0",
                              args.sleep_mode)
        send_message(connection, {"ok": True, "ready": {
            "engine_settings": backend.engine_settings, "deterministic": backend.deterministic,
            "gpus": backend.gpus, "gpu_memory_used_mb": backend.gpu_memory_used_mb,
            "cores": None if args.device == "cuda" else sorted(os.sched_getaffinity(0))}})
        serve(connection, backend)
    except Exception:  # noqa: BLE001 - told to the parent, which raises it
        send_message(connection, {"ok": False, "error": traceback.format_exc(limit=8)})
        return 1
    finally:
        if backend is not None:
            backend.close()
        connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
