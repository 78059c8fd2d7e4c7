"""The warm engine: an N-iteration run's generate + evaluate time with one engine per run vs an engine per stage.

Two runs of the same small config, each a real `rlpipe run` (driver, stage fork server, every stage a process):
`generate.warm_engine: off` (a fresh vLLM engine in every generate and evaluate stage, as before) and `on` (the
run's generation server: one engine, each checkpoint loaded in place). From their manifests it prints the
generate + evaluate stage time of each (the manifests' `seconds`, evaluate_base included) and the engine
starts per run (target: 1 per machine for the warm run). Then bare vLLM: one `vllm.LLM` (the stage's precision
and context length, vLLM's defaults otherwise), per iteration `reload_weights` of the checkpoint the run
generated with and `LLM.generate` of the same prompts with `SamplingParams(n=...)`, no seeds, no logprobs.
Throughput of generate including its amortised engine start: tokens / (generation + loading + the engine start
x generate's share of the engine's users (N of 2N+1 stages)), the same share for both; target: warm stage >=
0.95 x bare. Runs one after the other; loads are printed (the machine may be shared). On a shared machine wall
time follows the other jobs, so the same ratio is also printed in CPU seconds: the generation server's own
(it reports them per request and engine start) against the bare engine's process tree (/proc).

Run: `.venv/bin/python -m benchmarks.engine` (`--iterations 2`, small sizes: `--help`; `--root DIR` keeps runs).

Measured 2026-11-25 20:14, nothing else running (load 0.4 -> 1.7), the defaults: engine starts per run, warm 1,
fresh 5; generate + evaluate stages warm 56.8 s / fresh 79.7 s = 0.71; generate, warm stage 128.7 tok/s against
bare vLLM 93.3 tok/s with the amortised start: **1.38** (1.27 per CPU second; target >= 0.95). Generation alone
runs at the same rate (11.7 s against 11.8 s for ~1,940 tokens): bare `LLM()` spawns vLLM's engine-core and
worker processes, which import vLLM again (start 20.9 s), where the server's engine core runs in its process
(8.5 s). Details in docs/measurements.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_STAGES = ("evaluate_base", "generate", "evaluate")


def load1() -> float:
    return os.getloadavg()[0]


def run_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"iterations={args.iterations}", "threads=2", "device=cpu", "generate.backend=vllm",
        f"generate.prompts_per_iteration={args.prompts}", f"generate.n_samples={args.samples}",
        f"generate.max_new_tokens={args.max_new_tokens}", "generate.mismatch_samples=0",
        f"generate.vllm_kv_cache_gib={args.kv_cache_gib}", f"data.max_test_prompts={args.test_prompts}",
        f"evaluate.n_samples={args.eval_samples}", f"evaluate.k=[1,{args.eval_samples}]",
        f"evaluate.max_new_tokens={args.max_new_tokens}", "evaluate.every=1", "score.workers=2",
    ]


def rlpipe_run(root: Path, run_id: str, overrides: list[str], log: Path) -> float:
    """`rlpipe run` to completion, its output in `log`; its wall seconds."""
    command = [sys.executable, "-m", "flows.cli", "run", "--root", str(root), "--run-id", run_id]
    for override in overrides:
        command += ["--set", override]
    started = time.monotonic()
    with open(log, "wb") as handle:
        code = subprocess.call(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"rlpipe run {run_id} exited {code}; see {log}")
    return time.monotonic() - started


@dataclass
class RunFigures:
    name: str
    wall_seconds: float
    stage_seconds: float  # generate + evaluate + evaluate_base stages, from their manifests
    engine_starts: int
    generate_tokens: int
    generate_seconds: float  # generation inside the generate stages
    generate_load_seconds: float  # what each generate stage paid to have its engine (own start, or load)
    engine_start_seconds: float  # the warm run's one engine start (server side); the fresh run's mean start
    start_and_load_seconds: float  # every model stage's engine start or checkpoint load, the whole run
    generate_cpu_seconds: float  # the generation server's CPU seconds in the generate stages (warm run)
    engine_start_cpu_seconds: float  # the server's CPU seconds for its engine start (warm run)
    load_before: float
    load_after: float


def model_stage_manifests(run_dir: Path) -> list[dict]:
    found = []
    for path in sorted(run_dir.rglob("*.parquet.manifest.json")):
        manifest = json.loads(path.read_text())
        if manifest["stage"] in MODEL_STAGES:
            found.append(manifest)
    return found


def figures(name: str, run_dir: Path, wall: float, load_before: float) -> RunFigures:
    manifests = model_stage_manifests(run_dir)
    generate = [m for m in manifests if m["stage"] == "generate"]
    records = [m["metrics"]["warm_engine"] for m in manifests]
    warm_engines = {engine for r in records if r["used"] for engine in r["engine_ids"]}
    own_engines = [m for m, r in zip(manifests, records, strict=True) if not r["used"]]
    if warm_engines:
        start = sum(r["engine_start_seconds"] for r in records if r["used"])
    else:
        start = sum(m["metrics"]["engine_start_seconds"] for m in own_engines) / max(len(own_engines), 1)
    return RunFigures(
        name, wall, sum(m["seconds"] for m in manifests), len(warm_engines) + len(own_engines),
        sum(m["metrics"]["generated_tokens"] for m in generate),
        sum(m["metrics"]["generation_seconds"] for m in generate),
        sum(m["metrics"]["engine_start_seconds"] for m in generate), start,
        sum(m["metrics"]["engine_start_seconds"] for m in manifests),  # a warm stage's includes the start it waited for
        sum(m["metrics"]["warm_engine"].get("generation_cpu_seconds", 0.0) for m in generate),
        sum(r.get("engine_start_cpu_seconds", 0.0) for r in records), load_before, load1(),
    )


@dataclass
class BareFigures:
    tokens: int
    generate_seconds: float
    reload_seconds: float
    engine_start_seconds: float
    load_before: float
    load_after: float
    generate_cpu_seconds: float = 0.0
    reload_cpu_seconds: float = 0.0
    engine_start_cpu_seconds: float = 0.0


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (vLLM's engine core is a child)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def bare_vllm(run_dir: Path, iterations: int, args: argparse.Namespace) -> BareFigures:
    """One engine for every iteration: reload the run's checkpoint k-1 in place, generate its prompts."""
    import pyarrow.parquet as pq

    from stages.generation.vllm_backend import configure_cpu_environment, context_length, resolve_engine_settings

    load_before = load1()
    configure_cpu_environment(args.kv_cache_gib, 1)
    started, cpu = time.monotonic(), tree_cpu_seconds(os.getpid())
    from vllm import LLM, SamplingParams

    dtype, enforce_eager = resolve_engine_settings("auto", "auto", on_cpu=True)
    base = json.loads((run_dir / "checkpoints" / "base" / "manifest.json").read_text())
    model_dir = base["metrics"]["local_path"]
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=enforce_eager, seed=0,
              max_model_len=context_length(768, args.max_new_tokens))
    start_seconds, start_cpu = time.monotonic() - started, tree_cpu_seconds(os.getpid()) - cpu
    tokens, generate_seconds, reload_seconds, generate_cpu, reload_cpu = 0, 0.0, 0.0, 0.0, 0.0
    for k in range(iterations):
        if k > 0:
            started, cpu = time.monotonic(), tree_cpu_seconds(os.getpid())
            checkpoint = run_dir / "checkpoints" / f"iter={k - 1:04d}"
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint)})
            llm.reset_prefix_cache()
            reload_seconds += time.monotonic() - started
            reload_cpu += tree_cpu_seconds(os.getpid()) - cpu
        rows = pq.read_table(run_dir / f"iter={k:04d}" / "rollouts.parquet").to_pylist()
        prompts = list({tuple(r["prompt_token_ids"]): None for r in rows})
        params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_new_tokens)
        started, cpu = time.monotonic(), tree_cpu_seconds(os.getpid())
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        generate_seconds += time.monotonic() - started
        generate_cpu += tree_cpu_seconds(os.getpid()) - cpu
        tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return BareFigures(tokens, generate_seconds, reload_seconds, start_seconds, load_before, load1(), generate_cpu,
                       reload_cpu, start_cpu)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="training prompts per iteration")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--test-prompts", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--root", help="keep the runs here (default: a temporary directory, removed)")
    return parser.parse_args()


