"""The stage side of the generation server: find or start the run's server, and generate through it.

`open_stage_engine` gives a generating stage its backend: a `WarmEngine` (a `Backend` whose engine lives in the
server) when `generate.warm_engine` allows it, else the stage's own engine from `make_backend`, as before. A
server is found by its socket, `<tmp>/rlpipe-engines-<uid>/<key>.sock`, the key hashing the run's directory, the
generate section (less the warm_engine fields), the config's device and the interpreter: one engine per run and
machine. A stage that finds no server starts one (a file lock keeps two stages from both doing it), detached
in its own session with its output in `<key>.log`, so it outlives the stage; that is also how a killed server
comes back, and how a worker of the gpu pool gets one. It ends after `warm_engine_idle_s` without requests,
when the run's flow ends (`stop_server`), or soon after the run's driver dies (it watches the run lease). The
engine itself starts at the first load, in the stage that asks.

Trust: every answer names the checkpoint hash the server confirmed; a `WarmEngine` raises unless it is the
stage's input's, and the manifest records it (`warm_engine.checkpoint_sha256`). "Memory allows" on CPU is a
measured check made before an engine starts (`memory_refusal`); on a GPU the engine sleeps between requests
(server.py) and needs vLLM's sleep mode there. `WarmEngine.session` gives the multi-turn loop continuous batching
in the server's engine, as the in-process vLLM backend does (a `WarmSession`: frames on one connection).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.generation.base import Backend, GenerationRequest, ProgressCallback, Sample, SamplingSpec
from stages.generation.models import file_lock
from stages.generation.server import (
    ServerGone,
    decode_samples,
    encode_requests,
    receive_message,
    send_message,
)

if TYPE_CHECKING:
    from schemas.config import GenerateConfig
    from stages.generation.device import Device

GIB = 1 << 30
# Besides weights and KV cache, a CPU engine's process holds torch, vLLM and their buffers. Measured here: the
# server with SmolLM2-135M fp32 (0.48 GiB of weights) and a 1 GiB KV cache, 2.72 GiB RSS, 3.24 GiB peak (a
# reload holds the new weights beside the old): 1.25 GiB beyond weights and cache, and a second weights' worth.
ENGINE_RUNTIME_BYTES = int(1.25 * GIB)
WARM_ENGINE_FIELDS = ("warm_engine", "warm_engine_min_free_gib", "warm_engine_idle_s")
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
STOP_WAIT_S = 30.0


class WarmEngineError(RuntimeError):
    """The server answered with an error or a refusal (`refused`: hash_mismatch, incompatible, missing, ...)."""

    def __init__(self, message: str, refused: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused


class UntrustedServer(WarmEngineError):
    """The server did not confirm the checkpoint the stage asked for: nothing it generated is used."""


@dataclass(frozen=True)
class ServerAddress:
    key: str
    directory: Path

    @property
    def socket_path(self) -> Path:
        return self.directory / f"{self.key}.sock"

    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.key}.lock"

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.key}.log"


def server_directory() -> Path:
    """This uid's directory of server sockets, logs and locks (mode 0700: only this uid may talk to a server)."""
    directory = Path(tempfile.gettempdir()) / f"rlpipe-engines-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to another user: refusing to use its generation servers")
    return directory


def server_address(scope: str, cfg: GenerateConfig, device_setting: str) -> ServerAddress:
    """The address of the generation server for a run (`scope`: its directory) with this generate section on
    this machine's `device_setting` (the config's `device`, unresolved, so a flow can find it without torch)."""
    engine_config = cfg.model_dump(mode="json", exclude=set(WARM_ENGINE_FIELDS))
    payload = json.dumps([scope, engine_config, device_setting, sys.executable], sort_keys=True)
    return ServerAddress(hashlib.sha256(payload.encode()).hexdigest()[:16], server_directory())


