"""The training batch from scored rollouts: join, shape, group, filter, cap, estimate, mask (pure, on tables).

`samples_of` checks and joins a generation's rollouts and scores (every rollout scored once with a finite reward,
every (round, prompt) group of `generate.n_samples`, remax's greedy rows split off as their groups' baselines);
`build_batch` turns the joined samples into the batch table, one row per sample, and the manifest metrics, each
step one function below on numpy columns of the rows in (round, prompt, sample) order, where a group is a run of
rows. The estimator's record (advantages.ESTIMATORS) says which branch computes the advantages: outcome
estimators from the shaped rewards (remax against its greedy baselines), token-level GAE with the critic's values,
turn-level ones from the rollouts' turn spans and rewards. Bad input is an InputError naming the table and rollout
(the stage harness exits 2). The advantage stage (stages/advantage.py) reads the tables, adds the model columns
(KL, values) and writes the batch; docs/algorithms.md gives each step's formula.

remax's greedy row is left out of the batch rather than written as a dropped row: the batch is the groups of
n_samples sampled responses that filters, group statistics, metrics and the contracts count, and a row that is
never a training candidate would skew all of them. Its reward (+ the overlong shaping, as verl's reward function
gives it; no KL) is the baseline of its group's samples.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import AdvantageConfig
from schemas.errors import InputError
from schemas.tables import BASELINE_SAMPLE_IDX, ROLLOUT_KEY
from stages.rl.advantages import (
    ESTIMATORS,
    TOKEN_COLUMNS,
    EstimatorOptions,
    adaptive_kl_coef,
    compute_advantages,
    drops_zero_variance_groups,
    gae,
    remax_advantages,
    spread_over_turns,
    token_rewards,
    turn_gae,
    turn_rloo_advantages,
    whiten_token_values,
)
from stages.rl.filters import (
    DROP_OVER_TARGET,
    DROP_SUCCESS_RATE,
    DROP_TRUNCATED,
    DROP_ZERO_VARIANCE,
    DynamicSamplingExhausted,
    has_variance,
    is_skip_step,
    overlong_penalty,
    rounds_needed,
    success_rate_in_range,
)

# The batch's row order: a (round, prompt_id) group is a run of rows, and groups come in (round, prompt) order.
BATCH_ORDER = [("round", "ascending"), ("prompt_id", "ascending"), ("sample_idx", "ascending")]


def key_of(table: pa.Table, row: int) -> dict[str, Any]:
    """The rollout key of `table`'s row `row`, as errors name a rollout."""
    return {name: table[name][row].as_py() for name in ROLLOUT_KEY}


def duplicate_key(table: pa.Table) -> dict[str, Any] | None:
    """A rollout key that more than one row of `table` has (the first such in row order), or None."""
    counts = table.group_by(list(ROLLOUT_KEY), use_threads=False).aggregate([([], "count_all")])
    repeated = counts.filter(pc.greater(counts["count_all"], 1))
    return key_of(repeated, 0) if repeated.num_rows else None


def check_group_sizes(rollouts: pa.Table, n_samples: int, source: str) -> None:
    """Every (round, prompt) group has exactly `n_samples` rollouts, each key once: a short group (a lost sample)
    would give its members a baseline over fewer samples than the estimator assumes, silently."""
    if (key := duplicate_key(rollouts)) is not None:
        raise InputError(f"{source}: duplicate rollout {key}")
    sizes = rollouts.group_by(["round", "prompt_id"], use_threads=False).aggregate([([], "count_all")])
    wrong = sizes.filter(pc.not_equal(sizes["count_all"], n_samples))
    if wrong.num_rows:
        prompt_id, round_index, size = (wrong[name][0].as_py() for name in ("prompt_id", "round", "count_all"))
        raise InputError(
            f"{source}: prompt {prompt_id} (round {round_index}) has {size} rollouts, but generate.n_samples "
            f"is {n_samples}: the table is incomplete or from another config"
        )


