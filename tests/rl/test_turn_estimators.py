"""Turn-level estimators for multi-turn rollouts (issue 19): turn_rloo and turn_gae, by hand, then through the
advantage stage (and the train stage) on hand-built rollouts and scores rows.

The group used throughout (feedback mode: each turn scored), three conversations with 1, 2 and 3 model turns:
  c0: turn rewards [1.0]             shaped r' = [1.0]            returns G = [1.0]
  c1: turn rewards [0.2, 1.0]        shaped r' = [0.2, 0.8]       returns G = [1.0, 0.8]
  c2: turn rewards [0.0, 0.5, 0.5]   shaped r' = [0.0, 0.5, 0.0]  returns G = [0.5, 0.5, 0.0]
(r'_k = r_k - r_{k-1}, G_k = sum_{l >= k} r'_l.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import AdvantageConfig
from schemas.errors import InputError
from schemas.tables import BATCH, conform
from stages import advantage, train
from stages.harness import StageContext
from stages.rl.advantages import (
    delta_shaped_rewards,
    rloo_advantages,
    spread_over_turns,
    turn_gae,
    turn_returns,
    turn_rloo_advantages,
)
from stages.rl.batch import build_batch
from tests.support.stages import run_stage_at

FEEDBACK = [np.array([1.0]), np.array([0.2, 1.0]), np.array([0.0, 0.5, 0.5])]


def test_delta_shaping_and_turn_returns_by_hand() -> None:
    np.testing.assert_allclose(delta_shaped_rewards(np.array([0.2, 1.0])), [0.2, 0.8])
    np.testing.assert_allclose(turn_returns(np.array([0.0, 0.5, 0.5])), [0.5, 0.5, 0.0])
    np.testing.assert_allclose(turn_returns(np.array([0.2, 1.0])), [1.0, 0.8])
    with pytest.raises(ValueError, match="turn reward at position 1 is nan"):
        delta_shaped_rewards(np.array([0.0, float("nan")]))


def test_turn_rloo_by_hand_with_different_turn_counts() -> None:
    """Turn 1, all three: G = [1.0, 1.0, 0.5]; leave-one-out baselines (1.0 + 0.5) / 2 = 0.75, 0.75, (1 + 1) / 2 =
    1.0 -> A = [0.25, 0.25, -0.5]. Turn 2, only c1 and c2 reach it: G = [0.8, 0.5] -> A = [0.3, -0.3]. Turn 3, c2
    alone: no other sample, A = 0."""
    got = turn_rloo_advantages(FEEDBACK)
    np.testing.assert_allclose(got[0], [0.25])
    np.testing.assert_allclose(got[1], [0.25, 0.3])
    np.testing.assert_allclose(got[2], [-0.5, -0.3, 0.0])


def test_turn_rloo_in_tool_mode_and_single_turn() -> None:
    """Tool mode (no per-turn scores): every turn's reward 0 but the last, the score. Scores [1, 0, 1] with 1, 2, 3
    turns: G = [1], [0, 0], [1, 1, 1]. Turn 1: [1, 0, 1] -> [1 - 0.5, 0 - 1, 1 - 0.5] = [0.5, -1, 0.5]; turn 2:
    [0, 1] -> [-1, 1]; turn 3: c2 alone -> 0. Single-turn conversations are plain RLOO (the independent
    `rloo_advantages`); an all-equal turn index gives exact zeros."""
    got = turn_rloo_advantages([np.array([1.0]), np.array([0.0, 0.0]), np.array([0.0, 0.0, 1.0])])
    np.testing.assert_allclose(got[0], [0.5])
    np.testing.assert_allclose(got[1], [-1.0, -1.0])
    np.testing.assert_allclose(got[2], [0.5, 1.0, 0.0])
    rewards = np.array([0.3, 1.0, 0.0, 0.7])
    single = turn_rloo_advantages([np.array([r]) for r in rewards])
    np.testing.assert_allclose(np.concatenate(single), rloo_advantages(rewards), rtol=1e-12)
    same = turn_rloo_advantages([np.array([0.7, 0.7]), np.array([0.7, 0.7])])
    assert [a.tolist() for a in same] == [[0.0, 0.0], [0.0, 0.0]]


def test_turn_gae_by_hand() -> None:
    """gamma 0.9, lambda 0.8 (gamma lambda = 0.72), V after the last turn 0.
    c2, V = [0.2, 0.4, 0.1], r' = [0, 0.5, 0]:
      delta_3 = 0 - 0.1 = -0.1;  delta_2 = 0.5 + 0.9 * 0.1 - 0.4 = 0.19;  delta_1 = 0 + 0.9 * 0.4 - 0.2 = 0.16
      A_3 = -0.1;  A_2 = 0.19 + 0.72 * -0.1 = 0.118;  A_1 = 0.16 + 0.72 * 0.118 = 0.24496;  R = A + V
    c1, V = [0.3, 0.6], r' = [0.2, 0.8]: delta_2 = 0.8 - 0.6 = 0.2, delta_1 = 0.2 + 0.54 - 0.3 = 0.44;
      A = [0.44 + 0.72 * 0.2, 0.2] = [0.584, 0.2];  c0, V = [0.5]: A = 1 - 0.5 = 0.5."""
    advantages, returns = turn_gae(FEEDBACK[2], np.array([0.2, 0.4, 0.1]), 0.9, 0.8)
    np.testing.assert_allclose(advantages, [0.24496, 0.118, -0.1])
    np.testing.assert_allclose(returns, [0.44496, 0.518, 0.0], atol=1e-12)
    advantages, returns = turn_gae(FEEDBACK[1], np.array([0.3, 0.6]), 0.9, 0.8)
    np.testing.assert_allclose(advantages, [0.584, 0.2])
    np.testing.assert_allclose(returns, [0.884, 0.8])
    advantages, _ = turn_gae(FEEDBACK[0], np.array([0.5]), 0.9, 0.8)
    np.testing.assert_allclose(advantages, [0.5])


def test_spread_over_turns_puts_each_turns_value_on_its_model_tokens() -> None:
    # turns [0, 2) and [4, 6); tokens 2, 3 are an observation (mask 0) and outside every span
    got = spread_over_turns(np.array([0.25, 0.3]), [[0, 2], [4, 6]], np.array([1, 1, 0, 0, 1, 1]))
    np.testing.assert_allclose(got, [0.25, 0.25, 0.0, 0.0, 0.3, 0.3])


# ------------------------------------------------------------------------------------------------------------
# Through the stages: prompt p0 in feedback mode (turn_rewards), prompt p1 in tool mode (turn_rewards null).

# (response tokens, loss mask, turn spans, turn rewards, final score)
CONVERSATIONS = {
    "p0": [
        ([3, 4, 5], [1, 1, 1], [[0, 3]], [1.0], 1.0),
        ([3, 4, 9, 9, 5, 6], [1, 1, 0, 0, 1, 1], [[0, 2], [4, 6]], [0.2, 1.0], 1.0),
        ([3, 9, 5, 9, 9, 6, 7], [1, 0, 1, 0, 0, 1, 1], [[0, 1], [2, 3], [5, 7]], [0.0, 0.5, 0.5], 0.5),
    ],
    "p1": [
        ([3, 4], [1, 1], [[0, 2]], None, 1.0),
        ([3, 9, 4], [1, 0, 1], [[0, 1], [2, 3]], None, 0.0),
        ([3, 9, 4, 9, 5], [1, 0, 1, 0, 1], [[0, 1], [2, 3], [4, 5]], None, 1.0),
    ],
}
# turn_rloo, per token (the hand computations above: p0 the feedback group, p1 the tool-mode group)
TURN_RLOO_TOKENS = {
    ("p0", 0): [0.25, 0.25, 0.25],
    ("p0", 1): [0.25, 0.25, 0.0, 0.0, 0.3, 0.3],
    ("p0", 2): [-0.5, 0.0, -0.3, 0.0, 0.0, 0.0, 0.0],
    ("p1", 0): [0.5, 0.5],
    ("p1", 1): [-1.0, 0.0, -1.0],
    ("p1", 2): [0.5, 0.0, 1.0, 0.0, 0.0],
}
# turn_gae at iteration 0 (no critic yet: V = 0), gamma = lambda = 1: A_k = R_k = G_k, before whitening
TURN_GAE_RETURNS = {
    ("p0", 0): [1.0], ("p0", 1): [1.0, 0.8], ("p0", 2): [0.5, 0.5, 0.0],
    ("p1", 0): [1.0], ("p1", 1): [0.0, 0.0], ("p1", 2): [1.0, 1.0, 1.0],
}


def multi_turn_generate(ctx: StageContext) -> None:
    rows = []
    for prompt_id, conversations in CONVERSATIONS.items():
        for idx, (response, mask, spans, turn_rewards, _) in enumerate(conversations):
            rows.append({
                "run_id": ctx.run_id, "iteration": ctx.iteration, "round": 0, "prompt_id": prompt_id,
                "sample_idx": idx, "policy_version": ctx.inputs["policy"].sha256, "prompt_token_ids": [1, 5, 6],
                "response_token_ids": response,
                "response_logprobs": [-2.5 if m else 0.0 for m in mask],  # 0.0 at observations, as the loop writes
                "response_text": "", "finish_reason": "stop", "truncated": False, "num_tokens": len(response),
                "seed": 0, "backend": "fake", "loss_mask": mask, "turn_spans": spans, "turn_rewards": turn_rewards,
                "num_turns": len(spans), "tool_calls": len(spans) - 1,
                "tool_errors": 0, "tool_seconds": 0.0, "conversation": json.dumps([]), "policy_step": ctx.iteration,
            })  # fmt: skip
    ctx.write_table("rollouts", pa.Table.from_pylist(rows))


def multi_turn_score(ctx: StageContext) -> None:
    rows = []
    for r in ctx.read_input("rollouts").to_pylist():
        reward = CONVERSATIONS[r["prompt_id"]][r["sample_idx"]][4]
        rows.append({
            **{k: r[k] for k in ("run_id", "iteration", "round", "prompt_id", "sample_idx")}, "reward": reward,
            "passed": int(reward == 1.0), "total": 1, "status": "ok" if reward == 1.0 else "fail", "tests": "[]",
            "code": None, "sandbox_seconds": 0.0,
        })  # fmt: skip
    ctx.write_table("scores", pa.Table.from_pylist(rows))


# The rollouts contract checks turns and tool calls against generate.multi_turn (p0's feedback-style turn rewards
# ride along in a tool-mode run: the estimator reads whatever turn_rewards a row has).
MULTI_TURN = ("generate.n_samples=3", "generate.multi_turn.mode=tool", "generate.multi_turn.max_turns=3",
              "generate.multi_turn.max_tool_calls=2")


def run_multi_turn_iteration(layout, k: int = 0):  # noqa: ANN001, ANN201
    run_stage_at("generate", layout, k, multi_turn_generate)
    run_stage_at("score", layout, k, multi_turn_score)
    [batch_manifest] = run_stage_at("advantage", layout, k, advantage.run)
    rows = pq.read_table(Path(layout.table_path("batch", k))).to_pylist()
    batch = {(r["prompt_id"], r["sample_idx"]): r for r in rows}
    return batch_manifest, batch


@pytest.mark.slow
def test_turn_rloo_through_the_advantage_and_train_stages(run_layout) -> None:  # noqa: ANN001
    """The batch's token_advantages are the hand-computed turn_rloo values; the scalar advantage is their mean over
    model tokens (p1 c2: (0.5 + 1 + 0) / 3 = 0.5); values / returns stay null. The train stage then trains on the
    masked samples: its loss tokens are the 3 + 4 + 4 + 2 + 2 + 3 = 18 model tokens, not the 26 response tokens."""
    make, _ = run_layout
    layout = make("advantage.estimator=turn_rloo", *MULTI_TURN)
    manifest, batch = run_multi_turn_iteration(layout)
    for key, expected in TURN_RLOO_TOKENS.items():
        row = batch[key]
        assert row["kept"], key
        np.testing.assert_allclose(row["token_advantages"], expected, atol=1e-6, err_msg=str(key))
        model = [a for a, m in zip(expected, CONVERSATIONS[key[0]][key[1]][1], strict=True) if m]
        assert row["advantage"] == pytest.approx(np.mean(model), abs=1e-6), key
        assert row["values"] is None and row["returns"] is None
    assert manifest.metrics["skipped"] is False
    run_stage_at("train", layout, 0, train.run)
    [metrics_row] = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert metrics_row["loss_tokens"] == 18 and not metrics_row["skipped"]


@pytest.mark.slow
def test_turn_gae_through_the_advantage_and_train_stages(run_layout) -> None:  # noqa: ANN001
    """Iteration 0 has no critic: V = 0, so with gamma = lambda = 1 each turn's A = R = G (the returns table
    above). token_advantages: those values on the turn's model tokens, whitened over every model token of the
    batch (mean, Bessel variance, 1 / sqrt(var + 1e-8), computed here with numpy), observation tokens 0; returns:
    R_k on turn k's model tokens, 0 on observations. The train stage trains the critic beside the policy."""
    make, _ = run_layout
    layout = make("advantage.estimator=turn_gae", *MULTI_TURN)
    _, batch = run_multi_turn_iteration(layout)
    spread = {key: spread_over_turns(np.array(g), CONVERSATIONS[key[0]][key[1]][2],
                                     np.array(CONVERSATIONS[key[0]][key[1]][1])) for key, g in TURN_GAE_RETURNS.items()}
    masks = {key: np.array(CONVERSATIONS[key[0]][key[1]][1]) > 0 for key in TURN_GAE_RETURNS}
    model_values = np.concatenate([spread[key][masks[key]] for key in sorted(spread)])
    mean, var = model_values.mean(), model_values.var(ddof=1)
    for key in TURN_GAE_RETURNS:
        row = batch[key]
        expected = np.where(masks[key], (spread[key] - mean) / np.sqrt(var + 1e-8), 0.0)
        np.testing.assert_allclose(row["token_advantages"], expected, atol=1e-5, err_msg=str(key))
        np.testing.assert_allclose(row["returns"], spread[key], atol=1e-6, err_msg=str(key))
        assert set(row["values"]) == {0.0}
    run_stage_at("train", layout, 0, train.run)
    [metrics_row] = pq.read_table(Path(layout.table_path("train_metrics", 0))).to_pylist()
    assert metrics_row["loss_tokens"] == 18 and metrics_row["value_loss"] > 0
    assert (Path(layout.checkpoint_dir(0)) / "critic").is_dir()


