"""Synthetic runs in the real layout, with no model: for the report, catalog and lineage tests and benchmarks.

`write_synthetic_run` writes everything a real run writes (config.yaml, prompts, the base-model manifest,
the base evaluation, and per iteration rollouts, scores, batch, a checkpoint directory, train_metrics and
eval), each with a manifest whose inputs name the content hashes of what it was made from, exactly as
the stage harness wires them (stages/registry.py). Rewards rise with the iteration, so plots have a shape.

Columns are built with numpy and `take` from small pools of strings, so a million rollout rows take
seconds. Tables are filled generically from their schema (unknown columns get a type default), so the
generator keeps working when a schema gains a column.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.config import RunConfig, dump_config
from schemas.tables import TABLES
from storage.checkpoints import checkpoint_digest, publish_checkpoint
from storage.fs import atomic_write_bytes, is_remote
from storage.layout import BASE, RunLayout, manifest_path_for
from storage.manifest import Manifest, config_hash, stage_key, write_manifest
from storage.tables import write_table

STATUSES = ("ok", "fail", "timeout", "error", "no_code")
# Synthetic stage durations (seconds) so that the report's time-per-stage plot has something to show.
STAGE_SECONDS = {"generate": 42.0, "score": 11.0, "advantage": 0.4, "train": 75.0, "evaluate": 23.0}


@dataclass
class SyntheticSpec:
    run_id: str = "synth"
    iterations: int = 3
    train_prompts: int = 8  # the pool; each iteration uses `prompts_per_iteration` of them
    prompts_per_iteration: int = 4
    test_prompts: int = 3
    n_samples: int = 4
    eval_samples: int = 4
    steps_per_iteration: int = 2
    prompt_tokens: int = 24
    max_new_tokens: int = 64
    vocab: int = 2000
    seed: int = 0
    # Where the base model directory goes (it lives outside the run, like a real one); default: beside
    # the runs for a local root, a temporary folder for a remote root.
    base_model_dir: str | None = None
    with_eval: bool = True
    with_checkpoints: bool = True
    skipped_iterations: tuple[int, ...] = ()  # iterations whose train step was skipped (no kept group)
    # verl fields of prompt i of each split (metadata data_source = data_sources[i % len], ability "code");
    # None leaves prompt i without them, as a non-verl row. Empty: no prompt has them.
    data_sources: tuple[str | None, ...] = ()
    extra_config: dict[str, Any] = field(default_factory=dict)

    def config(self, root: str) -> RunConfig:
        values: dict[str, Any] = {
            "run_id": self.run_id, "root": root, "iterations": self.iterations, "seed": self.seed,
            "generate": {"n_samples": self.n_samples, "prompts_per_iteration": self.prompts_per_iteration,
                         "max_new_tokens": self.max_new_tokens},
            "evaluate": {"n_samples": self.eval_samples, "max_new_tokens": self.max_new_tokens},
        }
        for section, extra in self.extra_config.items():
            if isinstance(extra, dict):
                values.setdefault(section, {}).update(extra)
            else:
                values[section] = extra
        return RunConfig.model_validate(values)


def _default(dtype: pa.DataType, n: int) -> pa.Array:
    if pa.types.is_floating(dtype):
        return pa.array(np.zeros(n), dtype)
    if pa.types.is_integer(dtype):
        return pa.array(np.zeros(n, dtype=np.int64), dtype)
    if pa.types.is_boolean(dtype):
        return pa.array(np.zeros(n, dtype=bool))
    if pa.types.is_list(dtype):
        return pa.array([[]] * n, dtype)
    return pa.array([""] * n, dtype)


def build_table(name: str, columns: dict[str, Any], n: int) -> pa.Table:
    """A table of schema `name` from `columns` (arrays or lists); schema columns not given get defaults."""
    spec = TABLES[name]
    arrays = []
    for f in spec.schema:
        value = columns.get(f.name)
        if value is None:
            arrays.append(_default(f.type, n))
        elif isinstance(value, pa.Array | pa.ChunkedArray):
            arrays.append(value.cast(f.type) if value.type != f.type else value)
        else:
            arrays.append(pa.array(value, f.type))
    return pa.Table.from_arrays(arrays, schema=spec.schema)


def _list_array(lengths: np.ndarray, values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, dtype.value_type))


def _take(pool: list[str | None], index: np.ndarray) -> pa.Array:
    return pa.array(pool, pa.string()).take(pa.array(index.astype(np.int64)))


def prompt_id_for(seed: int, i: int, split: str) -> str:
    return hashlib.sha256(f"synthetic:{seed}:{split}:{i}".encode()).hexdigest()[:16]


class SyntheticRun:
    """Writes one synthetic run; `write()` does all of it, the methods are the stages."""

    def __init__(self, root: str, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.layout = RunLayout.create(root, spec.run_id)
        self.fs = self.layout.fs
        self.config = spec.config(self.layout.root)
        self.rng = np.random.default_rng(spec.seed)
        self.manifests: dict[tuple[str, int], Manifest] = {}
        self.train_ids = [prompt_id_for(spec.seed, i, "train") for i in range(spec.train_prompts)]
        self.test_ids = [prompt_id_for(spec.seed, i, "test") for i in range(spec.test_prompts)]
        # Per-prompt properties: difficulty (how often it is solved) and its number of tests.
        self.difficulty = {pid: float(d) for pid, d in zip(
            self.train_ids + self.test_ids, self.rng.uniform(-1.5, 1.5, spec.train_prompts + spec.test_prompts),
            strict=True)}
        self.tests = {pid: int(t) for pid, t in zip(
            self.train_ids + self.test_ids, self.rng.integers(2, 7, spec.train_prompts + spec.test_prompts),
            strict=True)}
        self.prompt_tokens = {pid: self.rng.integers(0, spec.vocab, spec.prompt_tokens).astype(np.int32)
                              for pid in self.train_ids}
        self.step = 0

    # --- manifests -------------------------------------------------------------------------------------

    def _record(self, stage: str, name: str, iteration: int, inputs: dict[str, str], **values: Any) -> Manifest:
        seconds = STAGE_SECONDS.get(stage, 1.0) * float(self.rng.uniform(0.8, 1.2))
        manifest = Manifest(
            stage=stage, key=stage_key(stage, {"synthetic": True}, inputs), inputs=inputs,
            config_hash=config_hash({"synthetic": True}), started_at="2026-01-01T00:00:00+00:00",
            ended_at="2026-01-01T00:00:00+00:00", seconds=round(seconds, 3), host="synthetic", **values,
        )
        kind = "checkpoint" if name == "checkpoint" else "table"
        if kind == "checkpoint":
            path = self.layout.checkpoint_dir(iteration)
        else:
            path = self.layout.table_path(name, iteration)
        write_manifest(self.fs, manifest_path_for(path, kind), manifest)
        self.manifests[(name, iteration)] = manifest
        return manifest

    def _write(self, stage: str, name: str, iteration: int, table: pa.Table, inputs: dict[str, str],
               metrics: dict[str, Any] | None = None) -> Manifest:
        written = write_table(self.fs, self.layout.table_path(name, iteration), table, TABLES[name])
        return self._record(stage, name, iteration, inputs, kind="table", path=written.path, sha256=written.sha256,
                            bytes=written.bytes, rows=written.rows, schema=TABLES[name].tag,
                            metrics=dict(metrics or {}))

    # --- run level -------------------------------------------------------------------------------------

    def write_config(self) -> None:
        atomic_write_bytes(self.fs, self.layout.config_path, dump_config(self.config).encode())

    def prompts_table(self) -> pa.Table:
        rows = []
        for split, ids in (("train", self.train_ids), ("test", self.test_ids)):
            for i, pid in enumerate(ids):
                name = f"task_{split}_{i}"
                rows.append({
                    "prompt_id": pid, "dataset": "synthetic", "split": split, "source_row": i + 1,
                    "messages": json.dumps([
                        {"role": "system", "content": "You are an expert Python programmer."},
                        {"role": "user", "content": f"Complete this Python function.\n\ndef {name}(x):\n"
                                                    f"    \"\"\"Return x plus {i}.\"\"\"\n"},
                    ]),
                    "reward_spec": json.dumps({"kind": "code_tests", "entry_point": name, "test": "def check(c): ..."}),
                    "metadata": json.dumps({"task_id": f"Synthetic/{i}", **self.verl_fields(i)}),
                })
        return build_table("prompts", {k: [r[k] for r in rows] for k in rows[0]}, len(rows))

    def verl_fields(self, i: int) -> dict[str, str]:
        sources = self.spec.data_sources
        source = sources[i % len(sources)] if sources else None
        return {} if source is None else {"data_source": source, "ability": "code"}

    def write_prompts(self) -> Manifest:
        metrics = {"train": len(self.train_ids), "test": len(self.test_ids)}
        return self._write("prompts", "prompts", BASE, self.prompts_table(), {}, metrics)

    def write_base_model(self) -> Manifest:
        base = self.spec.base_model_dir
        if base is None:
            base = (tempfile.mkdtemp(prefix="rlpipe-synthetic-base-") if is_remote(self.layout.root)
                    else f"{self.layout.root}/models/{self.spec.run_id}-base")
        directory = Path(base)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({"model_type": "llama", "synthetic": True}))
        (directory / "model.safetensors").write_bytes(np.random.default_rng(self.spec.seed).bytes(2048))
        digest, files, total = checkpoint_digest(directory)
        return self._record(
            "base_model", "checkpoint", BASE, {}, kind="checkpoint", path=str(directory), sha256=digest, bytes=total,
            metrics={"local_path": str(directory), "name_or_path": "synthetic-base", "files": files},
        )

    def write_checkpoint(self, iteration: int, inputs: dict[str, str]) -> Manifest:
        destination = self.layout.checkpoint_dir(iteration)
        with tempfile.TemporaryDirectory(prefix="rlpipe-synthetic-ckpt-") as scratch:
            local = Path(scratch)
            (local / "config.json").write_text(json.dumps({"model_type": "llama", "iteration": iteration}))
            (local / "model.safetensors").write_bytes(np.random.default_rng([self.spec.seed, iteration]).bytes(4096))
            digest, files, total = checkpoint_digest(local)
            publish_checkpoint(self.fs, local, destination)
        return self._record("train", "checkpoint", iteration, inputs, kind="checkpoint", path=destination,
                            sha256=digest, bytes=total, files=files, metrics={"steps": self.spec.steps_per_iteration})

    # --- one iteration ---------------------------------------------------------------------------------

    def _pass_probability(self, prompt_ids: list[str], iteration: int) -> np.ndarray:
        logits = np.array([-self.difficulty[p] for p in prompt_ids]) + 0.45 * (iteration + 1) - 0.6
        return 1.0 / (1.0 + np.exp(-logits))

    def iteration_tables(self, iteration: int, policy_version: str) -> dict[str, pa.Table]:
        """rollouts, scores and batch of one iteration (vectorised; a million rows take seconds)."""
        spec, rng = self.spec, self.rng
        start = (iteration * spec.prompts_per_iteration) % max(len(self.train_ids), 1)
        chosen = [self.train_ids[(start + j) % len(self.train_ids)] for j in range(spec.prompts_per_iteration)]
        n = spec.n_samples
        rows = len(chosen) * n
        group = np.repeat(np.arange(len(chosen)), n)
        prompt_ids = pa.array(chosen, pa.string()).take(pa.array(group))
        sample_idx = np.tile(np.arange(n, dtype=np.int32), len(chosen))

        # Lengths drift up over iterations; a response that hits the limit is truncated.
        lengths = np.clip(rng.normal(0.45 * spec.max_new_tokens + 2 * iteration, 0.2 * spec.max_new_tokens, rows),
                          1, spec.max_new_tokens).astype(np.int32)
        truncated = lengths >= spec.max_new_tokens
        response_ids = rng.integers(0, spec.vocab, int(lengths.sum())).astype(np.int32)
        logprobs = -rng.exponential(0.6, int(lengths.sum())).astype(np.float32)
        prompt_matrix = np.stack([self.prompt_tokens[p] for p in chosen])
        prompt_flat = prompt_matrix[group].ravel()

        totals = np.array([self.tests[p] for p in chosen])[group].astype(np.int32)
        p_pass = self._pass_probability(chosen, iteration)[group]
        passed = rng.binomial(totals, p_pass).astype(np.int32)
        status_draw = rng.random(rows)
        status = np.where(passed == totals, 0, 1)
        # statuses by index into STATUSES: 4 no_code (4%), 2 timeout (3%), 3 error (2%), else ok/fail by tests
        status = np.select([status_draw < 0.04, status_draw < 0.07, status_draw < 0.09], [4, 2, 3], status)
        passed = np.where(status >= 2, 0, passed).astype(np.int32)
        penalty = self.config.score.no_code_penalty
        reward = np.where(status == 4, penalty, passed / totals)

        # Response text and extracted code come from small pools, picked by status and a variant.
        variant = rng.integers(0, 8, rows)
        text_pool, code_pool = [], []
        for s in range(len(STATUSES)):
            for v in range(8):
                body = {0: f"    return x + {v}", 1: f"    return x + {v}", 2: "    while True: pass"}.get(
                    s, "    return x / 0")
                code = f"def solve(x):\n{body}\n"
                if s == 4:
                    text_pool.append("I think the answer depends on the input. " * (v + 1))
                    code_pool.append(None)
                else:
                    text_pool.append(f"Here is the solution:\n```python\n{code}```\n" + "Explanation. " * v)
                    code_pool.append(code)
        pool_index = status * 8 + variant
        # Per-test results depend only on (total, passed, status): one JSON string per distinct triple.
        triple = (totals.astype(np.int64) * 64 + passed) * 8 + status
        distinct, tests_index = np.unique(triple, return_inverse=True)
        tests_strings = []
        for code_ in distinct.tolist():
            s_, rest = code_ % 8, code_ // 8
            total, ok = rest // 64, rest % 64
            tests_strings.append("[]" if s_ == 4 else json.dumps([
                {"name": f"assert candidate({t}) == {t + 1}", "passed": t < ok,
                 "status": "ok" if t < ok else ("timeout" if s_ == 2 else "fail"),
                 "message": "" if t < ok else "AssertionError"}
                for t in range(total)
            ]))

        key_columns = {
            "run_id": _take([spec.run_id], np.zeros(rows, dtype=np.int64)),
            "iteration": pa.array(np.full(rows, iteration, dtype=np.int32)),
            "round": pa.array(np.zeros(rows, dtype=np.int32)),
            "prompt_id": prompt_ids,
            "sample_idx": pa.array(sample_idx),
        }
        rollouts = build_table("rollouts", {
            **key_columns,
            "policy_version": _take([policy_version], np.zeros(rows, dtype=np.int64)),
            "prompt_token_ids": _list_array(np.full(rows, spec.prompt_tokens), prompt_flat, pa.list_(pa.int32())),
            "response_token_ids": _list_array(lengths, response_ids, pa.list_(pa.int32())),
            "response_logprobs": _list_array(lengths, logprobs, pa.list_(pa.float32())),
            "response_text": _take(text_pool, pool_index),
            "finish_reason": _take(["stop", "length"], truncated.astype(np.int64)),
            "truncated": pa.array(truncated),
            "num_tokens": pa.array(lengths),
            "seed": pa.array(rng.integers(0, 2**62, rows)),
            "backend": _take(["synthetic"], np.zeros(rows, dtype=np.int64)),
            # single-turn rollouts: no mask, spans or conversation; one turn, no tool calls
            **{name: pa.nulls(rows, TABLES["rollouts"].schema.field(name).type)
               for name in ("loss_mask", "turn_spans", "turn_rewards", "conversation")},
            "num_turns": pa.array(np.ones(rows, dtype=np.int32)),
            "policy_step": pa.array(np.full(rows, iteration, dtype=np.int32)),  # strict order: checkpoint k-1
        }, rows)
        scores = build_table("scores", {
            **key_columns,
            "reward": pa.array(reward.astype(np.float64)),
            "passed": pa.array(passed), "total": pa.array(totals),
            "status": _take(list(STATUSES), status),
            "tests": _take(tests_strings, tests_index),
            "code": _take(code_pool, pool_index),
            "sandbox_seconds": pa.array(rng.uniform(0.01, 0.4, rows)),
        }, rows)

        # GRPO over groups of n; groups whose rewards are all equal are dropped (zero variance).
        grouped = reward.reshape(len(chosen), n)
        mean = grouped.mean(axis=1)
        std = grouped.std(axis=1)
        kept_group = std > 0
        advantage = np.where(kept_group[:, None], (grouped - mean[:, None]) / (std[:, None] + 1e-6), 0.0).ravel()
        kept = np.repeat(kept_group, n)
        batch = build_table("batch", {
            **key_columns,
            "reward": pa.array(reward.astype(np.float64)),
            "shaped_reward": pa.array(reward.astype(np.float64)),
            "advantage": pa.array(advantage),
            "kept": pa.array(kept),
            "drop_reason": pa.array(np.where(kept, None, "zero_variance").tolist(), pa.string()),
            "group_size": pa.array(np.full(rows, n, dtype=np.int32)),
            "group_mean": pa.array(np.repeat(mean, n)),
            "group_std": pa.array(np.repeat(std, n)),
        }, rows)
        return {"rollouts": rollouts, "scores": scores, "batch": batch}

    def train_metrics(self, iteration: int) -> pa.Table:
        steps = self.spec.steps_per_iteration
        rng = self.rng
        step = np.arange(self.step, self.step + steps, dtype=np.int32)
        self.step += steps
        decay = np.exp(-0.15 * (step + 1))
        columns = {
            "run_id": [self.spec.run_id] * steps, "iteration": np.full(steps, iteration, dtype=np.int32),
            "step": step, "epoch": np.zeros(steps, dtype=np.int32), "skipped": np.zeros(steps, dtype=bool),
            "loss": rng.normal(0.0, 0.05, steps), "policy_loss": rng.normal(0.0, 0.05, steps),
            "clip_frac_low": rng.uniform(0.0, 0.05, steps), "clip_frac_high": rng.uniform(0.0, 0.08, steps),
            "clip_frac_dual": np.zeros(steps),
            "approx_kl": 0.002 + 0.004 * rng.random(steps) * (1 + iteration),
            "kl_ref": 0.01 * (iteration + 1) * rng.uniform(0.8, 1.2, steps),
            "entropy": 1.2 * decay + 0.3, "is_ratio_mean": 1 + rng.normal(0, 0.01, steps),
            "is_ratio_min": rng.uniform(0.6, 0.9, steps), "is_ratio_max": rng.uniform(1.1, 1.6, steps),
            "is_ess": rng.uniform(0.9, 1.0, steps), "rejected_frac": np.zeros(steps),
            "grad_norm": rng.uniform(0.2, 1.5, steps), "lr": np.full(steps, self.config.train.lr),
            "tokens": np.full(steps, 6144, dtype=np.int64), "loss_tokens": np.full(steps, 3000, dtype=np.int64),
            "padding_frac": rng.uniform(0.1, 0.3, steps), "sequences": np.full(steps, 16, dtype=np.int32),
            "seconds": rng.uniform(20, 40, steps),
        }
        if iteration in self.spec.skipped_iterations:  # as stages/train.py's skipped_row: one row, no step taken
            self.step -= steps
            columns = {k: v[:1] for k, v in columns.items()} | {"skipped": [True], "grad_norm": [np.nan],
                                                                  "approx_kl": [np.nan], "entropy": [np.nan]}
            steps = 1
        return build_table("train_metrics", {k: pa.array(v) for k, v in columns.items()}, steps)

    def eval_table(self, iteration: int, policy_version: str) -> pa.Table:
        spec, rng = self.spec, self.rng
        rows: list[dict[str, Any]] = []
        p = self._pass_probability(self.test_ids, iteration)
        for pid, prob in zip(self.test_ids, p, strict=True):
            for mode, count in (("greedy", 1), ("sampled", spec.eval_samples)):
                for sample_idx in range(count):
                    correct = bool(rng.random() < prob)
                    rows.append({
                        "run_id": spec.run_id, "iteration": iteration, "policy_version": policy_version,
                        "dataset": "synthetic", "prompt_id": pid, "mode": mode, "sample_idx": sample_idx,
                        "correct": correct, "reward": 1.0 if correct else 0.0, "status": "ok" if correct else "fail",
                        "num_tokens": int(rng.integers(8, spec.max_new_tokens)),
                        "response_text": "```python\ndef solve(x):\n    return x + 1\n```",
                        "num_turns": 1, "tool_calls": 0, "tool_errors": 0, "first_answer_correct": correct,
                    })
        return build_table("eval", {k: [r[k] for r in rows] for k in rows[0]}, len(rows))

    def eval_metrics(self, table: pa.Table) -> dict[str, Any]:
        """The evaluate stage's manifest metrics: per held-out dataset, pass@k with its bootstrap interval; per
        data_source too where the test prompts mix them (stages/evaluate.py)."""
        from stages.evaluation.metrics import aggregate, splits_by_data_source  # numpy only

        rows, ks = table.to_pylist(), self.config.evaluate.k
        metrics: dict[str, Any] = {dataset: aggregate([r for r in rows if r["dataset"] == dataset], ks)
                                   for dataset in sorted({r["dataset"] for r in rows})}
        test = [row for row in self.prompts_table().to_pylist() if row["split"] == "test"]
        if (sources := splits_by_data_source(test)) is not None:
            metrics["data_sources"] = {
                source: aggregate([r for r in rows if sources[r["prompt_id"]] == source], ks)
                for source in sorted(set(sources.values()))}
        return metrics

    def write_iteration(self, iteration: int) -> None:
        prompts = self.manifests[("prompts", BASE)].sha256
        policy = self.manifests[("checkpoint", iteration - 1 if iteration > 0 else BASE)]
        tables = self.iteration_tables(iteration, policy.sha256)
        rollouts = self._write("generate", "rollouts", iteration, tables["rollouts"],
                               {"prompts": prompts, "policy": policy.sha256})
        scores = self._write("score", "scores", iteration, tables["scores"],
                             {"prompts": prompts, "rollouts": rollouts.sha256})
        batch = self._write("advantage", "batch", iteration, tables["batch"],
                            {"rollouts": rollouts.sha256, "scores": scores.sha256})
        if not self.spec.with_checkpoints:
            return
        train_inputs = {"batch": batch.sha256, "rollouts": rollouts.sha256, "policy": policy.sha256}
        checkpoint = self.write_checkpoint(iteration, train_inputs)
        self._write("train", "train_metrics", iteration, self.train_metrics(iteration), train_inputs)
        if self.spec.with_eval:
            table = self.eval_table(iteration, checkpoint.sha256)
            self._write("evaluate", "eval", iteration, table, {"prompts": prompts, "policy": checkpoint.sha256},
                        self.eval_metrics(table))

    def write(self) -> RunLayout:
        self.write_config()
        prompts = self.write_prompts()
        base = self.write_base_model()
        if self.spec.with_eval:
            table = self.eval_table(BASE, base.sha256)
            self._write("evaluate_base", "eval", BASE, table, {"prompts": prompts.sha256, "policy": base.sha256},
                        self.eval_metrics(table))
        for iteration in range(self.spec.iterations):
            self.write_iteration(iteration)
        return self.layout


def write_synthetic_run(root: str, spec: SyntheticSpec | None = None, **overrides: Any) -> RunLayout:
    """Write a whole synthetic run under `root` and return its layout."""
    spec = spec or SyntheticSpec(**overrides)
    return SyntheticRun(root, spec).write()