def split_baselines(table: pa.Table, greedy_baselines: bool, source: str) -> tuple[pa.Table, pa.Table]:
    """(sampled rows, greedy baseline rows: sample_idx -1) of a rollouts or scores table. Under remax
    (`greedy_baselines`: the estimator's needs_greedy_baseline) every (round, prompt) group of sampled rows has
    exactly one baseline row and every baseline row a group; otherwise there is none (a table from another
    config)."""
    is_baseline = pc.equal(table["sample_idx"], BASELINE_SAMPLE_IDX)
    sampled, baselines = table.filter(pc.invert(is_baseline)), table.filter(is_baseline)
    if not greedy_baselines:
        if baselines.num_rows:
            raise InputError(f"{source}: greedy baseline rollout {key_of(baselines, 0)} (sample_idx "
                             f"{BASELINE_SAMPLE_IDX}), but advantage.estimator is not remax: the table is from "
                             "another config")
        return sampled, baselines
    counts = Counter(zip(baselines["round"].to_pylist(), baselines["prompt_id"].to_pylist(), strict=True))
    groups = set(zip(sampled["round"].to_pylist(), sampled["prompt_id"].to_pylist(), strict=True))
    for round_index, prompt_id in sorted(groups | set(counts)):
        count = counts.get((round_index, prompt_id), 0)
        if count != 1 or (round_index, prompt_id) not in groups:
            what = f"{count} greedy baseline rows" if count != 1 else "a greedy baseline row but no sampled rows"
            raise InputError(f"{source}: prompt {prompt_id} (round {round_index}) has {what}; remax needs "
                             "exactly one beside the sampled rollouts of each prompt")
    return sampled, baselines


def join_scores(rollouts: pa.Table, scores: pa.Table, source: str = "scores") -> pa.Table:
    """`rollouts` with their score's `reward`: every rollout has exactly one score, with a finite reward, and every
    score a rollout. An error names `source` (the scores) and the first rollout at fault in `rollouts` order."""
    if (key := duplicate_key(scores)) is not None:
        raise InputError(f"{source}: duplicate score for rollout {key}")
    rollouts = rollouts.append_column("rollout_row", pa.array(np.arange(rollouts.num_rows)))
    scores = scores.select([*ROLLOUT_KEY, "reward", "status"])
    scores = scores.append_column("score_row", pa.array(np.arange(scores.num_rows)))
    joined = rollouts.join(scores, keys=list(ROLLOUT_KEY), join_type="full outer")
    joined = joined.sort_by([("rollout_row", "ascending"), ("score_row", "ascending")])
    has_rollout = pc.is_valid(joined["rollout_row"])
    unusable = joined.filter(pc.and_(has_rollout, pc.invert(pc.fill_null(pc.is_finite(joined["reward"]), False))))
    if unusable.num_rows:
        key = key_of(unusable, 0)
        if not unusable["score_row"][0].is_valid:
            raise InputError(f"{source}: no score for rollout {key}")
        raise InputError(
            f"{source}: reward {unusable['reward'][0].as_py()!r} of rollout {key} is not a finite number "
            "(a scorer bug: refusing to compute advantages from it)"
        )
    orphans = joined.filter(pc.invert(has_rollout))
    if orphans.num_rows:
        raise InputError(f"{source}: {orphans.num_rows} scores have no rollout, e.g. {key_of(orphans, 0)}")
    return joined.drop_columns(["rollout_row", "score_row"])


