"""The stage harness and the done-check: what makes resume correct, tested without a model."""

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest

from flows.runner.process import pending_stages
from schemas.config import load_config
from schemas.errors import InputError
from stages.harness import StageContext
from stages.harness import main as stage_main
from stages.registry import ITERATION_STAGES, STAGES, instance, is_scheduled, iteration_stages, stage_state
from storage.failure import read_failure
from storage.layout import BASE, RunLayout
from storage.run import Run
from tests.support.stages import run_stage_at, start_run


def write_prompts(ctx: StageContext) -> None:
    rows = [
        {
            "prompt_id": f"p{i}",
            "dataset": "toy",
            "split": "train" if i else "test",
            "source_row": i,
            "messages": json.dumps([{"role": "user", "content": f"q{i}"}]),
            "reward_spec": json.dumps({"kind": "math", "answer": str(i)}),
            "metadata": "{}",
        }
        for i in range(3)
    ]
    ctx.write_table("prompts", pa.Table.from_pylist(rows))


def state(layout: RunLayout, *overrides: str) -> str:
    config = load_config(None, ["run_id=t", *overrides])
    return stage_state(Run(layout, config), instance("prompts", BASE)).reason


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return start_run(load_config(None, ["run_id=t"]), str(tmp_path))


def test_done_only_with_matching_manifest(layout: RunLayout) -> None:
    assert state(layout) == "missing"
    [manifest] = run_stage_at("prompts", layout, BASE, write_prompts)
    assert manifest.rows == 3 and manifest.schema == "prompts/v1" and manifest.seconds >= 0
    assert state(layout) == "done"
    # The prompts stage hashes the data section: another test fraction makes it stale.
    assert state(layout, "data.test_fraction=0.5") == "stale key"
    # ...but a change in another section does not.
    assert state(layout, "train.lr=0.5") == "done"


def test_deleted_output_is_not_done(layout: RunLayout) -> None:
    run_stage_at("prompts", layout, BASE, write_prompts)
    Path(layout.prompts_path).unlink()
    assert state(layout) == "output changed"


def test_crash_after_write_before_manifest_is_not_done(layout: RunLayout) -> None:
    run_stage_at("prompts", layout, BASE, write_prompts)

    def crash(ctx: StageContext) -> None:
        write_prompts(ctx)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage_at("prompts", layout, BASE, crash)
    # The old manifest was removed before the rerun wrote anything, and the new one was never written.
    assert state(layout) == "missing"
    assert not list(Path(layout.run_dir).glob(".*tmp*"))


def test_stage_that_forgets_an_output_fails(layout: RunLayout) -> None:
    with pytest.raises(RuntimeError, match="expected"):
        run_stage_at("prompts", layout, BASE, lambda ctx: None)
    assert state(layout) == "missing"


def test_a_failed_stage_leaves_the_runs_failure_record_until_it_succeeds(layout: RunLayout) -> None:
    """Bad input (exit 2) and a crash (its exception re-raised, as before) are recorded with the stage and a
    one-line reason; the stage's next success removes the record."""
    argv = ["--run", "t", "--root", layout.root]

    def bad_input(ctx: StageContext) -> None:
        raise InputError("data/train.jsonl row 3: field `prompt` is missing")

    def crash(ctx: StageContext) -> None:
        raise RuntimeError("CUDA out of memory\n(traceback text)")

    assert stage_main("prompts", bad_input, argv) == 2
    failure = read_failure(layout)
    assert (failure.label, failure.exit_code, failure.reason) == (
        "prompts", 2, "data/train.jsonl row 3: field `prompt` is missing")
    with pytest.raises(RuntimeError):
        stage_main("prompts", crash, argv)
    failure = read_failure(layout)
    assert (failure.exit_code, failure.reason) == (1, "RuntimeError: CUDA out of memory (traceback text)")
    assert stage_main("prompts", write_prompts, argv) == 0 and read_failure(layout) is None


