"""PPO with a critic: GAE, the KL in the reward, the value loss, and the critic through the advantage and train
stages (its checkpoint beside the policy's, resumed the next iteration). Numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from schemas.config import AdvantageConfig, TrainConfig
from schemas.tables import BATCH, conform
from stages.rl.advantages import adaptive_kl_coef, gae, token_rewards, whiten_token_values
from stages.rl.batch import build_batch
from stages.rl.critic import (
    HEAD_FILE,
    STATE_FILE,
    CriticSample,
    CriticTrainer,
    explained_variance,
    load_value_model,
    predict_values,
    value_loss,
)

from .conftest import make_tiny_model
from .pipeline_helpers import run_iteration


def test_gae_by_hand():
    # rewards [0, 0, 1], V [0.5, 0.2, 0.4], gamma 0.9, lambda 0.8 (V after the end = 0):
    #   t=2: delta = 1 - 0.4 = 0.6;                 A = 0.6;                        R = 1.0
    #   t=1: delta = 0.9 * 0.4 - 0.2 = 0.16;         A = 0.16 + 0.72 * 0.6 = 0.592;   R = 0.792
    #   t=0: delta = 0.9 * 0.2 - 0.5 = -0.32;        A = -0.32 + 0.72 * 0.592 = 0.10624; R = 0.60624
    advantages, returns = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.2, 0.4]), 0.9, 0.8)
    np.testing.assert_allclose(advantages, [0.10624, 0.592, 0.6])
    np.testing.assert_allclose(returns, [0.60624, 0.792, 1.0])
    # gamma = lambda = 1 and V = 0: every token's advantage is the outcome (the reward-to-go)
    np.testing.assert_allclose(gae(np.array([0.0, 0.0, 2.0]), np.zeros(3), 1.0, 1.0)[0], [2.0, 2.0, 2.0])
    assert gae(np.zeros(0), np.zeros(0), 1.0, 1.0)[0].size == 0


def test_token_rewards_whitening_and_adaptive_kl():
    # outcome 1 on the last token, minus beta * kl on each: beta 0.5, kl [0.1, 0.2, 0.3] -> [-0.05, -0.1, 0.85]
    np.testing.assert_allclose(token_rewards(1.0, np.array([0.1, 0.2, 0.3]), 0.5), [-0.05, -0.1, 0.85])
    # whitening over every token: [1, 3] and [5]: mean 3, Bessel variance (4 + 0 + 4) / 2 = 4 -> [-1, 0], [1]
    whitened = whiten_token_values([np.array([1.0, 3.0]), np.array([5.0])])
    np.testing.assert_allclose(np.concatenate(whitened), [-1.0, 0.0, 1.0], rtol=1e-8)
    # adaptive controller: error clip(0.3 / 0.1 - 1, +-0.2) = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100) = 0.102;
    # 0.09 / 0.1 - 1 = -0.1 -> 0.1 * (1 - 0.1 * 10 / 100) = 0.099
    assert adaptive_kl_coef(0.1, 0.3, 0.1, 100, 10) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, 0.09, 0.1, 100, 10) == pytest.approx(0.099)


def test_value_loss_and_explained_variance_by_hand():
    # V = 0.9, V_old = 0.5, R = 1, clip 0.2: unclipped (0.9 - 1)^2 = 0.01; V_clip = 0.7, (0.7 - 1)^2 = 0.09:
    # L = 0.5 * max = 0.045, the clip active, and no gradient (the clipped branch is flat in V)
    values = torch.tensor([[0.9, 1.0]], requires_grad=True)
    loss, clipped = value_loss(values, torch.tensor([[0.5, 1.0]]), torch.tensor([[1.0, 0.0]]), 0.2)
    # second token: V = V_old = 1, R = 0: L = 0.5 * 1 = 0.5, gradient V - R = 1, not clipped
    torch.testing.assert_close(loss, torch.tensor([[0.045, 0.5]]))
    assert clipped.tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0]]))
    # without a clip: 0.5 (V - R)^2 = 0.005 on the first token
    assert value_loss(values, torch.tensor([[0.5, 1.0]]), torch.tensor([[1.0, 0.0]]), None)[0][0, 0].item() == (
        pytest.approx(0.005)
    )
    # R = [1, 2, 3], V = [1, 2, 2]: errors [0, 0, 1]; Var(R) = 2/3, Var(e) = 1/3 - 1/9 = 2/9 -> 1 - 1/3 = 2/3
    sums = {"r": 6.0, "r_sq": 14.0, "e": 1.0, "e_sq": 1.0, "count": 3.0}
    assert explained_variance(sums) == pytest.approx(2 / 3)


def gae_sample(prompt: str, idx: int, reward: float, tokens: int, kl: list[float] | None = None) -> dict:
    row = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": prompt, "sample_idx": idx, "reward": reward,
           "num_tokens": tokens, "truncated": False, "status": "ok" if reward == 1.0 else "fail"}
    return {**row, "kl": kl} if kl is not None else row


def test_gae_batch_by_hand():
    # group [1, 0] with 2 and 1 response tokens, no critic yet (V = 0), gamma = lambda = 1: A = [1, 1], [0];
    # whitened over the 3 tokens: mean 2/3, Bessel variance (2 * 1/9 + 4/9) / 2 = 1/3 -> (A - 2/3) / sqrt(1/3)
    # = [0.57735, 0.57735], [-1.154701]; a sample's advantage is its tokens' mean. A dropped group gets nulls (the
    # zero-variance filter, off by default for gae, turned on to drop the all-equal group b).
    samples = [gae_sample("a", 0, 1.0, 2), gae_sample("a", 1, 0.0, 1), gae_sample("b", 0, 1.0, 3),
               gae_sample("b", 1, 1.0, 1)]
    cfg = AdvantageConfig(estimator="gae", drop_zero_variance_groups=True)
    batch, _ = build_batch(pa.Table.from_pylist(samples), cfg, 96)
    rows = {(r["prompt_id"], r["sample_idx"]): r for r in conform(batch, BATCH, "batch").to_pylist()}
    np.testing.assert_allclose(rows[("a", 0)]["token_advantages"], [0.57735, 0.57735], rtol=1e-5)
    np.testing.assert_allclose(rows[("a", 1)]["token_advantages"], [-1.154701], rtol=1e-5)
    assert rows[("a", 0)]["advantage"] == pytest.approx(0.57735, rel=1e-5)
    assert rows[("a", 0)]["returns"] == [1.0, 1.0] and rows[("a", 1)]["returns"] == [0.0]
    assert rows[("a", 0)]["values"] == [0.0, 0.0]
    assert rows[("b", 0)]["drop_reason"] == "zero_variance" and rows[("b", 0)]["token_advantages"] is None


def test_kl_in_the_reward_by_hand():
    # beta 0.5, kl per token [0.2, 0.4] and [0.2]: kl_in_reward = 0.5 * [0.6, 0.2] = [0.3, 0.1];
    # GAE token rewards [-0.1, 1 - 0.2] and [-0.1]: A (gamma = lambda = 1, V = 0) = [0.7, 0.8], [-0.1]
    samples = [gae_sample("a", 0, 1.0, 2, [0.2, 0.4]), gae_sample("a", 1, 0.0, 1, [0.2])]
    cfg = AdvantageConfig(estimator="gae", use_kl_in_reward=True, kl_coef=0.5)
    batch, metrics = build_batch(pa.Table.from_pylist(samples), cfg, 96, kl_coef=0.5)
    rows = conform(batch, BATCH, "batch").to_pylist()
    assert [r["kl_in_reward"] for r in rows] == pytest.approx([0.3, 0.1])
    assert [r["shaped_reward"] for r in rows] == pytest.approx([0.7, -0.1])
    np.testing.assert_allclose(rows[0]["returns"], [0.7, 0.8], rtol=1e-6)
    np.testing.assert_allclose(rows[1]["returns"], [-0.1], rtol=1e-6)
    # the batch KL: mean over samples of each one's token mean, (0.3 + 0.2) / 2 = 0.25; fixed: the same beta next
    assert metrics["kl_in_reward_mean"] == pytest.approx(0.25) and metrics["kl_in_reward_next_coef"] == 0.5
    # an outcome estimator takes the KL from the sequence's reward: grpo of [0.7, -0.1]
    outcome, _ = build_batch(pa.Table.from_pylist(samples), AdvantageConfig(use_kl_in_reward=True), 96, 0.5)
    assert outcome["advantage"].to_pylist() == pytest.approx([0.4 / 0.400001, -0.4 / 0.400001])
    adaptive = cfg.model_copy(update={"kl_ctrl": "adaptive", "kl_target": 0.1, "kl_horizon": 20})
    _, metrics = build_batch(pa.Table.from_pylist(samples), adaptive, 96, kl_coef=0.5)
    # error clip(0.25 / 0.1 - 1) = 0.2, n = 2 samples: 0.5 * (1 + 0.2 * 2 / 20) = 0.51
    assert metrics["kl_in_reward_next_coef"] == pytest.approx(0.51)


def test_a_new_critic_predicts_zero_and_learns(tmp_path: Path):
    model_dir = tmp_path / "policy"
    make_tiny_model(seed=4).save_pretrained(model_dir)
    critic, step = load_value_model(None, model_dir)
    assert step == 0
    prompts, responses = [[1, 5, 6], [1, 7]], [[3, 4, 9], [8]]
    assert [v.tolist() for v in predict_values(critic, prompts, responses, 64)] == [[0.0, 0.0, 0.0], [0.0]]
    cfg = TrainConfig(critic_lr=1e-2, value_clip=None, max_grad_norm=100.0)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
    trainer = CriticTrainer(critic, cfg, optimizer)
    samples = [CriticSample(p, r, [0.0] * len(r), [1.0] * len(r)) for p, r in zip(prompts, responses, strict=True)]
    rows = [trainer.step(samples, [0, 1]) for _ in range(20)]
    # the first loss is 0.5 * mean (0 - 1)^2 = 0.5; regression toward R = 1 lowers it
    assert rows[0]["value_loss"] == pytest.approx(0.5) and rows[-1]["value_loss"] < 0.05
    assert trainer.global_step == 20


@pytest.mark.slow
def test_ppo_with_a_critic_through_the_stages(run_layout):
    make, _ = run_layout
    layout = make("advantage.estimator=gae", "advantage.lam=0.95", "train.critic_lr=1e-3")
    run_iteration(layout, 0)
    batch_0 = pq.read_table(Path(layout.table_path("batch", 0))).to_pylist()
    kept = [r for r in batch_0 if r["kept"]]
    # iteration 0 has no critic yet: V = 0, so R_t = A_t = (gamma lambda)^(L - 1 - t) * reward (lambda 0.95)
    assert all(set(r["values"]) == {0.0} for r in kept)
    for r in kept:
        length = len(r["returns"])
        expected = [0.95 ** (length - 1 - t) * r["reward"] for t in range(length)]
        np.testing.assert_allclose(r["returns"], expected, rtol=1e-6)
    critic_0 = Path(layout.checkpoint_dir(0)) / "critic"
    assert (critic_0 / HEAD_FILE).is_file() and (critic_0 / "optimizer.pt").is_file()
    assert json.loads((critic_0 / STATE_FILE).read_text()) == {"global_step": 1}
    [row] = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert row["value_loss"] > 0 and 0 <= row["vf_clip_frac"] <= 1
    # iteration 1: the advantage stage reads critic 0 (values no longer all 0); train resumes its step count
    _, _, manifest_1 = run_iteration(layout, 1)
    kept_1 = [r for r in pq.read_table(Path(layout.table_path("batch", 1))).to_pylist() if r["kept"]]
    assert any(v != 0.0 for r in kept_1 for v in r["values"])
    assert json.loads((Path(layout.checkpoint_dir(1)) / "critic" / STATE_FILE).read_text()) == {"global_step": 2}
    critic_1, _ = load_value_model(Path(layout.checkpoint_dir(1)), Path("unused"))
    critic_from_0, _ = load_value_model(Path(layout.checkpoint_dir(0)), Path("unused"))
    assert not torch.equal(critic_1.head.weight, critic_from_0.head.weight)
    assert manifest_1.metrics["steps"] == 1


def test_a_critic_needs_the_torch_backend():
    from schemas.config import ConfigError, load_config
    from stages.rl.advantages import check_estimator_fits

    with pytest.raises(ConfigError, match="has no critic yet"):
        check_estimator_fits(load_config(None, ["advantage.estimator=gae", "train.backend=deepspeed"]))


@pytest.mark.slow
def test_the_adaptive_kl_in_the_reward_carries_its_coefficient_across_iterations(run_layout):
    # The advantage stage takes KL(pi_sampler || pi_base) per token from the reward. Iteration 0 samples from the
    # base model itself, so its KL is ~0 (the fake sampler's logprobs are the model's own): below the target,
    # the adaptive coefficient falls by the clipped 20%: 0.5 * (1 - 0.2 * 8 / 100) = 0.492 (8 samples).
    make, _ = run_layout
    layout = make("advantage.use_kl_in_reward=true", "advantage.kl_ctrl=adaptive", "advantage.kl_coef=0.5",
                  "advantage.kl_target=0.1", "advantage.kl_horizon=100")
    batch_0, _, _ = run_iteration(layout, 0)
    assert batch_0.metrics["kl_in_reward_coef"] == 0.5
    assert batch_0.metrics["kl_in_reward_mean"] == pytest.approx(0.0, abs=1e-5)
    assert batch_0.metrics["kl_in_reward_next_coef"] == pytest.approx(0.492)
    # iteration 1 samples from checkpoint 0, which moved: a positive KL, taken at the coefficient handed on
    batch_1, _, _ = run_iteration(layout, 1)
    assert batch_1.metrics["kl_in_reward_coef"] == pytest.approx(0.492)
    assert batch_1.metrics["kl_in_reward_mean"] > 1e-4
    rows = pq.read_table(Path(layout.table_path("batch", 1))).to_pylist()
    assert all(r["kl_in_reward"] == pytest.approx(r["reward"] - r["shaped_reward"], abs=1e-9) for r in rows)
    assert sum(r["kl_in_reward"] for r in rows) > 0


def test_a_batch_table_of_the_previous_version_is_still_read(tmp_path: Path):
    # batch/v1 had no kl_in_reward, values, returns, token_advantages: read, they are 0 and null
    import fsspec

    from schemas.tables import TABLES
    from storage.tables import SCHEMA_METADATA_KEY, read_table

    v2 = TABLES["batch"].schema
    v1 = pa.schema([f for f in v2 if f.name not in ("kl_in_reward", "values", "returns", "token_advantages")])
    row = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "p", "sample_idx": 0, "reward": 1.0,
           "shaped_reward": 1.0, "advantage": 0.5, "kept": True, "drop_reason": None, "group_size": 2,
           "group_mean": 0.5, "group_std": 0.5}
    table = pa.Table.from_pylist([row], schema=v1).replace_schema_metadata({SCHEMA_METADATA_KEY: b"batch/v1"})
    pq.write_table(table, tmp_path / "batch.parquet")
    [read] = read_table(fsspec.filesystem("file"), str(tmp_path / "batch.parquet"), TABLES["batch"]).to_pylist()
    assert read["advantage"] == 0.5 and read["kl_in_reward"] == 0.0
    assert read["values"] is None and read["returns"] is None and read["token_advantages"] is None
