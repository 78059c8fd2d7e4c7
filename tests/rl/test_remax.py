"""remax (ReMax, Li et al. 2023): A_i = r_i - r_greedy, the greedy rollout of the same prompt as the baseline.

By hand: the formula; the advantage stage's pure core on hand-made groups with their greedy rows (overlong shaping
of the baseline, dynamic-sampling rounds each with their own greedy row, the greedy row out of the batch); the
baseline rows' checks; the contracts; the advantage and train stages through the real harness (the greedy row is
not trained on: the loss and its token count are those of the sampled rows alone); and the generate stage on the
packaged model (HF backend, tiny size) writing exactly one greedy row per prompt under remax and none otherwise,
its tokens equal to transformers' own greedy decoding (an independent reference); and dynamic sampling, where
each round's greedy rows are scored by the real score stage and serve as the baselines of that round's groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import AdvantageConfig, ConfigError, RunConfig, load_config
from schemas.contracts import checks_for
from schemas.errors import InputError
from schemas.tables import BASELINE_SAMPLE_IDX, BATCH, SINGLE_TURN_ROLLOUT, conform
from stages import advantage, train
from stages.harness import StageContext
from stages.rl.advantages import ESTIMATORS, check_estimator_fits, remax_advantages
from stages.rl.batch import build_batch, split_baselines
from tests.support.stages import run_stage_at

from .pipeline_helpers import N_PROMPTS, N_SAMPLES, write_policy_rollouts


def row(prompt: str, idx: int, reward: float, num_tokens: int = 10, round_: int = 0) -> dict:
    return {"run_id": "r", "iteration": 0, "round": round_, "prompt_id": prompt, "sample_idx": idx,
            "reward": reward, "num_tokens": num_tokens, "truncated": False, "status": "ok" if reward >= 1 else "fail"}


def remax_batch(samples: list[dict], greedy: list[dict], cfg: AdvantageConfig, max_new_tokens: int = 100):
    batch, metrics = build_batch(
        pa.Table.from_pylist(samples), cfg, max_new_tokens, baselines=pa.Table.from_pylist(greedy)
    )
    rows = conform(batch, BATCH, "batch").to_pylist()
    return {(r["round"], r["prompt_id"], r["sample_idx"]): r for r in rows}, metrics


def test_remax_formula_by_hand() -> None:
    # prompt a: greedy 0.5 -> [1 - .5, 0 - .5]; prompt b: greedy 1 -> [0.25 - 1, 1 - 1]
    got = remax_advantages(np.array([1.0, 0.0, 0.25, 1.0]), np.array([0.5, 0.5, 1.0, 1.0]))
    np.testing.assert_array_equal(got, [0.5, -0.5, -0.75, 0.0])
    with pytest.raises(ValueError, match="baseline reward at position 1 is nan"):
        remax_advantages(np.zeros(2), np.array([0.0, np.nan]))


def test_build_batch_takes_each_group_its_own_greedy_reward() -> None:
    # round 0: a [1, 0, 0] greedy 1 -> [0, -1, -1]; b [0, 1, 1] greedy 0 -> [0, 1, 1];
    # round 1 (dynamic sampling): a again, with its own greedy row 0 -> [1, 0, 0]
    samples = [row("a", i, r) for i, r in enumerate([1.0, 0.0, 0.0])]
    samples += [row("b", i, r) for i, r in enumerate([0.0, 1.0, 1.0])]
    samples += [row("a", i, r, round_=1) for i, r in enumerate([1.0, 0.0, 0.0])]
    greedy = [row("a", -1, 1.0), row("b", -1, 0.0), row("a", -1, 0.0, round_=1)]
    got, metrics = remax_batch(samples, greedy, AdvantageConfig(estimator="remax"))
    assert [got[(0, "a", i)]["advantage"] for i in range(3)] == [0.0, -1.0, -1.0]
    assert [got[(0, "b", i)]["advantage"] for i in range(3)] == [0.0, 1.0, 1.0]
    assert [got[(1, "a", i)]["advantage"] for i in range(3)] == [1.0, 0.0, 0.0]
    # the greedy rows are the baseline, not batch rows: groups of n_samples, every sampled row kept
    assert len(got) == 9 and all(key[2] >= 0 for key in got) and all(r["kept"] for r in got.values())
    assert {r["group_size"] for r in got.values()} == {3}
    assert metrics["baseline_reward_mean"] == pytest.approx(1 / 3) and metrics["samples"] == 9


def test_the_baseline_is_overlong_shaped_and_an_equal_group_still_learns() -> None:
    # max 100, buffer 20: greedy length 90 -> 1 - 0.5 = 0.5; sample lengths 50 (no penalty) and 100 (-1)
    # all-correct group, kept: remax has no group, so its zero-variance filter is off by default:
    # [1 - 0.5, (1 - 1) - 0.5] = [0.5, -0.5]
    cfg = AdvantageConfig(estimator="remax", overlong_buffer=20)
    got, metrics = remax_batch([row("a", 0, 1.0, 50), row("a", 1, 1.0, 100)], [row("a", -1, 1.0, 90)], cfg)
    assert got[(0, "a", 0)]["advantage"] == pytest.approx(0.5)
    assert got[(0, "a", 1)]["advantage"] == pytest.approx(-0.5)
    # the same group with DAPO's acc filter turned on (all correct) is dropped: advantage 0, nothing trained
    got, metrics = remax_batch([row("a", 0, 1.0, 50), row("a", 1, 1.0, 100)], [row("a", -1, 1.0, 90)],
                               AdvantageConfig(estimator="remax", overlong_buffer=20, drop_zero_variance_groups=True))
    assert [got[(0, "a", i)]["drop_reason"] for i in (0, 1)] == ["zero_variance"] * 2
    assert metrics["skipped"] is True


def test_baseline_rows_are_checked() -> None:
    def table(rows: list[dict]) -> pa.Table:
        return pa.Table.from_pylist(rows)

    sampled = [row("a", 0, 1.0), row("a", 1, 0.0)]
    kept, greedy = split_baselines(table([*sampled, row("a", -1, 1.0)]), True, "t.parquet")
    assert kept.num_rows == 2 and greedy["sample_idx"].to_pylist() == [-1]
    with pytest.raises(InputError, match=r"t.parquet: prompt a \(round 0\) has 0 greedy baseline rows"):
        split_baselines(table(sampled), True, "t.parquet")
    with pytest.raises(InputError, match=r"has 2 greedy baseline rows"):
        split_baselines(table([*sampled, row("a", -1, 1.0), {**row("a", -1, 1.0), "round": 0}]), True, "t")
    with pytest.raises(InputError, match=r"prompt b \(round 0\) has a greedy baseline row but no sampled"):
        split_baselines(table([*sampled, row("a", -1, 1.0), row("b", -1, 1.0)]), True, "t")
    with pytest.raises(InputError, match="sample_idx -1.*advantage.estimator is not remax"):
        split_baselines(table([*sampled, row("a", -1, 1.0)]), False, "t")


def test_contracts_expect_one_greedy_row_per_group_only_under_remax() -> None:
    def rules(config: RunConfig, table: str) -> dict[str, tuple]:
        greedy = ESTIMATORS[config.advantage.estimator].needs_greedy_baseline  # as the stage harness asks
        return {c.kwargs["column"]: (c.kwargs.get("min_value"), c.kwargs.get("max_value"))
                for c in checks_for(table, config, greedy) if c.kwargs.get("column") in ("sample_idx", "_group_size")}

    plain = load_config(None, ["generate.n_samples=4"])
    remax = load_config(None, ["generate.n_samples=4", "advantage.estimator=remax"])
    assert rules(plain, "rollouts") == {"sample_idx": (0, 3), "_group_size": (4, 4)}
    assert rules(remax, "rollouts") == {"sample_idx": (-1, 3), "_group_size": (5, 5)}
    assert rules(plain, "scores") == {"_group_size": (4, 4)} and rules(remax, "scores") == {"_group_size": (5, 5)}
    assert rules(remax, "batch") == {"_group_size": (4, 4)}  # the batch has the sampled rows alone


def test_remax_refuses_multi_turn() -> None:
    with pytest.raises(ConfigError, match="remax takes its baseline from one greedy response"):
        check_estimator_fits(load_config(None, ["advantage.estimator=remax", "generate.multi_turn.mode=feedback"]))


# --- through the real harness: the advantage and train stages on hand-made rollouts ------------------------

GREEDY_REWARD = {"p0": 1.0, "p1": 0.5}


def remax_generate(ctx: StageContext) -> None:
    """Random responses with their logprobs under the policy, N_SAMPLES sampled and one greedy row per prompt."""
    write_policy_rollouts(ctx, [*range(N_SAMPLES), BASELINE_SAMPLE_IDX], seed=7)


def remax_score(ctx: StageContext) -> None:
    """Sampled rows: reward sample_idx % 2; greedy rows: GREEDY_REWARD of the prompt."""
    rows = []
    for r in ctx.read_input("rollouts").to_pylist():
        reward = GREEDY_REWARD[r["prompt_id"]] if r["sample_idx"] == BASELINE_SAMPLE_IDX else float(r["sample_idx"] % 2)
        rows.append({**{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")},
                     "reward": reward, "passed": int(reward), "total": 1, "status": "ok" if reward == 1 else "fail",
                     "tests": "[]", "code": None, "sandbox_seconds": 0.0})
    ctx.write_table("scores", pa.Table.from_pylist(rows))


def test_advantage_and_train_stages_never_train_on_the_greedy_row(run_layout) -> None:  # noqa: ANN001
    make, _ = run_layout
    layout = make("advantage.estimator=remax", f"generate.n_samples={N_SAMPLES}")
    run_stage_at("generate", layout, 0, remax_generate)  # the contracts accept one greedy row per prompt
    run_stage_at("score", layout, 0, remax_score)
    [batch_manifest] = run_stage_at("advantage", layout, 0, advantage.run)
    run_stage_at("train", layout, 0, train.run)

    batch = {(r["prompt_id"], r["sample_idx"]): r for r in pq.read_table(layout.table_path("batch", 0)).to_pylist()}
    # by hand: p0 sampled [0, 1, 0, 1], greedy 1 -> [-1, 0, -1, 0]; p1 the same rewards, greedy .5 -> +-0.5
    assert sorted(batch) == [(f"p{p}", s) for p in range(N_PROMPTS) for s in range(N_SAMPLES)]
    assert [batch[("p0", s)]["advantage"] for s in range(N_SAMPLES)] == [-1.0, 0.0, -1.0, 0.0]
    assert [batch[("p1", s)]["advantage"] for s in range(N_SAMPLES)] == [-0.5, 0.5, -0.5, 0.5]
    assert all(r["kept"] for r in batch.values()) and batch_manifest.metrics["baseline_reward_mean"] == 0.75
    # one on-policy step: the token-mean loss -sum A_i L_i / sum L_i and its token count are the sampled rows'
    rollouts = pq.read_table(layout.table_path("rollouts", 0)).to_pylist()
    lengths = {(r["prompt_id"], r["sample_idx"]): r["num_tokens"] for r in rollouts}
    assert len(lengths) == N_PROMPTS * (N_SAMPLES + 1)
    [metrics] = pq.read_table(layout.table_path("train_metrics", 0)).to_pylist()
    sampled_tokens = sum(lengths[key] for key in batch)
    assert metrics["loss_tokens"] == sampled_tokens
    expected = -sum(batch[key]["advantage"] * lengths[key] for key in batch) / sampled_tokens
    assert metrics["policy_loss"] == pytest.approx(expected, abs=1e-6)

    # the training-reward summaries are of the sampled responses: 8 rows, mean 0.5, solved 0.5 (with the greedy
    # rows: 10 rows, mean 0.55, solved 0.5)
    from rich.console import Console

    from flows.artifacts import _table_summaries
    from flows.cli.status import training_table
    from storage.run import Run

    run = Run.open(layout.root, layout.run_id)
    summaries = {name: value for _, name, value in _table_summaries(run, 0)}
    assert summaries["reward.mean"] == 0.5 and summaries["passed.mean"] == 0.5
    console = Console(width=200, record=True)
    console.print(training_table(run))
    [line] = [line for line in console.export_text().splitlines() if line.count("│") == 6 and "0.500" in line]
    assert [cell.strip() for cell in line.split("│")[1:5]] == ["0", str(N_PROMPTS * N_SAMPLES), "0.500", "0.500"]


# --- the generate stage on the packaged model -------------------------------------------------------------


def generate_rows(tmp_path: Path, *extra: str):  # noqa: ANN201 - (rows, layout, base model directory)
    from stages import base_model, generate, prompts
    from storage.layout import BASE
    from tests.reliability import helpers as h
    from tests.support.stages import start_run

    overrides = h.run_overrides(
        tmp_path / "sources", "generate.backend=hf", "generate.prompts_per_iteration=2", "generate.n_samples=2",
        "generate.max_new_tokens=6", "generate.mismatch_samples=0", "data.max_test_prompts=1", "score.workers=1",
        *extra,
    )
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    [model] = run_stage_at("base_model", layout, BASE, base_model.run)
    run_stage_at("generate", layout, 0, generate.run)
    rows = pq.read_table(layout.table_path("rollouts", 0)).to_pylist()
    return rows, layout, model.metrics["local_path"]


@pytest.mark.slow
def test_generate_makes_one_greedy_row_per_prompt_under_remax_only(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from stages import score

    rows, layout, model_dir = generate_rows(tmp_path / "remax", "advantage.estimator=remax")
    prompts = sorted({r["prompt_id"] for r in rows})
    assert len(prompts) == 2
    for prompt_id in prompts:
        assert sorted(r["sample_idx"] for r in rows if r["prompt_id"] == prompt_id) == [-1, 0, 1]
    # the greedy row is transformers' own greedy decoding of the same prompt (do_sample=False)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    for greedy in (r for r in rows if r["sample_idx"] == BASELINE_SAMPLE_IDX):
        prompt_T = torch.tensor([greedy["prompt_token_ids"]])
        with torch.no_grad():
            out = policy.generate(prompt_T, do_sample=False, max_new_tokens=6, pad_token_id=2, eos_token_id=2)
        expected = out[0, prompt_T.shape[1]:].tolist()
        assert greedy["response_token_ids"] == expected[: len(greedy["response_token_ids"])]
        assert len(greedy["response_token_ids"]) == len(expected) or expected[len(greedy["response_token_ids"])] == 2
    # the score stage scores the greedy rows like any other (its contracts: one per group)
    run_stage_at("score", layout, 0, score.run)
    scored = pq.read_table(layout.table_path("scores", 0)).to_pylist()
    assert sorted((r["prompt_id"], r["sample_idx"]) for r in scored) == sorted(
        (r["prompt_id"], r["sample_idx"]) for r in rows)

    plain, _, _ = generate_rows(tmp_path / "plain")
    assert sorted(r["sample_idx"] for r in plain) == [0, 0, 1, 1]


# --- dynamic sampling: each round has its own greedy rows (the real score and advantage stages) ------------


def test_dynamic_sampling_rounds_each_bring_their_own_greedy_rows(tmp_path: Path) -> None:
    from flows.runner.process import StageOutcome, dynamic_sampling_rounds
    from stages.generate import select_round_prompts
    from stages.registry import Output, stage_state
    from storage.layout import BASE, StageInstance
    from storage.manifest import read_manifest
    from storage.run import Run, read_run_config
    from tests.reliability import helpers as h
    from tests.reliability import test_dynamic_sampling as ds
    from tests.support.stages import start_run

    def remax_standin_generate(ctx: StageContext) -> None:
        """The dynamic-sampling stand-in's rollouts (even problems: a mixed group, odd: all wrong), plus a greedy
        row per prompt that solves it (reward 1)."""
        train = [r["prompt_id"] for r in ctx.read_input("prompts").to_pylist() if r["split"] == "train"]
        cfg = ctx.config.generate
        chosen = select_round_prompts(train, ctx.config.seed, ctx.iteration, cfg.prompts_per_iteration, ctx.round_idx)
        rows = []
        for pid in chosen:
            for s in [*range(cfg.n_samples), BASELINE_SAMPLE_IDX]:
                right = s == BASELINE_SAMPLE_IDX or (ds.has_variance(pid) and s % 2 == 0)
                rows.append({
                    "run_id": ctx.run_id, "iteration": ctx.iteration, "round": ctx.round_idx, "prompt_id": pid,
                    "sample_idx": s, "policy_version": ctx.inputs["policy"].sha256, "prompt_token_ids": [1, 2],
                    "response_token_ids": [4, 5], "response_logprobs": [-0.5, -0.25],
                    "response_text": h.good_answer(ds.INDEX[pid]) if right else h.bad_answer(ds.INDEX[pid]),
                    "finish_reason": "stop", "truncated": False, "num_tokens": 2, "seed": s, "backend": "standin",
                    **SINGLE_TURN_ROLLOUT,
                })
        ctx.write_table("rollouts", pa.Table.from_pylist(rows), {"backend": "standin", "deterministic": True})

    work = {**ds.WORK, "generate": remax_standin_generate}
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in ds.PROBLEMS[:-1]))
    (sources / "test.jsonl").write_text(json.dumps(ds.PROBLEMS[-1]) + "\n")
    overrides = [
        "run_id=ds", f"data.train={sources / 'train.jsonl'}", f"data.test={sources / 'test.jsonl'}", "iterations=1",
        "threads=1", f"generate.prompts_per_iteration={ds.PER_ROUND}", f"generate.n_samples={ds.N_SAMPLES}",
        "score.workers=2", "score.timeout_s=5", "evaluate.n_samples=2", "evaluate.k=[1,2]",
        f"advantage.target_groups={ds.TARGET}", "advantage.estimator=remax",
        "advantage.drop_zero_variance_groups=true",  # DAPO's filter, off by default for remax (it has no group)
    ]
    layout = start_run(load_config(None, overrides), str(tmp_path / "root"))
    for stage in ("prompts", "base_model", "evaluate_base"):
        run_stage_at(stage, layout, BASE, work[stage])
    for stage in ("generate", "score", "advantage"):
        run_stage_at(stage, layout, 0, work[stage])
    config = read_run_config(layout)

    def execute(target: StageInstance) -> StageOutcome:
        if stage_state(Run(layout, config), target).done:
            return StageOutcome(target, ran=False, seconds=0.0)
        run_stage_at(target.stage, layout, target.iteration, work[target.stage], target.round_idx)
        return StageOutcome(target, ran=True, seconds=0.0)

    dynamic_sampling_rounds(Run(layout, config), 0, execute=execute, log=lambda *a: None)
    n_rounds, _ = ds.expected_rounds(layout)
    assert n_rounds >= 2
    for r in range(n_rounds):  # every round's scores hold its greedy rows, scored by the real sandbox: solved
        scores = pq.read_table(layout.table_path("scores", 0, r)).to_pylist()
        greedy = [s for s in scores if s["sample_idx"] == BASELINE_SAMPLE_IDX]
        assert len(greedy) == ds.PER_ROUND and {s["reward"] for s in greedy} == {1.0}
        # the manifest's mean reward is the policy's samples' only (the greedy rows, all 1.0, would raise it)
        sampled = [s["reward"] for s in scores if s["sample_idx"] >= 0]
        manifest = read_manifest(layout.fs, Output("scores", 0, r).manifest_path(layout))
        assert manifest.metrics["mean_reward"] == pytest.approx(sum(sampled) / len(sampled))
        assert manifest.metrics["mean_reward"] < sum(s["reward"] for s in scores) / len(scores)
    batch = pq.read_table(layout.table_path("batch", 0)).to_pylist()
    assert len(batch) == n_rounds * ds.PER_ROUND * ds.N_SAMPLES and min(r["sample_idx"] for r in batch) == 0
    kept = [r for r in batch if r["kept"]]
    assert len({(r["round"], r["prompt_id"]) for r in kept}) == ds.TARGET
    # a kept group: sampled rewards [1, 0, 1, 0] (even samples right), greedy 1 -> [0, -1, 0, -1]
    assert all(r["advantage"] == (0.0 if r["sample_idx"] % 2 == 0 else -1.0) for r in kept)
