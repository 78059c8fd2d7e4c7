"""Arrow schemas of every table rlpipe writes, each with a version.

These schemas are the contract between stages: a stage may only write a table that matches its schema
exactly (same columns, same types, no extra columns), and a reader refuses a file whose recorded schema
version is not the one it knows, or one of the `older` versions it upgrades (the columns added since get the
value `added` names). Bump a table's version whenever its columns change.

The rollout key is (run_id, iteration, prompt_id, sample_idx, round); `round` numbers the generation rounds
of one iteration (dynamic sampling may generate more than one round), 0 for the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: int
    schema: pa.Schema
    key: tuple[str, ...]
    older: tuple[int, ...] = ()  # versions a reader still reads, upgraded by `upgrade`
    added: tuple[tuple[str, Any], ...] = ()  # (column, value for the rows of an older file) since those versions

    @property
    def tag(self) -> str:
        return f"{self.name}/v{self.version}"

    def reads(self, tag: str) -> bool:
        """Whether a file tagged `tag` is this version or one this reader upgrades."""
        return tag == self.tag or tag in {f"{self.name}/v{v}" for v in self.older}


def _schema(fields: list[tuple[str, pa.DataType]], nullable: frozenset[str] = frozenset()) -> pa.Schema:
    return pa.schema([pa.field(name, dtype, nullable=name in nullable) for name, dtype in fields])


ROLLOUT_KEY = ("run_id", "iteration", "round", "prompt_id", "sample_idx")
# The sample_idx of a group's greedy baseline rollout (advantage.estimator remax): scored like any rollout, never
# in the batch; the sampled rollouts keep 0..n_samples-1.
BASELINE_SAMPLE_IDX = -1
_KEY_FIELDS: list[tuple[str, pa.DataType]] = [
    ("run_id", pa.string()),
    ("iteration", pa.int32()),
    ("round", pa.int32()),
    ("prompt_id", pa.string()),
    ("sample_idx", pa.int32()),
]

PROMPTS = TableSchema(
    name="prompts",
    version=1,
    schema=_schema(
        [
            ("prompt_id", pa.string()),  # sha256 of dataset-independent content, first 16 hex digits
            ("dataset", pa.string()),
            ("split", pa.string()),  # train | test
            ("source_row", pa.int64()),  # line (JSONL, 1-based) or row (Parquet, 0-based) in the source
            ("messages", pa.string()),  # JSON list of {"role", "content"}
            ("reward_spec", pa.string()),  # JSON object; "kind" is code_tests | code_stdio | math
            ("metadata", pa.string()),  # JSON object
        ]
    ),
    key=("prompt_id", "split"),
)

ROLLOUTS = TableSchema(
    name="rollouts",
    version=3,
    schema=_schema(
        _KEY_FIELDS
        + [
            ("policy_version", pa.string()),  # content hash of the checkpoint that generated the row
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("response_token_ids", pa.list_(pa.int32())),
            # The sampler's log-probability of each sampled token under the distribution it was actually
            # drawn from (after temperature and top-p/top-k): the behaviour policy for importance weights.
            ("response_logprobs", pa.list_(pa.float32())),
            ("response_text", pa.string()),
            ("finish_reason", pa.string()),  # stop | length
            ("truncated", pa.bool_()),
            ("num_tokens", pa.int32()),
            ("seed", pa.int64()),
            ("backend", pa.string()),
            # Multi-turn (generate.multi_turn): the response is the whole conversation after the prompt, the
            # model's turns and the tool or environment observations between them, as one token sequence.
            # loss_mask: 1 per model token, 0 per observation token; null = every token is the model's.
            ("loss_mask", pa.list_(pa.int8())),
            ("turn_spans", pa.list_(pa.list_(pa.int32()))),  # each model turn's [start, end) in response tokens
            ("turn_rewards", pa.list_(pa.float64())),  # per model turn, where the mode scores each (feedback)
            ("num_turns", pa.int32()),  # model turns; 1 single-turn
            ("tool_calls", pa.int32()),
            ("tool_errors", pa.int32()),  # calls that raised, timed out or crashed
            ("tool_seconds", pa.float64()),  # wall time in the sandbox, all calls
            ("conversation", pa.string()),  # JSON list of {"role", "content"} after the prompt; null single-turn
            # Train stages the generating checkpoint had had: 0 the base model, j + 1 iteration j's checkpoint (the
            # sampler of iteration k is k-1-pipeline.max_staleness). Null in a table before v3: strict order, k.
            ("policy_step", pa.int32()),
        ],
        nullable=frozenset({"loss_mask", "turn_spans", "turn_rewards", "conversation", "policy_step"}),
    ),
    key=ROLLOUT_KEY,
    # v2: multi-turn columns; a v1 table reads as single-turn rollouts. v3: policy_step (null before).
    older=(1, 2),
    added=(("loss_mask", None), ("turn_spans", None), ("turn_rewards", None), ("num_turns", 1), ("tool_calls", 0),
           ("tool_errors", 0), ("tool_seconds", 0.0), ("conversation", None), ("policy_step", None)),
)
# What a rollout row of an older table holds in the columns added since: a single-turn rollout (no mask, spans
# or conversation, one turn, no tool calls) made in strict order (policy_step null: iteration k's own step).
SINGLE_TURN_ROLLOUT = dict(ROLLOUTS.added)

SCORES = TableSchema(
    name="scores",
    version=1,
    schema=_schema(
        _KEY_FIELDS
        + [
            ("reward", pa.float64()),
            ("passed", pa.int32()),
            ("total", pa.int32()),
            ("status", pa.string()),  # ok | fail | timeout | error | no_code
            ("tests", pa.string()),  # JSON list of per-test results
            ("code", pa.string()),
            ("sandbox_seconds", pa.float64()),
        ],
        nullable=frozenset({"code"}),
    ),
    key=ROLLOUT_KEY,
)

BATCH = TableSchema(
    name="batch",
    # v2: kl_in_reward, and per response token values, returns, token_advantages (PPO with a critic, GAE)
    version=2,
    schema=_schema(
        _KEY_FIELDS
        + [
            ("reward", pa.float64()),
            ("shaped_reward", pa.float64()),  # + overlong punishment - kl_in_reward
            ("advantage", pa.float64()),  # the sample's; with GAE the mean of its token_advantages
            ("kept", pa.bool_()),
            ("drop_reason", pa.string()),
            ("group_size", pa.int32()),
            ("group_mean", pa.float64()),
            ("group_std", pa.float64()),
            ("kl_in_reward", pa.float64()),  # beta * sum_t kl_t taken from the reward (advantage.use_kl_in_reward)
            # GAE (advantage.estimator gae), null otherwise and in dropped groups: the critic's V(s_t) per response
            # token, the returns A_t + V_t the critic is trained on, the (whitened) advantage A_t the policy gets
            ("values", pa.list_(pa.float32())),
            ("returns", pa.list_(pa.float32())),
            ("token_advantages", pa.list_(pa.float32())),
        ],
        nullable=frozenset({"drop_reason", "values", "returns", "token_advantages"}),
    ),
    key=ROLLOUT_KEY,
    older=(1,),
    added=(("kl_in_reward", 0.0), ("values", None), ("returns", None), ("token_advantages", None)),
)

TRAIN_METRICS = TableSchema(
    name="train_metrics",
    # v2: kl_ref, clip_frac_dual, is_ess, rejected_frac, loss_tokens, padding_frac. v3: value_loss,
    # vf_clip_frac, vf_explained_var. v4: staleness_mean, staleness_max. Definitions of every column are in
    # stages/rl/trainer.py (`metrics_row`), stages/rl/critic.py and stages/train.py (staleness); a skipped step
    # is one row, skipped = True.
    version=4,
    schema=_schema(
        [
            ("run_id", pa.string()),
            ("iteration", pa.int32()),
            ("step", pa.int32()),  # optimizer step, counted over the whole run
            ("epoch", pa.int32()),
            ("skipped", pa.bool_()),
            ("loss", pa.float64()),  # policy loss + kl_coef * KL term - entropy_coef * entropy term
            ("policy_loss", pa.float64()),
            ("clip_frac_low", pa.float64()),  # loss tokens low-clipped (A < 0, r < 1 - eps_low)
            ("clip_frac_high", pa.float64()),  # loss tokens high-clipped (A > 0, r > 1 + eps_high)
            ("clip_frac_dual", pa.float64()),  # loss tokens capped by the dual clip
            ("approx_kl", pa.float64()),  # k3 estimate of KL(pi_old || pi_theta) per loss token
            ("kl_ref", pa.float64()),  # KL(pi_theta || pi_ref) per token (train.kl_estimator); 0 if off
            ("entropy", pa.float64()),  # mean entropy of pi_theta over loss tokens
            ("is_ratio_mean", pa.float64()),  # pi_old / pi_sampler over response tokens (before truncation)
            ("is_ratio_min", pa.float64()),
            ("is_ratio_max", pa.float64()),
            ("is_ess", pa.float64()),  # (sum w)^2 / (n sum w^2) of those ratios, in (0, 1]
            ("rejected_frac", pa.float64()),  # response tokens rejected by rollout correction
            ("grad_norm", pa.float64()),  # before clipping
            ("lr", pa.float64()),
            ("tokens", pa.int64()),  # the trained sequences' prompt + response tokens
            ("loss_tokens", pa.int64()),  # response tokens in the loss
            ("padding_frac", pa.float64()),  # padded positions / all positions of the micro-batches
            ("sequences", pa.int32()),
            ("seconds", pa.float64()),
            ("value_loss", pa.float64()),  # the critic's clipped value loss (0 without a critic)
            ("vf_clip_frac", pa.float64()),  # response tokens whose value clip was active
            ("vf_explained_var", pa.float64()),  # 1 - Var(R - V) / Var(R) of the critic before its update
            # iteration - policy_step over the samples the iteration trains (the same on each of its rows): how
            # many train stages behind the sampler was (pipeline.max_staleness); NaN / 0 when none has a response
            ("staleness_mean", pa.float64()),
            ("staleness_max", pa.int32()),
        ]
    ),
    key=("run_id", "iteration", "step"),
    older=(2, 3),
    added=(("value_loss", 0.0), ("vf_clip_frac", 0.0), ("vf_explained_var", 0.0), ("staleness_mean", 0.0),
           ("staleness_max", 0)),
)

EVAL = TableSchema(
    name="eval",
    # v2: num_turns, tool_calls, tool_errors, first_answer_correct (multi-turn evaluation)
    version=2,
    schema=_schema(
        [
            ("run_id", pa.string()),
            ("iteration", pa.int32()),  # the iteration whose checkpoint was evaluated; -1 is the base model
            ("policy_version", pa.string()),
            ("dataset", pa.string()),
            ("prompt_id", pa.string()),
            ("mode", pa.string()),  # greedy | sampled
            ("sample_idx", pa.int32()),
            ("correct", pa.bool_()),
            ("reward", pa.float64()),
            ("status", pa.string()),
            ("num_tokens", pa.int32()),
            ("response_text", pa.string()),
            ("num_turns", pa.int32()),  # model turns (generate.multi_turn); 1 single-turn
            ("tool_calls", pa.int32()),
            ("tool_errors", pa.int32()),
            # whether the first answer was already correct (feedback mode retries after it); null in a v1 table
            ("first_answer_correct", pa.bool_()),
        ],
        nullable=frozenset({"first_answer_correct"}),
    ),
    key=("run_id", "iteration", "dataset", "prompt_id", "mode", "sample_idx"),
    older=(1,),
    added=(("num_turns", 1), ("tool_calls", 0), ("tool_errors", 0), ("first_answer_correct", None)),
)

TABLES: dict[str, TableSchema] = {t.name: t for t in (PROMPTS, ROLLOUTS, SCORES, BATCH, TRAIN_METRICS, EVAL)}


class SchemaMismatch(ValueError):
    """A table that does not match its declared schema; the message names the table and the columns."""


def upgrade(table: pa.Table, spec: TableSchema) -> pa.Table:
    """An older version's table with the columns added since (`spec.added`) filled in: every row gets the
    column's value (null for a nullable column)."""
    for name, value in spec.added:
        if name not in table.column_names:
            dtype = spec.schema.field(name).type
            table = table.append_column(name, pa.array([value] * table.num_rows, dtype))
    return table


def conform(table: pa.Table, spec: TableSchema, source: str) -> pa.Table:
    """Return `table` cast to `spec`'s schema, or raise SchemaMismatch naming missing/extra/bad columns.

    Only lossless casts are allowed (e.g. int64 -> int32 when the values fit); a null in a non-nullable
    column is an error naming the column and the first bad row.
    """
    expected = spec.schema
    missing = [name for name in expected.names if name not in table.column_names]
    extra = [name for name in table.column_names if name not in expected.names]
    if missing or extra:
        raise SchemaMismatch(
            f"{source}: table does not match schema {spec.tag}: missing columns {missing}, extra columns {extra}"
        )
    table = table.select(expected.names)
    columns = []
    for field in expected:
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            first = next(i for i, v in enumerate(column.to_pylist()) if v is None)
            raise SchemaMismatch(f"{source}: column {field.name!r} of {spec.tag} is null at row {first}")
        if column.type != field.type:
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise SchemaMismatch(
                    f"{source}: column {field.name!r} of {spec.tag} has type {table.schema.field(field.name).type},"
                    f" expected {field.type}: {error}"
                ) from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=expected)
