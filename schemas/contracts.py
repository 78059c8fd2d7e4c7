"""Data contracts: one Great Expectations suite per table, checked before a stage writes its manifest.

The Arrow schemas (schemas/tables.py) fix columns and types; the contracts fix what the values may be:
rewards within the reward kind's bounds, finite advantages and losses, one row per rollout key, every
generation group of exactly `generate.n_samples` samples, sampler log-probabilities <= 0, token counts that
match the token lists, and so on. `checks_for(table, config)` lists them as data (GX expectation class,
arguments, the rule in words); `validate_table` runs them through GX and returns a `ContractResult` that
the harness turns into a failed stage (naming the expectation and sample rows) or into
`<table>.parquet.validation.json` (+ a GX data-docs HTML page) beside the output.

GX has no "finite", group-size or list-element expectations and is slow per expectation, so NaN becomes +inf
in the frame GX sees, derived `_...` columns carry group sizes and merged range checks, and GX is imported
only inside `validate_table`: docs/architecture.md, "Data contracts". Checks never assume a column that the
table's current schema version lacks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import BUILTIN_REWARDS, VERIFIER_REWARDS, RunConfig, ScoreConfig
from schemas.settings import cache_dir
from schemas.tables import TABLES

FINITE_BOUND = 1e300  # |x| <= this  <=>  x is finite, for float64 (GX sees NaN as +inf: see to_frame)
SAMPLE_ROWS = 5
STATUSES = ("ok", "fail", "timeout", "error", "no_code")
REWARD_KINDS = ("code_tests", "code_stdio", "code_call", "math", "custom")
FINISH_REASONS = ("stop", "length")
# Multi-turn conversations (generate.multi_turn) also end at the conversation budget or at a refused tool call.
MULTI_TURN_FINISH_REASONS = ("stop", "length", "budget", "max_turns", "max_tool_calls")
TRUNCATING_FINISH_REASONS = ("length", "budget")
EVAL_MODES = ("greedy", "sampled")
SPLITS = ("train", "test")
GROUP_KEY = ("run_id", "iteration", "round", "prompt_id")  # a generation group: n samples of one prompt
EVAL_GROUP_KEY = ("run_id", "iteration", "dataset", "prompt_id", "mode")


def reward_bounds(kind: str, score: ScoreConfig) -> tuple[float, float]:
    """[low, high] of a reward of this kind: a response without code/answer gets `no_code_penalty` (<= 0),
    anything else a fraction of tests passed (code) or 0/1 (math)."""
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; kinds are {', '.join(REWARD_KINDS)}")
    return min(score.no_code_penalty, 0.0), 1.0


def table_reward_bounds(score: ScoreConfig) -> tuple[float, float]:
    """Bounds for a table whose rows do not carry their kind (scores, batch, eval): the union over kinds.

    Under score.rewards a row's reward is one verifier's weighted value (in [0, 1]) plus every format term's,
    or the no_code penalty; a user function's value is any finite number, so then only finiteness is checked."""
    if not score.rewards:
        bounds = [reward_bounds(kind, score) for kind in REWARD_KINDS]
        return min(low for low, _ in bounds), max(high for _, high in bounds)
    if any(entry.fn not in BUILTIN_REWARDS for entry in score.rewards):
        return -FINITE_BOUND, FINITE_BOUND
    verifiers = [entry.weight for entry in score.rewards if entry.fn in VERIFIER_REWARDS]
    formats = [entry.weight for entry in score.rewards if entry.fn not in VERIFIER_REWARDS]
    low = min((min(w, 0.0) for w in verifiers), default=0.0) + sum(min(w, 0.0) for w in formats)
    high = max((max(w, 0.0) for w in verifiers), default=0.0) + sum(max(w, 0.0) for w in formats)
    return min(low, score.no_code_penalty, 0.0), high


@dataclass(frozen=True)
class Check:
    """One expectation as data: the GX class, its arguments, the rule in words, columns to show on failure."""

    expectation: str  # GX class name, e.g. "ExpectColumnValuesToBeBetween"
    kwargs: dict[str, Any]
    rule: str
    shows: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        k = self.kwargs
        if "column" in k:
            return (k["column"],)
        if "column_A" in k:
            return (k["column_A"], k["column_B"])
        return tuple(k.get("column_list", ()))


def _between(column: str, low: float | None, high: float | None, rule: str) -> Check:
    return Check("ExpectColumnValuesToBeBetween", {"column": column, "min_value": low, "max_value": high}, rule)


