"""stages/data/pytasks.py: generated problems whose tests agree with their docstrings, split by family, scored for
real by the sandbox, and loaded beside HumanEval as a list of sources."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from schemas.config import ConfigError, DataConfig, ScoreConfig, load_config
from stages.data.pytasks import FAMILIES, INSTANCES_PER_FAMILY, generate_rows, instance_rng
from stages.data.sources import DataError, load_prompts, load_splits
from stages.sandbox import Sandbox, ScoreJob


def test_every_problem_is_a_valid_humaneval_style_row_whose_reference_passes_its_tests() -> None:
    """Each family's reference solution, bound to the instance's constants, passes its check(); a wrong
    answer (always None) fails it. The docstring's examples are the first tests."""
    rows = generate_rows()
    by_family = {family.name: family for family in FAMILIES}
    assert len(by_family) == len(FAMILIES) == 43
    assert len(rows) == len({row["prompt"] for row in rows}) >= 40 * INSTANCES_PER_FAMILY
    for row in rows:
        namespace: dict = {}
        exec(row["test"], namespace)  # trusted: generated here
        family = by_family[row["family"]]
        assert row["prompt"].startswith(f"def {row['entry_point']}(")
        assert row["test"].count("assert ") >= 3, row["task_id"]
        # The constants are not in the row: draw them again from the instance's seed.
        instance = int(row["task_id"].rsplit("/", 1)[1])
        name, constants = family.make(instance_rng(family.name, instance))
        assert name == row["entry_point"]
        namespace["check"](lambda *args, c=constants, f=family: f.solve(c, *args))
        with pytest.raises((AssertionError, TypeError)):  # TypeError: None - float in a float comparison
            namespace["check"](lambda *args: None)


def test_generation_is_deterministic() -> None:
    assert generate_rows() == generate_rows()


def test_split_is_by_family_and_holds_out_whole_families() -> None:
    cfg = DataConfig(train="pytasks", test="pytasks", max_test_prompts=None)
    metadata = {s: load_prompts("pytasks", s, cfg).column("metadata").to_pylist() for s in ("train", "test")}
    families = {split: Counter(json.loads(m)["family"] for m in rows) for split, rows in metadata.items()}
    assert not set(families["train"]) & set(families["test"])
    assert len(families["test"]) == 8 and sum(families["test"].values()) == 64
    assert sum(families["train"].values()) == 280


def test_a_list_of_sources_concatenates_each_sources_split() -> None:
    cfg = DataConfig(train=["humaneval", "pytasks"], test=["humaneval", "pytasks"], max_test_prompts=None)
    train, test = load_splits(cfg)
    assert Counter(train.column("dataset").to_pylist()) == {"humaneval": 122, "pytasks": 280}
    assert Counter(test.column("dataset").to_pylist()) == {"humaneval": 42, "pytasks": 64}
    # A source named for train only gives train all of its rows (and never appears in test).
    train, test = load_splits(DataConfig(train=["humaneval", "pytasks"], test="humaneval", max_test_prompts=None))
    assert Counter(train.column("dataset").to_pylist()) == {"humaneval": 122, "pytasks": 344}
    assert Counter(test.column("dataset").to_pylist()) == {"humaneval": 42}
    # max_test_prompts caps each test source.
    _, test = load_splits(DataConfig(train="humaneval", test=["humaneval", "pytasks"], max_test_prompts=5))
    assert Counter(test.column("dataset").to_pylist()) == {"humaneval": 5, "pytasks": 5}


def test_a_problem_in_two_sources_or_in_both_splits_is_refused(tmp_path) -> None:  # noqa: ANN001
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps(row) + "\n" for row in generate_rows()[:3]))
    with pytest.raises(DataError, match=r"data.train: prompt \w+ is in more than one source \(pytasks, copy\)"):
        load_splits(DataConfig(train=["pytasks", str(copy)], test="humaneval"))
    with pytest.raises(DataError, match="data.train and data.test share 3 prompt"):
        load_splits(DataConfig(train="pytasks", test=str(copy)))


def test_source_lists_are_checked_at_config_load() -> None:
    assert load_config(None, ["data.train=[humaneval, pytasks]"]).data.train == ["humaneval", "pytasks"]
    with pytest.raises(ConfigError, match="data.train"):
        load_config(None, ["data.train=[]"])
    with pytest.raises(ConfigError, match="names a source twice"):
        load_config(None, ["data.test=[pytasks, pytasks]"])


def test_the_sandbox_scores_pytasks_answers() -> None:
    """A correct answer to a generated problem earns 1.0 in the real sandbox, a partly right one the
    fraction of asserts it passes."""
    row = next(r for r in generate_rows() if r["family"] == "count_above")
    (prompt,) = [p for p in load_splits(DataConfig(train="pytasks", test="pytasks", max_test_prompts=None))[0]
                 .to_pylist() if json.loads(p["metadata"])["task_id"] == row["task_id"]]
    spec = json.loads(prompt["reward_spec"])
    threshold = int(row["prompt"].split("greater than ")[1].split(".")[0])
    right = f"```python\ndef {row['entry_point']}(nums):\n    return sum(1 for x in nums if x > {threshold})\n```"
    off_by_one = f"```python\ndef {row['entry_point']}(nums):\n    return sum(1 for x in nums if x >= {threshold})\n```"
    with Sandbox.from_config(ScoreConfig(workers=1, reward="fraction")) as sandbox:
        correct, partial = sandbox.score([ScoreJob(right, spec), ScoreJob(off_by_one, spec)])
    assert (correct.status, correct.reward) == ("ok", 1.0)
    assert partial.status == "fail" and 0.0 <= partial.reward < 1.0