def samples_of(
    rollouts: pa.Table, scores: pa.Table, n_samples: int, greedy_baselines: bool, list_columns: list[str],
    rollouts_source: str, scores_source: str,
) -> tuple[pa.Table, pa.Table | None]:
    """(samples, baselines): the sampled rollouts joined with their scores' `reward` and `status`, in `rollouts`
    order, and under remax (`greedy_baselines`) the greedy rows joined with theirs (the rollout key, `num_tokens`,
    `reward`, `status`; None otherwise). Checked: every (round, prompt) group has `n_samples` sampled rows
    (check_group_sizes), one greedy row each under remax (split_baselines), every rollout one finite score
    (join_scores). `list_columns` of the rollouts are carried by row (Arrow's join carries no list columns);
    errors name `rollouts_source` or `scores_source`."""
    rollouts, baseline_rollouts = split_baselines(rollouts, greedy_baselines, rollouts_source)
    scores, baseline_scores = split_baselines(scores, greedy_baselines, scores_source)
    check_group_sizes(rollouts, n_samples, rollouts_source)
    baselines = None
    if greedy_baselines:
        baselines = join_scores(baseline_rollouts.select([*ROLLOUT_KEY, "num_tokens"]), baseline_scores, scores_source)
    keyed = rollouts.drop_columns(list_columns).append_column("_row", pa.array(np.arange(rollouts.num_rows)))
    samples = join_scores(keyed, scores, scores_source)
    for name in list_columns:
        samples = samples.append_column(name, rollouts[name].take(samples["_row"]))
    return samples.drop_columns(["_row"]), baselines


@dataclass(frozen=True)
class Groups:
    """The (round, prompt_id) groups of samples in BATCH_ORDER: group k is rows bounds_K1[k] : bounds_K1[k + 1]."""

    id_N: np.ndarray  # each sample's group, 0..K-1 in (round, prompt) order
    bounds_K1: np.ndarray  # K + 1 row offsets
    round_K: np.ndarray

    @staticmethod
    def of(samples: pa.Table) -> Groups:
        round_N = samples["round"].to_numpy()
        prompt_N = samples["prompt_id"].to_numpy(zero_copy_only=False)
        starts_N = np.ones(len(round_N), dtype=bool)
        starts_N[1:] = (round_N[1:] != round_N[:-1]) | (prompt_N[1:] != prompt_N[:-1])
        bounds_K1 = np.append(np.flatnonzero(starts_N), len(starts_N))
        return Groups(np.cumsum(starts_N) - 1, bounds_K1, round_N[starts_N])

    @property
    def size_K(self) -> np.ndarray:
        return np.diff(self.bounds_K1)

    def split(self, values_N: np.ndarray) -> list[np.ndarray]:
        """`values_N` cut into one array per group."""
        return [values_N[start:end] for start, end in zip(self.bounds_K1[:-1], self.bounds_K1[1:], strict=True)]