def _in_set(column: str, values: tuple[str, ...] | list[Any], rule: str, shows: tuple[str, ...] = ()) -> Check:
    return Check("ExpectColumnValuesToBeInSet", {"column": column, "value_set": list(values)}, rule, shows)


def _equal(a: str, b: str, rule: str, shows: tuple[str, ...] = ()) -> Check:
    return Check("ExpectColumnPairValuesToBeEqual", {"column_A": a, "column_B": b}, rule, shows)


def _at_least(a: str, b: str, rule: str) -> Check:
    return Check("ExpectColumnPairValuesAToBeGreaterThanB", {"column_A": a, "column_B": b, "or_equal": True}, rule)


# Derived columns each table's checks use, in the order they are added (names start with "_").
DERIVED: dict[str, tuple[str, ...]] = {
    "prompts": ("_reward_kind", "_messages_ok"),
    "rollouts": ("_group_size", "_response_len", "_logprobs_len", "_logprob_max", "_logprob_nonfinite",
                 "_finish_is_length", "_loss_mask_len_ok", "_turns_ok", "_staleness"),
    "scores": ("_group_size", "_no_code_reward_ok"),
    "batch": ("_group_size", "_drop_reason_null"),
    "train_metrics": (),
    "eval": ("_group_size", "_group_expected", "_status_ok"),
}


NATIVE_RANGES = ("reward", "advantage")  # float columns the issue names: GX range checks of their own


def float_ranges(table_name: str, config: RunConfig) -> dict[str, tuple[float, float, str]]:
    """[low, high] and the rule in words for every float column of the table (default: finite)."""
    low, high = table_reward_bounds(config.score)
    reward_range = "score.rewards' range" if config.score.rewards else "no_code_penalty .. 1"
    known: dict[str, tuple[float, float, str]] = {
        "reward": (low, high, f"reward within [{low:g}, {high:g}] ({reward_range})"),
        "advantage": (-FINITE_BOUND, FINITE_BOUND, "advantage is finite (not NaN or inf)"),
        "sandbox_seconds": (0.0, FINITE_BOUND, "sandbox_seconds >= 0"),
        "group_std": (0.0, FINITE_BOUND, "group_std >= 0"),
    }
    if table_name == "train_metrics":
        # Skipped steps are recorded, not trained: their metrics are not checked (see out_of_range).
        for name in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "rejected_frac", "padding_frac", "is_ess",
                     "vf_clip_frac"):
            known[name] = (0.0, 1.0, f"{name} in [0, 1]")
        for name in ("entropy", "grad_norm", "lr", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "seconds",
                     "value_loss"):
            known[name] = (0.0, FINITE_BOUND, f"{name} >= 0")
    ranges = {}
    for f in TABLES[table_name].schema:
        if pa.types.is_floating(f.type):
            ranges[f.name] = known.get(f.name, (-FINITE_BOUND, FINITE_BOUND, f"{f.name} finite"))
    return ranges


def out_of_range(table_name: str, table: pa.Table, config: RunConfig) -> list[str]:
    """Per row: "" or the folded float columns that are out of range, e.g. "loss=nan (loss finite)"."""
    messages = [""] * table.num_rows
    skipped = None
    if table_name == "train_metrics" and "skipped" in table.column_names:
        skipped = table.column("skipped").to_numpy(zero_copy_only=False).astype(bool)
    for column, (low, high, rule) in float_ranges(table_name, config).items():
        if column in NATIVE_RANGES or column not in table.column_names:
            continue
        values = table.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(values) | (values < low) | (values > high)
        if skipped is not None:
            bad &= ~skipped
        for row in np.flatnonzero(bad):
            note = f"{column}={values[row]:g} ({rule})"
            messages[row] = f"{messages[row]}; {note}" if messages[row] else note
    names = set(table.column_names)
    if table_name == "train_metrics" and {"is_ratio_min", "is_ratio_mean", "is_ratio_max"} <= names:
        low, mean, high = (table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
                           for c in ("is_ratio_min", "is_ratio_mean", "is_ratio_max"))
        disordered = ~((low <= mean) & (mean <= high))
        if skipped is not None:
            disordered &= ~skipped
        for row in np.flatnonzero(disordered):
            note = f"is_ratio min/mean/max = {low[row]:g}/{mean[row]:g}/{high[row]:g} (min <= mean <= max)"
            messages[row] = f"{messages[row]}; {note}" if messages[row] else note
    return messages


