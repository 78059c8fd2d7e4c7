"""DeepSpeed ZeRO as a training backend: the same `PolicyTrainer`, with a DeepSpeed engine as its optimizer.

The train stage calls `launch(job, processes)`, which runs the DeepSpeed launcher on this module; every rank
runs `worker`, which wraps `ResponseLogprobs(model)` in the engine (so ZeRO-3 gathers parameters in forward)
and trains with `DeepSpeedStepper`. Every rank packs the same minibatch and takes every world-th micro-batch,
padding with zero-weight repeats so all ranks make the same number of calls; gradient accumulation is ours
(`engine.step()` reduces and updates); the loss is scaled by the world size, since DeepSpeed averages. The
optimizer is torch AdamW (no DeepSpeed op compiled; with `zero_offload` DeepSpeed's CPU Adam) and bf16 is our
autocast, so state stays fp32. On CUDA: NCCL, one rank per GPU (`--include`, never CUDA_VISIBLE_DEVICES, which
the launcher drops); on CPU: gloo.

Several nodes (`train.nodes`) use the launcher's no-ssh mode, one launcher per node on the same hostfile: node
0's is the stage's; node R's is started by `serve_node` (`rlpipe train-node RUN --node-rank R`), which finds each
job in the run's `nodes_dir`, a directory every node sees at the same path (as the job's checkpoint directory).
Such a directory, not ssh, is the one channel between the nodes: a job file that goes ends that node's ranks.

Rank 0 (on node 0) writes the HF checkpoint and the metrics; the optimizer state is DeepSpeed's checkpoint in
`<checkpoint>/deepspeed/`, resumed when world size and ZeRO stage match. The launcher's processes never
outlive the stage: every rank watches the stage process (`RLPIPE_DS_STAGE`: pid and start time) and ends
within a second of it, and `launch` kills the launcher's whole tree on a timeout, an exception or a signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from schemas import settings
from schemas.config import ConfigError, TrainConfig
from stages.rl.checkpoint import TrainerState, copy_non_model_files, load_policy, load_reference, read_state
from stages.rl.logprobs import ResponseLogprobs
from stages.rl.session import TrainJob, seed_everything, session_metrics
from stages.rl.trainer import PolicyTrainer, make_adamw
from storage.fs import is_remote
from storage.process import end_process

DS_DIR = "deepspeed"
DS_TAG = "optimizer"
DS_META = "deepspeed_meta.json"
READY = "rlpipe deepspeed rank ready:"  # each rank prints it to the launcher log once its engine is built
PROGRESS_SUFFIX = ".progress.jsonl"  # rank 0 appends each optimizer step's metrics row (the stage's progress bar)
STAGE_ENV = settings.DS_STAGE.name  # "<pid>:<start time>" of the train stage that launched the ranks
REPO_ROOT = Path(__file__).resolve().parents[2]


def deepspeed_config(cfg: TrainConfig, world_size: int, on_cuda: bool = False) -> dict[str, Any]:
    """DeepSpeed's config for `cfg`. With `zero_offload` the optimizer state (and under ZeRO-3 the parameters)
    live in CPU memory and DeepSpeed builds its own AdamW from the config (its CPU Adam, the optimizer offload is
    made for) instead of taking our torch AdamW; pinned host memory only on CUDA."""
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    optimizer: dict[str, Any] = {}
    if cfg.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
        if cfg.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
        optimizer["optimizer"] = {"type": "AdamW", "params": {
            "lr": cfg.lr, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay}}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **optimizer,
    }


def resolve_processes(setting: int | str, device_type: str, gpus: int) -> int:
    """The number of ranks for `train.processes`: `auto` is one per GPU the stage may use on CUDA, 1 on CPU (gloo
    ranks share the cores). More ranks than GPUs on CUDA is a ConfigError naming the field (stage exit 2)."""
    if device_type != "cuda":
        return 1 if setting == "auto" else int(setting)
    if setting == "auto":
        return gpus
    if int(setting) > gpus:
        raise ConfigError(
            f"train.processes={setting}, but the train stage has {gpus} GPU(s) and DeepSpeed runs one rank per GPU; "
            "set train.processes: auto or at most that (device: cuda:N leaves the stage one GPU)"
        )
    return int(setting)


def dist_backend(device_type: str) -> str:
    """torch.distributed's backend for the ranks: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, local_rank: int) -> str:
    """The device of the rank with `local_rank` on its node: its own GPU on CUDA (one rank per GPU), else the CPU."""
    return f"cuda:{local_rank}" if device_type == "cuda" else "cpu"


