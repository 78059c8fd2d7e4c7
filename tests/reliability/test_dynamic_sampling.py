"""DAPO dynamic sampling across generation rounds, on the real harness, registry, score and advantage stages.

The model stages are stand-ins (tests/reliability/helpers.py) so that which groups have variance is chosen
by the test: a prompt of an even-numbered problem gets a mixed group (kept), an odd one a group of wrong
answers only (zero variance, dropped). The loop under test is the one the iteration flow runs
(`flows.runner.process.dynamic_sampling_rounds`), given an in-process stage runner instead of Prefect's task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from flows.artifacts import iteration_metrics
from flows.cli.status import extra_rounds
from flows.runner.process import StageOutcome, dynamic_sampling_rounds
from schemas.config import load_config
from schemas.errors import InputError
from schemas.tables import SINGLE_TURN_ROLLOUT
from stages.data.sources import code_messages, code_tests_spec, prompt_id_of
from stages.generate import select_round_prompts
from stages.harness import StageContext
from stages.registry import instance, round_inputs, stage_state
from storage.catalog import Catalog
from storage.layout import BASE, RunLayout, StageInstance
from storage.lineage import trace
from storage.manifest import read_manifest
from storage.run import Run, read_run_config
from tests.support.stages import run_stage_at, start_run

from . import helpers as h

N_PROBLEMS, N_SAMPLES, PER_ROUND, TARGET = 12, 4, 2, 3
PROBLEMS = [
    {
        "task_id": f"ds/{i}",
        "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
        "entry_point": f"f{i}",
        "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n",
    }
    for i in range(N_PROBLEMS + 1)  # the last one is held out
]
INDEX = {
    prompt_id_of(code_messages(p["prompt"]), code_tests_spec(p["prompt"], p["test"], p["entry_point"])): i
    for i, p in enumerate(PROBLEMS)
}


def has_variance(prompt_id: str) -> bool:
    return INDEX[prompt_id] % 2 == 0


def standin_generate(ctx: StageContext) -> None:
    """Rollouts of the prompts the real generate stage would pick for this round."""
    train = [r["prompt_id"] for r in ctx.read_input("prompts").to_pylist() if r["split"] == "train"]
    cfg = ctx.config.generate
    chosen = select_round_prompts(train, ctx.config.seed, ctx.iteration, cfg.prompts_per_iteration, ctx.round_idx)
    rows = []
    for pid in chosen:
        for s in range(cfg.n_samples):
            right = has_variance(pid) and s % 2 == 0
            text = h.good_answer(INDEX[pid]) if right else h.bad_answer(INDEX[pid])
            rows.append({
                "run_id": ctx.run_id, "iteration": ctx.iteration, "round": ctx.round_idx, "prompt_id": pid,
                "sample_idx": s, "policy_version": ctx.inputs["policy"].sha256, "prompt_token_ids": [1, 2],
                "response_token_ids": [4, 5], "response_logprobs": [-0.5, -0.25], "response_text": text,
                "finish_reason": "stop", "truncated": False, "num_tokens": 2, "seed": s, "backend": "standin",
                **SINGLE_TURN_ROLLOUT,
            })
    ctx.write_table("rollouts", pa.Table.from_pylist(rows), {"backend": "standin", "deterministic": True})


WORK = {**h.STANDINS, "generate": standin_generate, **{name: h.real_stage(name) for name in h.REAL}}


def start(tmp_path: Path, *extra: str) -> RunLayout:
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS[:-1]))
    (sources / "test.jsonl").write_text(json.dumps(PROBLEMS[-1]) + "\n")
    overrides = [
        "run_id=ds", f"data.train={sources / 'train.jsonl'}", f"data.test={sources / 'test.jsonl'}",
        "iterations=1", "threads=1", f"generate.prompts_per_iteration={PER_ROUND}",
        f"generate.n_samples={N_SAMPLES}", "score.workers=2", "score.timeout_s=5", "evaluate.n_samples=2",
        "evaluate.k=[1,2]", f"advantage.target_groups={TARGET}", *extra,
    ]
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    for stage in ("prompts", "base_model", "evaluate_base"):
        run_stage_at(stage, layout, BASE, WORK[stage])
    for stage in ("generate", "score", "advantage"):
        run_stage_at(stage, layout, 0, WORK[stage])
    return layout


def in_process(layout: RunLayout, ran: list[tuple[str, int]]):  # noqa: ANN201 - the runner the loop calls
    def execute(target: StageInstance) -> StageOutcome:
        if stage_state(Run(layout, read_run_config(layout)), target).done:
            return StageOutcome(target, ran=False, seconds=0.0)
        run_stage_at(target.stage, layout, target.iteration, WORK[target.stage], target.round_idx)
        ran.append((target.stage, target.round_idx))
        return StageOutcome(target, ran=True, seconds=0.0)

    return execute


def batch_manifest(layout: RunLayout):  # noqa: ANN201 - a Manifest
    return read_manifest(layout.fs, layout.table_path("batch", 0) + ".manifest.json")


def expected_rounds(layout: RunLayout) -> tuple[int, list[list[str]]]:
    """How many rounds the batch needs to hold TARGET kept groups, and each round's prompts."""
    config = read_run_config(layout)
    train = [pid for pid, i in INDEX.items() if i < N_PROBLEMS]
    kept, rounds = 0, []
    while kept < TARGET:
        chosen = select_round_prompts(train, config.seed, 0, PER_ROUND, len(rounds))
        rounds.append(chosen)
        kept += sum(has_variance(pid) for pid in chosen)
    return len(rounds), rounds


