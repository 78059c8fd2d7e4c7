"""Multi-turn recipes against the same data single-turn (issue 33): what does the tool or the feedback add?

Takes pairs of finished runs, MULTI:SINGLE, that differ only in `generate.multi_turn.mode` (same data, prompts,
samples, iterations, seed). Prints markdown tables, ready for docs/measurements.md:
- training by iteration, per run: mean final reward, share solved, groups the step kept, and (multi-turn) turns,
  tool calls per answer and the tool error rate (tool mode) or the answers retried and the share of those whose
  retry passed (feedback mode), from the catalog's `samples` view;
- held-out pass@1 of the base model and of the last evaluated checkpoint, and the paired gain with the bootstrap
  interval `rlpipe status` prints (benchmarks/seeds.py), per dataset and pooled. In feedback mode also the first
  answer's (what single-turn generation gives the same model and seed), and the retry's share at test time: the
  final answer over the first, on the same answers (problems resampled, answers held fixed);
- each run's stage time (the sum of its stage instances' seconds).
Run: `.venv/bin/python -m benchmarks.multi_turn_learning --root ROOT MULTI:SINGLE [MULTI:SINGLE ...]`.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.seeds import SeedResult, figure, seed_result, signed
from flows.cli.status import POOLED, by_dataset, checkpoint_gains, eval_rows, evaluated_checkpoints, prompt_rows
from stages.evaluation.metrics import answer_counts, bootstrap_mean_gain, clusters_of, pass_at_k
from storage.catalog import Catalog
from storage.layout import BASE
from storage.run import Run

TRAINING_SQL = """
SELECT iter, count(*) AS answers, avg(reward) AS reward, avg(CAST(status = 'ok' AS DOUBLE)) AS solved,
       avg(num_turns) AS turns, sum(tool_calls) / count(*) AS calls_per_answer,
       sum(tool_errors) / nullif(sum(tool_calls), 0) AS tool_error_rate,
       count(*) FILTER (WHERE num_turns > 1) AS retried,
       avg(CAST(status = 'ok' AS DOUBLE)) FILTER (WHERE num_turns > 1) AS solved_after_retry
FROM samples WHERE sample_idx >= 0 GROUP BY iter ORDER BY iter
"""
KEPT_SQL = """
SELECT iter, json_extract(metrics, '$.groups_kept') AS kept, json_extract(metrics, '$.groups') AS groups
FROM manifests WHERE name = 'batch' AND round = 0
"""


def training_table(root: str, run_id: str, mode: str) -> list[str]:
    """Markdown rows of one run's training by iteration."""
    with Catalog(root, [run_id]) as catalog:
        rows = catalog.rows(TRAINING_SQL)
        kept = {row["iter"]: f"{row['kept']}/{row['groups']}" for row in catalog.rows(KEPT_SQL)}
    extra = {"tool": ["turns", "tool calls / answer", "tool error rate"],
             "feedback": ["turns", "retried", "solved after retry"]}.get(mode, [])
    header = ["iteration", "answers", "mean reward", "solved", "groups kept", *extra]
    lines = [f"{run_id}:", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        cells = [str(row["iter"]), str(row["answers"]), figure(row["reward"]), figure(row["solved"]),
                 kept.get(row["iter"], "")]
        if mode == "tool":
            cells += [f"{row['turns']:.2f}", figure(row["calls_per_answer"]), figure(row["tool_error_rate"])]
        elif mode == "feedback":
            cells += [f"{row['turns']:.2f}", str(row["retried"]), figure(row["solved_after_retry"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pass_at_1(rows: list[dict]) -> float:
    """Mean over problems of the unbiased pass@1 of their sampled answers."""
    return float(np.mean([pass_at_k(n, c, 1) for n, c in answer_counts(rows).values()]))


def of_dataset(rows: list[dict], dataset: str) -> list[dict]:
    return rows if dataset == POOLED else [row for row in rows if row["dataset"] == dataset]


def first_answers(rows: list[dict]) -> list[dict]:
    """The eval rows graded on their first answer (feedback mode; the final answer otherwise)."""
    return [{**row, "correct": row["first_answer_correct"]} for row in rows]


def retry_gain(rows: list[dict], clusters: dict[str, str]) -> tuple[float, float, tuple[float, float, float]]:
    """(first-answer pass@1, final pass@1, (gain, low, high)) of the same sampled answers: the problems' pass rates
    paired and resampled by cluster (`bootstrap_mean_gain`), the answers held fixed, as the two gradings are of one
    set of answers (a retry only follows a failed first answer, so no problem's rate can fall)."""
    counts = answer_counts(rows)
    first_counts = answer_counts(first_answers(rows))
    problems = sorted(counts)
    first_P, final_P = (np.array([c[p][1] / c[p][0] for p in problems]) for c in (first_counts, counts))
    cluster_P = np.array([clusters.get(p, p) for p in problems])
    return float(first_P.mean()), float(final_P.mean()), bootstrap_mean_gain(first_P, final_P, cluster_P=cluster_P)


def held_out_rows(root: str, run_id: str) -> list[str]:
    """Markdown rows: held-out pass@1 before and after, and the paired gain, per dataset (and pooled); in feedback
    mode again on the first answer."""
    run = Run.open(root, run_id)
    label, iteration, _ = list(evaluated_checkpoints(run))[-1]
    base, last = eval_rows(run, BASE), eval_rows(run, iteration)
    clusters = clusters_of(prompt_rows(run))
    mode = run.config.generate.multi_turn.mode
    graded = [("final answer", base, last)]
    lines = []
    if mode == "feedback":
        graded.append(("first answer", first_answers(base), first_answers(last)))
        # the retry's share at test time: the final answer over the first, same answers
        for checkpoint, rows in (("base", base), (label, last)):
            datasets = sorted(by_dataset(rows))
            for dataset in [*datasets, *([POOLED] if len(datasets) > 1 else [])]:
                first, final, gain = retry_gain(of_dataset(rows, dataset), clusters)
                lines.append(f"| {run_id} | {mode} | retry: final over first answer, {checkpoint} | {dataset} | "
                             f"{first:.3f} | {final:.3f} | {signed(*gain)} |")
    for answer, before, after in graded:
        for dataset, gain in checkpoint_gains(by_dataset(before), after, clusters):
            if "pass@1" not in gain:
                continue
            before_pass, after_pass = (pass_at_1(of_dataset(rows, dataset)) for rows in (before, after))
            lines.append(f"| {run_id} | {mode} | {answer} | {dataset} | {before_pass:.3f} | {after_pass:.3f} "
                         f"({label}) | {signed(*gain['pass@1'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="MULTI:SINGLE run ids")
    parser.add_argument("--root", default="./rlpipe-data")
    args = parser.parse_args()
    run_ids = list(dict.fromkeys(run_id for pair in args.pairs for run_id in pair.split(":")))
    for run_id in run_ids:
        mode = Run.open(args.root, run_id).config.generate.multi_turn.mode
        print("\n".join(training_table(args.root, run_id, mode)) + "\n")
    print("| run | mode | graded on | held out | pass@1 before | pass@1 after | gain [95% interval] |")
    print("|---" * 7 + "|")
    for run_id in run_ids:
        print("\n".join(held_out_rows(args.root, run_id)))
    print()
    results: list[SeedResult] = [seed_result(args.root, run_id) for run_id in run_ids]
    for result in results:
        print(f"{result.run_id}: stage time {result.stage_minutes:.1f} min, training reward "
              f"{figure(result.reward_first)} -> {figure(result.reward_last)}")


if __name__ == "__main__":
    main()
