"""Data contracts: each table's GX suite passes on good data and names the expectation and rows on bad data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from schemas.config import RunConfig, ScoreConfig
from schemas.contracts import (
    ContractViolation,
    checks_for,
    gx_import_seconds,
    rejected_path,
    reward_bounds,
    validate_table,
)
from schemas.tables import TABLES
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> SyntheticRun:
    gx_import_seconds()  # once, up front: the first validation should not carry the import in its timing
    return SyntheticRun(str(tmp_path_factory.mktemp("contracts")), SyntheticSpec(run_id="c", iterations=2))


@pytest.fixture(scope="module")
def tables(synthetic: SyntheticRun) -> dict[str, pa.Table]:
    made = synthetic.iteration_tables(1, "f" * 64)
    made["prompts"] = synthetic.prompts_table()
    made["train_metrics"] = synthetic.train_metrics(1)
    made["eval"] = synthetic.eval_table(-1, "e" * 64)
    return made


@pytest.fixture(scope="module")
def config(synthetic: SyntheticRun) -> RunConfig:
    return synthetic.config


def replace(table: pa.Table, column: str, values: list | pa.Array) -> pa.Table:
    index = table.schema.get_field_index(column)
    return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))


def failing(result, expectation: str, column: str | None):  # noqa: ANN001, ANN201 - ContractResult, Failure
    matches = [f for f in result.failures if f.expectation == expectation and f.column == column]
    assert matches, f"no failure {expectation}({column}) in:\n{result.summary()}"
    return matches[0]


@pytest.mark.parametrize("name", ["prompts", "rollouts", "scores", "batch", "train_metrics", "eval"])
def test_good_tables_pass(name: str, tables: dict[str, pa.Table], config: RunConfig) -> None:
    result = validate_table(name, tables[name], config)
    assert result.success, result.summary()
    assert result.failures == [] and result.evaluated == len(checks_for(name, config)) >= 5
    assert result.rows == tables[name].num_rows
    stored = json.loads(result.to_json())
    assert stored["success"] is True and stored["schema"] == TABLES[name].tag
    assert stored["gx_result"]["statistics"]["evaluated_expectations"] == result.evaluated


def test_reward_out_of_bounds_and_nan(tables: dict[str, pa.Table], config: RunConfig) -> None:
    scores = tables["scores"]
    rewards = scores.column("reward").to_pylist()
    rewards[3], rewards[5] = 1.5, math.nan
    result = validate_table("scores", replace(scores, "reward", rewards), config)
    assert not result.success
    failure = failing(result, "expect_column_values_to_be_between", "reward")
    assert failure.unexpected_count == 2
    assert failure.rule == "reward within [0, 1] (no_code_penalty .. 1)"
    bad = {row["sample_idx"]: row["reward"] for row in failure.sample_rows}
    key = scores.slice(3, 1).to_pylist()[0]
    assert failure.sample_rows[0]["prompt_id"] == key["prompt_id"] and bad[key["sample_idx"]] == 1.5
    assert "nan" in {str(v) for v in bad.values()}  # the sample row shows the real NaN, not GX's stand-in


def test_reward_bounds_follow_no_code_penalty() -> None:
    score = ScoreConfig(no_code_penalty=-0.5)
    assert reward_bounds("code_tests", score) == reward_bounds("math", score) == (-0.5, 1.0)
    assert reward_bounds("code_stdio", ScoreConfig()) == (0.0, 1.0)
    with pytest.raises(ValueError, match="unknown reward kind"):
        reward_bounds("poetry", score)


def test_no_code_penalty_is_checked(tables: dict[str, pa.Table]) -> None:
    config = RunConfig.model_validate({"run_id": "c", "iterations": 2, "score": {"no_code_penalty": -0.5}})
    result = validate_table("scores", tables["scores"], config)  # synthetic no_code rows carry reward 0
    failure = failing(result, "expect_column_values_to_be_in_set", "_no_code_reward_ok")
    assert failure.rule == "status no_code has reward = no_code_penalty (-0.5)"
    assert {row["status"] for row in failure.sample_rows} == {"no_code"}
    assert failure.unexpected_count == pc.sum(pc.equal(tables["scores"].column("status"), "no_code")).as_py()


def test_infinite_advantage(tables: dict[str, pa.Table], config: RunConfig) -> None:
    advantages = tables["batch"].column("advantage").to_pylist()
    advantages[0] = math.inf
    result = validate_table("batch", replace(tables["batch"], "advantage", advantages), config)
    failure = failing(result, "expect_column_values_to_be_between", "advantage")
    assert failure.rule == "advantage is finite (not NaN or inf)" and failure.unexpected_count == 1
    assert failure.sample_rows[0]["advantage"] == "inf"


def test_duplicate_rollout_key_and_wrong_group_size(tables: dict[str, pa.Table], config: RunConfig) -> None:
    rollouts = tables["rollouts"]
    duplicated = pa.concat_tables([rollouts, rollouts.slice(0, 1)])
    result = validate_table("rollouts", duplicated, config)
    unique = failing(result, "expect_compound_columns_to_be_unique", "run_id, iteration, round, prompt_id, sample_idx")
    assert unique.unexpected_count == 2
    group = failing(result, "expect_column_values_to_be_between", "_group_size")
    assert group.rule == "every (round, prompt) group has n_samples = 4 rows"
    assert group.unexpected_count == 5 and {row["_group_size"] for row in group.sample_rows} == {5}
    short = validate_table("rollouts", rollouts.slice(1), config)  # the first group loses a sample
    assert failing(short, "expect_column_values_to_be_between", "_group_size").unexpected_count == 3


def test_positive_logprob_and_token_count(tables: dict[str, pa.Table], config: RunConfig) -> None:
    rollouts = tables["rollouts"]
    logprobs = rollouts.column("response_logprobs").to_pylist()
    logprobs[2] = [0.25, *logprobs[2][1:]]
    logprobs[4] = logprobs[4][:-1]
    bad = replace(rollouts, "response_logprobs", logprobs)
    result = validate_table("rollouts", bad, config)
    positive = failing(result, "expect_column_values_to_be_between", "_logprob_max")
    assert positive.rule == "every response logprob <= 0" and positive.unexpected_count == 1
    assert positive.sample_rows[0]["sample_idx"] == rollouts.column("sample_idx")[2].as_py()
    assert positive.sample_rows[0]["_logprob_max"] == 0.25
    lengths = failing(result, "expect_column_pair_values_to_be_equal", "_logprobs_len, _response_len")
    assert lengths.unexpected_count == 1
    assert len(result.failures) == 2, result.summary()
    path = "/r/iter=0001/rollouts.parquet"
    message = str(ContractViolation(path, result, rejected_path(path)))
    assert message.startswith("/r/iter=0001/rollouts.parquet: contract rollouts/v3: 2 of ")
    assert "expect_column_values_to_be_between(_logprob_max) — every response logprob <= 0: 1 bad row; e.g. {" in (
        message)
    assert "kept at /r/iter=0001/rollouts.rejected.parquet, not as the output" in message


def test_types_and_columns(tables: dict[str, pa.Table], config: RunConfig) -> None:
    scores = tables["scores"]
    retyped = scores.set_column(scores.schema.get_field_index("passed"), "passed",
                                pc.cast(scores.column("passed"), pa.int64()))
    result = validate_table("scores", retyped.append_column("extra", pa.array(np.zeros(scores.num_rows))), config)
    columns = failing(result, "expect_table_columns_to_match_set", None)
    assert columns.observed["unexpected"] == ["extra"] and not columns.observed.get("missing")
    types = failing(result, "expect_column_values_to_be_in_set", "_schema_mismatch")
    assert types.sample_rows[0]["_schema_mismatch"] == "passed: int64, expected int32"


def test_skipped_training_steps_need_no_numbers(tables: dict[str, pa.Table], config: RunConfig) -> None:
    metrics = tables["train_metrics"]
    skipped = replace(metrics, "skipped", [True, False])
    skipped = replace(skipped, "loss", [math.nan, 0.1])
    assert validate_table("train_metrics", skipped, config).success
    trained = replace(metrics, "loss", [0.1, math.nan])
    trained = replace(trained, "clip_frac_high", [1.5, 0.0])
    result = validate_table("train_metrics", trained, config)
    failure = failing(result, "expect_column_values_to_be_in_set", "_out_of_range")
    assert len(result.failures) == 1 and failure.unexpected_count == 2
    steps = metrics.column("step").to_pylist()
    assert failure.sample_rows == [
        {"run_id": "c", "iteration": 1, "step": steps[0],
         "_out_of_range": "clip_frac_high=1.5 (clip_frac_high in [0, 1])"},
        {"run_id": "c", "iteration": 1, "step": steps[1], "_out_of_range": "loss=nan (loss finite)"},
    ]
    disordered = replace(metrics, "is_ratio_min", [1.2, 0.5])  # above the mean in the first step
    failure = failing(validate_table("train_metrics", disordered, config), "expect_column_values_to_be_in_set",
                      "_out_of_range")
    assert failure.unexpected_count == 1
    assert failure.sample_rows[0]["_out_of_range"].startswith("is_ratio min/mean/max = 1.2/")


def test_eval_groups_and_correctness(tables: dict[str, pa.Table], config: RunConfig) -> None:
    ev = tables["eval"]
    missing_sample = ev.filter(pc.invert(pc.and_(pc.equal(ev.column("mode"), "sampled"),
                                                 pc.equal(ev.column("sample_idx"), 2))))
    result = validate_table("eval", missing_sample, config)
    failure = failing(result, "expect_column_pair_values_to_be_equal", "_group_size, _group_expected")
    assert failure.unexpected_count == 3 * 3  # three prompts, three sampled rows left in each
    correct = ev.column("correct").to_pylist()
    correct[0] = not correct[0]
    flipped = validate_table("eval", replace(ev, "correct", correct), config)
    assert failing(flipped, "expect_column_pair_values_to_be_equal", "correct, _status_ok").unexpected_count == 1


def test_prompts_contract(tables: dict[str, pa.Table], config: RunConfig) -> None:
    prompts = tables["prompts"]
    specs = prompts.column("reward_spec").to_pylist()
    specs[0] = json.dumps({"kind": "poetry"})
    messages = prompts.column("messages").to_pylist()
    messages[1] = "not json"
    result = validate_table("prompts", replace(replace(prompts, "reward_spec", specs), "messages", messages), config)
    assert {f.column for f in result.failures} == {"_reward_kind", "_messages_ok"}
    assert failing(result, "expect_column_values_to_be_in_set", "_messages_ok").sample_rows[0]["messages"] == "not json"


def test_checks_only_use_columns_of_the_current_schema(config: RunConfig) -> None:
    for name, spec in TABLES.items():
        for check in checks_for(name, config):
            assert all(c in spec.schema.names or c.startswith("_") for c in check.columns), (name, check)


def test_html_data_docs_render(tables: dict[str, pa.Table], config: RunConfig, tmp_path: Path) -> None:
    rewards = tables["scores"].column("reward").to_pylist()
    rewards[0] = 2.0
    html = validate_table("scores", replace(tables["scores"], "reward", rewards), config).to_html()
    assert html is not None and "<html" in html.lower()
    assert "expect_column_values_to_be_between" in html or "values must be" in html.lower()


def test_data_docs_templates_compile_once_per_machine(
    tables: dict[str, pa.Table], config: RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GX's Jinja templates go to a bytecode cache under $RLPIPE_CACHE (compiling them cost ~0.3 s in every
    stage process), and a page rendered from the cache is the page GX renders compiling them."""
    import re

    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    import schemas.contracts as contracts

    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path))
    monkeypatch.delitem(contracts._GX, "page_view", raising=False)
    result = validate_table("scores", tables["scores"], config)
    cached = result.to_html()
    assert sorted(p.suffix for p in (tmp_path / "jinja2").iterdir())[:1] == [".cache"]
    fresh = DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result.gx_result))

    def comparable(html: str) -> str:  # element ids are random per render, and the page has its time
        html = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "ID", html)
        return re.sub(r"\d{8}T\d{6}\.\d{6}Z", "TIME", html)

    assert cached is not None and comparable(cached) == comparable(fresh)


