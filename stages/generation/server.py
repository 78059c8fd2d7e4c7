"""The generation server: one process per run and machine that keeps a vLLM engine warm across stages.

`python -m stages.generation.server` listens on a Unix socket (a directory of this uid's, mode 0700) that the
client (client.py) bound and passed in, so requests queue while vLLM imports. Requests are served one at a time
(one engine, or `generate.engines` of them behind one backend: replicas.py): `ping`, `load` (checkpoint k: the
engine starts at the first load, later loads swap weights in place with vLLM's `reload_weights`), `generate`
(loads first, then the same `generate` the in-process backend runs, streaming progress), `session` (continuous
batching for the multi-turn loop, one engine only: the in-process backend's `VLLMSession`, its submits and
finished requests as frames on the one connection) and `shutdown`.
Frames are an 8-byte length and JSON: only this uid talks here, floats round-trip exactly, and no pickle means a
request cannot run code in the server.

Trust: the server hashes the checkpoint directory itself (`checkpoint_digest`, the manifests' content hash) and
refuses one that is not what the stage expects; its tokenizer and architecture files must equal those the engine
started with, since `reload_weights` replaces only weights. Every answer names the hash it has loaded.
On a GPU the engine starts with vLLM's sleep mode and sleeps (level 1: weights to host memory, KV cache freed)
between requests, so a train stage on the same GPU gets its memory; it wakes at the next request. Untested on
GPU here. On CPU vLLM has no sleep mode: the engine stays up (client.py decides whether memory allows).
The server exits at `shutdown`, after `--idle-timeout` seconds without a request, when stdin ends (`--watch-stdin`),
when the run's driver is gone (`--run-lock`: its lease's holder died, `RunDriverWatch`), or after an engine error
(the next stage starts a fresh one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages.generation.base import Backend, GenerationRequest, ProgressCallback, Sample, SamplingSpec, sessions
from storage.process import release_freed_memory

FRAME_HEADER = struct.Struct(">Q")
MAX_FRAME_BYTES = 1 << 32
# Keys of config.json / generation_config.json that say how a file was written, not what the model is.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"})
WEIGHT_PATTERNS = (".safetensors", ".safetensors.index.json", ".bin")
SLEEP_LEVEL = 1  # weights kept in host memory: a wake-up for the same checkpoint needs no reload
# How often the server reads its run's lease: it ends within this (plus a request in progress) of its driver's death.
RUN_LEASE_POLL_S = 10.0


class ServerGone(ConnectionError):
    """The server closed the connection before answering (killed, idle exit, crash)."""


class RequestRefused(RuntimeError):
    """A request the server will not serve (hash mismatch, incompatible checkpoint, bad request); it stays up."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def send_message(connection: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    connection.sendall(FRAME_HEADER.pack(len(data)) + data)


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, received = [], 0
    while received < size:
        chunk = connection.recv(min(size - received, 1 << 20))
        if not chunk:
            if received:
                raise ServerGone("connection closed in the middle of a message")
            return None
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def receive_message(connection: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the other side closed the connection between messages."""
    header = _receive_exactly(connection, FRAME_HEADER.size)
    if header is None:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"message of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    body = _receive_exactly(connection, size)
    if body is None:
        raise ServerGone("connection closed in the middle of a message")
    return json.loads(body)


def encode_requests(requests: list[GenerationRequest]) -> list[list[Any]]:
    return [[list(request.prompt_token_ids), request.seed] for request in requests]


def decode_requests(rows: list[list[Any]]) -> list[GenerationRequest]:
    return [GenerationRequest([int(t) for t in token_ids], int(seed)) for token_ids, seed in rows]


def encode_samples(samples: list[Sample]) -> list[list[Any]]:
    return [[s.token_ids, s.logprobs, s.text, s.finish_reason] for s in samples]


def decode_samples(rows: list[list[Any]]) -> list[Sample]:
    return [Sample(token_ids=ids, logprobs=logprobs, text=text, finish_reason=reason)
            for ids, logprobs, text, reason in rows]


def engine_structure(model_dir: Path, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What an engine keeps from the directory it started from and `reload_weights` does not replace: the model
    config and generation config (less the keys that record how they were written) and every other policy file
    (tokenizer, chat template) by hash. Two directories with equal structures differ only in their weights."""
    from storage.checkpoints import is_policy_file

    structure: dict[str, Any] = {}
    for relative, info in sorted(files.items()):
        if not is_policy_file(relative) or relative.endswith(WEIGHT_PATTERNS):
            continue
        if relative in ("config.json", "generation_config.json"):
            values = json.loads((model_dir / relative).read_text())
            structure[relative] = {k: v for k, v in values.items() if k not in VOLATILE_CONFIG_KEYS}
        else:
            structure[relative] = info["sha256"]
    return structure


def process_cpu_seconds() -> float:
    """User + system CPU time of this process, every thread (the CPU engine's too: it runs in this process)."""
    times = os.times()
    return times.user + times.system


@dataclass
class LoadResult:
    """What a load did: the hash the server confirmed, whether it started the engine or swapped weights, and the
    seconds each part took (hashing, engine start and its CPU seconds, reload)."""

    checkpoint_sha256: str
    engine_started: bool
    reloaded: bool
    hash_seconds: float
    engine_start_seconds: float
    reload_seconds: float
    engine_start_cpu_seconds: float = 0.0


class EngineHost:
    """The engine a server holds: started at the first load, its weights swapped in place after that, asleep
    between requests when `sleep_mode` (GPU). `start_engine(model_dir)` makes the backend (a `VLLMBackend`)."""

    def __init__(self, start_engine: Callable[[Path], Backend], sleep_mode: bool) -> None:
        self.start_engine = start_engine
        self.sleep_mode = sleep_mode
        self.backend: Any = None
        self.engine_id: str | None = None
        self.engine_start_seconds = 0.0
        self.structure: dict[str, Any] | None = None
        self.loaded_sha256: str | None = None
        self.sleeping = False
        self.requests_served = 0

    def load(self, model_dir: Path, expected_sha256: str) -> LoadResult:
        """Make `model_dir` the engine's weights, after checking its content hash is `expected_sha256`."""
        from storage.checkpoints import checkpoint_digest

        started = time.monotonic()
        if not model_dir.is_dir():
            raise RequestRefused("missing", f"{model_dir} is not a directory on this machine")
        digest, files, _ = checkpoint_digest(model_dir)
        hash_seconds = time.monotonic() - started
        if digest != expected_sha256:
            raise RequestRefused("hash_mismatch", f"{model_dir} has content hash {digest[:12]}, the stage expects "
                                 f"{expected_sha256[:12]}: not loaded")
        structure = engine_structure(model_dir, files)
        if self.backend is None:
            started, cpu_started = time.monotonic(), process_cpu_seconds()
            self.backend = self.start_engine(model_dir)
            self.engine_start_seconds = time.monotonic() - started
            self.engine_id = uuid.uuid4().hex[:16]
            self.structure, self.loaded_sha256 = structure, digest
            return LoadResult(digest, True, False, hash_seconds, self.engine_start_seconds, 0.0,
                              process_cpu_seconds() - cpu_started)
        if structure != self.structure:
            changed = sorted(k for k in {*structure, *self.structure} if structure.get(k) != self.structure.get(k))
            raise RequestRefused("incompatible", f"{model_dir} differs from the engine's model in more than its "
                                 f"weights ({', '.join(changed)}): reload_weights cannot swap it in")
        self.wake()
        if digest == self.loaded_sha256:
            return LoadResult(digest, False, False, hash_seconds, 0.0, 0.0)
        started = time.monotonic()
        self.loaded_sha256 = None  # until the reload has finished
        self.backend.reload_weights(model_dir)  # every engine's, with generate.engines > 1
        self.loaded_sha256 = digest
        return LoadResult(digest, False, True, hash_seconds, 0.0, time.monotonic() - started)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingSpec,
                 progress: ProgressCallback | None) -> list[Sample]:
        self.wake()
        try:
            return self.backend.generate(requests, sampling, progress=progress)
        except BaseException:
            self.abort_unfinished()
            raise
        finally:
            self.requests_served += 1
            release_freed_memory()

    def run_session(self, connection: socket.socket) -> None:
        """Op `session`: continuous batching over one connection (client.py's `WarmSession`). `submit` frames add a
        request; whenever any is running the engine steps and each step's finished requests go back in a
        `finished` frame; `end` closes the session. A client gone mid-session: its requests are aborted."""
        self.wake()
        try:
            with self.backend.session() as session:
                while True:
                    if session.running == 0 or select.select([connection], [], [], 0)[0]:
                        message = receive_message(connection)
                        if message is None:
                            raise ConnectionResetError("the client closed its session")
                        if message.get("op") == "end":
                            return
                        if message.get("op") != "submit":
                            raise RequestRefused("bad_request", f"unknown session op {message.get('op')!r}")
                        (request,) = decode_requests([message["request"]])
                        session.submit(int(message["key"]), request, SamplingSpec(**message["sampling"]),
                                       bool(message.get("ignore_eos", False)))
                        continue  # take every submit already sent before the next step
                    finished = session.step()
                    if finished:
                        keys, samples = zip(*finished, strict=True)
                        send_message(connection, {"finished": [list(keys), encode_samples(list(samples))]})
        finally:
            self.requests_served += 1
            release_freed_memory()

    def abort_unfinished(self) -> None:
        """Drop what a broken-off generate left in the engine (its client went away), so the next one starts clean."""
        self.backend.abort_unfinished()

    def wake(self) -> None:
        if self.sleeping:
            self.backend.wake_up()
            self.sleeping = False

    def idle(self) -> None:
        """Between requests: on a GPU, give the engine's memory back until the next request."""
        if self.sleep_mode and self.backend is not None and not self.sleeping:
            self.backend.sleep(SLEEP_LEVEL)
            self.sleeping = True

    def describe(self) -> dict[str, Any]:
        backend = self.backend
        return {
            "pid": os.getpid(),
            "engine_id": self.engine_id,
            "engine_start_seconds": round(self.engine_start_seconds, 3),
            "engine_settings": None if backend is None else backend.engine_settings,
            "deterministic": None if backend is None else backend.deterministic,
            "gpus": 0 if backend is None else backend.gpus,
            "gpu_memory_used_mb": None if backend is None else backend.gpu_memory_used_mb,
            "loaded_sha256": self.loaded_sha256,
            "sleep_mode": self.sleep_mode,
            # continuous batching (op `session`): one engine's; several engines generate whole batches only
            "sessions": backend is not None and sessions(backend) is not None,
            "requests_served": self.requests_served,
        }

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def handle(connection: socket.socket, message: dict[str, Any], host: EngineHost) -> str:
    """Serve one request; "shutdown" when the server should end, else "served"."""
    op = message.get("op")
    if op == "ping":
        send_message(connection, {"ok": True, "server": host.describe()})
        return "served"
    if op == "shutdown":
        send_message(connection, {"ok": True, "server": host.describe()})
        return "shutdown"
    if op not in ("load", "generate", "session"):
        raise RequestRefused("bad_request", f"unknown op {op!r}")
    loaded = host.load(Path(message["model_dir"]), str(message["checkpoint_sha256"]))
    if op == "session" and sessions(host.backend) is None:
        raise RequestRefused("bad_request", "this server's engines (generate.engines > 1) have no continuous "
                             "batching: send whole batches (op generate)")
    answer: dict[str, Any] = {"ok": True, "load": asdict(loaded)}
    if op == "session":  # the load confirmed first, then the session's frames, then the closing answer
        send_message(connection, {**answer, "server": host.describe()})
        cpu_started = process_cpu_seconds()
        host.run_session(connection)
        send_message(connection, {"ok": True, "server": host.describe(),
                                  "cpu_seconds": process_cpu_seconds() - cpu_started})
        return "served"
    if op == "generate":
        spec = SamplingSpec(**message["sampling"])
        cpu_started = process_cpu_seconds()
        samples = host.generate(decode_requests(message["requests"]), spec,
                                lambda done, tokens: send_message(connection, {"progress": [done, tokens]}))
        answer["samples"] = encode_samples(samples)
        answer["cpu_seconds"] = process_cpu_seconds() - cpu_started  # the engine's work, whatever else loads the CPU
    answer["server"] = host.describe()
    send_message(connection, answer)
    return "served"