def test_turn_gae_reads_the_critic_at_each_turns_first_model_token() -> None:
    """A critic that is not zero (an iteration after the first), V varying inside each turn, gamma 0.9, lambda
    0.8 (gamma lambda 0.72), through build_batch. c0: mask [1, 1, 0, 0, 1, 1], spans [0, 2) [4, 6), turn rewards
    [0.2, 1.0] (r' = [0.2, 0.8]), V = [0.5, 0.9, 0, 0, 0.3, 0.7]: V at the turns' first tokens [0.5, 0.3]
      delta_2 = 0.8 - 0.3 = 0.5 = A_2, R_2 = 0.8;  delta_1 = 0.2 + 0.9 * 0.3 - 0.5 = -0.03,
      A_1 = -0.03 + 0.72 * 0.5 = 0.33, R_1 = 0.83
    (read at the last tokens [0.9, 0.7]: A = [-0.106, 0.1], R_1 = 0.902). c1: one turn, reward 0, V = [0.4, 0.1,
    0.2]: A = -0.4, R = 0. token_advantages: those on the model tokens, whitened over the 7 model tokens."""
    base = {"run_id": "r", "iteration": 1, "round": 0, "prompt_id": "a", "truncated": False}
    rows = [{**base, "sample_idx": 0, "reward": 1.0, "status": "ok", "num_tokens": 6, "loss_mask": [1, 1, 0, 0, 1, 1],
             "turn_spans": [[0, 2], [4, 6]], "turn_rewards": [0.2, 1.0], "values": [0.5, 0.9, 0.0, 0.0, 0.3, 0.7]},
            {**base, "sample_idx": 1, "reward": 0.0, "status": "fail", "num_tokens": 3, "loss_mask": [1, 1, 1],
             "turn_spans": [[0, 3]], "turn_rewards": [0.0], "values": [0.4, 0.1, 0.2]}]
    cfg = AdvantageConfig(estimator="turn_gae", gamma=0.9, lam=0.8)
    batch, _ = advantage.build_batch(pa.Table.from_pylist(rows), cfg, 16)
    c0, c1 = batch.sort_by("sample_idx").to_pylist()
    np.testing.assert_allclose(c0["returns"], [0.83, 0.83, 0.0, 0.0, 0.8, 0.8], atol=1e-6)
    np.testing.assert_allclose(c1["returns"], [0.0, 0.0, 0.0], atol=1e-6)
    model = np.array([0.33, 0.33, 0.5, 0.5, -0.4, -0.4, -0.4])
    whitened = (model - model.mean()) / np.sqrt(model.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(c0["token_advantages"], [*whitened[:2], 0.0, 0.0, *whitened[2:4]], atol=1e-5)
    np.testing.assert_allclose(c1["token_advantages"], whitened[4:], atol=1e-5)
    np.testing.assert_allclose(c0["values"], rows[0]["values"], atol=1e-6)


def test_bad_turns_are_an_input_error() -> None:
    """A span outside the response or a turn_rewards list of the wrong length names the rollout."""
    base = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "a", "num_tokens": 3, "truncated": False,
            "status": "ok", "loss_mask": [1, 0, 1]}
    rows = [{**base, "sample_idx": 0, "reward": 1.0, "turn_spans": [[0, 1], [2, 4]], "turn_rewards": None},
            {**base, "sample_idx": 1, "reward": 0.0, "status": "fail", "turn_spans": [[0, 1]], "turn_rewards": None}]
    cfg = AdvantageConfig(estimator="turn_rloo")
    with pytest.raises(InputError, match="'sample_idx': 0.*turn span \\[2, 4\\] is not"):
        build_batch(pa.Table.from_pylist(rows), cfg, 16)
    rows[0].update(turn_spans=[[0, 1], [2, 3]], turn_rewards=[0.5])
    with pytest.raises(InputError, match="1 turn_rewards for 2 turns"):
        build_batch(pa.Table.from_pylist(rows), cfg, 16)