def test_warm_up_leaves_no_thread_and_validation_still_judges_after_it(
    tables: dict[str, pa.Table], config: RunConfig
) -> None:
    import threading

    from tqdm._monitor import TMonitor

    from schemas.contracts import warm_up

    validate_table("batch", tables["batch"], config)  # GX's progress bars start tqdm's monitor thread
    assert warm_up() > 0
    assert not [t for t in threading.enumerate() if isinstance(t, TMonitor)]  # a fork copies no held lock
    scores = tables["scores"]
    rewards = scores.column("reward").to_pylist()
    rewards[2] = -3.0
    result = validate_table("scores", replace(scores, "reward", rewards), config)
    assert failing(result, "expect_column_values_to_be_between", "reward").unexpected_count == 1
    assert validate_table("scores", scores, config).success


def multi_turn_rollouts(rollouts: pa.Table) -> pa.Table:
    """The synthetic rollouts as 3-turn tool conversations: tokens model(2) obs(1) model(2) obs(1) model(rest)."""
    rows = rollouts.to_pylist()
    for row in rows:
        n = row["num_tokens"] = len(row["response_token_ids"])
        assert n >= 7
        row["loss_mask"] = [1, 1, 0, 1, 1, 0] + [1] * (n - 6)
        row["response_logprobs"] = [lp if m else 0.0 for lp, m in zip(row["response_logprobs"], row["loss_mask"],
                                                                         strict=True)]
        row.update(turn_spans=[[0, 2], [3, 5], [6, n]], turn_rewards=None, num_turns=3, tool_calls=2, tool_errors=1,
                   tool_seconds=0.25, finish_reason="budget", truncated=True,
                   conversation=json.dumps([{"role": "assistant", "content": "a"}]))
    return pa.Table.from_pylist(rows, schema=rollouts.schema)