def serve_connection(connection: socket.socket, host: EngineHost) -> str:
    """One connection, one request. A refusal keeps the server; any other error ends it ("failed"), since an
    engine in an unknown state must not serve the next stage."""
    with connection:
        try:
            message = receive_message(connection)
        except (OSError, ValueError):
            return "served"
        if message is None:
            return "served"
        try:
            return handle(connection, message, host)
        except RequestRefused as refusal:
            with contextlib.suppress(OSError):
                send_message(connection, {"ok": False, "refused": refusal.kind, "error": str(refusal)})
            return "served"
        except (BrokenPipeError, ConnectionResetError):  # the stage went away mid-request; its work was dropped
            return "served"
        except Exception as error:  # noqa: BLE001 - reported to the client, then the server ends
            traceback.print_exc()
            with contextlib.suppress(OSError):
                send_message(connection, {"ok": False, "error": f"{type(error).__name__}: {error}"})
            return "failed"
        finally:
            with contextlib.suppress(Exception):
                host.idle()


class RunDriverWatch:
    """The run this server serves, followed through its run lease (storage/lock.py `lease_state`), read every
    RUN_LEASE_POLL_S between requests. Once it has seen the run driven, a lease whose holder died (a SIGKILLed
    flow process; with S3, a lease expired) means the run is gone, and so is the server. A lease released (a
    run that ended, a scheduled trigger's iteration done) leaves the idle timeout in charge, and a new driver
    (a resumed run, the next trigger) is followed as the first was. A server of stages run by hand, with no
    driver, never sees one: the idle timeout alone ends it."""

    def __init__(self, lock_path: str) -> None:
        self.lock_path = lock_path
        self.seen_driven = False
        self.next_check = time.monotonic()

    def run_gone(self) -> bool:
        if time.monotonic() < self.next_check:
            return False
        self.next_check = time.monotonic() + RUN_LEASE_POLL_S
        from storage.lock import lease_state

        try:
            state = lease_state(self.lock_path)
        except Exception as error:  # noqa: BLE001 - storage unreachable for now: judged at the next check
            print(f"generation server: cannot read the run lease {self.lock_path}: {error}", flush=True)
            return False
        self.seen_driven = self.seen_driven or state == "held"
        return self.seen_driven and state == "abandoned"