def test_extra_rounds_fill_the_batch_and_nothing_is_lost(tmp_path: Path) -> None:
    """Proves: while the batch lacks kept groups, each extra round generates unused prompts into its own
    tables (round 0 untouched), the batch is rebuilt over every round until it holds exactly
    `target_groups` kept groups, history sees every round, train reads them all, and a resumed loop
    does nothing."""
    layout = start(tmp_path)
    n_rounds, round_prompts = expected_rounds(layout)
    assert n_rounds >= 2, "the seed must make round 0 fall short, or this test tests nothing"
    first = batch_manifest(layout)
    assert first.metrics["groups_needed"] == TARGET - sum(has_variance(p) for p in round_prompts[0]) > 0
    round0 = read_manifest(layout.fs, layout.table_path("rollouts", 0) + ".manifest.json")

    ran: list[tuple[str, int]] = []
    config = read_run_config(layout)
    dynamic_sampling_rounds(Run(layout, config), 0, execute=in_process(layout, ran), log=lambda *a: None)

    # One generate and one score per extra round, and the batch rebuilt after each.
    assert ran == [step for r in range(1, n_rounds) for step in (("generate", r), ("score", r), ("advantage", 0))]
    batch = batch_manifest(layout)
    assert batch.metrics["groups_needed"] == 0 and batch.metrics["rounds"] == n_rounds
    assert batch.metrics["groups_kept"] == TARGET
    assert {"read_seconds", "validate_seconds", "write_seconds"} <= set(batch.metrics["harness"])
    # Each extra round is its own table beside round 0, which is untouched; the batch names them all.
    for r in range(1, n_rounds):
        path = layout.table_path("rollouts", 0, r)
        assert path.endswith(f"iter=0000/round={r:02d}/rollouts.parquet")
        assert set(batch.inputs) >= {f"rollouts@round={r:02d}", f"scores@round={r:02d}"}
    assert read_manifest(layout.fs, layout.table_path("rollouts", 0) + ".manifest.json").sha256 == round0.sha256
    # Rounds draw prompts no earlier round of the iteration used.
    flat = [pid for prompts in round_prompts for pid in prompts]
    assert len(flat) == len(set(flat))

    # Every rollout of every round is a batch row; kept groups are the first TARGET with variance.
    rows = pa.parquet.read_table(layout.table_path("batch", 0)).to_pylist()
    assert len(rows) == n_rounds * PER_ROUND * N_SAMPLES
    assert {r["round"] for r in rows} == set(range(n_rounds))
    kept_prompts = [p for p in flat if has_variance(p)][:TARGET]
    assert sorted({r["prompt_id"] for r in rows if r["kept"]}) == sorted(kept_prompts)
    reasons = {r["prompt_id"]: r["drop_reason"] for r in rows}
    assert all(reasons[p] == "zero_variance" for p in flat if not has_variance(p))

    # History sees every round's rollouts (DuckDB over the catalog).
    with Catalog(layout.root) as catalog:
        counts = dict(catalog.sql("select round, count(*) from rollouts group by round order by round").fetchall())
    assert counts == {r: PER_ROUND * N_SAMPLES for r in range(n_rounds)}

    # Status has a row per extra round; the Prefect metrics' mean reward covers every round.
    assert extra_rounds(Run(layout, config), 0) == list(range(1, n_rounds))
    rewards = [r["reward"] for k in range(n_rounds)
               for r in pa.parquet.read_table(layout.table_path("scores", 0, k)).to_pylist()]
    metrics = {(m["stage"], m["metric"]): m["value"] for m in iteration_metrics(Run(layout, config), 0)}
    assert metrics[("score", "reward.mean")] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)

    # Train reads every round's rollouts; a resumed loop has nothing to do.
    run_stage_at("train", layout, 0, WORK["train"])
    ran.clear()
    assert dynamic_sampling_rounds(Run(layout, config), 0, execute=in_process(layout, ran), log=lambda *a: None) == []
    assert ran == []
    for stage in ("advantage", "train"):
        assert stage_state(Run(layout, config), instance(stage, 0)).done, stage

    # Lineage names every round's tables apart, and the catalog's manifests carry their round.
    labels = [node.label for node in trace(str(tmp_path / "root"), "ds", 0).nodes]
    assert len(labels) == len(set(labels)) and "iter=0000/round=01/rollouts" in labels
    with Catalog(layout.root) as catalog:
        per_round = catalog.sql("select count(*) from manifests where round > 0").fetchall()[0][0]
    assert per_round == 2 * (n_rounds - 1)  # rollouts and scores of each extra round