def derived_columns(table_name: str, config: RunConfig) -> list[str]:
    """The `_...` columns `to_frame` adds for this table, in order."""
    folded = any(c not in NATIVE_RANGES for c in float_ranges(table_name, config))
    return ["_schema_mismatch", *(["_out_of_range"] if folded else []), *DERIVED.get(table_name, ())]


def checks_for(table_name: str, config: RunConfig, greedy_baselines: bool = False) -> list[Check]:
    """The suite of table `table_name` under `config`, as data (no GX needed to list it). `greedy_baselines`:
    the estimator adds one greedy rollout per generation group (remax; the stage harness asks
    stages/rl/advantages.ESTIMATORS, which this module, below the libraries, cannot import)."""
    spec = TABLES[table_name]
    names = set(spec.schema.names)
    derived = derived_columns(table_name, config)
    gen, score, ev = config.generate, config.score, config.evaluate
    # remax: each (round, prompt) group of rollouts and scores has one more row, its greedy baseline (sample_idx
    # -1); with the key unique, n_samples + 1 rows within -1..n_samples-1 means exactly one of them per group.
    baselines = int(greedy_baselines)
    group_rows = gen.n_samples + baselines
    group_rule = (f"every (round, prompt) group has n_samples = {gen.n_samples} rows" if not baselines else
                  f"every (round, prompt) group has n_samples = {gen.n_samples} rows and 1 greedy baseline (remax)")
    checks = [
        Check("ExpectTableColumnsToMatchSet", {"column_set": [*spec.schema.names, *derived], "exact_match": True},
              f"columns are exactly those of {spec.tag} (plus the derived {', '.join(derived)})"),
        _in_set("_schema_mismatch", [""], f"every column has the type {spec.tag} declares"),
    ]
    checks.append(Check("ExpectCompoundColumnsToBeUnique", {"column_list": list(spec.key)},
                        f"one row per key ({', '.join(spec.key)})"))
    if "run_id" in names:
        checks.append(_in_set("run_id", [config.run_id], f"rows belong to run {config.run_id}"))

    # Reward and advantage: GX range checks of their own. Every other float column: `_out_of_range`.
    ranges = float_ranges(table_name, config)
    for column, (low_, high_, rule) in ranges.items():
        if column in NATIVE_RANGES:
            checks.append(_between(column, low_, high_, rule))
    folded = [c for c in ranges if c not in NATIVE_RANGES]
    if folded:
        rule = "every other float column is in its range: " + "; ".join(ranges[c][2] for c in folded)
        if table_name == "train_metrics":
            rule += "; is_ratio_min <= is_ratio_mean <= is_ratio_max (trained steps only)"
        checks.append(_in_set("_out_of_range", [""], rule))

    iterations = f"0..{config.iterations - 1}"
    if table_name == "prompts":
        checks += [
            _in_set("split", SPLITS, "split is train or test"),
            _in_set("_reward_kind", REWARD_KINDS, "reward_spec is a JSON object with a known kind",
                    shows=("reward_spec",)),
            _in_set("_messages_ok", [True], "messages is a JSON list of {role, content}", shows=("messages",)),
        ]
    elif table_name == "rollouts":
        mt = gen.multi_turn
        finish_reasons = MULTI_TURN_FINISH_REASONS if mt.mode != "off" else FINISH_REASONS
        checks += [
            _between("iteration", 0, config.iterations - 1, f"iteration within {iterations}"),
            _between("round", 0, None if config.advantage.round_cap is None else config.advantage.round_cap - 1,
                     "round < advantage.max_generation_rounds (0: unlimited)"),
            _between("sample_idx", -baselines, gen.n_samples - 1,
                     f"sample_idx within {-baselines}..n_samples-1 ({gen.n_samples - 1})"),
            _between("_group_size", group_rows, group_rows, group_rule),
            _between("num_tokens", 0, gen.response_token_limit,
                     f"num_tokens within 0..multi_turn.max_response_tokens ({gen.response_token_limit}), the "
                     "conversation's budget" if mt.mode != "off" else
                     f"num_tokens within 0..max_new_tokens ({gen.max_new_tokens})"),
            _equal("num_tokens", "_response_len", "num_tokens = len(response_token_ids)"),
            _equal("_logprobs_len", "_response_len", "one logprob per response token"),
            Check("ExpectColumnValuesToBeBetween", {"column": "_logprob_max", "max_value": 0.0},
                  "every response logprob <= 0"),
            _between("_logprob_nonfinite", 0, 0, "every response logprob is finite"),
            _in_set("finish_reason", finish_reasons, f"finish_reason is one of {', '.join(finish_reasons)}"),
            _equal("truncated", "_finish_is_length",
                   f"truncated exactly when finish_reason is {' or '.join(TRUNCATING_FINISH_REASONS)}",
                   shows=("finish_reason",)),
            _in_set("_loss_mask_len_ok", [True], "loss_mask is null or has one entry (0 or 1) per response token",
                    shows=("num_tokens",)),
            _between("num_turns", 1, mt.max_turns if mt.mode != "off" else 1,
                     f"num_turns within 1..{mt.max_turns if mt.mode != 'off' else 1} (multi_turn.max_turns)"),
            _between("tool_calls", 0, mt.max_tool_calls if mt.mode == "tool" else 0,
                     "tool_calls within 0..multi_turn.max_tool_calls (0 outside tool mode)"),
            _at_least("tool_calls", "tool_errors", "tool_errors <= tool_calls"),
            _in_set("_turns_ok", [True], "turn_spans (where set) has num_turns ordered [start, end) spans within the "
                    "response, and turn_rewards (where set) one value per turn", shows=("num_turns",)),
            Check("ExpectColumnValuesToBeBetween",
                  {"column": "_staleness", "min_value": 0, "max_value": config.pipeline.max_staleness},
                  f"iteration - policy_step within 0..pipeline.max_staleness ({config.pipeline.max_staleness}); a null "
                  "step is strict order, 0", ("iteration", "policy_step")),
        ]
    elif table_name == "scores":
        checks += [
            _between("iteration", 0, config.iterations - 1, f"iteration within {iterations}"),
            _between("_group_size", group_rows, group_rows, group_rule),
            _in_set("status", STATUSES, f"status is one of {', '.join(STATUSES)}"),
            _between("passed", 0, None, "passed >= 0"),
            _at_least("total", "passed", "passed <= total"),
            _in_set("_no_code_reward_ok", [True],
                    f"status no_code has reward = no_code_penalty ({score.no_code_penalty:g})",
                    shows=("status", "reward")),
        ]
    elif table_name == "batch":
        checks += [
            _between("iteration", 0, config.iterations - 1, f"iteration within {iterations}"),
            _between("_group_size", gen.n_samples, gen.n_samples,
                     f"every (round, prompt) group has n_samples = {gen.n_samples} rows"),
            _equal("group_size", "_group_size", "group_size = the number of rows of the group"),
            _equal("kept", "_drop_reason_null", "drop_reason is set exactly for rows not kept", shows=("drop_reason",)),
        ]
    elif table_name == "eval":
        checks += [
            _between("iteration", -1, config.iterations - 1, f"iteration within -1 (base) .. {config.iterations - 1}"),
            _in_set("mode", EVAL_MODES, "mode is greedy or sampled"),
            _in_set("status", STATUSES, f"status is one of {', '.join(STATUSES)}"),
            _between("num_tokens", 0, ev.max_new_tokens if gen.multi_turn.mode == "off" else
                     gen.multi_turn.max_response_tokens,
                     f"num_tokens within 0..evaluate.max_new_tokens ({ev.max_new_tokens})" if gen.multi_turn.mode ==
                     "off" else f"num_tokens within 0..multi_turn.max_response_tokens "
                     f"({gen.multi_turn.max_response_tokens})"),
            _at_least("tool_calls", "tool_errors", "tool_errors <= tool_calls"),
            _equal("_group_size", "_group_expected",
                   f"each prompt has evaluate.n_samples = {ev.n_samples} sampled rows and 1 greedy row",
                   shows=("mode",)),
            _equal("correct", "_status_ok", "correct exactly when status = ok", shows=("status",)),
        ]
    elif table_name == "train_metrics":
        checks.append(_between("iteration", 0, config.iterations - 1, f"iteration within {iterations}"))
        for f in spec.schema:
            if pa.types.is_integer(f.type) and f.name != "iteration":
                checks.append(_between(f.name, 0, None, f"{f.name} >= 0"))

    # Drop checks on columns this schema version does not have (derived columns are always there).
    return [c for c in checks if all(col in names or col.startswith("_") for col in c.columns)]