def serve(listener: socket.socket, host: EngineHost, idle_timeout_s: float | None, watch_stdin: bool,
          run: RunDriverWatch | None = None) -> str:
    """Serve requests until shutdown, idle timeout, stdin EOF, the run's driver gone or an engine error; why it
    ended."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    if watch_stdin:
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "caller")
    last_request = time.monotonic()
    while True:
        if run is not None and run.run_gone():
            return "run gone"
        timeout = None if not idle_timeout_s else max(0.0, last_request + idle_timeout_s - time.monotonic())
        if run is not None:
            timeout = max(0.0, min(timeout if timeout is not None else RUN_LEASE_POLL_S,
                                   run.next_check - time.monotonic()))
        events = selector.select(timeout)
        if not events and idle_timeout_s and time.monotonic() - last_request >= idle_timeout_s:
            return "idle"
        for key, _ in events:
            if key.data == "caller":
                if not os.read(sys.stdin.fileno(), 4096):
                    return "caller gone"
                continue
            connection, _ = listener.accept()
            outcome = serve_connection(connection, host)
            last_request = time.monotonic()
            if outcome != "served":
                return outcome


def start_vllm_engine(generate_config_json: str, device: str, sleep_mode: bool) -> Callable[[Path], Backend]:
    def start(model_dir: Path) -> Backend:
        from schemas.config import GenerateConfig
        from stages.generation import make_backend

        cfg = GenerateConfig.model_validate_json(generate_config_json)
        return make_backend("vllm", model_dir, cfg, device, sleep_mode=sleep_mode)

    return start


def sleep_mode_available(device: str) -> bool:
    """vLLM's sleep mode where the engine runs on a GPU whose platform has it (CUDA, ROCm); never on CPU."""
    if device == "cpu":
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rlpipe generation server (started by stages.generation.client)")
    parser.add_argument("--listen-fd", type=int, required=True, help="a bound, listening Unix socket")
    parser.add_argument("--socket", required=True, help="its path, removed at exit while it is still this server's")
    parser.add_argument("--generate-config", required=True, help="the run's generate section as JSON")
    parser.add_argument("--device", required=True, help="the config's device, as this process's environment sees it")
    parser.add_argument("--idle-timeout", type=float, default=0.0, help="seconds without a request before exiting")
    parser.add_argument("--watch-stdin", action="store_true", help="exit when stdin reaches EOF (the caller ended)")
    parser.add_argument("--run-lock", help="the run's lease (path or URL): exit once its driver is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver; the server ends by its own rules
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(f"{sys.executable} -m stages.generation.server (rlpipe generation server)")
    listener = socket.socket(fileno=args.listen_fd)
    bound_inode = os.stat(args.socket).st_ino
    host: EngineHost | None = None
    reason = "failed"
    try:
        from stages.generation.device import claim_device

        device = claim_device(args.device)
        host = EngineHost(start_vllm_engine(args.generate_config, device.torch, sleep_mode_available(device.torch)),
                          sleep_mode=sleep_mode_available(device.torch))
        print(f"generation server {os.getpid()} ready on {args.socket} (device {device.name})", flush=True)
        reason = serve(listener, host, args.idle_timeout or None, args.watch_stdin,
                       RunDriverWatch(args.run_lock) if args.run_lock else None)
    finally:
        with contextlib.suppress(OSError):
            if os.stat(args.socket).st_ino == bound_inode:  # not yet replaced by a newer server's socket
                os.unlink(args.socket)
        listener.close()
        print(f"generation server {os.getpid()} ends: {reason}", flush=True)
        if host is not None:
            host.close()
    return 0 if reason in ("shutdown", "idle", "caller gone", "run gone") else 1


if __name__ == "__main__":
    sys.exit(main())