def test_kl_in_the_reward_counts_model_tokens_only() -> None:
    """beta 0.5; sample 0 has mask [1, 0, 1] and kl [0.2, 0, 0.4] (the stage zeroes observations): kl_in_reward =
    0.5 * 0.6 = 0.3 and its token mean is over its 2 model tokens, 0.3; sample 1 (single turn) kl [0.2]: 0.1. The
    batch KL = (0.3 + 0.2) / 2 = 0.25 (a mean over all 3 tokens would give 0.2 for sample 0)."""
    base = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "a", "truncated": False}
    rows = [{**base, "sample_idx": 0, "reward": 1.0, "status": "ok", "num_tokens": 3, "kl": [0.2, 0.0, 0.4],
             "loss_mask": [1, 0, 1]},
            {**base, "sample_idx": 1, "reward": 0.0, "status": "fail", "num_tokens": 1, "kl": [0.2], "loss_mask": None}]
    cfg = AdvantageConfig(use_kl_in_reward=True, kl_coef=0.5)
    batch, metrics = build_batch(pa.Table.from_pylist(rows), cfg, 16, kl_coef=0.5)
    got = conform(batch, BATCH, "batch").to_pylist()
    assert [r["kl_in_reward"] for r in got] == pytest.approx([0.3, 0.1])
    assert metrics["kl_in_reward_mean"] == pytest.approx(0.25)


