"""Shared machinery of the reliability drills: a small run, stand-in stage work, real processes, checks.

A drill that is about the harness, the flow or storage runs on a run whose model stages are stand-ins
(`base_model`, `evaluate_base`, `generate`, `train`, `evaluate` write small, deterministic outputs through the
real harness, so their manifests and stage keys are the real ones), while `prompts`, `score` and `advantage`
are the real stages: they need no model, so a whole run costs seconds. Drills about the model stages
(tests/reliability/test_model_stages.py) use SmolLM2 instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import load_config
from schemas.tables import SINGLE_TURN_ROLLOUT
from stages.data.sources import code_messages, code_tests_spec, prompt_id_of
from stages.harness import StageContext
from stages.registry import ITERATION_STAGES, RUN_STAGES, STAGES, instance, stage_state
from storage.checkpoints import verify_checkpoint
from storage.layout import BASE, RunLayout
from storage.manifest import Manifest, read_manifest, sha256_file
from storage.run import Run
from tests.support.processes import spawn_tied
from tests.support.stages import run_stage_at

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
RUN_ID = "drill"
N_SAMPLES = 4

# Three tiny HumanEval-style problems: two for training, one held out. Good and bad solutions per problem.
PROBLEMS = [
    {
        "task_id": f"drill/{i}",
        "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
        "entry_point": f"f{i}",
        "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n    assert candidate(5) == {5 + i}\n",
    }
    for i in range(3)
]


def good_answer(i: int, sleep_s: float = 0.0) -> str:
    wait = f"    import time\n    time.sleep({sleep_s})\n" if sleep_s else ""
    return f"```python\ndef f{i}(x):\n{wait}    return x + {i}\n```"


def bad_answer(i: int) -> str:
    return f"```python\ndef f{i}(x):\n    return x - 100\n```"


def problem_id(problem: dict) -> str:
    spec = code_tests_spec(problem["prompt"], problem["test"], problem["entry_point"])
    return prompt_id_of(code_messages(problem["prompt"]), spec)


TRAIN_IDS = sorted(problem_id(p) for p in PROBLEMS[:2])
TEST_IDS = [problem_id(PROBLEMS[2])]
# prompt_id -> problem index, for stand-in answers.
INDEX = {problem_id(p): i for i, p in enumerate(PROBLEMS)}


def write_sources(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    train, test = directory / "train.jsonl", directory / "test.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS[:2]))
    test.write_text(json.dumps(PROBLEMS[2]) + "\n")
    return train, test


def run_overrides(sources: Path, *extra: str) -> list[str]:
    train, test = write_sources(sources)
    return [
        f"run_id={RUN_ID}", f"data.train={train}", f"data.test={test}", "iterations=1", "threads=1",
        "generate.prompts_per_iteration=2", f"generate.n_samples={N_SAMPLES}", "score.workers=2",
        "score.timeout_s=5", "evaluate.n_samples=2", "evaluate.k=[1,2]", *extra,
    ]


def start(root: str, sources: Path, *extra: str) -> RunLayout:
    from tests.support.stages import start_run

    return start_run(load_config(None, run_overrides(sources, *extra)), root)


# ---------------------------------------------------------------------------------------------------------
# Stand-in stage work (deterministic: the same inputs give the same bytes)


def pause() -> None:
    """Stand-ins pause between their steps when $RLPIPE_DRILL_PAUSE_S is set, so that a random SIGKILL can land
    between two writes (as it can in a real stage, whose steps take seconds) and not only in the imports."""
    time.sleep(float(os.environ.get("RLPIPE_DRILL_PAUSE_S", "0")))


def _small_checkpoint(directory: Path, seed: str) -> None:
    """A checkpoint-shaped directory; $RLPIPE_DRILL_WEIGHTS_BYTES sizes its weights file (default 2 KiB)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "standin": seed}))
    pause()
    size = int(os.environ.get("RLPIPE_DRILL_WEIGHTS_BYTES", "2048"))
    block = hashlib.sha256(seed.encode()).digest()
    with open(directory / "model.safetensors", "wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
    pause()
    (directory / "tokenizer_config.json").write_text("{}")


def standin_base_model(ctx: StageContext) -> None:
    scratch = ctx.scratch_checkpoint_dir()
    _small_checkpoint(scratch, "base")
    ctx.write_checkpoint(scratch)


def _eval_rows(ctx: StageContext) -> list[dict]:
    pause()
    return [
        {"run_id": ctx.run_id, "iteration": ctx.iteration, "policy_version": ctx.inputs["policy"].sha256,
         "dataset": "test", "prompt_id": pid, "mode": "sampled", "sample_idx": s, "correct": s == 0,
         "reward": float(s == 0), "status": "ok" if s == 0 else "fail", "num_tokens": 3, "response_text": "x",
         "num_turns": 1, "tool_calls": 0, "tool_errors": 0, "first_answer_correct": s == 0}
        for pid in TEST_IDS for s in range(2)
    ]


def standin_evaluate(ctx: StageContext) -> None:
    ctx.write_table("eval", pa.Table.from_pylist(_eval_rows(ctx)))


def rollout_rows(
    run_id: str, iteration: int, policy: str, groups: dict[str, int] | None = None, sleep_s: float = 0.0
) -> list[dict]:
    """N_SAMPLES rollouts per training prompt (or `groups`: prompt_id -> samples); even samples answer right
    (after sleeping `sleep_s` in the sandbox, to make the score stage slow on purpose)."""
    groups = groups or {pid: N_SAMPLES for pid in TRAIN_IDS}
    rows = []
    for pid, n in groups.items():
        for s in range(n):
            text = good_answer(INDEX[pid], sleep_s) if s % 2 == 0 else bad_answer(INDEX[pid])
            rows.append({
                "run_id": run_id, "iteration": iteration, "round": 0, "prompt_id": pid, "sample_idx": s,
                "policy_version": policy, "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
                "response_logprobs": [-0.5, -0.25], "response_text": text, "finish_reason": "stop",
                "truncated": False, "num_tokens": 2, "seed": s, "backend": "standin", **SINGLE_TURN_ROLLOUT,
            })
    return rows


def standin_generate(ctx: StageContext, sleep_s: float = 0.0) -> None:
    pause()
    groups = {pid: N_SAMPLES for pid in ctx.shard_groups(TRAIN_IDS)}  # all, or a shard's (pipeline.shards)
    rows = rollout_rows(ctx.run_id, ctx.iteration, ctx.inputs["policy"].sha256, groups, sleep_s=sleep_s)
    ctx.write_table("rollouts", pa.Table.from_pylist(rows), {"backend": "standin", "deterministic": True})


def standin_train(ctx: StageContext) -> None:
    scratch = ctx.scratch_checkpoint_dir()
    _small_checkpoint(scratch, ctx.inputs["batch"].sha256)
    ctx.write_checkpoint(scratch)
    pause()
    row = {"run_id": ctx.run_id, "iteration": ctx.iteration, "step": 0, "epoch": 0, "skipped": False}
    floats = [f.name for f in pa.schema(STAGE_SCHEMAS["train_metrics"]) if f.type == pa.float64()]
    row |= {name: 0.0 for name in floats} | {"tokens": 10, "loss_tokens": 4, "sequences": 8, "staleness_max": 0}
    ctx.write_table("train_metrics", pa.Table.from_pylist([row]))


def _stage_schemas() -> dict[str, pa.Schema]:
    from schemas.tables import TABLES

    return {name: spec.schema for name, spec in TABLES.items()}


STAGE_SCHEMAS = _stage_schemas()


def real_stage(name: str):  # noqa: ANN201 - a stage's run(ctx)
    import importlib

    return importlib.import_module(f"stages.{name}").run


STANDINS = {
    "base_model": standin_base_model, "evaluate_base": standin_evaluate, "generate": standin_generate,
    "train": standin_train, "evaluate": standin_evaluate,
}
REAL = ("prompts", "score", "advantage")


def build_run(layout: RunLayout, upto: str | None = None) -> None:
    """Run every stage of the (one-iteration) run in this process, in order, stopping before `upto`."""
    for stage in [*RUN_STAGES, *ITERATION_STAGES]:
        if stage == upto:
            return
        work = real_stage(stage) if stage in REAL else STANDINS[stage]
        run_stage_at(stage, layout, BASE if STAGES[stage].run_level else 0, work)


# ---------------------------------------------------------------------------------------------------------
# Processes


def env_for(root: str | Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "RLPIPE_ROOT": str(root), "COLUMNS": "250", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def stage_command(layout: RunLayout, stage: str, iteration: int = 0) -> list[str]:
    return [PYTHON, "-m", f"stages.{stage}", "--root", layout.root, "--run", layout.run_id, "--iter", str(iteration)]


def rlpipe_command(*args: str) -> list[str]:
    return [PYTHON, "-m", "flows.cli", *args]


def run(command: list[str], root: str | Path, timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env_for(root, **extra_env), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def spawn(command: list[str], root: str | Path, log: Path, **extra_env: str) -> subprocess.Popen:
    """A process in a session of its own (so its whole group can be killed), output to `log`."""
    handle = open(log, "wb")  # noqa: SIM115 - closed by the caller through `finish`
    process = spawn_tied(command, env=env_for(root, **extra_env), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    process.log_handle = handle  # type: ignore[attr-defined]
    return process


def finish(process: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return process.wait(timeout=timeout)
    finally:
        process.log_handle.close()  # type: ignore[attr-defined]


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finish(process)


def processes_matching(*needles: str) -> list[int]:
    """Pids whose command line contains every needle (the drills give each run a unique root path)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(needle in text for needle in needles):
            found.append(int(entry.parent.name))
    return found


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def kill_at_random_point(command: list[str], root: str | Path, log: Path, seed: int, clean_seconds: float) -> float:
    """Start `command`, SIGKILL its process group at a uniformly random time in [0, clean_seconds).

    Returns the delay used. A process that finished before the kill is fine: that is a point too.
    """
    delay = random.Random(seed).uniform(0.0, clean_seconds)
    process = spawn(command, root, log)
    try:
        process.wait(timeout=delay)
        finish(process)
    except subprocess.TimeoutExpired:
        kill_group(process)
    return delay


# ---------------------------------------------------------------------------------------------------------
# Checks


def manifests_of(layout: RunLayout) -> dict[str, Manifest]:
    """Relative manifest path -> manifest, for every manifest under the run (local roots)."""
    run_dir = Path(layout.run_dir)
    found = {}
    for path in sorted(run_dir.rglob("*manifest.json")):
        manifest = read_manifest(layout.fs, str(path))
        assert manifest is not None, f"unreadable manifest {path}"
        found[str(path.relative_to(run_dir))] = manifest
    return found


def assert_manifests_vouch_for_their_outputs(fs, manifests: Iterable[Manifest]) -> None:  # noqa: ANN001
    """Every manifest points at a complete output: the full content hash matches (not only the size)."""
    for manifest in manifests:
        if manifest.kind == "checkpoint":
            assert verify_checkpoint(fs, manifest) == [], manifest.path
        else:
            assert fs.exists(manifest.path), f"manifest points at missing {manifest.path}"
            assert sha256_file(fs, manifest.path) == manifest.sha256, f"manifest points at partial {manifest.path}"
            assert "tmp" not in manifest.path.rsplit("/", 1)[1]


def temporary_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if ".tmp" in p.name]


@dataclass
class Keys:
    """What every table of the one-iteration drill run must hold: exactly these keys, once each."""

    rollout: list[tuple[str, int]]
    prompts: list[tuple[str, str]]

    @classmethod
    def expected(cls) -> Keys:
        return cls(
            rollout=sorted((pid, s) for pid in TRAIN_IDS for s in range(N_SAMPLES)),
            prompts=sorted([(pid, "train") for pid in TRAIN_IDS] + [(pid, "test") for pid in TEST_IDS]),
        )


def table_rows(layout: RunLayout, table: str, iteration: int = 0) -> list[dict]:
    with layout.fs.open(layout.table_path(table, iteration), "rb") as handle:
        return pq.read_table(handle).to_pylist()


def assert_exact_keys(layout: RunLayout, tables: Iterable[str] = ("rollouts", "scores", "batch")) -> None:
    expected = Keys.expected()
    prompts = sorted((r["prompt_id"], r["split"]) for r in table_rows(layout, "prompts", BASE))
    assert prompts == expected.prompts
    for table in tables:
        keys = sorted((r["prompt_id"], r["sample_idx"]) for r in table_rows(layout, table))
        assert keys == expected.rollout, f"{table}: {keys}"


def assert_run_done(layout: RunLayout) -> None:
    from storage.run import read_run_config

    config = read_run_config(layout)
    layout.fs.invalidate_cache()
    for stage in [*RUN_STAGES, *ITERATION_STAGES]:
        iteration = BASE if STAGES[stage].run_level else 0
        state = stage_state(Run(layout, config), instance(stage, iteration))
        assert state.done, f"{stage}: {state.reason}"


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def snapshot(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `directory` (lock files left out)."""
    return {
        str(p.relative_to(directory)): file_digest(p)
        for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".lock")
    }


def standin_command(layout: RunLayout, stage: str, iteration: int = 0) -> list[str]:
    """The stand-in work of `stage` run through the real stage entry point (`stages.harness.main`)."""
    code = (
        "import sys; from stages.harness import main; from tests.reliability.helpers import STANDINS; "
        f"sys.exit(main({stage!r}, STANDINS[{stage!r}], sys.argv[1:]))"
    )
    return [PYTHON, "-c", code, "--root", layout.root, "--run", layout.run_id, "--iter", str(iteration)]


def command_for(layout: RunLayout, stage: str) -> list[str]:
    iteration = BASE if STAGES[stage].run_level else 0
    return stage_command(layout, stage, iteration) if stage in REAL else standin_command(layout, stage, iteration)


def ensure_upstream_done(layout: RunLayout, stage: str) -> None:
    """Redo, in this process, every stage before `stage` that is not done (an earlier drill may have changed
    an upstream table's bytes, e.g. score's timing column)."""
    from storage.run import read_run_config

    config = read_run_config(layout)
    for name in [*RUN_STAGES, *ITERATION_STAGES]:
        if name == stage:
            return
        iteration = BASE if STAGES[name].run_level else 0
        layout.fs.invalidate_cache()
        if not stage_state(Run(layout, config), instance(name, iteration)).done:
            run_stage_at(name, layout, iteration, real_stage(name) if name in REAL else STANDINS[name])


def ensure_done(layout: RunLayout, stage: str) -> None:
    """`stage` and everything before it done (redone in this process where an earlier drill changed them)."""
    from storage.run import read_run_config

    ensure_upstream_done(layout, stage)
    iteration = BASE if STAGES[stage].run_level else 0
    layout.fs.invalidate_cache()
    if not stage_state(Run(layout, read_run_config(layout)), instance(stage, iteration)).done:
        run_stage_at(stage, layout, iteration, work_for(stage))


def job_uid_processes(owner_pid: int) -> list[int]:
    """Live processes running as one of the sandbox job uids of the sandbox in process `owner_pid`
    (stages/sandbox/isolation.py `job_uid`: (1 << 30) + (owner_pid << 6) + slot)."""
    low = (1 << 30) + ((owner_pid & 0x3FFFFF) << 6)
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        uid = int(fields.get("Uid", "0").split()[0])
        if low <= uid < low + 64 and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(status.parent.name))
    return found


TIMING_COLUMNS = {"sandbox_seconds", "seconds"}


def output_contents(layout: RunLayout, stage: str) -> dict[str, object]:
    """What a stage's outputs hold, for comparing a resumed stage with a clean one: table rows without the
    columns that measure time, and a checkpoint's content hash."""
    from storage.layout import manifest_path_for

    contents: dict[str, object] = {}
    iteration = BASE if STAGES[stage].run_level else 0
    for output in STAGES[stage].outputs(iteration):
        if output.kind == "checkpoint":
            manifest = read_manifest(layout.fs, manifest_path_for(output.path(layout), "checkpoint"))
            contents[output.name] = manifest.sha256 if manifest else None
        else:
            rows = table_rows(layout, output.name, output.iteration)
            contents[output.name] = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]
    return contents


# ---------------------------------------------------------------------------------------------------------
# Stage processes forked from this one


@dataclass
class Forked:
    """A stage process forked from the test process: `stages.harness.main(stage, work, argv)`, exactly what
    `python -m stages.<name>` runs, minus the interpreter start and imports (GX alone costs seconds of CPU per
    process), so that a drill can start dozens of them. It leads a session of its own (its sandbox workers
    die with it when the group is killed) and writes its output to `log`."""

    pid: int
    log: Path
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait(60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def fork_stage(layout: RunLayout, stage: str, work, log: Path, **env: str) -> Forked:  # noqa: ANN001
    from stages.harness import main

    iteration = BASE if STAGES[stage].run_level else 0
    argv = ["--root", layout.root, "--run", layout.run_id, "--iter", str(iteration)]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setsid()
            handle = open(log, "w")  # noqa: SIM115 - the process ends below
            os.dup2(handle.fileno(), 1)
            os.dup2(handle.fileno(), 2)
            sys.stdout = sys.stderr = handle
            os.environ.update(env)
            code = main(stage, work, argv)
        except BaseException:  # noqa: BLE001 - report anything, exit 1 like an uncaught exception would
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
            finally:
                os._exit(code)
    return Forked(pid, log)


def work_for(stage: str):  # noqa: ANN201 - a stage's run(ctx)
    return real_stage(stage) if stage in REAL else STANDINS[stage]


def clone_run(pristine: RunLayout, root: Path) -> RunLayout:
    """A copy of a finished run under another storage root, as if it had been run there. Manifests record
    their output's full path, so the old root is replaced by the new one in them; everything else (keys,
    content hashes, config) does not depend on where the root is. Costs milliseconds where building a run
    costs seconds of CPU (every table passes its data contract on the way in)."""
    import shutil

    source = Path(pristine.run_dir)
    target = Path(root) / "runs" / pristine.run_id
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.lock"))
    for manifest in target.rglob("*manifest.json"):
        manifest.write_text(manifest.read_text().replace(pristine.root + "/", str(Path(root).resolve()) + "/"))
    return RunLayout.create(str(root), pristine.run_id)


def assert_readers_see_only_finished_outputs(layout: RunLayout, unfinished: Iterable) -> None:
    """The run's reader (the DuckDB catalog) reads no output that lacks a manifest, and sees every rollout key
    at most once."""
    from storage.catalog import Catalog

    with Catalog(layout.root) as catalog:
        for output in unfinished:
            if output.kind == "table":
                read = [e.url for e in catalog.entries(output.name)
                        if e.iteration in (output.iteration, None) and e.problem is None]
                assert read == [], f"the catalog reads {read}, which has no manifest"
        for name in ("rollouts", "scores", "batch"):
            duplicates = catalog.rows(
                f"SELECT prompt_id, sample_idx, count(*) AS n FROM {name} GROUP BY ALL HAVING count(*) > 1")
            assert duplicates == [], f"{name}: {duplicates}"
