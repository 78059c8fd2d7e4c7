"""Benchmark: questions about a run's history, through the catalog vs pandas over JSONL dumps.

Writes `--rows` synthetic rollout rows (default 1,000,000) in the real run layout (tests/support/synthetic_runs.py),
and the same samples as one JSONL file per iteration, the format other trainers dump (verl's
`rollout_data_dir`, OpenRLHF/TRL logs). Then it answers three questions both ways: reward by iteration,
group stats per prompt, response length. Catalog: open (list manifests, create views) + one SQL query into
Arrow. pandas: `read_json(lines=True)` of every dump + `groupby`, since a script answering from dumps has to
parse them first; the compute-only time and the load average are printed too.

    .venv/bin/python benchmarks/history.py [--rows 1000000] [--runs 2] [--iterations 50] [--dir DIR [--reuse]]

Target: reward by iteration <= 0.5 s from a cold catalog (0.137 s on 2026-11-23, 65x pandas over the
dumps: docs/measurements.md, "Benchmark notes").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402

from storage.catalog import Catalog  # noqa: E402
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec  # noqa: E402

QUERIES = {
    "reward by iteration": """
        SELECT run_id, iteration, avg(reward) AS mean_reward, count(*) AS n
        FROM scores GROUP BY ALL ORDER BY ALL""",
    "group stats": """
        SELECT run_id, iteration, prompt_id, count(*) AS n, avg(reward) AS mean, stddev_pop(reward) AS std,
               min(reward) AS min, max(reward) AS max, avg(CAST(status = 'ok' AS DOUBLE)) AS solve_rate
        FROM scores GROUP BY ALL""",
    "text length": """
        SELECT run_id, iteration, avg(length(response_text)) AS chars, avg(num_tokens) AS tokens
        FROM rollouts GROUP BY ALL ORDER BY ALL""",
}


def pandas_answers(frame: pd.DataFrame) -> dict[str, Callable[[], pd.DataFrame]]:
    def reward() -> pd.DataFrame:
        return frame.groupby(["run_id", "step"])["score"].agg(["mean", "count"]).reset_index()

    def groups() -> pd.DataFrame:
        grouped = frame.assign(solved=frame["status"] == "ok").groupby(["run_id", "step", "prompt_id"])
        stats = grouped["score"].agg(["count", "mean", "min", "max"])
        stats["std"] = grouped["score"].std(ddof=0)
        stats["solve_rate"] = grouped["solved"].mean()
        return stats.reset_index()

    def length() -> pd.DataFrame:
        return (frame.assign(chars=frame["output"].str.len())
                .groupby(["run_id", "step"])[["chars", "num_tokens"]].mean().reset_index())

    return {"reward by iteration": reward, "group stats": groups, "text length": length}


def write_history(root: Path, rows: int, runs: int, iterations: int, n_samples: int) -> tuple[list[Path], float]:
    """The run layout under `root` and JSONL dumps under `root/jsonl`; returns (dump files, seconds)."""
    started = time.perf_counter()
    per_iteration = rows // (runs * iterations)
    prompts = max(per_iteration // n_samples, 1)
    dumps: list[Path] = []
    for r in range(runs):
        spec = SyntheticSpec(run_id=f"bench{r}", iterations=iterations, train_prompts=prompts * 4,
                             prompts_per_iteration=prompts, n_samples=n_samples, test_prompts=2, seed=r,
                             max_new_tokens=96, prompt_tokens=48, with_checkpoints=False, with_eval=False)
        run = SyntheticRun(str(root), spec)
        run.write_config()
        prompt_manifest = run.write_prompts()
        base = run.write_base_model()
        prompt_text = {row["prompt_id"]: json.loads(row["messages"])[-1]["content"]
                       for row in run.prompts_table().to_pylist()}
        for k in range(iterations):
            tables = run.iteration_tables(k, base.sha256)
            rollouts = run._write("generate", "rollouts", k, tables["rollouts"],
                                  {"prompts": prompt_manifest.sha256, "policy": base.sha256})
            scores = run._write("score", "scores", k, tables["scores"],
                                {"prompts": prompt_manifest.sha256, "rollouts": rollouts.sha256})
            run._write("advantage", "batch", k, tables["batch"],
                       {"rollouts": rollouts.sha256, "scores": scores.sha256})
            dumps.append(write_dump(root / "jsonl" / spec.run_id / f"step_{k:04d}.jsonl", tables, prompt_text))
    return dumps, time.perf_counter() - started


def write_dump(path: Path, tables: dict[str, pa.Table], prompt_text: dict[str, str]) -> Path:
    """One iteration as JSONL, one object per sample, the fields other trainers write."""
    rollouts, scores, batch = tables["rollouts"], tables["scores"], tables["batch"]
    frame = pd.DataFrame({
        "run_id": rollouts.column("run_id").to_numpy(),
        "step": rollouts.column("iteration").to_numpy(),
        "prompt_id": rollouts.column("prompt_id").to_numpy(),
        "sample_idx": rollouts.column("sample_idx").to_numpy(),
        "input": [prompt_text[p] for p in rollouts.column("prompt_id").to_pylist()],
        "output": rollouts.column("response_text").to_numpy(zero_copy_only=False),
        "num_tokens": rollouts.column("num_tokens").to_numpy(),
        "score": scores.column("reward").to_numpy(),
        "status": scores.column("status").to_numpy(zero_copy_only=False),
        "passed": scores.column("passed").to_numpy(),
        "total": scores.column("total").to_numpy(),
        "advantage": batch.column("advantage").to_numpy(),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_json(path, orient="records", lines=True)
    return path


def timed(function: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(first run's seconds, median of `repeat` further runs, the result)."""
    started = time.perf_counter()
    result = function()
    first = time.perf_counter() - started
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return first, statistics.median(times) if times else first, result