# --- derived columns ---------------------------------------------------------------------------------------


def _list_stats(column: pa.ChunkedArray | pa.Array, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: list length, max of the list (NaN ignored; NaN for an empty list), count of non-finite values."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False).astype(np.float64)
    parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
    nonfinite = np.bincount(parents, weights=~np.isfinite(values), minlength=rows).astype(np.int64)
    maxima = np.full(rows, np.nan)
    nonempty = lengths > 0
    if values.size:
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[nonempty]
        maxima[nonempty] = np.fmax.reduceat(values, starts)
    return lengths, maxima, nonfinite


def _json_kind(text: str | None) -> str | None:
    try:
        value = json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        return None
    return value.get("kind") if isinstance(value, dict) else None


def _messages_ok(text: str | None) -> bool:
    try:
        value = json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        return False
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _turns_ok(table: pa.Table, response_len: np.ndarray) -> list[bool]:
    """Per rollout: turn_spans null, or num_turns spans [start, end) in order inside the response; turn_rewards
    null or one per turn."""
    spans = table.column("turn_spans").to_pylist()
    turns = table.column("num_turns").to_pylist()
    rewards = table.column("turn_rewards").to_pylist()
    ok = []
    for row_spans, n, row_rewards, length in zip(spans, turns, rewards, response_len, strict=True):
        good = row_rewards is None or len(row_rewards) == n
        if row_spans is not None:
            edges = [edge for span in row_spans for edge in span]
            good = good and len(row_spans) == n and all(len(span) == 2 for span in row_spans) and (
                edges == sorted(edges) and all(0 <= e <= length for e in edges))
        ok.append(good)
    return ok


def schema_mismatch(table: pa.Table, table_name: str) -> str:
    """"" when every column present has its declared type, else "col: has, expected want; ..."."""
    declared = TABLES[table_name].schema
    problems = [
        f"{f.name}: {f.type}, expected {declared.field(f.name).type}"
        for f in table.schema
        if f.name in declared.names and f.type != declared.field(f.name).type
    ]
    return "; ".join(problems)


def to_frame(table_name: str, table: pa.Table, config: RunConfig):  # noqa: ANN201 - pandas.DataFrame
    """The pandas frame GX validates: the table's columns plus the derived `_...` columns."""
    import pandas as pd

    frame = table.to_pandas(types_mapper=lambda t: pd.ArrowDtype(t) if pa.types.is_list(t) else None)
    rows = table.num_rows
    frame["_schema_mismatch"] = schema_mismatch(table, table_name)
    if "_out_of_range" in derived_columns(table_name, config):
        frame["_out_of_range"] = out_of_range(table_name, table, config)
    for column in NATIVE_RANGES:
        if column in frame.columns and pa.types.is_floating(table.schema.field(column).type):
            values = frame[column].to_numpy(np.float64, copy=True)
            values[np.isnan(values)] = np.inf  # NaN is null to GX and would pass its range check
            frame[column] = values

    def group_size(keys: tuple[str, ...]) -> np.ndarray:
        if not rows:
            return np.zeros(0, dtype=np.int64)
        return frame.groupby(list(keys), sort=False, dropna=False)[keys[0]].transform("size").to_numpy(np.int64)

    names = set(table.column_names)
    if table_name == "prompts":
        frame["_reward_kind"] = [_json_kind(v) for v in table.column("reward_spec").to_pylist()]
        frame["_messages_ok"] = [_messages_ok(v) for v in table.column("messages").to_pylist()]
    elif table_name == "rollouts":
        frame["_group_size"] = group_size(GROUP_KEY)
        response_len, _, _ = _list_stats(table.column("response_token_ids"), rows)
        logprobs_len, logprob_max, nonfinite = _list_stats(table.column("response_logprobs"), rows)
        frame["_response_len"] = response_len
        frame["_logprobs_len"] = logprobs_len
        frame["_logprob_max"] = logprob_max
        frame["_logprob_nonfinite"] = nonfinite
        frame["_finish_is_length"] = frame["finish_reason"].isin(TRUNCATING_FINISH_REASONS).to_numpy(bool)
        masks = table.column("loss_mask").to_pylist() if "loss_mask" in names else [None] * rows
        frame["_loss_mask_len_ok"] = [
            mask is None or (len(mask) == n and set(mask) <= {0, 1})
            for mask, n in zip(masks, response_len, strict=True)
        ]
        frame["_turns_ok"] = _turns_ok(table, response_len) if "turn_spans" in names else [True] * rows
        steps = frame["policy_step"].to_numpy(np.float64) if "policy_step" in names else np.full(rows, np.nan)
        behind = frame["iteration"].to_numpy(np.float64) - steps
        frame["_staleness"] = np.where(np.isnan(steps), 0, behind).astype(np.int64)
    elif table_name == "scores":
        frame["_group_size"] = group_size(GROUP_KEY)
        no_code = (frame["status"] == "no_code").to_numpy(bool)
        reward = frame["reward"].to_numpy(np.float64)
        frame["_no_code_reward_ok"] = ~no_code | np.isclose(reward, config.score.no_code_penalty)
    elif table_name == "batch":
        frame["_group_size"] = group_size(GROUP_KEY)
        frame["_drop_reason_null"] = frame["drop_reason"].isna().to_numpy(bool)
    elif table_name == "eval":
        key = tuple(k for k in EVAL_GROUP_KEY if k in names)
        frame["_group_size"] = group_size(key)
        sampled = (frame["mode"] == "sampled").to_numpy(bool)
        frame["_group_expected"] = np.where(sampled, config.evaluate.n_samples, 1).astype(np.int64)
        frame["_status_ok"] = (frame["status"] == "ok").to_numpy(bool)
    return frame


# --- results -------------------------------------------------------------------------------------------------


@dataclass
class Failure:
    expectation: str  # GX expectation type, e.g. expect_column_values_to_be_between
    column: str | None  # the column (or "A, B" for a pair, or the key columns)
    rule: str
    unexpected_count: int | None = None
    observed: Any = None
    sample_rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # GX raised while evaluating (counts as a failure)

    def describe(self) -> str:
        where = f"({self.column})" if self.column else ""
        text = f"{self.expectation}{where} — {self.rule}"
        if self.error:
            return f"{text}: error: {self.error}"
        if self.unexpected_count is not None:
            text += f": {self.unexpected_count} bad row{'s' if self.unexpected_count != 1 else ''}"
        elif self.observed is not None:
            text += f": observed {_short(self.observed)}"
        if self.sample_rows:
            text += "; e.g. " + "; ".join(json.dumps(row, default=str) for row in self.sample_rows[:3])
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"expectation": self.expectation, "column": self.column, "rule": self.rule,
                "unexpected_count": self.unexpected_count, "observed": _plain(self.observed),
                "sample_rows": self.sample_rows, "error": self.error}