def test_a_stage_killed_before_it_could_say_why_is_recorded_by_the_driver(
    layout: RunLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage ended by a signal (the kernel's OOM killer) writes no record; the driver records the signal. A
    record the stage wrote itself in this attempt is kept, and a lease held elsewhere (exit 3) is no failure."""
    from flows.runner import forkserver, process

    run = Run.open(layout.root, "t")
    target = instance("prompts", BASE)
    monkeypatch.setattr(forkserver, "run", lambda command, env: -9)
    with pytest.raises(process.StageFailed):
        process.run_stage_process(run, target)
    failure = read_failure(layout)
    assert (failure.label, failure.exit_code, failure.reason) == ("prompts", -9, "ended by signal SIGKILL")

    def fails_saying_why(command: list[str], env: dict[str, str]) -> int:
        return stage_main("prompts", lambda ctx: (_ for _ in ()).throw(InputError("bad row 3")), command[3:])

    monkeypatch.setattr(forkserver, "run", fails_saying_why)
    with pytest.raises(process.StageFailed):
        process.run_stage_process(run, target)
    assert read_failure(layout).reason == "bad row 3"
    monkeypatch.setattr(forkserver, "run", lambda command, env: 3)
    with pytest.raises(process.StageFailed):
        process.run_stage_process(run, target)
    assert read_failure(layout).reason == "bad row 3"


def test_downstream_needs_upstream(layout: RunLayout) -> None:
    config = load_config(None, ["run_id=t"])
    assert stage_state(Run(layout, config), instance("score", 0)).reason == "missing"


def test_manifest_times_the_harness_apart_from_the_stage_work(layout: RunLayout) -> None:
    """The harness's own work (reading inputs, validating and writing outputs) is timed into every output's
    manifest, so benchmarks/overhead.py can tell it from model and sandbox work; a sleep in the stage body
    counts toward the stage's seconds and not toward the harness. (Reading is timed too: a stage with
    inputs, tests/reliability/test_dynamic_sampling.py.)"""
    [manifest] = run_stage_at("prompts", layout, BASE, lambda ctx: (time.sleep(0.3), write_prompts(ctx)))
    harness = manifest.metrics["harness"]
    assert set(harness) == {"validate_seconds", "write_seconds"}
    assert all(seconds > 0 for seconds in harness.values())
    assert manifest.seconds >= 0.3 + sum(harness.values()) - 1e-3


@pytest.mark.parametrize("stage", ["evaluate", "evaluate_base"])
def test_evaluation_keys_follow_the_generate_settings_evaluation_uses(stage: str) -> None:
    """Evaluation generates with generate's engine, precision and prompt-length rule, so a change of one of
    them reruns it; generate's sampling settings are not evaluation's (it has its own), so they do not."""
    payload = STAGES[stage].config_payload
    base = payload(load_config(None, []))
    for change in ("generate.vllm_dtype=float32", "generate.vllm_compile=on", "generate.dtype=bfloat16",
                   "generate.max_prompt_tokens=64",
                   "generate.overlong_prompt=truncate", "generate.backend=hf"):
        assert payload(load_config(None, [change])) != base, change
    for change in ("generate.temperature=0.5", "generate.n_samples=2", "train.lr=0.5"):
        assert payload(load_config(None, [change])) == base, change


@pytest.mark.parametrize("stage", ["score", "evaluate", "evaluate_base"])
def test_a_field_added_later_keeps_older_runs_keys_at_its_default(stage: str) -> None:
    """score.math_answer came after runs existed: at `strict` (what scoring did before it) the key is the one the
    older code computed from a score section without the field, so upgrading does not make finished stages stale;
    `flexible` grades differently and is in the key."""
    payload = STAGES[stage].config_payload
    older = {k: v for k, v in load_config(None, []).model_dump(mode="json")["score"].items() if k != "math_answer"}
    assert payload(load_config(None, []))["score"] == older
    assert payload(load_config(None, ["score.math_answer=flexible"]))["score"] == {**older, "math_answer": "flexible"}


def test_stage_processes_never_import_prefect() -> None:
    """Prefect with no server starts a temporary one per process (~15 s): only the flow process may import it.
    Every stage module (and the storage and schema code they use) imports without pulling Prefect in."""
    import subprocess
    import sys

    modules = [f"stages.{path.stem}" for path in sorted((Path(__file__).parents[2] / "stages").glob("*.py"))
               if path.stem != "__init__"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('prefect')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_evaluate_every_schedules_evaluation_without_entering_any_key() -> None:
    """evaluate.every=2 over 5 iterations evaluates checkpoints 1, 3 and the last one (4); every other stage
    runs in every iteration. `every` says when, not what: it is in no stage key, so raising it on a run
    leaves its finished evaluations done."""
    config = load_config(None, ["iterations=5", "evaluate.every=2"])
    assert [k for k in range(5) if is_scheduled(config, "evaluate", k)] == [1, 3, 4]
    assert iteration_stages(config, 0) == ["generate", "score", "advantage", "train"]
    assert iteration_stages(config, 3) == ITERATION_STAGES
    assert all(is_scheduled(load_config(None, ["iterations=5"]), "evaluate", k) for k in range(5))
    for stage in STAGES.values():
        assert stage.config_payload(config) == stage.config_payload(load_config(None, ["iterations=5"])), stage.name


def test_evaluate_every_leaves_unscheduled_evaluations_out_of_the_plan(tmp_path: Path) -> None:
    config = load_config(None, ["run_id=t", "iterations=3", "evaluate.every=2"])
    layout = start_run(config, str(tmp_path))
    plan = pending_stages(Run(layout, config))
    assert [target.iteration for target in plan if target.stage == "evaluate"] == [1, 2]
    assert [target.iteration for target in plan if target.stage == "train"] == [0, 1, 2]


EXIT_WITH_SCRIPT = """
import atexit, sys, threading, time
from stages.harness import exit_with

marker, root = sys.argv[1], sys.argv[2]
def late_write():  # a non-daemon thread still running when the stage returns: exit waits for it
    time.sleep(0.3)
    open(marker, "a").write("thread ")
threading.Thread(target=late_write).start()
atexit.register(lambda: open(marker, "a").write("atexit"))
sys.argv = ["prompts", "--root", root, "--run", "nosuchrun"]
print("before exit", flush=False)
exit_with("prompts", lambda ctx: None)
"""


def test_a_stage_process_ends_with_its_exit_code_after_pythons_exit_work(tmp_path: Path) -> None:
    """exit_with ends the process with os._exit (no C++ teardown), yet as Python would: the stage's exit code
    (2: a run that does not exist), non-daemon threads finished, then atexit handlers, streams flushed."""
    import subprocess
    import sys

    marker = tmp_path / "marker"
    result = subprocess.run([sys.executable, "-c", EXIT_WITH_SCRIPT, str(marker), str(tmp_path / "root")],
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert marker.read_text() == "thread atexit"
    assert "before exit" in result.stdout and "prompts" in result.stdout + result.stderr
