"""Overlapped iterations: iterations per hour with `pipeline.max_staleness: 1` vs 0 (strict), and both reward curves.

Two real `rlpipe run`s of the same config and seed from fresh roots (driver, stage fork server, every stage a
process), one strict and one overlapped, each with its lanes pinned to separate cores as a stand-in for two
machines: `RLPIPE_LANE_CPUS=rollout=0;train=1` (generate, score, evaluate on core 0; advantage, train on core
1), `threads: 1`. Iterations per hour = N / (first iteration stage's start -> last one's end, from the
manifests), so the run-level stages (prompts, base model, base evaluation) count in neither. Target: >= 1.4x.

Overlap can at best turn (G + T) per iteration into max(G, T) (G = generate + score, T = advantage + train), so
the config is one where the two are about equal on this CPU: the default run's shape (4 prompts x 4 samples x
<= 128 tokens, vLLM fp32 eager, an engine per stage) with every group kept (`drop_zero_variance_groups: false`,
TRL's and verl's default). Kept groups matter twice: from iteration 1 on the two runs sample different rollouts,
and with zero-variance groups dropped they trained on different amounts (48 against 56 samples in 8 iterations,
the strict run one skipped step), so the ratio measured the data as much as the schedule; and the train lane's
time followed the kept count (0.5 to 55 s), so the lanes took turns waiting. Kept whole, a batch costs about the
same every iteration (one pass, `--train-epochs 1`). With G = T the ceiling is 2x, less what cannot overlap:
iteration 0's generate, the last train, and the one evaluation (`evaluate.every` is large: only the last
checkpoint is judged, on 2 held-out prompts). Both runs use `train.is_level: token` (max_staleness > 0 needs a
sampler correction; in the strict run the weights are ~1), so the algorithms differ only in the sampler's
staleness. The reward printed per iteration is the mean score of that iteration's rollouts.

Run: `.venv/bin/python -m benchmarks.overlap` (`--iterations 8`: the steady state outweighs the ends; sizes:
`--help`; `--root DIR` keeps the runs). On a shared machine the other jobs share the two cores: the load average
is printed before and after.

Measured 2026-11-25 20:31, nothing else running (load 0.2 -> 1.7), the defaults: strict 557.9 s for the 8
iterations (51.6/hour: generate 29-32 s, train 32-39 s), overlapped 315.0 s (91.4/hour), **ratio 1.77**; both
lanes busy 223 of 315 s; side by side generate took 30-35 s and train 33-39 s, as alone. The overlapped run's
last batch had all rewards 0, a skipped step (0.8 s): with a train of the mean 35 s there it would be ~1.6.
Training reward per iteration, strict / overlapped: .025/.025, .062/.062, .062/.062, .306/.244, .066/.045,
.106/.106, .072/.062, .056/.000 (16 samples each; within their noise). Before every group was kept (2 epochs,
zero-variance groups dropped): 1.27 over 4 iterations and 1.33 over 8, quiet; 0.86 under other jobs' load 6.6,
where both cores were shared with them (docs/measurements.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from stages.registry import ITERATION_STAGES, LANES

REPO = Path(__file__).resolve().parents[1]


def run_overrides(args: argparse.Namespace, staleness: int) -> list[str]:
    return [
        f"iterations={args.iterations}", "threads=1", "device=cpu", f"generate.backend={args.backend}",
        f"generate.prompts_per_iteration={args.prompts}", f"generate.n_samples={args.samples}",
        f"generate.max_new_tokens={args.max_new_tokens}", "generate.temperature=1.0",
        f"generate.warm_engine={args.warm_engine}", f"generate.vllm_kv_cache_gib={args.kv_cache_gib}",
        f"data.max_test_prompts={args.test_prompts}", "evaluate.n_samples=1", "evaluate.k=[1]",
        f"evaluate.max_new_tokens={args.max_new_tokens}", "evaluate.every=1000", "score.workers=1",
        "train.is_level=token", "advantage.drop_zero_variance_groups=false", f"train.epochs={args.train_epochs}",
        f"seed={args.seed}",
        f"pipeline.max_staleness={staleness}",
    ]


def rlpipe_run(root: Path, run_id: str, overrides: list[str], cpus: str, log: Path) -> float:
    """`rlpipe run` to completion with the lanes pinned, its output in `log`; its wall seconds."""
    command = [sys.executable, "-m", "flows.cli", "run", "--root", str(root), "--run-id", run_id]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "RLPIPE_LANE_CPUS": cpus}
    started = time.monotonic()
    with open(log, "wb") as handle:
        code = subprocess.call(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"rlpipe run {run_id} exited {code}; see {log}")
    return time.monotonic() - started


def stage_spans(run_dir: Path) -> dict[tuple[str, int], tuple[float, float]]:
    """(stage, iteration) -> (start, end) in epoch seconds, from the iteration stages' manifests."""
    spans = {}
    for path in run_dir.glob("**/*manifest.json"):
        manifest = json.loads(path.read_text())
        if manifest["stage"] in ITERATION_STAGES:
            start = datetime.fromisoformat(manifest["started_at"]).timestamp()
            end = datetime.fromisoformat(manifest["ended_at"]).timestamp()
            spans[(manifest["stage"], int(re.search(r"iter=(\d+)", manifest["path"]).group(1)))] = (start, end)
    return spans