def test_the_round_cap_fails_naming_it_and_train_refuses_a_short_batch(tmp_path: Path) -> None:
    """Proves: past `max_generation_rounds` the loop ends with an error naming the cap, the batch already
    written stays valid, the extra round's tables are kept, and train refuses a batch that is still short."""
    layout = start(tmp_path, "advantage.max_generation_rounds=2", f"advantage.target_groups={N_PROBLEMS}")
    with pytest.raises(InputError, match=r"still needs \d+ kept groups"):
        run_stage_at("train", layout, 0, h.real_stage("train"))
    before = batch_manifest(layout)

    ran: list[tuple[str, int]] = []
    config = read_run_config(layout)
    with pytest.raises(InputError, match=r"advantage.max_generation_rounds=2"):
        dynamic_sampling_rounds(Run(layout, config), 0, execute=in_process(layout, ran), log=lambda *a: None)
    assert ran == [("generate", 1), ("score", 1)]  # the advantage over both rounds refused: the cap
    # The refused rebuild left the previous batch as it was; round 1's tables are kept for a larger cap.
    assert batch_manifest(layout).sha256 == before.sha256
    assert read_manifest(layout.fs, layout.table_path("scores", 0, 1) + ".manifest.json") is not None


def test_a_round_outside_dynamic_sampling_is_refused(tmp_path: Path) -> None:
    """Proves: a round number beyond the cap, or a round of a stage that has none, is a config error."""
    layout = start(tmp_path)
    with pytest.raises(Exception, match=r"numbered 1\.\.3"):
        run_stage_at("generate", layout, 0, standin_generate, round_idx=4)
    with pytest.raises(Exception, match="no generation rounds"):
        run_stage_at("advantage", layout, 0, WORK["advantage"], round_idx=1)


def test_a_round_from_another_config_is_never_mixed_in(tmp_path: Path) -> None:
    """Proves: rounds made under another generate config are not inputs of the batch (so it reruns), and
    without dynamic sampling no round is read at all."""
    layout = start(tmp_path)
    config = read_run_config(layout)
    dynamic_sampling_rounds(Run(layout, config), 0, execute=in_process(layout, []), log=lambda *a: None)
    assert "rollouts@round=01" in round_inputs(Run(layout, config), "advantage", 0)
    # Another sampling temperature: every round on disk was made by another generate config, so none counts,
    # and the advantage stage is no longer done (its round inputs changed).
    changed = config.model_copy(update={"generate": config.generate.model_copy(update={"temperature": 0.5})})
    assert round_inputs(Run(layout, changed), "advantage", 0) == {}
    assert not stage_state(Run(layout, changed), instance("advantage", 0)).done
    # Without dynamic sampling the rounds are not read at all.
    plain = config.model_copy(update={"advantage": config.advantage.model_copy(update={"target_groups": None})})
    assert round_inputs(Run(layout, plain), "advantage", 0) == {}


def test_a_round_whose_score_did_not_finish_is_finished_on_resume(tmp_path: Path) -> None:
    """Proves: a crash between an extra round's generate and its score (no scores manifest) leaves no stage
    asking for the missing table: advantage reruns on the complete rounds, the loop scores the unfinished
    round (its rollouts are not generated again), and the batch comes out as it was before the crash."""
    layout = start(tmp_path)
    config = read_run_config(layout)
    dynamic_sampling_rounds(Run(layout, config), 0, execute=in_process(layout, []), log=lambda *a: None)
    complete = batch_manifest(layout)
    n_rounds = complete.metrics["rounds"]
    rollouts_r1 = read_manifest(layout.fs, layout.table_path("rollouts", 0, 1) + ".manifest.json")
    # The crash: round 1's score output never got its manifest (the table itself may or may not be there).
    layout.fs.rm(layout.table_path("scores", 0, 1) + ".manifest.json")

    assert "scores@round=01" not in round_inputs(Run(layout, config), "advantage", 0)
    state = stage_state(Run(layout, config), instance("advantage", 0))
    assert not state.done and state.reason != "inputs missing"

    ran: list[tuple[str, int]] = []
    run = in_process(layout, ran)
    run(instance("advantage", 0))  # what the iteration flow runs first
    dynamic_sampling_rounds(Run(layout, config), 0, execute=run, log=lambda *a: None)
    assert ran == [("advantage", 0), ("score", 1), ("advantage", 0)]
    after = batch_manifest(layout)
    assert after.metrics["rounds"] == n_rounds and after.metrics["groups_needed"] == 0
    assert after.sha256 == complete.sha256  # (its key differs: the rescored table has other sandbox timings)
    assert read_manifest(layout.fs, layout.table_path("rollouts", 0, 1) + ".manifest.json").sha256 == rollouts_r1.sha256