@dataclass
class ContractResult:
    table: str
    schema: str
    rows: int
    success: bool
    failures: list[Failure]
    evaluated: int
    seconds: float
    gx_version: str = ""
    gx_result: Any = field(default=None, repr=False)  # GX's ExpectationSuiteValidationResult

    def summary(self) -> str:
        head = (f"contract {self.schema}: {len(self.failures)} of {self.evaluated} expectations failed on "
                f"{self.rows} rows" if self.failures else
                f"contract {self.schema}: all {self.evaluated} expectations met on {self.rows} rows")
        return "\n".join([head, *[f"  - {f.describe()}" for f in self.failures]])

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table, "schema": self.schema, "rows": self.rows, "success": self.success,
            "evaluated_expectations": self.evaluated, "seconds": round(self.seconds, 3),
            "great_expectations_version": self.gx_version,
            "failures": [f.to_dict() for f in self.failures],
            "gx_result": self.gx_result.to_json_dict() if self.gx_result is not None else None,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str).encode()

    def to_html(self) -> str | None:
        """GX's data-docs page for this validation (one self-standing file; styles load from a CDN when
        online, the content reads without them). None if GX cannot render it."""
        if self.gx_result is None:
            return None
        try:
            from great_expectations.render.renderer import ValidationResultsPageRenderer

            return _page_view().render(ValidationResultsPageRenderer().render(self.gx_result))
        except Exception:  # noqa: BLE001 - the HTML is a convenience; the JSON is the record
            return None