def main() -> None:
    from stages.generation.client import ping, server_address
    from storage.run import Run

    args = parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="rlpipe-engine-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    overrides = run_overrides(args)
    print(f"{args.iterations} iterations, {args.prompts} prompts x {args.samples} samples x <= {args.max_new_tokens} "
          f"tokens, evaluation {args.test_prompts} prompts x (greedy + {args.eval_samples}); cores "
          f"{len(os.sched_getaffinity(0))}; runs under {root}", flush=True)
    runs: dict[str, RunFigures] = {}
    try:
        for name, switch in (("fresh", "off"), ("warm", "on")):
            before = load1()
            wall = rlpipe_run(root, name, [*overrides, f"generate.warm_engine={switch}"], root / f"{name}.log")
            runs[name] = figures(name, root / "runs" / name, wall, before)
            print(f"{name}: run {wall:.1f} s, load {before:.1f} -> {runs[name].load_after:.1f}", flush=True)
        warm_run = Run.open(str(root), "warm")
        address = server_address(warm_run.layout.run_dir, warm_run.config.generate, warm_run.config.device)
        server_left = ping(address) is not None
        bare = bare_vllm(root / "runs" / "warm", args.iterations, args)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)

    print()
    stages = 2 * args.iterations + 1  # evaluate_base, and generate + evaluate per iteration (evaluate.every=1)
    share = args.iterations / stages
    for run in runs.values():
        print(f"{run.name:<6} generate+evaluate stages {run.stage_seconds:7.1f} s   engine starts per run "
              f"{run.engine_starts}   (whole run {run.wall_seconds:.1f} s, load {run.load_before:.1f} -> "
              f"{run.load_after:.1f})")
    fresh, warm = runs["fresh"], runs["warm"]
    print(f"generate + evaluate time, warm / fresh = {warm.stage_seconds / fresh.stage_seconds:.2f}   "
          f"(engine starts: warm {warm.engine_starts} (target 1), fresh {fresh.engine_starts})")
    print(f"engine starts + checkpoint loads, whole run: fresh {fresh.start_and_load_seconds:.1f} s, warm "
          f"{warm.start_and_load_seconds:.1f} s")
    print(f"the warm run's server was {'STILL RUNNING' if server_left else 'stopped'} after the run")
    warm_rate = warm.generate_tokens / (warm.generate_seconds + warm.generate_load_seconds
                                        + warm.engine_start_seconds * share)
    bare_rate = bare.tokens / (bare.generate_seconds + bare.reload_seconds + bare.engine_start_seconds * share)
    print(f"generate, warm stage: {warm.generate_tokens} tok in {warm.generate_seconds:.1f} s + loads "
          f"{warm.generate_load_seconds:.1f} s + engine start {warm.engine_start_seconds:.1f} s x {share:.2f} "
          f"= {warm_rate:.1f} tok/s")
    print(f"generate, bare vLLM:  {bare.tokens} tok in {bare.generate_seconds:.1f} s + reloads "
          f"{bare.reload_seconds:.1f} s + engine start {bare.engine_start_seconds:.1f} s x {share:.2f} = "
          f"{bare_rate:.1f} tok/s   (load {bare.load_before:.1f} -> {bare.load_after:.1f})")
    print(f"warm generate stage / bare vLLM (amortised start) = {warm_rate / bare_rate:.2f}   (target >= 0.95)")
    warm_cpu_rate = warm.generate_tokens / (warm.generate_cpu_seconds + warm.engine_start_cpu_seconds * share)
    bare_cpu_rate = bare.tokens / (bare.generate_cpu_seconds + bare.reload_cpu_seconds
                                   + bare.engine_start_cpu_seconds * share)
    print(f"in CPU seconds: warm stage {warm.generate_cpu_seconds:.1f} + start {warm.engine_start_cpu_seconds:.1f} x "
          f"{share:.2f} = {warm_cpu_rate:.1f} tok/CPU-s; bare {bare.generate_cpu_seconds:.1f} + reloads "
          f"{bare.reload_cpu_seconds:.1f} + start {bare.engine_start_cpu_seconds:.1f} x {share:.2f} = "
          f"{bare_cpu_rate:.1f} tok/CPU-s; ratio {warm_cpu_rate / bare_cpu_rate:.2f}")


if __name__ == "__main__":
    main()