def build_batch(
    samples: pa.Table, cfg: AdvantageConfig, max_new_tokens: int, kl_coef: float = 0.0,
    baselines: pa.Table | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """The batch table (one row per sample, BATCH's columns) and the manifest metrics, from joined rollouts and
    scores (the rollout key, `reward`, `status`, `num_tokens`, `truncated`; with `use_kl_in_reward` a list column
    `kl` of each token's KL estimate, with GAE one `values` of the critic's V(s_t), zeros if absent): shape,
    group, filter, cap to target, estimate, mask, each step one function below. `kl_coef`: the KL-in-reward
    beta. `baselines`: remax's greedy rows (the rollout key, `reward`, `num_tokens`), one per group. Reasons are
    per group (`_K`, None = kept), then per sample (`_N`)."""
    samples = samples.sort_by(BATCH_ORDER)
    groups = Groups.of(samples)
    rewards_N = samples["reward"].to_numpy()
    lengths_N = samples["num_tokens"].to_numpy().astype(np.float64)
    kl_by_sample = per_token(samples, "kl")
    outcome_N = shape_rewards(rewards_N, lengths_N, cfg, max_new_tokens)
    kl_in_reward_N = kl_coef * np.array([kl_T.sum() for kl_T in kl_by_sample]) if kl_by_sample else 0 * rewards_N
    shaped_N = outcome_N - kl_in_reward_N
    drop_K = filter_groups(groups, filter_values(samples, rewards_N, shaped_N, cfg), cfg)
    drop_K, groups_needed = cap_to_target(drop_K, groups, cfg)
    in_kept_group_N = np.equal(drop_K, None)[groups.id_N]
    token_columns = {name: pa.nulls(samples.num_rows, pa.list_(pa.float32())) for name in TOKEN_COLUMNS}
    record = ESTIMATORS[cfg.estimator]
    if record.level == "token":
        advantages_N, token_columns = estimate_gae(samples, outcome_N, kl_by_sample, kl_coef, in_kept_group_N, cfg)
    elif record.level == "turn":
        advantages_N, token_columns = estimate_turns(samples, shaped_N, groups, in_kept_group_N, cfg)
    elif record.needs_greedy_baseline:
        if baselines is None:
            raise InputError(f"advantage.estimator {cfg.estimator} needs the greedy baseline rows (sample_idx -1)")
        baseline_N = group_baselines(samples, groups, baselines, cfg, max_new_tokens)
        advantages_N = np.zeros_like(shaped_N)
        advantages_N[in_kept_group_N] = remax_advantages(shaped_N[in_kept_group_N], baseline_N[in_kept_group_N])
    else:
        advantages_N = estimate(shaped_N, lengths_N, groups, in_kept_group_N, cfg)
    drop_N = mask_samples(drop_K[groups.id_N], samples["truncated"].to_numpy(zero_copy_only=False), cfg)
    shaped_by_group = groups.split(shaped_N)
    batch = pa.table(
        {
            **{name: samples[name] for name in ROLLOUT_KEY},
            "reward": rewards_N,
            "shaped_reward": shaped_N,
            "advantage": advantages_N,
            "kept": np.equal(drop_N, None),
            "drop_reason": pa.array(drop_N, pa.string()),
            "group_size": groups.size_K[groups.id_N],
            "group_mean": np.array([shaped_G.mean() for shaped_G in shaped_by_group])[groups.id_N],
            "group_std": np.array([shaped_G.std(ddof=0) for shaped_G in shaped_by_group])[groups.id_N],
            "kl_in_reward": kl_in_reward_N,
            **token_columns,
        }
    )
    metrics = batch_metrics(batch, drop_K, groups, groups_needed, cfg)
    if baselines is not None:
        metrics["baseline_reward_mean"] = float(baselines["reward"].to_numpy().mean()) if baselines.num_rows else 0.0
    if cfg.use_kl_in_reward:
        metrics.update(kl_in_reward_metrics(kl_by_sample, kl_coef, cfg, model_masks(samples, kl_by_sample)))
    return batch, metrics


def group_baselines(
    samples: pa.Table, groups: Groups, baselines: pa.Table, cfg: AdvantageConfig, max_new_tokens: int
) -> np.ndarray:
    """Each sample's remax baseline: its group's greedy reward, overlong-shaped like the samples' (shape_rewards;
    verl's baseline is its reward function's score, overlong punishment included, without the KL in the reward)."""
    shaped_B = shape_rewards(baselines["reward"].to_numpy(), baselines["num_tokens"].to_numpy().astype(np.float64),
                             cfg, max_new_tokens)
    by_group = dict(zip(zip(baselines["round"].to_pylist(), baselines["prompt_id"].to_pylist(), strict=True),
                        shaped_B.tolist(), strict=True))
    starts = groups.bounds_K1[:-1]
    keys_K = zip(samples["round"].take(starts).to_pylist(), samples["prompt_id"].take(starts).to_pylist(), strict=True)
    baseline_K = []
    for round_index, prompt_id in keys_K:
        if (round_index, prompt_id) not in by_group:
            raise InputError(f"prompt {prompt_id} (round {round_index}) has no greedy baseline row (remax)")
        baseline_K.append(by_group[(round_index, prompt_id)])
    return np.array(baseline_K, dtype=np.float64)[groups.id_N]


def model_masks(samples: pa.Table, like: list[np.ndarray]) -> list[np.ndarray]:
    """Each sample's loss mask (1 model token, 0 observation) as floats, ones where it is null or the table has
    none (single-turn); `like`: per-sample arrays of the response length."""
    masks = samples["loss_mask"].to_pylist() if "loss_mask" in samples.column_names else [None] * len(like)
    return [np.ones(len(values)) if mask is None else np.asarray(mask, dtype=np.float64)
            for mask, values in zip(masks, like, strict=True)]


@dataclass(frozen=True)
class Turns:
    """One sample's model turns: the spans [start, end) in response tokens, the loss mask, the turn rewards."""

    spans: list[list[int]]
    mask_T: np.ndarray
    rewards_K: np.ndarray


def turns_of(samples: pa.Table, row: int, final_reward: float) -> Turns:
    """Sample `row`'s turns. A single-turn row (turn_spans null) is one turn over its whole response. The turn
    rewards are `turn_rewards` where the mode scored each turn (feedback), else 0 for every turn (tool mode), and
    the last turn's is `final_reward` (the sample's shaped reward, the scores table's being the final word)."""
    column = samples.column_names
    mask = samples["loss_mask"][row].as_py() if "loss_mask" in column else None
    length = len(mask) if mask is not None else int(samples["num_tokens"][row].as_py())
    spans = samples["turn_spans"][row].as_py() if "turn_spans" in column else None
    spans = [[0, length]] if spans is None else [list(span) for span in spans]
    given = samples["turn_rewards"][row].as_py() if "turn_rewards" in column else None
    where = key_of(samples, row)
    for span in spans:
        if len(span) != 2 or not 0 <= span[0] <= span[1] <= length:
            raise InputError(f"rollout {where}: turn span {span} is not a [start, end) within its {length} "
                             "response tokens")
    if given is not None and len(given) != len(spans):
        raise InputError(f"rollout {where}: {len(given)} turn_rewards for {len(spans)} turns")
    rewards_K = np.zeros(len(spans)) if given is None else np.asarray(given, dtype=np.float64)
    if len(spans):
        rewards_K[-1] = final_reward
    if not np.all(np.isfinite(rewards_K)):
        raise InputError(f"rollout {where}: turn_rewards {given} are not all finite")
    mask_T = np.ones(length) if mask is None else np.asarray(mask, dtype=np.float64)
    return Turns(spans, mask_T, rewards_K)


def estimate_turns(
    samples: pa.Table, shaped_N: np.ndarray, groups: Groups, kept_N: np.ndarray, cfg: AdvantageConfig
) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """The turn-level estimators for the samples of kept groups (stages/rl/advantages.py): `turn_rloo` (a
    leave-one-out baseline per turn index across the group) or `turn_gae` (GAE over turns with the critic's value
    at each turn's first model token, V = 0 without a critic; the advantages whitened over every model token of
    those samples, as `gae`, and the critic's returns R_k on turn k's model tokens). Each model token of turn k
    gets turn k's advantage, observation tokens 0 (masked in training anyway). Returns each sample's scalar
    advantage (the mean over its model tokens) and the token columns (null outside kept groups; `values` and
    `returns` null for turn_rloo)."""
    columns: dict[str, list] = {name: [None] * samples.num_rows for name in TOKEN_COLUMNS}
    rows = np.flatnonzero(kept_N)
    turns = {int(i): turns_of(samples, int(i), float(shaped_N[i])) for i in rows}
    tokens: dict[int, np.ndarray] = {}
    if not ESTIMATORS[cfg.estimator].needs_critic:  # turn_rloo: leave-one-out across the group
        for start, end in zip(groups.bounds_K1[:-1], groups.bounds_K1[1:], strict=True):
            if not kept_N[start]:
                continue
            members = list(range(start, end))
            per_turn = turn_rloo_advantages([turns[i].rewards_K for i in members])
            for i, advantages_K in zip(members, per_turn, strict=True):
                tokens[i] = spread_over_turns(advantages_K, turns[i].spans, turns[i].mask_T)
    else:  # turn_gae: GAE over each conversation's turns
        values_by_sample = per_token(samples, "values")
        for i, sample_turns in turns.items():
            values_T = values_by_sample[i] if values_by_sample else np.zeros(len(sample_turns.mask_T))
            starts = [start for start, _ in sample_turns.spans]
            values_K = np.array([values_T[start] if start < len(values_T) else 0.0 for start in starts])
            advantages_K, returns_K = turn_gae(sample_turns.rewards_K, values_K, cfg.gamma, cfg.lam)
            tokens[i] = spread_over_turns(advantages_K, sample_turns.spans, sample_turns.mask_T)
            columns["values"][i] = values_T.tolist()
            columns["returns"][i] = spread_over_turns(returns_K, sample_turns.spans, sample_turns.mask_T).tolist()
        # whitened over model tokens only (verl's masked_whiten over the response mask)
        order = sorted(tokens)
        model = [tokens[i][turns[i].mask_T > 0] for i in order]
        for i, whitened in zip(order, whiten_token_values(model), strict=True):
            tokens[i] = tokens[i].copy()
            tokens[i][turns[i].mask_T > 0] = whitened
    advantages_N = np.zeros(samples.num_rows)
    for i, advantages_T in tokens.items():
        columns["token_advantages"][i] = advantages_T.tolist()
        model_T = turns[i].mask_T > 0
        advantages_N[i] = advantages_T[model_T].mean() if model_T.any() else 0.0
    return advantages_N, {name: pa.array(values, pa.list_(pa.float32())) for name, values in columns.items()}


def per_token(samples: pa.Table, column: str) -> list[np.ndarray]:
    """The list column `column` of `samples` as one float64 array per sample; [] when the table has none."""
    if column not in samples.column_names:
        return []
    return [np.asarray(values, dtype=np.float64) for values in samples[column].to_pylist()]


def estimate_gae(
    samples: pa.Table,
    outcome_N: np.ndarray,
    kl_by_sample: list[np.ndarray],
    kl_coef: float,
    kept_N: np.ndarray,
    cfg: AdvantageConfig,
) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """GAE (advantages.gae) for the samples of kept groups: token rewards = the outcome (reward + overlong
    punishment) on the last token - kl_coef * kl_t on each, V(s_t) from the critic (0 without one: a new critic's
    zero head), the advantages whitened over every token of those samples (verl's masked_whiten). Returns each
    sample's scalar advantage (the mean of its tokens', 0 for an empty response or a dropped group) and the
    values / returns / token_advantages columns (null outside kept groups). A multi-turn sample's observation
    tokens are skipped: GAE runs over its model tokens alone (the outcome on the last of them; verl's GAE carries
    V and A across masked tokens the same way), they alone are whitened, and observations get 0."""
    lengths = samples["num_tokens"].to_numpy().astype(int).tolist()
    values_by_sample = per_token(samples, "values") or [np.zeros(n) for n in lengths]
    masks = model_masks(samples, values_by_sample)
    rows = np.flatnonzero(kept_N)
    model_rows = [np.flatnonzero(masks[i] > 0) for i in rows]
    advantages, returns = [], []
    for i, model_T in zip(rows, model_rows, strict=True):
        kl_T = kl_by_sample[i][model_T] if kl_by_sample else np.zeros(len(model_T))
        advantages_T, returns_T = gae(
            token_rewards(float(outcome_N[i]), kl_T, kl_coef), values_by_sample[i][model_T], cfg.gamma, cfg.lam
        )
        advantages.append(advantages_T)
        returns.append(returns_T)
    advantages = whiten_token_values(advantages)
    columns: dict[str, list] = {name: [None] * samples.num_rows for name in TOKEN_COLUMNS}
    advantages_N = np.zeros(samples.num_rows)
    for i, model_T, advantages_M, returns_M in zip(rows, model_rows, advantages, returns, strict=True):
        advantages_T, returns_T = np.zeros(len(masks[i])), np.zeros(len(masks[i]))
        advantages_T[model_T], returns_T[model_T] = advantages_M, returns_M
        columns["values"][i] = values_by_sample[i].tolist()
        columns["returns"][i] = returns_T.tolist()
        columns["token_advantages"][i] = advantages_T.tolist()
        advantages_N[i] = advantages_M.mean() if len(advantages_M) else 0.0
    return advantages_N, {name: pa.array(values, pa.list_(pa.float32())) for name, values in columns.items()}


def kl_in_reward_metrics(
    kl_by_sample: list[np.ndarray], kl_coef: float, cfg: AdvantageConfig, masks: list[np.ndarray] | None = None
) -> dict[str, float]:
    """The KL-in-reward coefficient used, the batch's KL (the mean over samples of each one's token-mean KL, as
    verl's apply_kl_penalty; over model tokens with multi-turn `masks`) and the next iteration's coefficient
    (advantages.adaptive_kl_coef, n = the samples; the same for `kl_ctrl: fixed`)."""
    masks = masks if masks is not None else [np.ones(len(kl_T)) for kl_T in kl_by_sample]
    per_sample = [(kl_T * m).sum() / m.sum() for kl_T, m in zip(kl_by_sample, masks, strict=True) if m.sum() > 0]
    current = float(np.mean(per_sample)) if per_sample else 0.0
    next_coef = kl_coef
    if cfg.kl_ctrl == "adaptive":
        next_coef = adaptive_kl_coef(kl_coef, current, cfg.kl_target, cfg.kl_horizon, len(kl_by_sample))
    return {"kl_in_reward_coef": kl_coef, "kl_in_reward_mean": current, "kl_in_reward_next_coef": next_coef}


def shape_rewards(
    rewards_N: np.ndarray, lengths_N: np.ndarray, cfg: AdvantageConfig, max_new_tokens: int
) -> np.ndarray:
    """shaped = reward + DAPO's overlong penalty (filters.overlong_penalty) when `overlong_buffer` > 0, over
    `overlong_max_length` (default generate.max_new_tokens); else the reward."""
    if cfg.overlong_buffer == 0:
        return rewards_N
    max_length = cfg.overlong_max_length or max_new_tokens
    return rewards_N + overlong_penalty(lengths_N, max_length, cfg.overlong_buffer, cfg.overlong_penalty_factor)


def filter_values(
    samples: pa.Table, rewards_N: np.ndarray, shaped_N: np.ndarray, cfg: AdvantageConfig
) -> np.ndarray:
    """What the group filters look at, by `filter_metric` (DAPO's filter_groups.metric, verl's ray_trainer):
    `acc` 1.0 when the score's status is ok (every test passed) else 0.0; `seq_reward` the scored reward;
    `reward` the shaped reward. DAPO filters on correctness, so lengths differing only inside the overlong
    buffer do not make an all-correct group look informative (and then punish its correct answers)."""
    if cfg.filter_metric == "acc":
        return (samples["status"].to_numpy(zero_copy_only=False) == "ok").astype(np.float64)
    return rewards_N if cfg.filter_metric == "seq_reward" else shaped_N


def filter_groups(groups: Groups, values_N: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """Each group's drop reason (None = kept), the first failing filter naming it: `zero_variance` when its filter
    values are all equal (filters.has_variance, if advantages.drops_zero_variance_groups; a one-sample group is
    zero variance only for an estimator that needs a group), `success_rate_out_of_range` when their mean is
    outside [min_group_mean, max_group_mean] (filters.success_rate_in_range, if either is set)."""
    filters = []
    if drops_zero_variance_groups(cfg):
        varies = partial(has_variance, one_sample_varies=not ESTIMATORS[cfg.estimator].needs_group)
        filters.append((DROP_ZERO_VARIANCE, varies, groups.split(values_N)))
    if cfg.min_group_mean is not None or cfg.max_group_mean is not None:
        low = -math.inf if cfg.min_group_mean is None else cfg.min_group_mean
        high = math.inf if cfg.max_group_mean is None else cfg.max_group_mean
        if low > high:
            raise InputError(f"advantage.min_group_mean {low} > advantage.max_group_mean {high}: no group passes")
        in_range = partial(success_rate_in_range, low=low, high=high)
        filters.append((DROP_SUCCESS_RATE, in_range, groups.split(values_N)))
    drop_K = np.full(len(groups.round_K), None, dtype=object)
    for reason, keep, values_by_group in filters:
        for k, values_G in enumerate(values_by_group):
            if drop_K[k] is None and not keep(values_G):
                drop_K[k] = reason
    return drop_K


def cap_to_target(drop_K: np.ndarray, groups: Groups, cfg: AdvantageConfig) -> tuple[np.ndarray, int]:
    """Dynamic sampling: with `target_groups`, keep the first that many kept groups in (round, prompt) order and
    drop the rest (`over_target`); and the groups the next round must generate (filters.rounds_needed: 0 when
    the batch is full, an error naming the cap once `max_generation_rounds` rounds are in the table)."""
    if cfg.target_groups is None:
        return drop_K, 0
    kept_K = np.flatnonzero(np.equal(drop_K, None))
    drop_K = drop_K.copy()
    drop_K[kept_K[cfg.target_groups :]] = DROP_OVER_TARGET
    rounds = len(np.unique(groups.round_K))
    try:
        needed = rounds_needed(min(len(kept_K), cfg.target_groups), cfg.target_groups, rounds, cfg.round_cap)
    except DynamicSamplingExhausted as error:
        raise InputError(str(error)) from None
    return drop_K, needed


def estimate(
    shaped_N: np.ndarray, lengths_N: np.ndarray, groups: Groups, kept_N: np.ndarray, cfg: AdvantageConfig
) -> np.ndarray:
    """Advantages by `cfg.estimator` over the samples of kept groups, truncated ones included (they are part of
    their group's baseline); 0 for the samples of dropped groups. `kept_N`: the sample's group is kept."""
    advantages_N = np.zeros_like(shaped_N)
    options = EstimatorOptions(cfg.std_epsilon, cfg.std_ddof, cfg.singleton_advantage, cfg.whiten_by)
    advantages_N[kept_N] = compute_advantages(
        cfg.estimator, shaped_N[kept_N], groups.id_N[kept_N], lengths_N[kept_N], options
    )
    return advantages_N


def mask_samples(drop_N: np.ndarray, truncated_N: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """Each sample's drop reason: its group's, or `truncated` for a truncated response in a kept group when
    `mask_truncated` (out of the loss, after it served in the baseline)."""
    if not cfg.mask_truncated:
        return drop_N
    return np.where(np.equal(drop_N, None) & truncated_N, DROP_TRUNCATED, drop_N)


def batch_metrics(
    batch: pa.Table, drop_K: np.ndarray, groups: Groups, groups_needed: int, cfg: AdvantageConfig
) -> dict[str, Any]:
    """The batch manifest's metrics; `skipped` (filters.is_skip_step) tells train to record a skipped step."""
    kept_N = batch["kept"].to_numpy(zero_copy_only=False)
    advantages_N = batch["advantage"].to_numpy()
    rewards_N, shaped_N = batch["reward"].to_numpy(), batch["shaped_reward"].to_numpy()
    return {
        "estimator": cfg.estimator,
        "samples": batch.num_rows,
        "samples_kept": int(kept_N.sum()),
        "samples_dropped": dict(sorted(Counter(batch["drop_reason"].drop_null().to_pylist()).items())),
        "groups": len(drop_K),
        "groups_kept": int(np.equal(drop_K, None).sum()),
        "groups_dropped": dict(sorted(Counter(reason for reason in drop_K if reason is not None).items())),
        "rounds": len(np.unique(groups.round_K)),
        "groups_needed": groups_needed,
        "nonzero_advantages": int(np.count_nonzero(advantages_N[kept_N])),
        "mean_reward": float(rewards_N.mean()) if batch.num_rows else 0.0,
        "mean_shaped_reward": float(shaped_N.mean()) if batch.num_rows else 0.0,
        "skipped": is_skip_step(advantages_N, kept_N),
    }