@pytest.mark.slow
def test_the_stages_kl_in_the_reward_skips_observation_tokens(run_layout) -> None:  # noqa: ANN001
    """use_kl_in_reward with beta 0.5 (k1): kl_in_reward = 0.5 * sum over model tokens of (sampler - reference)
    logprob, the reference computed here by a full-logits forward of the base model (`full_softmax_logprobs`).
    The observation tokens (sampler logprob 0.0, a placeholder) would add 0.5 * (0 - ref) > 0 each if counted."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.logprobs import build_micro_batch
    from tests.support.logprobs import full_softmax_logprobs

    make, model_dir = run_layout
    layout = make("advantage.estimator=turn_rloo", *MULTI_TURN, "advantage.use_kl_in_reward=true",
                  "advantage.kl_coef=0.5", "advantage.kl_penalty=k1")
    _, batch = run_multi_turn_iteration(layout)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for (prompt_id, idx), row in batch.items():
        response, mask = CONVERSATIONS[prompt_id][idx][:2]
        with torch.no_grad():
            ref_BT, _ = full_softmax_logprobs(reference, build_micro_batch([0], [[1, 5, 6]], [response]))
        sampler = torch.tensor([-2.5 if m else 0.0 for m in mask], dtype=torch.float64)
        kl_T = sampler - ref_BT[0].double()
        expected = 0.5 * float((kl_T * torch.tensor(mask)).sum())
        assert row["kl_in_reward"] == pytest.approx(expected, abs=1e-5), (prompt_id, idx)
        if 0 in mask:
            assert abs(0.5 * float(kl_T.sum()) - expected) > 1e-2


def test_token_level_gae_skips_observation_tokens() -> None:
    """`gae` on a multi-turn row, mask [1, 0, 0, 1], V [0.5, 9, 9, 0.2], reward 1, gamma 0.9, lambda 0.8: GAE over
    the model tokens alone (V 0.5, 0.2; the outcome on the last model token):
      t=3: delta = 1 - 0.2 = 0.8, A = 0.8, R = 1.0;  t=0: delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.8
      = 0.256, R = 0.756;  observations: A = R = 0.
    The other sample (single turn, reward 0, V [0.1]): A = -0.1, R = 0. The advantages are whitened over the three
    model-token values [0.256, 0.8, -0.1] (numpy here: mean, Bessel variance, + 1e-8 under the root)."""
    base = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "a", "truncated": False}
    rows = [{**base, "sample_idx": 0, "reward": 1.0, "status": "ok", "num_tokens": 4, "loss_mask": [1, 0, 0, 1],
             "values": [0.5, 9.0, 9.0, 0.2]},
            {**base, "sample_idx": 1, "reward": 0.0, "status": "fail", "num_tokens": 1, "loss_mask": None,
             "values": [0.1]}]
    cfg = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    batch, _ = build_batch(pa.Table.from_pylist(rows), cfg, 16)
    got = conform(batch, BATCH, "batch").to_pylist()
    np.testing.assert_allclose(got[0]["returns"], [0.756, 0.0, 0.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(got[1]["returns"], [0.0], atol=1e-6)
    raw = np.array([0.256, 0.8, -0.1])
    white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(got[0]["token_advantages"], [white[0], 0.0, 0.0, white[1]], atol=1e-6)
    np.testing.assert_allclose(got[1]["token_advantages"], [white[2]], atol=1e-6)
    assert got[0]["advantage"] == pytest.approx((white[0] + white[1]) / 2, abs=1e-6)