def test_multi_turn_rollouts(tables: dict[str, pa.Table], config: RunConfig) -> None:
    """Under generate.multi_turn the suite accepts conversations (new finish reasons, the conversation's budget)
    and names each broken rule: a loss mask of the wrong length, more errors than calls, too many turns,
    spans out of order, truncated not matching a budget finish."""
    multi = config.model_copy(update={"generate": config.generate.model_copy(update={
        "multi_turn": config.generate.multi_turn.model_copy(update={"mode": "tool", "max_turns": 3,
                                                                   "max_response_tokens": 4096})})})
    good = multi_turn_rollouts(tables["rollouts"])
    result = validate_table("rollouts", good, multi)
    assert result.success, result.summary()
    assert not validate_table("rollouts", good, config).success  # single-turn config: "budget" is not a reason
    masks = good.column("loss_mask").to_pylist()
    masks[0] = masks[0][:-1]
    spans = good.column("turn_spans").to_pylist()
    spans[1] = [[3, 5], [0, 2], [6, 7]]
    errors = good.column("tool_errors").to_pylist()
    errors[2] = 3
    turns = good.column("num_turns").to_pylist()
    turns[3] = 4
    truncated = good.column("truncated").to_pylist()
    truncated[4] = False
    bad = replace(replace(replace(replace(replace(good, "loss_mask", masks), "turn_spans", spans), "tool_errors",
                                  errors), "num_turns", turns), "truncated", truncated)
    result = validate_table("rollouts", bad, multi)
    assert failing(result, "expect_column_values_to_be_in_set", "_loss_mask_len_ok").unexpected_count == 1
    # row 1's spans are out of order; row 3 has 4 turns for 3 spans
    assert failing(result, "expect_column_values_to_be_in_set", "_turns_ok").unexpected_count == 2
    assert failing(result, "expect_column_pair_values_a_to_be_greater_than_b", "tool_calls, tool_errors")
    assert failing(result, "expect_column_values_to_be_between", "num_turns").unexpected_count == 1
    truncation = failing(result, "expect_column_pair_values_to_be_equal", "truncated, _finish_is_length")
    assert truncation.unexpected_count == 1