def launcher_resources(device_type: str, processes: int, visible_devices: str | None) -> list[str]:
    """The DeepSpeed launcher's arguments choosing the ranks of one node. CPU: `--num_gpus N` processes (gloo).
    CUDA: `--include localhost:<ids>` with the first N GPUs this process sees, named as the launcher needs
    (physical indices, read through CUDA_VISIBLE_DEVICES, which the launcher would otherwise drop)."""
    if device_type != "cuda":
        return ["--num_gpus", str(processes)]
    visible = [entry.strip() for entry in visible_devices.split(",")] if visible_devices else []
    ids = visible[:processes] if visible else [str(i) for i in range(processes)]
    if not all(entry.isdigit() for entry in ids):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={visible_devices} names GPUs by UUID; DeepSpeed's launcher takes indices: set "
            "it to indices (e.g. 0,1) for train.backend=deepspeed"
        )
    return ["--include", "localhost:" + ",".join(ids)]


def node_resources(hostfile: Path, node_rank: int, master_addr: str) -> list[str]:
    """The launcher's arguments for node `node_rank` of a multi-node job: DeepSpeed's no-ssh mode, where every node
    runs a launcher on the same hostfile (`write_hostfile`) and starts its own ranks, which meet at node 0's
    `master_addr`. On CUDA each node's ranks take its GPUs 0..N-1 (the launcher sets CUDA_VISIBLE_DEVICES)."""
    return ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank), "--master_addr", master_addr]


def write_hostfile(path: Path, nodes: int, processes: int) -> Path:
    """DeepSpeed's hostfile of `nodes` nodes with `processes` ranks each. Without ssh the host names are only keys
    (`node0`, `node1`, ...): node R's launcher starts the ranks of the R-th line, and `--master_addr` says
    where they meet."""
    path.write_text("".join(f"node{rank} slots={processes}\n" for rank in range(nodes)))
    return path


def hostfile_slots(path: Path) -> int:
    """The ranks per node of a hostfile `write_hostfile` wrote."""
    first = path.read_text().splitlines()[0]
    return int(first.partition("slots=")[2])


class DeepSpeedStepper:
    def __init__(self, engine: Any):  # noqa: ANN401 - deepspeed.DeepSpeedEngine
        import torch.distributed as dist

        self.engine = engine
        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # NCCL reduces GPU tensors only; gloo CPU ones.
        self.device = engine.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self, lr: float) -> float:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": self.dist.ReduceOp.SUM, "min": self.dist.ReduceOp.MIN, "max": self.dist.ReduceOp.MAX}
        values = values.to(self.device, copy=True)
        self.dist.all_reduce(values, op=ops[op])
        return values.cpu()


def _save(engine: Any, model: torch.nn.Module, job: TrainJob, cfg: TrainConfig, state: TrainerState) -> None:  # noqa: ANN401
    import deepspeed
    import torch.distributed as dist

    out_dir = Path(job.out_dir)
    rank = dist.get_rank()
    # Under ZeRO-3 every rank holds a shard of each parameter: gather the full tensors for the save.
    gather = (
        deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
        if cfg.zero_stage == 3
        else contextlib.nullcontext()
    )
    with gather:
        if rank == 0:
            to_save = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
            to_save.config.use_cache = True
            to_save.save_pretrained(out_dir, safe_serialization=True)
            copy_non_model_files(Path(job.policy_dir), out_dir)
            (out_dir / "trainer_state.json").write_text(json.dumps(state.__dict__, sort_keys=True) + "\n")
    dist.barrier()
    if cfg.save_optimizer and cfg.lora_rank == 0:
        engine.save_checkpoint(str(out_dir / DS_DIR), tag=DS_TAG)
        if rank == 0:
            meta = {"world_size": dist.get_world_size(), "zero_stage": cfg.zero_stage}
            (out_dir / DS_DIR / DS_META).write_text(json.dumps(meta) + "\n")
    dist.barrier()