def both_lanes_busy(spans: dict[tuple[str, int], tuple[float, float]]) -> float:
    """Seconds during which a rollout-lane stage and a train-lane stage ran at the same time."""
    rollout = [span for (stage, _), span in spans.items() if stage in LANES["rollout"]]
    train = [span for (stage, _), span in spans.items() if stage in LANES["train"]]
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for a in rollout for b in train)


def rewards(run_dir: Path, iterations: int) -> list[float]:
    """Mean reward of each iteration's rollouts (the scores table)."""
    means = []
    for k in range(iterations):
        values = pq.read_table(run_dir / f"iter={k:04d}" / "scores.parquet", columns=["reward"]).column(0)
        means.append(sum(values.to_pylist()) / len(values))
    return means


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--test-prompts", type=int, default=2)
    parser.add_argument("--train-epochs", type=int, default=1, help="passes over each batch (balances the lanes)")
    parser.add_argument("--backend", default="vllm", choices=("hf", "vllm"))
    parser.add_argument("--warm-engine", default="off", choices=("auto", "on", "off"),
                        help="generate.warm_engine (off: the same engine starts in both runs, whatever memory is free)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="generate.vllm_kv_cache_gib")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", default="rollout=0;train=1", help="RLPIPE_LANE_CPUS for both runs")
    parser.add_argument("--root", help="keep the runs here (default: a temporary directory, removed after)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="rlpipe-overlap-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"overlap benchmark: {args.iterations} iterations, {args.prompts} prompts x {args.samples} samples x "
          f"<= {args.max_new_tokens} tokens, {args.backend} (warm engine {args.warm_engine}), {args.train_epochs} "
          f"train epochs, lanes {args.cpus}; load {load_before[0]:.2f}; "
          f"runs under {root}", flush=True)
    figures = {}
    try:
        for name, staleness in (("strict", 0), ("overlap", 1)):
            wall = rlpipe_run(root / name, name, run_overrides(args, staleness), args.cpus, root / f"{name}.log")
            run_dir = root / name / "runs" / name
            spans = stage_spans(run_dir)
            span = max(end for _, end in spans.values()) - min(start for start, _ in spans.values())
            figures[name] = (span, rewards(run_dir, args.iterations))
            print(f"{name:8s} max_staleness={staleness}: run {wall:6.1f} s, iterations {span:6.1f} s = "
                  f"{args.iterations / span * 3600:6.1f} iterations/hour; "
                  f"both lanes busy {both_lanes_busy(spans):5.1f} s", flush=True)
        load_after = os.getloadavg()
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    (strict_span, strict_rewards), (overlap_span, overlap_rewards) = figures["strict"], figures["overlap"]
    print(f"ratio (iterations/hour, overlap / strict): {strict_span / overlap_span:.2f} (target >= 1.4)")
    print("training reward per iteration (mean score of its rollouts):")
    for k, (a, b) in enumerate(zip(strict_rewards, overlap_rewards, strict=True)):
        print(f"  iter {k}: strict {a:.3f}  overlap {b:.3f}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f} (1, 5 min)")


if __name__ == "__main__":
    main()