class ContractViolation(ValueError):
    """A stage's output breaks its table's contract; the message names the expectations and sample rows."""

    def __init__(self, path: str, result: ContractResult, kept_at: str | None = None) -> None:
        where = f" (the table is kept at {kept_at}, not as the output)" if kept_at else ""
        super().__init__(f"{path}: {result.summary()}{where}")
        self.result = result


def rejected_path(output_path: str) -> str:
    """Where a table that failed its contract is kept: beside the output, under a name no reader takes."""
    return output_path.removesuffix(".parquet") + ".rejected.parquet"


def validation_path(output_path: str, suffix: str = "json") -> str:
    return f"{output_path}.validation.{suffix}"


def _plain(value: Any) -> Any:
    """A JSON-able copy of a value from pandas/numpy/Arrow (lists shortened)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list | tuple | np.ndarray):
        items = [_plain(v) for v in list(value)[:8]]
        return items + [f"... {len(value) - 8} more"] if len(value) > 8 else items
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, str) and len(value) > 160:
        return value[:160] + "..."
    return value


def _short(value: Any) -> str:
    text = json.dumps(_plain(value), default=str)
    return text if len(text) <= 200 else text[:200] + "..."


# --- Great Expectations ------------------------------------------------------------------------------------

_GX: dict[str, Any] = {}


def gx_import_seconds() -> float:
    """Import GX (once per process) and return how long that took (0 when already imported)."""
    if "gx" in _GX:
        return 0.0
    # No usage statistics, no network: these machines may be offline, and a stage must not phone home.
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    started = time.perf_counter()
    import great_expectations as gx
    import great_expectations.expectations as gxe

    _GX.update(gx=gx, gxe=gxe, import_seconds=time.perf_counter() - started)
    return _GX["import_seconds"]


def _context() -> Any:
    """One ephemeral GX context per process (no files, no server) with a pandas data source."""
    if "context" not in _GX:
        gx_import_seconds()
        from great_expectations.data_context.types.base import ProgressBarsConfig

        context = _GX["gx"].get_context(mode="ephemeral")
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        _GX["context"] = context
        _GX["source"] = context.data_sources.add_pandas("rlpipe")
    return _GX["context"]


def _page_view() -> Any:
    """One GX data-docs page view per process, its Jinja templates compiled once per machine: GX builds a
    fresh Jinja environment per view, and compiling its 17 templates cost ~0.3 s in every stage process
    (more than the validation of a small table). Jinja's bytecode cache keys each template by its source's
    checksum, so a GX upgrade recompiles."""
    if "page_view" not in _GX:
        from great_expectations.render.view import DefaultJinjaPageView
        from jinja2 import FileSystemBytecodeCache

        view = DefaultJinjaPageView()
        cache = cache_dir() / "jinja2"
        try:
            cache.mkdir(parents=True, exist_ok=True)
            view.env.bytecode_cache = FileSystemBytecodeCache(str(cache))
        except OSError:  # a read-only home: compile every time, as GX does
            pass
        _GX["page_view"] = view
    return _GX["page_view"]


def suite_for(table_name: str, config: RunConfig, greedy_baselines: bool = False) -> Any:
    """The GX ExpectationSuite of a table (named `<table>/v<version>`), built from `checks_for`."""
    _context()
    gx, gxe = _GX["gx"], _GX["gxe"]
    expectations = [
        getattr(gxe, check.expectation)(**check.kwargs, meta={"rule": check.rule, "check": number})
        for number, check in enumerate(checks_for(table_name, config, greedy_baselines))
    ]
    # All at once: `add_expectation` on a suite whose name the context already holds saves the whole suite
    # to the context's store at every addition.
    return gx.ExpectationSuite(name=TABLES[table_name].tag, expectations=expectations)


WARM_UP_TABLE = "warm-up"


def warm_up() -> float:
    """Pay in this process what each process pays on its first validation, and return the seconds it took:
    the GX context, GX's lazily imported metric and renderer modules, the data-docs templates (~0.05 s of a
    stage's ~0.1 s validation). The stage server (flows/runner/forkserver.py) calls it before it forks
    stages. Leaves no thread behind (a fork copies no held lock): tqdm's monitor, which GX starts, is stopped."""
    started = time.perf_counter()
    context = _context()
    gx, gxe = _GX["gx"], _GX["gxe"]
    import pandas as pd

    frame = pd.DataFrame({"a": [0, 1], "b": [0, 1], "s": ["x", "y"]})
    expectations = [
        gxe.ExpectTableColumnsToMatchSet(column_set=["a", "b", "s"], exact_match=True),
        gxe.ExpectColumnValuesToBeInSet(column="s", value_set=["x", "y"]),
        gxe.ExpectCompoundColumnsToBeUnique(column_list=["a", "s"]),
        gxe.ExpectColumnValuesToBeBetween(column="a", min_value=0, max_value=1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="a", column_B="b"),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="a", column_B="b", or_equal=True),
    ]
    suite = context.suites.add(gx.ExpectationSuite(name=WARM_UP_TABLE, expectations=expectations))
    result = _batch(WARM_UP_TABLE, frame).validate(suite, result_format={"result_format": "BOOLEAN_ONLY"})
    ContractResult(WARM_UP_TABLE, WARM_UP_TABLE, 2, result.success, [], len(result.results), 0.0,
                   gx_result=result).to_html()
    context.suites.delete(WARM_UP_TABLE)
    with contextlib.suppress(ImportError):
        import threading

        from tqdm._monitor import TMonitor

        for thread in threading.enumerate():
            if isinstance(thread, TMonitor):
                thread.exit()
                thread.tqdm_cls.monitor = None  # the next progress bar starts a new one
    return time.perf_counter() - started


