"""Learning over seeds: the held-out pass@1 gain of finished runs of one recipe, one run per seed (issue 31).

For each run: its seed, training reward at the first and last iteration, the pass@1 gain of its last evaluated
checkpoint over the base model per held-out dataset and pooled, each with the paired bootstrap 95% interval
`rlpipe status` prints (pytasks resampled by family), and its stage time (the sum of its stage instances'
seconds, a fork's shared ones included: a forked run's wall clock does not say what the whole run costs). Then
per dataset the mean gain over the seeds with a Student-t 95% interval over them (n - 1 degrees of freedom: with
three seeds the half-width is 4.30 standard errors), and how many seeds' own intervals lie above 0. Prints
markdown tables, ready for docs/measurements.md. With `--peer=-peer-trl`, the same over the peer's final models
(`benchmarks/peer_trl.py` evaluates TRL's model of run R as run `R-peer-trl`) against each run's base model.
Run: `.venv/bin/python -m benchmarks.seeds --root ROOT [--peer SUFFIX] RUN [RUN ...]`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from flows.cli.status import POOLED, by_dataset, checkpoint_gains, eval_rows, evaluated_checkpoints, prompt_rows
from stages.evaluation.metrics import clusters_of
from storage.catalog import Catalog
from storage.layout import BASE
from storage.run import Run


@dataclass
class SeedResult:
    run_id: str
    seed: int
    checkpoint: str  # the last evaluated checkpoint, e.g. "iter 7"
    reward_first: float | None  # mean training reward at iteration 0 (None: a peer's, not in our tables)
    reward_last: float | None  # and at the last iteration
    stage_minutes: float | None
    gains: dict[str, tuple[float, float, float]]  # dataset (and POOLED) -> pass@1 (gain, low, high)


def mean_over_seeds(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): mean ± t_{(1+c)/2, n-1} · s / √n, s the sample standard deviation (ddof 1)."""
    if len(values) < 2:
        raise ValueError(f"an interval over seeds needs at least 2 values, got {len(values)}")
    values_S = np.asarray(values, dtype=np.float64)
    half = stats.t.ppf((1 + confidence) / 2, len(values_S) - 1) * values_S.std(ddof=1) / math.sqrt(len(values_S))
    mean = float(values_S.mean())
    return mean, mean - float(half), mean + float(half)


def seed_result(root: str, run_id: str) -> SeedResult:
    run = Run.open(root, run_id)
    evaluated = list(evaluated_checkpoints(run))
    if len(evaluated) < 2 or evaluated[0][1] != BASE:
        raise SystemExit(f"run {run_id} has no evaluated checkpoint beside the base model: nothing to compare")
    label, iteration, _ = evaluated[-1]
    with Catalog(root, [run_id]) as catalog:
        rewards = {row["iter"]: row["reward"] for row in catalog.rows(
            "SELECT iter, avg(reward) AS reward FROM scores GROUP BY iter")}
        # one figure per stage instance: a stage with two outputs (train: checkpoint and metrics) counted once
        (seconds,) = catalog.rows("SELECT sum(s) AS s FROM (SELECT max(seconds) AS s FROM manifests "
                                  "GROUP BY stage, iter, round)")
    return SeedResult(run_id, run.config.seed, label, rewards[min(rewards)], rewards[max(rewards)],
                      seconds["s"] / 60, pass_at_1_gains(run, eval_rows(run, iteration)))


def peer_result(root: str, run_id: str, suffix: str) -> SeedResult:
    """The peer's final model, evaluated as run `run_id + suffix`, against run `run_id`'s base model: the pairs
    and families `peer_trl` compares on."""
    run, peer = Run.open(root, run_id), Run.open(root, run_id + suffix)
    return SeedResult(run_id + suffix, run.config.seed, "peer's final model", None, None, None,
                      pass_at_1_gains(run, eval_rows(peer, BASE)))


def pass_at_1_gains(run: Run, rows: list[dict]) -> dict[str, tuple[float, float, float]]:
    """dataset (and POOLED) -> pass@1 (gain, low, high) of the eval `rows` over `run`'s base model, paired, with
    the families of `run`'s prompts (as `rlpipe status` compares a checkpoint)."""
    compared = checkpoint_gains(by_dataset(eval_rows(run, BASE)), rows, clusters_of(prompt_rows(run)))
    return {dataset: gain["pass@1"] for dataset, gain in compared if "pass@1" in gain}


def _mean(values: list[float | None]) -> float | None:
    return None if None in values else float(np.mean(values))


def figure(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.{1 if unit else 3}f}{unit}"


def signed(gain: float, low: float, high: float) -> str:
    return f"{gain:+.3f} [{low:+.3f}, {high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished runs of one recipe, one per seed")
    parser.add_argument("--root", default="./rlpipe-data")
    parser.add_argument("--peer", default=None, help="the peer's final models instead: run RUN + PEER each")
    args = parser.parse_args()
    results = [peer_result(args.root, run_id, args.peer) if args.peer else seed_result(args.root, run_id)
               for run_id in args.runs]
    datasets = sorted({d for r in results for d in r.gains} - {POOLED}) + [POOLED]
    datasets = [d for d in datasets if all(d in r.gains for r in results)]
    print("| run | seed | checkpoint | train reward, first → last | stage time | "
          + " | ".join(f"pass@1 gain, {d}" for d in datasets) + " |")
    print("|---" * (5 + len(datasets)) + "|")
    for r in results:
        print(f"| {r.run_id} | {r.seed} | {r.checkpoint} | {figure(r.reward_first)} → {figure(r.reward_last)} | "
              f"{figure(r.stage_minutes, ' min')} | " + " | ".join(signed(*r.gains[d]) for d in datasets) + " |")
    if len(results) < 2:
        return
    cells = []
    for d in datasets:
        mean, low, high = mean_over_seeds([r.gains[d][0] for r in results])
        above = sum(r.gains[d][1] > 0 for r in results)
        cells.append(f"{signed(mean, low, high)}, {above}/{len(results)} above 0")
    first, last = _mean([r.reward_first for r in results]), _mean([r.reward_last for r in results])
    rewards = f"{figure(first)} → {figure(last)}"
    minutes = figure(_mean([r.stage_minutes for r in results]), " min")
    print(f"| mean over {len(results)} seeds (t interval) | | | {rewards} | {minutes} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
