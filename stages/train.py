"""Stage `train`: update the policy on this iteration's batch and write checkpoint k + train_metrics k.

The kept batch rows are joined with their rollouts (token ids, the sampler's logprobs) on the rollout key, in
key order, into `TrainSample`s and trained from checkpoint k-1 (the base model for k = 0; the rows were sampled
by checkpoint k-1-N, N = pipeline.max_staleness, and train_metrics reports k - policy_step as `staleness`)
by stages/rl/session.py (plain torch, in this process) or stages/rl/deepspeed_backend.py
(`train.processes` ranks). Old-policy logprobs are recomputed by the trainer at the generation temperature;
the sampler's are the behaviour policy for rollout correction (or the old policy, `bypass_old_logprobs`).
The KL reference is the base model, verified against the run's base-model hash. A skipped batch (no kept
nonzero advantage) trains nothing: the checkpoint is a copy of the input policy, so iteration k+1 has one,
and the table holds one row with skipped = True. Otherwise train_metrics' manifest says `deterministic: false`,
since each step's `seconds` is measured (on CPU it names that column alone: `nondeterministic_columns`). Seeds
are fixed by (train.seed, iteration). With GAE a critic trains beside the policy (stages/rl/critic.py), in the
checkpoint's `critic/`. A multi-turn rollout's `loss_mask` goes with its sample: observation tokens are context,
never loss. A progress bar counts the optimizer steps with loss, KL and tokens/s; DeepSpeed's rank 0 reports each
step through a file. With `train.nodes` > 1 this process is node 0 and the job goes to the run's directory for
the other nodes' `rlpipe train-node` (`job_parent`).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch  # noqa: F401 - imported first so the harness sets torch's thread count (stages/harness.py)

from schemas.errors import InputError
from schemas.tables import ROLLOUT_KEY
from stages.generation.device import claim_device, device_record, release_memory, resolve_dtype
from stages.harness import StageContext, exit_with
from stages.rl.advantages import ESTIMATORS, TOKEN_COLUMNS
from stages.rl.checkpoint import TrainerState, copy_policy, read_state
from stages.rl.critic import copy_value_model
from stages.rl.filters import is_skip_step
from stages.rl.schedule import lr_at
from stages.rl.session import TrainJob, peak_rss_mb, run_job
from stages.rl.trainer import optimizer_steps
from storage.progress import progress_bar
from storage.retention import require_unpruned


def _key(row: dict[str, Any]) -> tuple:
    return tuple(row[name] for name in ROLLOUT_KEY)


def training_samples(
    batch: list[dict], rollouts: list[dict], source: str = "batch"
) -> tuple[list[dict], int]:
    """Kept batch rows joined with their rollouts, in rollout-key order, as TrainSample fields.

    Returns the samples and the number of kept rows with an empty response (nothing to train on; left out).
    """
    by_key = {_key(r): r for r in rollouts}
    samples, empty = [], 0
    for row in sorted((r for r in batch if r["kept"]), key=_key):
        rollout = by_key.get(_key(row))
        if rollout is None:
            raise InputError(
                f"{source}: kept row {dict(zip(ROLLOUT_KEY, _key(row), strict=True))} has no rollout"
            )
        if not math.isfinite(row["advantage"]):
            raise InputError(f"{source}: advantage {row['advantage']} of {_key(row)} is not finite")
        if not rollout["response_token_ids"]:
            empty += 1
            continue
        samples.append(
            {
                "prompt_ids": list(rollout["prompt_token_ids"]),
                "response_ids": list(rollout["response_token_ids"]),
                "behaviour_logprobs": [float(x) for x in rollout["response_logprobs"]],
                "advantage": float(row["advantage"]),
                # GAE's per-token columns (batch/v2), absent or null for outcome estimators
                **{name: [float(x) for x in row[name]] for name in TOKEN_COLUMNS if row.get(name) is not None},
                # multi-turn: observation tokens (0) stay out of every loss term; absent single-turn
                **({"loss_mask": [int(x) for x in mask]} if (mask := rollout.get("loss_mask")) is not None else {}),
            }
        )
    return samples, empty


def staleness(iteration: int, batch: list[dict], rollouts: list[dict]) -> dict[str, float | int]:
    """How many train stages the sampler of the rows trained (kept, with a response) was behind: mean and max of
    k - policy_step. A null policy_step (a rollouts table before v3, made in strict order by checkpoint k-1) is
    k: staleness 0. NaN mean and max 0 when no row is trained."""
    kept = {_key(row) for row in batch if row["kept"]}
    behind = [iteration - (r["policy_step"] if r.get("policy_step") is not None else iteration)
              for r in rollouts if _key(r) in kept and r["response_token_ids"]]
    if not behind:
        return {"staleness_mean": math.nan, "staleness_max": 0}
    return {"staleness_mean": sum(behind) / len(behind), "staleness_max": max(behind)}


def skipped_row(global_step: int, lr: float) -> dict[str, Any]:
    """The one metrics row of a skipped step: nothing was computed, so the statistics are NaN, counts 0."""
    nan = math.nan
    return {
        "step": global_step,
        "epoch": 0,
        "skipped": True,
        "loss": nan,
        "policy_loss": nan,
        "clip_frac_low": 0.0,
        "clip_frac_high": 0.0,
        "clip_frac_dual": 0.0,
        "approx_kl": nan,
        "kl_ref": nan,
        "entropy": nan,
        "is_ratio_mean": nan,
        "is_ratio_min": nan,
        "is_ratio_max": nan,
        "is_ess": nan,
        "rejected_frac": 0.0,
        "grad_norm": nan,
        "lr": lr,
        "tokens": 0,
        "loss_tokens": 0,
        "padding_frac": 0.0,
        "sequences": 0,
        "seconds": 0.0,
        "value_loss": nan,
        "vf_clip_frac": 0.0,
        "vf_explained_var": nan,
    }


@contextlib.contextmanager
def step_progress(total: int, label: str) -> Iterator[Callable[[dict], None]]:
    """A progress bar over `total` optimizer steps; yields the callback each step's metrics row goes to. It shows
    the step's loss and KL (to the sampling policy; to the reference too when the loss has it) and tokens/s over
    the steps so far (tokens forwarded / seconds of the steps)."""
    with progress_bar(label, total) as advance:
        totals = {"tokens": 0.0, "seconds": 0.0}

        def on_step(row: dict) -> None:
            totals["tokens"] += row["tokens"]
            totals["seconds"] += row["seconds"]
            rate = totals["tokens"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
            kl_ref = row.get("kl_ref")
            to_ref = f" · KL ref {kl_ref:.2e}" if kl_ref and math.isfinite(kl_ref) else ""  # 0: no KL term
            stats = f"loss {row['loss']:+.4f} · KL {row['approx_kl']:.2e}{to_ref} · {rate:.0f} tok/s"
            advance(1, stats)

        yield on_step


@contextlib.contextmanager
def following(path: Path, on_line: Callable[[dict], None], poll_s: float = 0.5) -> Iterator[None]:
    """While the block runs, hand each complete JSON line appended to `path` to `on_line` (polled every `poll_s`),
    and the rest once it ends: how the stage sees the steps DeepSpeed's rank 0 reports (PROGRESS_SUFFIX)."""
    stop = threading.Event()

    def follow() -> None:
        offset = 0
        while True:
            stopping = stop.wait(poll_s)
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next poll
                offset += len(complete)
                for line in complete.splitlines():
                    on_line(json.loads(line))
            if stopping:
                return

    thread = threading.Thread(target=follow, daemon=True, name="rlpipe train progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def reference_dir(ctx: StageContext) -> Path | None:
    """The frozen KL reference: the base model, re-resolved on this machine and checked against its hash."""
    if ctx.config.train.kl_coef <= 0:
        return None
    return ctx.policy_dir("reference")


def job_parent(ctx: StageContext) -> str | None:
    """Where a DeepSpeed job's directory goes: the system's temporary directory for one node; for several, the
    run's directory the other nodes' `rlpipe train-node` watch, cleared of the jobs of a killed earlier attempt
    (whose ranks on the other nodes end as their job file goes)."""
    if ctx.config.train.nodes == 1:
        return None
    from stages.rl.deepspeed_backend import nodes_dir, remove_stale_jobs

    directory = nodes_dir(ctx.layout.run_dir, ctx.run_id)
    directory.mkdir(parents=True, exist_ok=True)
    if stale := remove_stale_jobs(directory):
        print(f"removed {len(stale)} train job(s) of an earlier attempt that did not finish: {stale}")
    return str(directory)


def run(ctx: StageContext) -> None:
    cfg = ctx.config.train
    require_unpruned(ctx.inputs["policy"], optimizer=True)  # Adam's moments carry over: never start them afresh
    if needed := ctx.inputs["batch"].metrics.get("groups_needed", 0):
        rounds = ctx.inputs["batch"].metrics.get("rounds", 1)
        raise InputError(
            f"{ctx.inputs['batch'].path}: dynamic sampling still needs {needed} kept groups (advantage.target_groups"
            f"={ctx.config.advantage.target_groups}): run generate and score round {rounds}, then advantage, first "
            "(the iteration flow does this)"
        )
    device = claim_device(ctx.config.device)
    deepspeed = cfg.backend == "deepspeed"
    if deepspeed:
        from stages.rl.deepspeed_backend import launch, launch_timeout, resolve_processes

        ranks = resolve_processes(cfg.processes, device.type, device.gpus)  # refused here, before any work
    batch = ctx.read_input("batch").to_pylist()
    columns = [*ROLLOUT_KEY, "prompt_token_ids", "response_token_ids", "response_logprobs", "loss_mask", "policy_step"]
    rollouts = ctx.read_rounds("rollouts", columns).to_pylist()  # every generation round the batch drew on
    samples, empty = training_samples(batch, rollouts, ctx.inputs["batch"].path)
    behind = staleness(ctx.iteration, batch, rollouts)
    policy_dir = ctx.policy_dir()
    out_dir = ctx.scratch_checkpoint_dir()
    state = read_state(policy_dir)
    advantages = [s["advantage"] for s in samples]
    skipped = is_skip_step(advantages, [True] * len(advantages))

    if skipped:
        copy_policy(policy_dir, out_dir, TrainerState(state.global_step, ctx.iteration, state.lora))
        copy_value_model(policy_dir, out_dir)  # the critic carries over too (PPO with GAE)
        rows = [skipped_row(state.global_step, lr_at(state.global_step, cfg))]
        metrics: dict[str, Any] = {"backend": cfg.backend, "steps": 0, "peak_rss_mb": round(peak_rss_mb(), 1)}
    else:
        job = TrainJob(
            policy_dir=str(policy_dir),
            out_dir=str(out_dir),
            train=cfg.model_dump(mode="json"),
            iteration=ctx.iteration,
            temperature=ctx.config.generate.temperature,
            # the longest response: max_new_tokens, or the conversation budget of a multi-turn run
            norm_length=cfg.loss_norm_length or ctx.config.generate.response_token_limit,
            reference_dir=str(ref) if (ref := reference_dir(ctx)) else None,
            threads=ctx.config.threads,
            samples=samples,
            # The ranks take their own GPUs (local rank) on CUDA; one process trains on the stage's device.
            device=device.type if deepspeed else device.torch,
            critic=ESTIMATORS[ctx.config.advantage.estimator].needs_critic,
        )
        with step_progress(optimizer_steps(cfg, len(samples)), ctx.instance.label) as on_step:
            if deepspeed:
                from stages.rl.deepspeed_backend import JOB_DIR_PREFIX, JOB_FILE, PROGRESS_SUFFIX

                with tempfile.TemporaryDirectory(prefix=JOB_DIR_PREFIX, dir=job_parent(ctx)) as scratch:
                    job_path = Path(scratch) / JOB_FILE
                    with following(Path(f"{job_path}{PROGRESS_SUFFIX}"), on_step):
                        rows, metrics = launch(job, job_path, ranks, timeout_s=launch_timeout(cfg, samples))
            else:
                rows, metrics = run_job(job, on_step)
        release_memory(device.torch)

    gpus_used = ranks if deepspeed and not skipped else None
    metrics["device"] = device_record(device, resolve_dtype(cfg.dtype, device.torch), gpus_used,
                                      metrics.pop("peak_gpu_memory_mb", None))
    metrics.update({"skipped": skipped, "samples": len(samples), "empty_responses": empty, **behind})
    if not skipped:  # each step's `seconds` is measured wall time; on a GPU the kernels need not repeat the rest
        metrics["deterministic"] = False
        if device.type == "cpu":
            metrics["nondeterministic_columns"] = ["seconds"]
    table_rows = [{"run_id": ctx.run_id, "iteration": ctx.iteration, **row, **behind} for row in rows]
    ctx.write_checkpoint(out_dir, metrics)
    ctx.write_table("train_metrics", pa.Table.from_pylist(table_rows), metrics)


if __name__ == "__main__":
    exit_with("train", run)