def _batch(table_name: str, frame: Any) -> Any:
    source = _GX["source"]
    asset_name = f"{table_name}"
    try:
        asset = source.get_asset(asset_name)
    except LookupError:
        asset = source.add_dataframe_asset(asset_name)
    try:
        definition = asset.get_batch_definition("whole")
    except (LookupError, KeyError):
        definition = asset.add_batch_definition_whole_dataframe("whole")
    return definition.get_batch(batch_parameters={"dataframe": frame})


def _sample_rows(
    table: pa.Table, frame: Any, indices: list[int], key: tuple[str, ...], check: Check
) -> list[dict[str, Any]]:
    """Key, checked and shown columns of the first bad rows: real columns from the table itself (the frame
    GX saw has NaN as inf and skipped steps as 0), derived ones from the frame."""
    columns = list(dict.fromkeys(c for c in (*key, *check.columns, *check.shows) if c in frame.columns))
    rows = []
    for index in indices[:SAMPLE_ROWS]:
        row = {}
        for c in columns:
            value = table.column(c)[int(index)].as_py() if c in table.column_names else frame[c].iloc[int(index)]
            row[c] = _plain(value)
        rows.append(row)
    return rows


def validate_table(
    table_name: str, table: pa.Table, config: RunConfig, greedy_baselines: bool = False
) -> ContractResult:
    """Run the table's GX suite over `table` (`greedy_baselines`: as checks_for); never raises for bad data (see
    ContractResult.success)."""
    if table_name not in TABLES:
        raise KeyError(f"no contract for table {table_name!r}; tables are {', '.join(TABLES)}")
    started = time.perf_counter()
    context = _context()
    spec = TABLES[table_name]
    checks = checks_for(table_name, config, greedy_baselines)
    frame = to_frame(table_name, table, config)
    suite = suite_for(table_name, config, greedy_baselines)
    # An ephemeral context keeps suites by name: replace the previous one of this table (config may differ).
    try:
        context.suites.delete(suite.name)
    except Exception:  # noqa: BLE001 - GX raises different errors for "no such suite" across versions
        pass
    suite = context.suites.add(suite)
    batch = _batch(table_name, frame)
    # BOOLEAN_ONLY first: each expectation's verdict, at ~75% of BASIC's cost and ~50% of SUMMARY's (GX's
    # per-expectation metric graphs dominate on these small tables); a table that passes has no bad rows to
    # count. Only a table that fails is validated again with SUMMARY, for the counts and indices of its bad rows.
    result = batch.validate(suite, result_format={"result_format": "BOOLEAN_ONLY"})
    if not result.success:
        result = batch.validate(
            suite, result_format={"result_format": "SUMMARY", "partial_unexpected_count": SAMPLE_ROWS}
        )
    failures = []
    for item in result.results:
        if item.success:
            continue
        config_ = item.expectation_config
        number = (config_.meta or {}).get("check")
        check = checks[number] if isinstance(number, int) else Check(config_.type, dict(config_.kwargs), "")
        info = item.result or {}
        error = None
        if item.exception_info and item.exception_info.get("raised_exception"):
            error = str(item.exception_info.get("exception_message"))
        failures.append(Failure(
            expectation=config_.type,
            column=", ".join(check.columns) or None,
            rule=check.rule,
            unexpected_count=info.get("unexpected_count"),
            # The column-set expectation says what is missing/unexpected in "details"; that beats the full list.
            observed=(info.get("details") or {}).get("mismatched") or info.get("observed_value"),
            sample_rows=_sample_rows(table, frame, info.get("partial_unexpected_index_list") or [], spec.key, check),
            error=error,
        ))
    return ContractResult(
        table=table_name, schema=spec.tag, rows=table.num_rows, success=not failures, failures=failures,
        evaluated=len(result.results), seconds=time.perf_counter() - started,
        gx_version=str(getattr(_GX["gx"], "__version__", "")), gx_result=result,
    )
