"""Group filters that fit the estimator: what `advantage.drop_zero_variance_groups` does for each kind of estimator,
and the configs that would drop or zero every sample by construction, refused at load.

By hand: gae, remax, reinforce_pp and turn_gae with one sample per prompt through the real harness (generate and
score stand-ins, the advantage and train stages for real), every sample kept and trained on; GAE keeping an
all-equal group by default (the critic's values still tell its samples apart); an explicit filter under an
estimator without a group dropping the all-equal groups of two but never a sample alone; the refusals, naming the
fields, by the library check, the CLI and the stage harness.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import AdvantageConfig, ConfigError, load_config
from schemas.tables import BASELINE_SAMPLE_IDX, BATCH, conform
from stages import advantage, train
from stages.harness import StageContext
from stages.rl.advantages import ESTIMATORS, check_estimator_fits
from stages.rl.batch import build_batch
from tests.support.stages import run_stage_at

from .pipeline_helpers import write_policy_rollouts

# p0 is solved, p1 is not; remax's greedy row scores 0.5 on both
REWARD = {"p0": 1.0, "p1": 0.0}
GREEDY_REWARD = 0.5


def one_sample_generate(ctx: StageContext) -> None:
    """`generate.n_samples` random responses per prompt with their logprobs under the policy, and a greedy row per
    prompt when the estimator needs one."""
    greedy = [BASELINE_SAMPLE_IDX] if ESTIMATORS[ctx.config.advantage.estimator].needs_greedy_baseline else []
    write_policy_rollouts(ctx, [*range(ctx.config.generate.n_samples), *greedy], seed=11)


def fixed_score(ctx: StageContext) -> None:
    rows = []
    for r in ctx.read_input("rollouts").to_pylist():
        reward = GREEDY_REWARD if r["sample_idx"] == BASELINE_SAMPLE_IDX else REWARD[r["prompt_id"]]
        rows.append({**{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")},
                     "reward": reward, "passed": int(reward == 1.0), "total": 1,
                     "status": "ok" if reward == 1.0 else "fail", "tests": "[]", "code": None,
                     "sandbox_seconds": 0.0})
    ctx.write_table("scores", pa.Table.from_pylist(rows))


def token_whitened(lengths: dict[str, int]) -> dict[str, float]:
    """GAE with gamma = lambda = 1 and V = 0 (no critic before iteration 0's train): every token of p0 has advantage
    1 (its reward-to-go), of p1 0; whitened over all L0 + L1 tokens with Bessel's variance (verl's masked_whiten),
    each sample's advantage the mean of its tokens'."""
    n0, n1 = lengths["p0"], lengths["p1"]
    mean = n0 / (n0 + n1)
    var = (n0 * (1 - mean) ** 2 + n1 * mean**2) / (n0 + n1 - 1)
    return {"p0": (1 - mean) / np.sqrt(var + 1e-8), "p1": -mean / np.sqrt(var + 1e-8)}


@pytest.mark.parametrize("estimator", ["gae", "remax", "reinforce_pp", "turn_gae"])
def test_estimators_without_a_group_train_with_one_sample_per_prompt(run_layout, estimator: str) -> None:  # noqa: ANN001
    make, _ = run_layout
    # the default zero-variance filter; an explicit `true` keeps a sample alone too (the last assertion)
    layout = make(f"advantage.estimator={estimator}", "generate.n_samples=1")
    run_stage_at("generate", layout, 0, one_sample_generate)
    run_stage_at("score", layout, 0, fixed_score)
    [manifest] = run_stage_at("advantage", layout, 0, advantage.run)
    run_stage_at("train", layout, 0, train.run)

    batch = {r["prompt_id"]: r for r in pq.read_table(layout.table_path("batch", 0)).to_pylist()}
    lengths = {r["prompt_id"]: r["num_tokens"] for r in pq.read_table(layout.table_path("rollouts", 0)).to_pylist()
               if r["sample_idx"] == 0}
    expected = {
        # whiten([1, 0]) over the samples: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
        "reinforce_pp": {"p0": 0.5 / 0.500001, "p1": -0.5 / 0.500001},
        "remax": {"p0": 1.0 - 0.5, "p1": 0.0 - 0.5},  # r - r_greedy
        "gae": token_whitened(lengths),
        "turn_gae": token_whitened(lengths),  # a single-turn row is one turn: V = 0, delta = r on each token
    }[estimator]
    assert sorted(batch) == ["p0", "p1"] and all(r["kept"] and r["drop_reason"] is None for r in batch.values())
    assert {p: batch[p]["advantage"] for p in batch} == pytest.approx(expected, rel=1e-9)
    assert manifest.metrics["groups_kept"] == 2 and manifest.metrics["groups_dropped"] == {}
    assert manifest.metrics["samples_kept"] == 2 and manifest.metrics["skipped"] is False
    [step] = pq.read_table(layout.table_path("train_metrics", 0)).to_pylist()
    assert step["skipped"] is False and step["loss_tokens"] == lengths["p0"] + lengths["p1"]


def rows(rewards: dict[str, list[float]], values: dict[str, list[list[float]]] | None = None) -> pa.Table:
    """Samples of 2 tokens each, reward as given, status ok when 1; `values`: the critic's V per token."""
    table = [{"run_id": "r", "iteration": 0, "round": 0, "prompt_id": p, "sample_idx": i, "reward": r,
              "num_tokens": 2, "truncated": False, "status": "ok" if r == 1.0 else "fail",
              **({"values": values[p][i]} if values else {})}
             for p, group in rewards.items() for i, r in enumerate(group)]
    return pa.Table.from_pylist(table)