def connect(address: ServerAddress) -> socket.socket | None:
    """A connection to the server, or None when nothing listens there (no socket, or a dead server's)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(address.socket_path))
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        return None
    return connection


def request(address: ServerAddress, message: dict[str, Any], progress: ProgressCallback | None = None
            ) -> dict[str, Any]:
    """Send one request and return the server's answer, passing its progress frames to `progress`; ServerGone
    when no server listens or it ends before answering. A request waits its turn behind another stage's."""
    connection = connect(address)
    if connection is None:
        raise ServerGone(f"no generation server at {address.socket_path}")
    with connection:
        try:
            send_message(connection, message)
            while True:
                answer = receive_message(connection)
                if answer is None:
                    raise ServerGone(f"the generation server at {address.socket_path} ended without answering "
                                     f"(its log: {address.log_path})")
                if "progress" in answer:
                    if progress is not None:
                        progress(*answer["progress"])
                    continue
                return answer
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ServerGone(f"the generation server at {address.socket_path} went away: {error} "
                             f"(its log: {address.log_path})") from None


def ping(address: ServerAddress) -> dict[str, Any] | None:
    """The server's description (pid, engine id, loaded hash, ...), or None when there is none."""
    try:
        return request(address, {"op": "ping"})["server"]
    except ServerGone:
        return None


def start_server(
    address: ServerAddress, cfg: GenerateConfig, device: str, idle_timeout_s: float | None,
    env: dict[str, str] | None = None, watch_stdin: bool = False, run_lock: str | None = None,
) -> subprocess.Popen | None:
    """Start a server at `address` unless one listens there already (then None). The socket is bound here and
    passed in, so requests queue while the server imports vLLM. `device`: torch's name for the stage's device
    in `env` (the server claims it again, so a `cuda:N` stage's narrowed GPU stays the server's). `run_lock`: the
    run's lease, whose driver the server follows (it ends once that died: server.py `RunDriverWatch`)."""
    with file_lock(address.lock_path):
        existing = connect(address)
        if existing is not None:
            existing.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            address.socket_path.unlink()  # a dead server's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(address.socket_path))
            listener.listen(64)
            command = [
                sys.executable, "-m", "stages.generation.server", "--listen-fd", str(listener.fileno()),
                "--socket", str(address.socket_path), "--generate-config", cfg.model_dump_json(),
                "--device", device, "--idle-timeout", str(idle_timeout_s or 0),
            ] + (["--watch-stdin"] if watch_stdin else []) + (["--run-lock", run_lock] if run_lock else [])
            # vLLM's lines go to the server's own log (its output), not to the log file of the stage that started it
            server_env = {name: value for name, value in (os.environ if env is None else env).items()
                          if name != "VLLM_LOGGING_CONFIG_PATH"}
            with open(address.log_path, "ab") as log:
                # Its own session: a signal to the stage's process group (a killed stage) does not reach it.
                return subprocess.Popen(
                    command, stdin=subprocess.PIPE if watch_stdin else subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=(listener.fileno(),), env=server_env, start_new_session=True,
                )
        finally:
            listener.close()