def _maybe_resume(engine: Any, policy_dir: Path, cfg: TrainConfig, world_size: int) -> bool:  # noqa: ANN401
    meta_path = policy_dir / DS_DIR / DS_META
    if cfg.lora_rank > 0 or not meta_path.is_file():
        return False
    meta = json.loads(meta_path.read_text())
    if meta != {"world_size": world_size, "zero_stage": cfg.zero_stage}:
        return False
    engine.load_checkpoint(
        str(policy_dir / DS_DIR), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    return True


def worker(job_path: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    job = TrainJob.load(job_path)
    cfg = job.cfg
    device_type = "cpu" if job.device == "cpu" else "cuda"
    device = rank_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts: each rank's communicator on its own GPU
    deepspeed.init_distributed(dist_backend=dist_backend(device_type))
    world = dist.get_world_size()
    rank = dist.get_rank()
    if device_type == "cpu":
        # Every rank has mapped every rank's all-reduce buffer once all have passed init: the names can go now
        # (the mappings live on), so the buffers leave nothing in /dev/shm however the job ends.
        dist.barrier()
        remove_shm_buffers(int(os.environ["MASTER_PORT"]))
    # The machine's threads are shared by the ranks.
    torch.set_num_threads(max(1, job.threads // world))
    seed_everything(cfg, job.iteration)
    started = time.monotonic()
    policy_dir = Path(job.policy_dir)
    model = load_policy(policy_dir, cfg, device)
    policy = ResponseLogprobs(model, job.temperature, cfg.logprob_chunk_tokens)
    # Our torch AdamW as the client optimizer; with ZeRO-Offload DeepSpeed builds its CPU Adam from the config.
    optimizer = (
        {"model_parameters": [p for p in model.parameters() if p.requires_grad]} if cfg.zero_offload
        else {"optimizer": make_adamw(model, cfg)}
    )
    engine, _, _, _ = deepspeed.initialize(
        model=policy, config=deepspeed_config(cfg, world, device_type == "cuda"), **optimizer
    )
    resumed = _maybe_resume(engine, policy_dir, cfg, world)
    state = read_state(policy_dir)
    ref = load_reference(Path(job.reference_dir), device) if cfg.kl_coef > 0 and job.reference_dir else None
    loaded = time.monotonic()
    print(f"{READY} {rank}/{world} in {loaded - started:.1f}s (optimizer resumed: {resumed})", flush=True)
    trainer = PolicyTrainer(
        model,
        cfg,
        DeepSpeedStepper(engine),
        temperature=job.temperature,
        norm_length=job.norm_length,
        ref_model=ref,
        global_step=state.global_step,
        policy=engine,
        device=device,
    )
    progress = Path(str(job_path) + PROGRESS_SUFFIX)
    report = (lambda row: _append_line(progress, row)) if rank == 0 else None  # steps' rows are all-reduced
    rows = trainer.train(job.train_samples(), job.iteration, report)
    trained = time.monotonic()
    # The largest of the ranks' peaks (each rank's GPU); None on CPU.
    peak_mb = None
    if device_type == "cuda":
        peak_bytes = torch.tensor([float(torch.cuda.max_memory_allocated(device))], dtype=torch.float64)
        peak_mb = round(float(trainer.stepper.all_reduce(peak_bytes, "max")[0]) / 1e6, 1)
    _save(engine, model, job, cfg, TrainerState(trainer.global_step, job.iteration, cfg.lora_rank > 0))
    saved = time.monotonic()
    if rank == 0:
        metrics = session_metrics(
            rows, loaded - started, trained - loaded, saved - trained, resumed, "deepspeed", world
        )
        metrics["zero_stage"] = cfg.zero_stage
        metrics["zero_offload"] = cfg.zero_offload
        metrics["nodes"] = cfg.nodes
        metrics["peak_gpu_memory_mb"] = peak_mb
        Path(str(job_path) + ".result.json").write_text(json.dumps({"rows": rows, "metrics": metrics}))
    dist.destroy_process_group()  # its threads joined here, not left to the interpreter's teardown


def _append_line(path: Path, row: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DeepSpeedLaunchError(RuntimeError):
    pass


def _tail(log_path: Path, chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-chars:]


def _kill_tree(launcher: subprocess.Popen) -> int:
    """SIGKILL the launcher and every process below it, and wait for them; how many there were."""
    try:
        root = psutil.Process(launcher.pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return 0
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=10)
    launcher.wait()
    return len(tree)


# DeepSpeed's CPU all-reduce maps one POSIX shared-memory file per rank (deepspeed/ops/csrc/cpu/comm/shm.cpp,
# `deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`, 69 MB each) and never unlinks it: every
# CPU job would leave them in /dev/shm (RAM) until reboot. The ranks unlink them once all have mapped them
# (`worker`), and `launch` again when the job ends (a rank that died before that point).
SHM_DIR = Path("/dev/shm")


def remove_shm_buffers(port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Unlink this user's DeepSpeed all-reduce buffers of the job on `port` (any address, any rank)."""
    removed = sorted(shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _watch_stage(stage: str, poll_s: float = 1.0) -> None:
    """In a rank: kill this process once the train stage that launched it (`pid:start time`) has ended.

    The start time tells the stage from a later process given the same pid; a zombie counts as ended.
    """
    pid, started = stage.split(":")

    def stage_alive() -> bool:
        try:
            process = psutil.Process(int(pid))
            return process.create_time() == float(started) and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while stage_alive():
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: the stage that would use this rank's work is gone

    threading.Thread(target=watch, daemon=True, name="rlpipe stage watch").start()


# A launch's time when train.launch_timeout_s is not set: the launch itself (ranks start, the model loads, DeepSpeed's
# CPU Adam compiles on first use, ~1.5 min here) and 1 s per token trained, every epoch plus the old-policy pass.
# A 2-core CPU trains SmolLM2-135M at ~55 tokens/s, so a job that reaches it has a hung rank, not a slow one.
LAUNCH_ALLOWANCE_S = 900.0
SECONDS_PER_TOKEN = 1.0


def launch_timeout(cfg: TrainConfig, samples: list[dict]) -> float:
    """`train.launch_timeout_s`, or sized from the job: LAUNCH_ALLOWANCE_S + SECONDS_PER_TOKEN * tokens *
    (epochs + 1), tokens = prompt + response tokens of every sample."""
    if cfg.launch_timeout_s is not None:
        return cfg.launch_timeout_s
    tokens = sum(len(sample["prompt_ids"]) + len(sample["response_ids"]) for sample in samples)
    return LAUNCH_ALLOWANCE_S + SECONDS_PER_TOKEN * tokens * (cfg.epochs + 1)


def extension_build_locks(root: Path | None = None) -> list[Path]:
    """torch's build locks of compiled ops (`<root>/<build>/<op>/lock`, or `<root>/<op>/lock` under
    $TORCH_EXTENSIONS_DIR), where DeepSpeed's CPU Adam is built on first use."""
    if root is None:
        configured = os.environ.get("TORCH_EXTENSIONS_DIR")
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(configured or get_default_build_root())
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def open_paths() -> set[str]:
    """Every file some process on this machine has open (that this process may look at), by real path."""
    paths = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    paths.add(os.path.realpath(os.readlink(fd)))
        except OSError:
            continue
    return paths


def remove_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Remove each build lock whose holder is gone, and return them. torch's FileBaton is an empty file that the
    building process creates, keeps open while it compiles, and deletes after; a launch killed mid-build (its
    timeout, a Ctrl-C) leaves it, and every later build of that op waits for it forever. A lock no process here
    has open is such a leftover. A holder on another machine (a home directory shared over NFS) or in another
    pid namespace cannot be seen: keep TORCH_EXTENSIONS_DIR on a local disk."""
    locks = extension_build_locks(root)
    if not locks:
        return []
    held = open_paths()
    stale = [lock for lock in locks if os.path.realpath(lock) not in held]
    for lock in stale:
        lock.unlink(missing_ok=True)
    return stale


# A multi-node train job's directories in `nodes_dir`; each holds the job file (JOB_FILE), the hostfile and the
# nodes' launcher logs (`node_log`). The train stage makes one per launch and removes it when the launch ends.
JOB_DIR_PREFIX = ".rlpipe-ds-"
JOB_FILE = "job.json"
HOSTFILE = "hostfile"
# How long node 0 waits for every other node to take its job (`serve_node` polls once a second) before it fails
# the stage naming the node, rather than waiting at the rendezvous until the launch's timeout.
NODE_JOIN_TIMEOUT_S = 120.0
POLL_S = 1.0


def nodes_dir(run_dir: str, run_id: str) -> Path:
    """Where the train stage of a multi-node run puts each job for the other nodes (`serve_node`): in the run's
    directory under a local root, else (an s3:// root) in rlpipe's cache directory. Either must be at the same
    path on every train node, as the checkpoint the ranks build there must be."""
    if is_remote(run_dir):
        return settings.cache_dir() / "train-nodes" / run_id
    return Path(run_dir) / ".train-nodes"


def remove_stale_jobs(directory: Path) -> list[Path]:
    """Remove the job directories a killed train stage left in `directory`: only one train stage of a run runs at a
    time (under its lease), so none is live, and a node still serving one ends its ranks once its file goes."""
    stale = sorted(directory.glob(f"{JOB_DIR_PREFIX}*"))
    for job_dir in stale:
        shutil.rmtree(job_dir, ignore_errors=True)
    return stale


def node_log(job_path: Path, node_rank: int) -> Path:
    """The launcher log of node `node_rank` of a job: `<job>.log` on node 0, `<job>.node<R>.log` on the others."""
    return Path(f"{job_path}.log") if node_rank == 0 else Path(f"{job_path}.node{node_rank}.log")


def launcher_command(job: TrainJob, job_path: Path, processes: int, port: int, node_rank: int = 0) -> list[str]:
    """The DeepSpeed launcher running `job` on this node: its `processes` ranks, or node `node_rank`'s ranks of a
    multi-node job (whose hostfile is beside the job file)."""
    cfg = job.cfg
    if cfg.nodes > 1:
        resources = node_resources(job_path.parent / HOSTFILE, node_rank, str(cfg.master_addr))
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        resources = launcher_resources("cpu" if job.device == "cpu" else "cuda", processes, visible)
    return [sys.executable, "-m", "deepspeed.launcher.runner", *resources, "--master_port", str(port),
            "--module", "stages.rl.deepspeed_backend", "--job", str(job_path)]


def launcher_environment(job: TrainJob, processes: int, watched: psutil.Process) -> dict[str, str]:
    """The launcher's environment: this checkout importable, the process whose end ends the ranks (`watched`),
    the accelerator, and the node's threads shared by its `processes` ranks."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        STAGE_ENV: f"{watched.pid}:{watched.create_time()}",
        # DeepSpeed would pick CUDA by itself on a GPU machine, also for a stage told to train on the CPU.
        "DS_ACCELERATOR": "cpu" if job.device == "cpu" else "cuda",
    }
    env.setdefault("OMP_NUM_THREADS", str(max(1, job.threads // processes)))
    return env


def run_launcher(
    command: list[str], env: dict[str, str], log_path: Path, timeout_s: float | None,
    failure: Callable[[], str | None] = lambda: None,
) -> int:
    """Run the launcher (output to `log_path`) until it exits, and return its exit code. It is killed, launcher
    and ranks, when `timeout_s` passes, when `failure()` (asked every POLL_S) names a reason to give up, or on
    an exception or a signal while waiting; the first two raise DeepSpeedLaunchError with the reason."""
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return launcher.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                reason = f"did not finish in {timeout_s:g}s"
            elif (reason := failure()) is None:
                continue
            killed = _kill_tree(launcher)
            raise DeepSpeedLaunchError(
                f"deepspeed job {command[-1]} {reason}: killed its {killed} processes (launcher and ranks); "
                f"its output ended:\n{_tail(log_path)}"
            )
    except BaseException:  # an exception or a signal while waiting: the job's work is not wanted any more
        _kill_tree(launcher)
        raise


def node_exit(job_path: Path, node_rank: int) -> Path:
    """Where node `node_rank` (>= 1) writes its launcher's exit code once its ranks of the job have ended."""
    return Path(f"{job_path}.node{node_rank}.exit")


def _node_failure(job_path: Path, nodes: int, started: float) -> str | None:
    """Node 0's reason to give up on a multi-node job: a node whose ranks failed (node 0's ranks would only
    notice at their collective's timeout, minutes later, if the peer's connection did not close), or one that
    has not taken the job in NODE_JOIN_TIMEOUT_S."""
    for rank in range(1, nodes):
        exit_path = node_exit(job_path, rank)
        if exit_path.exists() and (code := exit_path.read_text().strip()) not in ("", "0"):
            return f"failed on node {rank}: its launcher exited with {code} (a rank failed or was killed there)"
    if time.monotonic() - started < NODE_JOIN_TIMEOUT_S:
        return None
    missing = [rank for rank in range(1, nodes) if not node_log(job_path, rank).exists()]
    if not missing:
        return None
    return (f"was not taken by node {missing[0]} in {NODE_JOIN_TIMEOUT_S:g}s: run `rlpipe train-node RUN "
            f"--node-rank {missing[0]}` there, with the job's directory {job_path.parent} at the same path")


def _other_nodes_output(job_path: Path, nodes: int) -> str:
    """The tails of the other nodes' launcher logs, for node 0's error (a rank may have died there)."""
    return "".join(f"\nnode {rank}'s output ended:\n{_tail(node_log(job_path, rank))}"
                   for rank in range(1, nodes) if node_log(job_path, rank).exists())


def launch(job: TrainJob, job_path: Path, processes: int, timeout_s: float | None = None) -> tuple[list[dict], dict]:
    """Run `job` under the DeepSpeed launcher with `processes` ranks (per node); returns rank 0's (rows, metrics).

    The launcher's output goes to `<job_path>.log`; its tail (and the other nodes') is in the error when the job
    fails. With `timeout_s`, a job still running after that long is killed, launcher and ranks, and raises.
    A multi-node job (`train.nodes`) writes its hostfile beside `job_path`, then the job file last (by rename,
    since the other nodes take it the moment it appears), and is this node's share: node 0's ranks.
    """
    for lock in remove_stale_build_locks():
        print(f"removed a stale torch extension build lock (its builder is gone): {lock}", file=sys.stderr)
    cfg = job.cfg
    result_path = Path(str(job_path) + ".result.json")
    result_path.unlink(missing_ok=True)
    port = cfg.master_port if cfg.nodes > 1 else _free_port()
    if cfg.nodes > 1:
        write_hostfile(job_path.parent / HOSTFILE, cfg.nodes, processes)
    job.dump(job_path)
    started = time.monotonic()
    failure = (lambda: _node_failure(job_path, cfg.nodes, started)) if cfg.nodes > 1 else (lambda: None)
    command = launcher_command(job, job_path, processes, port)
    try:
        returncode = run_launcher(command, launcher_environment(job, processes, psutil.Process()),
                                  node_log(job_path, 0), timeout_s, failure)
    except DeepSpeedLaunchError as error:  # a timeout, a node that failed or never came: its output too
        raise DeepSpeedLaunchError(f"{error}{_other_nodes_output(job_path, cfg.nodes)}") from None
    finally:
        remove_shm_buffers(port)
    if returncode != 0 or not result_path.is_file():
        raise DeepSpeedLaunchError(
            f"deepspeed launcher exited with {returncode} (a rank failed or was killed):\n"
            f"{_tail(node_log(job_path, 0))}{_other_nodes_output(job_path, cfg.nodes)}"
        )
    # The job's directory goes when the stage returns, which ends the ranks still running elsewhere: let the other
    # nodes' ranks, done with their work once rank 0 has saved, exit by themselves first.
    deadline = time.monotonic() + NODE_JOIN_TIMEOUT_S
    while time.monotonic() < deadline and not all(node_exit(job_path, r).exists() for r in range(1, cfg.nodes)):
        time.sleep(POLL_S / 4)
    result = json.loads(result_path.read_text())
    return result["rows"], result["metrics"]


def serve_job(job_path: Path, node_rank: int) -> int:
    """Run node `node_rank`'s ranks of one multi-node job until they end, or until its job file goes (node 0's
    stage ended); returns the launcher's exit code."""
    job = TrainJob.load(job_path)
    cfg = job.cfg
    processes = hostfile_slots(job_path.parent / HOSTFILE)
    command = launcher_command(job, job_path, processes, cfg.master_port, node_rank)

    def withdrawn() -> str | None:
        return None if job_path.exists() else "was withdrawn by node 0 (its train stage ended)"

    code = -1  # killed: a timeout, the job withdrawn, an interrupt
    try:
        code = run_launcher(command, launcher_environment(job, processes, psutil.Process()),
                            node_log(job_path, node_rank), launch_timeout(cfg, job.samples), withdrawn)
        return code
    finally:
        remove_shm_buffers(cfg.master_port)
        with contextlib.suppress(OSError):  # the job's directory may be gone with the job
            node_exit(job_path, node_rank).write_text(f"{code}\n")


def serve_node(directory: Path, node_rank: int, stop: threading.Event | None = None) -> None:
    """Be node `node_rank` of a run's multi-node train jobs: run this node's ranks of each job the train stage puts
    in `directory` (`nodes_dir`), one at a time, once each, until `stop` is set or the process is interrupted.
    A job that fails here fails node 0's stage too (its ranks lose a peer); its rerun is a new job."""
    stop = stop or threading.Event()
    served: set[Path] = set()
    print(f"node {node_rank}: waiting for train jobs in {directory}", flush=True)
    while not stop.wait(POLL_S):
        for job_path in sorted(directory.glob(f"{JOB_DIR_PREFIX}*/{JOB_FILE}")):
            if job_path in served:
                continue
            served.add(job_path)
            print(f"node {node_rank}: running {job_path}", flush=True)
            try:
                code = serve_job(job_path, node_rank)
                outcome = "done" if code == 0 else f"failed: launcher exited with {code}"
            except (DeepSpeedLaunchError, FileNotFoundError) as error:
                outcome = f"ended: {str(error).splitlines()[0]}"
            print(f"node {node_rank}: {job_path} {outcome} (log {node_log(job_path, node_rank)})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rlpipe DeepSpeed training worker (run by the launcher)")
    parser.add_argument("--job", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by some launcher versions
    args, _ = parser.parse_known_args(argv)
    if stage := os.environ.get(STAGE_ENV):
        _watch_stage(stage)
    worker(args.job)
    end_process(0)  # a rank that wrote its work must not die in a C++ destructor at exit (storage/process.py)


if __name__ == "__main__":
    main()