def test_gae_keeps_an_all_equal_group_by_default() -> None:
    # Both samples solve the prompt (acc [1, 1]: zero variance). With the critic's values V_a = [0.5, 0.5] and
    # V_b = [0, 0], gamma = lambda = 1, token rewards [0, 1]: a: delta_1 = 1 - 0.5, delta_0 = 0.5 - 0.5 -> A = [0.5,
    # 0.5]; b: A = [1, 1]. Whitened over the 4 tokens: mean 0.75, var 4 * 0.0625 / 3 -> -+0.866025.
    samples = rows({"g": [1.0, 1.0]}, {"g": [[0.5, 0.5], [0.0, 0.0]]})
    batch, metrics = build_batch(samples, AdvantageConfig(estimator="gae"), 96)
    got = conform(batch, BATCH, "batch").to_pylist()
    assert [r["kept"] for r in got] == [True, True] and metrics["groups_dropped"] == {}
    assert [r["advantage"] for r in got] == pytest.approx([-0.866025, 0.866025], abs=1e-6)
    # grpo's default filter drops the same group: equal rewards give it no signal
    _, metrics = build_batch(samples, AdvantageConfig(estimator="grpo"), 96)
    assert metrics["groups_dropped"] == {"zero_variance": 1} and metrics["skipped"] is True


def test_an_explicit_filter_without_a_group_never_drops_a_sample_alone() -> None:
    # reinforce_pp with DAPO's filter on: the all-equal pair is dropped, the single samples are kept whatever
    # their reward; the kept rewards [1, 0] whitened -> +-0.5 / (0.5 + 1e-6)
    samples = rows({"equal": [1.0, 1.0], "solo_right": [1.0], "solo_wrong": [0.0]})
    cfg = AdvantageConfig(estimator="reinforce_pp", drop_zero_variance_groups=True)
    batch, metrics = build_batch(samples, cfg, 96)
    got = {(r["prompt_id"], r["sample_idx"]): r for r in batch.to_pylist()}
    assert [got[("equal", i)]["drop_reason"] for i in (0, 1)] == ["zero_variance"] * 2
    assert got[("solo_right", 0)]["kept"] and got[("solo_wrong", 0)]["kept"]
    assert got[("solo_right", 0)]["advantage"] == pytest.approx(0.5 / 0.500001)
    assert got[("solo_wrong", 0)]["advantage"] == pytest.approx(-0.5 / 0.500001)
    assert metrics["groups_kept"] == 2 and metrics["groups_dropped"] == {"zero_variance": 1}
    # the default for reinforce_pp: nothing dropped
    _, metrics = build_batch(samples, AdvantageConfig(estimator="reinforce_pp"), 96)
    assert metrics["groups_kept"] == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # every group one sample, dropped as zero variance by the default filter
        (["generate.n_samples=1"], r"advantage.estimator=grpo .*generate.n_samples=1 .*"
                                   r"advantage.drop_zero_variance_groups \(null: on for this estimator\)"),
        (["generate.n_samples=1", "advantage.estimator=rloo", "advantage.drop_zero_variance_groups=true"],
         r"advantage.estimator=rloo .*advantage.drop_zero_variance_groups \(true\)"),
        # the filter off: every advantage 0, every step skipped
        (["generate.n_samples=1", "advantage.drop_zero_variance_groups=false"],
         r"advantage.estimator=grpo .*generate.n_samples=1 .*advantage.singleton_advantage=zero"),
        (["generate.n_samples=1", "advantage.estimator=turn_rloo"], r"advantage.estimator=turn_rloo .*n_samples=1"),
    ],
)
def test_one_sample_groups_under_a_group_estimator_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        check_estimator_fits(load_config(None, overrides))
    assert "(reinforce_pp, gae, turn_gae, remax)" in str(error.value)  # what would train instead


@pytest.mark.parametrize("estimator", ["gae", "remax", "reinforce_pp", "turn_gae"])
def test_one_sample_groups_are_accepted_without_a_group(estimator: str) -> None:
    check_estimator_fits(load_config(None, ["generate.n_samples=1", f"advantage.estimator={estimator}"]))


def test_a_group_estimator_with_verls_singleton_rule_is_accepted_with_one_sample() -> None:
    # with the filter off, a sample alone gets its raw reward (verl's rule): a signal, if an uncentred one
    check_estimator_fits(load_config(None, ["generate.n_samples=1", "advantage.drop_zero_variance_groups=false",
                                            "advantage.singleton_advantage=reward"]))


def test_the_cli_and_the_stage_harness_refuse_before_any_stage_runs(tmp_path, run_layout, capsys) -> None:  # noqa: ANN001
    from flows.cli.commands import main

    assert main(["run", "--root", str(tmp_path / "cli"), "--set", "generate.n_samples=1"]) == 2
    assert "generate.n_samples=1" in capsys.readouterr().out.replace("\n", "")
    assert not (tmp_path / "cli" / "runs").exists()  # no run started
    # a config.yaml written without the CLI: the harness refuses the first stage (exit 2 from its `main`)
    make, _ = run_layout
    with pytest.raises(ConfigError, match="advantage.drop_zero_variance_groups"):
        make("generate.n_samples=1")