def size_of(path: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats of each query (median)")
    parser.add_argument("--dir", help="where to write the data (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the data afterwards")
    parser.add_argument("--reuse", action="store_true", help="time the data already in --dir (written before)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    root = Path(args.dir or tempfile.mkdtemp(prefix="rlpipe-history-"))
    results: dict[str, Any] = {"rows": args.rows, "runs": args.runs, "iterations": args.iterations,
                               "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    try:
        if args.reuse and (root / "jsonl").is_dir():
            dumps, seconds = sorted((root / "jsonl").rglob("*.jsonl")), 0.0
        else:
            dumps, seconds = write_history(root, args.rows, args.runs, args.iterations, args.n_samples)
        parquet_mb = size_of(root / "runs", ".parquet") / 1e6
        jsonl_mb = size_of(root / "jsonl", ".jsonl") / 1e6
        written = f"wrote in {seconds:.1f}s" if seconds else "reused"
        print(f"{args.rows:,} rollouts ({args.runs} runs × {args.iterations} iterations), {written}: "
              f"Parquet (rollouts+scores+batch, token ids included) {parquet_mb:.0f} MB, JSONL {jsonl_mb:.0f} MB")
        results.update(write_seconds=seconds, parquet_mb=parquet_mb, jsonl_mb=jsonl_mb)

        started = time.perf_counter()
        catalog = Catalog(str(root))
        open_seconds = time.perf_counter() - started
        manifests = sum(len(v) for v in catalog.listing.tables.values())
        rows = catalog.rows("SELECT count(*) AS n FROM rollouts")[0]["n"]
        assert rows == (args.rows // (args.runs * args.iterations) // args.n_samples) * args.n_samples * args.runs * (
            args.iterations), rows
        print(f"catalog open (list {manifests} table manifests, create views): {open_seconds:.3f}s; "
              f"rollouts view: {rows:,} rows")

        started = time.perf_counter()
        frame = pd.concat([pd.read_json(path, lines=True) for path in dumps], ignore_index=True)
        load_seconds = time.perf_counter() - started
        print(f"pandas read_json(lines=True) of {len(dumps)} dumps: {load_seconds:.2f}s ({len(frame):,} rows)")
        answers = pandas_answers(frame)

        results.update(catalog_open_seconds=open_seconds, pandas_load_seconds=load_seconds, queries={})
        header = (f"{'question':<22}{'catalog first':>14}{'catalog warm':>13}{'open+warm':>11}"
                  f"{'pandas compute':>15}{'pandas load+compute':>21}{'ratio':>8}{'compute ratio':>15}")
        print(header)
        for name, sql in QUERIES.items():
            duck_first, duck_warm, duck = timed(lambda sql=sql: catalog.arrow(sql), args.repeat)
            pandas_first, pandas_warm, expected = timed(answers[name], max(args.repeat // 2, 1))
            check(name, duck, expected)
            # The ratio compares answering from files on disk both ways: catalog open + query against
            # JSONL parse + groupby. The compute ratio compares only the in-memory/columnar query parts.
            end_to_end = load_seconds + pandas_warm
            ratio = end_to_end / (open_seconds + duck_warm)
            print(f"{name:<22}{duck_first:>13.3f}s{duck_warm:>12.3f}s{open_seconds + duck_warm:>10.3f}s"
                  f"{pandas_warm:>14.3f}s{end_to_end:>20.2f}s{ratio:>7.0f}×{pandas_warm / duck_warm:>14.1f}×")
            results["queries"][name] = {"catalog_first": duck_first, "catalog_warm": duck_warm,
                                        "pandas_compute": pandas_warm, "pandas_load_compute": end_to_end,
                                        "catalog_open_and_warm": open_seconds + duck_warm, "ratio": ratio,
                                        "ratio_compute_only": pandas_warm / duck_warm}
        catalog.close()
        reward = results["queries"]["reward by iteration"]
        cold = open_seconds + reward["catalog_first"]
        print(f"reward by iteration from a cold catalog (open + first query): {cold:.3f}s "
              f"(target ≤ 0.5 s: {'met' if cold <= 0.5 else 'NOT met'})")
        results["reward_by_iteration_cold_seconds"] = cold
        results["load_after"] = os.getloadavg()
        print(f"load average before {results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f} "
              f"on {os.cpu_count()} CPUs (DuckDB uses all of them; pandas one)")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def check(name: str, duck: pa.Table, expected: pd.DataFrame) -> None:
    """Both ways must give the same answer (same groups, same means), or the timing means nothing."""
    ours = duck.to_pandas()
    if name == "reward by iteration":
        left, right = ours["mean_reward"].to_numpy(), expected.sort_values(["run_id", "step"])["mean"].to_numpy()
    elif name == "group stats":
        ours = ours.sort_values(["run_id", "iteration", "prompt_id"])
        theirs = expected.sort_values(["run_id", "step", "prompt_id"])
        left = np.stack([ours["mean"], ours["std"], ours["solve_rate"]])
        right = np.stack([theirs["mean"], theirs["std"], theirs["solve_rate"]])
    else:
        left, right = ours["chars"].to_numpy(), expected.sort_values(["run_id", "step"])["chars"].to_numpy()
    if left.shape != right.shape or not np.allclose(left, right):
        raise AssertionError(f"{name}: catalog and pandas answers differ")


if __name__ == "__main__":
    sys.exit(main())