def stop_server(address: ServerAddress, timeout_s: float = STOP_WAIT_S) -> bool:
    """Ask the server at `address` to end and wait until it stopped listening; False when there was none."""
    try:
        answer = request(address, {"op": "shutdown"})
    except ServerGone:
        return False
    pid = int(answer["server"]["pid"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _is_zombie(pid):
            return True
        time.sleep(0.05)
    return True


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------------------------------------------------
# Does memory allow a warm engine (CPU)?


def available_memory_bytes(meminfo: str, cgroup_limit: int | None, cgroup_usage: int | None) -> int:
    """MemAvailable from /proc/meminfo text, or the cgroup's headroom (limit - usage) when that is smaller."""
    kib = next(int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    available = kib * 1024
    if cgroup_limit is not None and cgroup_usage is not None:
        available = min(available, max(0, cgroup_limit - cgroup_usage))
    return available


def read_available_memory() -> int:
    """`available_memory_bytes` of this machine and this process's cgroup v1 memory group (when limited)."""
    limit = usage = None
    with contextlib.suppress(OSError, ValueError):
        limit = int((CGROUP_V1_MEMORY / "memory.limit_in_bytes").read_text())
        usage = int((CGROUP_V1_MEMORY / "memory.usage_in_bytes").read_text())
        if limit >= 1 << 60:  # "no limit"
            limit = usage = None
    return available_memory_bytes(Path("/proc/meminfo").read_text(), limit, usage)


def engine_size_bytes(model_dir: Path, kv_cache_gib: int) -> int:
    """A CPU engine's estimated peak memory: twice its weight files (a reload holds old and new; an upper bound:
    bf16 halves fp32 files) + its KV cache + the runtime (ENGINE_RUNTIME_BYTES)."""
    weights = sum(p.stat().st_size for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin"))
    return 2 * weights + kv_cache_gib * GIB + ENGINE_RUNTIME_BYTES


def memory_refusal(available: int, engine_bytes: int, min_free_gib: float) -> str | None:
    """Why memory does not allow a warm engine (None when it does): what is available now less the engine's
    size must leave `min_free_gib` for the stages that run beside it (train)."""
    left = available - engine_bytes
    if left >= min_free_gib * GIB:
        return None
    return (f"memory: {available / GIB:.1f} GiB available, the engine needs ~{engine_bytes / GIB:.1f} GiB, leaving "
            f"{left / GIB:.1f} < generate.warm_engine_min_free_gib={min_free_gib:g}")


# ---------------------------------------------------------------------------------------------------------
# The warm engine as a stage's backend


class WarmEngine:
    """A `Backend` whose vLLM engine lives in the generation server at `address`, loaded with `model_dir`
    (content hash `checkpoint_sha256`). Constructing it loads the checkpoint (starting the server and its
    engine if there is none); `engine_start_seconds` is what that cost this stage. A server that is gone is
    started again once per request. `close` leaves the server running for the next stage."""

    name = "vllm"

    def __init__(self, address: ServerAddress, cfg: GenerateConfig, device: str, model_dir: Path,
                 checkpoint_sha256: str, run_lock: str | None = None) -> None:
        self.address, self.cfg, self.device, self.run_lock = address, cfg, device, run_lock
        self.model_dir, self.checkpoint_sha256 = Path(model_dir), checkpoint_sha256
        self.server: dict[str, Any] = {}
        self.engine_ids: list[str] = []
        self.engine_started = False
        self.server_engine_start_seconds = 0.0
        self.server_starts = 0
        self.reloads, self.reload_seconds, self.hash_seconds = 0, 0.0, 0.0
        self.engine_start_cpu_seconds, self.generation_cpu_seconds = 0.0, 0.0
        started = time.monotonic()
        self._call({"op": "load", **self._checkpoint()})
        self.engine_start_seconds = time.monotonic() - started

    def _checkpoint(self) -> dict[str, str]:
        return {"model_dir": str(self.model_dir), "checkpoint_sha256": self.checkpoint_sha256}

    def _call(self, message: dict[str, Any], progress: ProgressCallback | None = None) -> dict[str, Any]:
        try:
            answer = request(self.address, message, progress)
        except ServerGone:
            # None there (first use, killed, idle exit): start one (unless another stage just did) and ask again.
            if start_server(self.address, self.cfg, self.device, self.cfg.warm_engine_idle_s,
                            run_lock=self.run_lock) is not None:
                self.server_starts += 1
            answer = request(self.address, message, progress)
        if not answer["ok"]:
            raise WarmEngineError(f"generation server: {answer['error']}", answer.get("refused"))
        self._check_and_note(answer)
        return answer

    def _check_and_note(self, answer: dict[str, Any]) -> None:
        """Trust nothing the server did not confirm: the hash it checked and the hash it has loaded must both be
        the stage's checkpoint's."""
        load, server = answer["load"], answer["server"]
        confirmed = {load["checkpoint_sha256"], server["loaded_sha256"]}
        if confirmed != {self.checkpoint_sha256}:
            raise UntrustedServer(f"the generation server confirmed {sorted(map(str, confirmed))}, not the stage's "
                                  f"checkpoint {self.checkpoint_sha256[:12]}: its samples are not used")
        self.server = server
        if server["engine_id"] not in self.engine_ids:
            self.engine_ids.append(server["engine_id"])
        if load["engine_started"]:
            self.engine_started = True
            self.server_engine_start_seconds += load["engine_start_seconds"]
            self.engine_start_cpu_seconds += load["engine_start_cpu_seconds"]
        self.generation_cpu_seconds += answer.get("cpu_seconds", 0.0)
        self.reloads += int(load["reloaded"])
        self.reload_seconds += load["reload_seconds"]
        self.hash_seconds += load["hash_seconds"]

    @property
    def deterministic(self) -> bool:
        return bool(self.server["deterministic"])

    @property
    def engine_settings(self) -> dict[str, object]:
        return dict(self.server["engine_settings"])

    @property
    def gpus(self) -> int:
        return int(self.server["gpus"])

    @property
    def gpu_memory_used_mb(self) -> float | None:
        return self.server["gpu_memory_used_mb"]

    def generate(self, requests: list[GenerationRequest], sampling: SamplingSpec,
                 progress: ProgressCallback | None = None) -> list[Sample]:
        answer = self._call({"op": "generate", **self._checkpoint(), "requests": encode_requests(requests),
                             "sampling": asdict(sampling)}, progress)
        return decode_samples(answer["samples"])

    @property
    def session(self) -> Callable[[], WarmSession] | None:
        """Continuous batching in the server's engine (base.TurnSession), for the multi-turn agent loop; None when
        the server runs several engines (generate.engines > 1), which generate whole batches only."""
        return (lambda: WarmSession(self)) if self.server.get("sessions", True) else None

    def close(self) -> None:
        """Nothing to free here: the engine stays warm in the server for the next stage."""

    def record(self) -> dict[str, Any]:
        """The manifest's `warm_engine`: which engine served (a new `engine_id` = a new engine start), whether this
        stage started it, the checkpoint hash the server confirmed, and what loading cost."""
        return {
            "used": True,
            "server_pid": self.server["pid"],
            "engine_id": self.engine_ids[-1],
            "engine_ids": self.engine_ids,
            "engine_started": self.engine_started,
            "engine_start_seconds": round(self.server_engine_start_seconds, 3),
            "server_starts": self.server_starts,
            "checkpoint_sha256": self.server["loaded_sha256"],
            "reloads": self.reloads,
            "reload_seconds": round(self.reload_seconds, 3),
            "hash_seconds": round(self.hash_seconds, 3),
            # The server's own CPU seconds (all its threads): what the work cost, whatever else loads the machine.
            "engine_start_cpu_seconds": round(self.engine_start_cpu_seconds, 3),
            "generation_cpu_seconds": round(self.generation_cpu_seconds, 3),
            "sleep_mode": self.server["sleep_mode"],
        }


class WarmSession:
    """A `TurnSession` over one connection to the server (its op `session`): a submit is one frame out, the
    engine's finished requests come back in frames as its steps finish them. `step` waits at most
    `STEP_WAIT_S` for one, so the caller gets to submit the turns its tool calls have meanwhile made ready.
    An error closes the connection, and the server aborts what is left of the session."""

    STEP_WAIT_S = 0.02

    def __init__(self, engine: WarmEngine) -> None:
        self.engine = engine
        self.connection: socket.socket | None = None
        self.submitted = 0
        self.returned = 0

    def __enter__(self) -> WarmSession:
        engine = self.engine
        self.connection = connect(engine.address)
        if self.connection is None:  # none there (killed, idle exit): start one, as WarmEngine._call does
            if start_server(engine.address, engine.cfg, engine.device, engine.cfg.warm_engine_idle_s,
                            run_lock=engine.run_lock) is not None:
                engine.server_starts += 1
            self.connection = connect(engine.address)
        if self.connection is None:
            raise ServerGone(f"no generation server at {engine.address.socket_path}")
        send_message(self.connection, {"op": "session", **self.engine._checkpoint()})
        self._note(self._receive())
        return self

    @property
    def running(self) -> int:
        return self.submitted - self.returned

    def submit(self, key: int, request: GenerationRequest, sampling: SamplingSpec, ignore_eos: bool = False) -> None:
        assert self.connection is not None, "use the session as a context manager"
        send_message(self.connection, {"op": "submit", "key": key, "request": encode_requests([request])[0],
                                       "sampling": asdict(sampling), "ignore_eos": ignore_eos})
        self.submitted += 1

    def step(self) -> list[tuple[int, Sample]]:
        assert self.connection is not None, "use the session as a context manager"
        if not select.select([self.connection], [], [], self.STEP_WAIT_S)[0]:
            return []
        answer = self._receive()
        if "finished" not in answer:
            self._note(answer)  # raises: only an error ends a session from the server's side
            raise WarmEngineError(f"generation server ended the session early: {answer}")
        keys, samples = answer["finished"]
        self.returned += len(keys)
        return list(zip(keys, decode_samples(samples), strict=True))

    def _receive(self) -> dict[str, Any]:
        assert self.connection is not None
        answer = receive_message(self.connection)
        if answer is None:
            raise ServerGone(f"the generation server at {self.engine.address.socket_path} ended the session "
                             f"(its log: {self.engine.address.log_path})")
        return answer

    def _note(self, answer: dict[str, Any]) -> None:
        if not answer.get("ok"):
            raise WarmEngineError(f"generation server: {answer.get('error')}", answer.get("refused"))
        self.engine._check_and_note(answer)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        connection, self.connection = self.connection, None
        if connection is None:
            return
        with connection:
            if exc_type is None:
                send_message(connection, {"op": "end"})
                self.connection = connection
                answer = self._receive()
                self.connection = None
                if not answer.get("ok"):
                    raise WarmEngineError(f"generation server: {answer.get('error')}", answer.get("refused"))
                if answer["server"]["loaded_sha256"] != self.engine.checkpoint_sha256:
                    raise UntrustedServer("the generation server's engine changed checkpoint during the session")
                self.engine.server = answer["server"]
                self.engine.generation_cpu_seconds += answer["cpu_seconds"]


@dataclass
class StageEngine:
    """The backend a generating stage uses, and why it is the stage's own engine when it is not the warm one."""

    backend: Backend
    own_engine_reason: str | None = None

    def manifest_record(self) -> dict[str, Any]:
        if isinstance(self.backend, WarmEngine):
            return self.backend.record()
        return {"used": False, "reason": self.own_engine_reason}


def warm_engine_refusal(cfg: GenerateConfig, backend_name: str, device: str, server: dict[str, Any] | None,
                        model_dir: Path) -> str | None:
    """Why this stage runs an engine of its own (None: it uses the warm engine). A server that holds an engine
    already is used whatever the memory (its memory is taken either way); before one starts, `auto` on CPU asks
    `memory_refusal`, and on a GPU needs vLLM's sleep mode (else an idle engine keeps the memory train needs)."""
    if cfg.warm_engine == "off":
        return "generate.warm_engine is off"
    if backend_name != "vllm":
        return f"the backend is {backend_name}: the warm engine is vLLM's"
    if cfg.warm_engine == "on" or (server is not None and server.get("engine_id")):
        return None
    if device != "cpu":
        from stages.generation.server import sleep_mode_available

        return None if sleep_mode_available(device) else "vLLM has no sleep mode on this GPU platform"
    engines = 1 if cfg.engines == "auto" else cfg.engines  # `auto` is one engine on CPU
    return memory_refusal(read_available_memory(), engines * engine_size_bytes(model_dir, cfg.vllm_kv_cache_gib),
                          cfg.warm_engine_min_free_gib)


def open_stage_engine(cfg: GenerateConfig, model_dir: Path, device: Device, device_setting: str,
                      checkpoint_sha256: str, scope: str, run_lock: str | None = None) -> StageEngine:
    """The backend of a generate or evaluate stage: the run's warm engine loaded with `model_dir` (whose content
    hash must be `checkpoint_sha256`) when `generate.warm_engine` allows, else `make_backend` as before. In `auto`
    a server that cannot serve (it fails to start, refuses the checkpoint's layout) means an engine of the
    stage's own; with `on` it is an error. A checkpoint whose hash is not its manifest's is an error always.
    A server started here follows the driver of the run whose lease is `run_lock` (start_server)."""
    from stages.generation import make_backend, resolve_backend_name

    reason = "generate.warm_engine is off" if cfg.warm_engine == "off" else None
    if reason is None:
        address = server_address(scope, cfg, device_setting)
        reason = warm_engine_refusal(cfg, resolve_backend_name(cfg.backend, device.torch), device.torch,
                                     ping(address), model_dir)
        if reason is None:
            try:
                return StageEngine(WarmEngine(address, cfg, device.torch, model_dir, checkpoint_sha256, run_lock))
            except (ServerGone, WarmEngineError) as error:
                if cfg.warm_engine == "on" or getattr(error, "refused", None) == "hash_mismatch":
                    raise
                reason = f"the generation server could not serve: {error}"
    return StageEngine(make_backend(cfg.backend, model_dir, cfg, device.torch), reason)
