"""Storage: atomic writes, schema-checked tables, manifests and stage keys."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.tables import PROMPTS, ROLLOUTS, SchemaMismatch
from storage.fs import atomic_write_bytes, filesystem
from storage.manifest import Manifest, read_manifest, stage_key, write_manifest
from storage.tables import TableVersionError, read_table, write_table


def prompt_rows(n: int) -> list[dict]:
    return [
        {"prompt_id": f"p{i}", "dataset": "toy", "split": "train", "source_row": i,
         "messages": json.dumps([{"role": "user", "content": f"q{i}"}]),
         "reward_spec": json.dumps({"kind": "math", "answer": str(i)}), "metadata": "{}"}
        for i in range(n)
    ]


def test_atomic_write_leaves_only_the_file(tmp_path: Path) -> None:
    fs = filesystem(str(tmp_path))
    target = f"{tmp_path}/a/b/out.bin"
    atomic_write_bytes(fs, target, b"x" * 10)
    atomic_write_bytes(fs, target, b"y" * 5)
    assert Path(target).read_bytes() == b"yyyyy"
    assert sorted(p.name for p in Path(target).parent.iterdir()) == ["out.bin"]


def test_table_round_trip_is_deterministic(tmp_path: Path) -> None:
    fs = filesystem(str(tmp_path))
    table = pa.Table.from_pylist(prompt_rows(3))
    first = write_table(fs, f"{tmp_path}/p1.parquet", table, PROMPTS)
    second = write_table(fs, f"{tmp_path}/p2.parquet", table, PROMPTS)
    assert first.sha256 == second.sha256 and first.rows == 3
    assert read_table(fs, first.path, PROMPTS).to_pylist() == prompt_rows(3)


def test_missing_and_extra_columns_are_named() -> None:
    table = pa.Table.from_pylist(prompt_rows(1)).drop(["metadata"]).append_column("oops", pa.array([1]))
    with pytest.raises(SchemaMismatch, match=r"missing columns \['metadata'\], extra columns \['oops'\]"):
        write_table(filesystem("/tmp"), "/tmp/never.parquet", table, PROMPTS)
    assert not Path("/tmp/never.parquet").exists()


def test_null_in_required_column_names_row() -> None:
    rows = prompt_rows(3)
    rows[2]["messages"] = None
    with pytest.raises(SchemaMismatch, match=r"'messages' of prompts/v1 is null at row 2"):
        write_table(filesystem("/tmp"), "/tmp/never.parquet", pa.Table.from_pylist(rows), PROMPTS)


def test_reader_refuses_other_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "old.parquet"
    table = pa.Table.from_pylist(prompt_rows(1)).replace_schema_metadata({b"rlpipe.schema": b"prompts/v0"})
    pq.write_table(table, path)
    with pytest.raises(TableVersionError, match=r"old.parquet: schema version prompts/v0"):
        read_table(filesystem(str(tmp_path)), str(path), PROMPTS)


def test_reader_refuses_wrong_table(tmp_path: Path) -> None:
    fs = filesystem(str(tmp_path))
    written = write_table(fs, f"{tmp_path}/p.parquet", pa.Table.from_pylist(prompt_rows(1)), PROMPTS)
    with pytest.raises(TableVersionError, match="rollouts/v3"):
        read_table(fs, written.path, ROLLOUTS)


def test_manifest_round_trip_and_unreadable_manifest_means_not_done(tmp_path: Path) -> None:
    fs = filesystem(str(tmp_path))
    manifest = Manifest(stage="s", key="k", kind="table", path="p", sha256="h", bytes=1, rows=1)
    write_manifest(fs, f"{tmp_path}/m.json", manifest)
    assert read_manifest(fs, f"{tmp_path}/m.json") == manifest
    (tmp_path / "bad.json").write_text("{not json")
    assert read_manifest(fs, f"{tmp_path}/bad.json") is None
    assert read_manifest(fs, f"{tmp_path}/none.json") is None


def test_stage_key_depends_on_stage_config_and_inputs() -> None:
    base = stage_key("score", {"score": {"timeout_s": 5}}, {"rollouts": "aa"})
    assert base == stage_key("score", {"score": {"timeout_s": 5}}, {"rollouts": "aa"})
    assert base != stage_key("score", {"score": {"timeout_s": 6}}, {"rollouts": "aa"})
    assert base != stage_key("score", {"score": {"timeout_s": 5}}, {"rollouts": "bb"})
    assert base != stage_key("train", {"score": {"timeout_s": 5}}, {"rollouts": "aa"})


def test_output_damage_names_the_missing_file_or_the_size_change(tmp_path: Path) -> None:
    from storage.manifest import output_damage

    fs = filesystem(str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"12345")
    (tmp_path / "ckpt" / "config.json").write_bytes(b"{}")
    files = {"model.safetensors": {"bytes": 5, "sha256": "x"}, "config.json": {"bytes": 2, "sha256": "y"}}
    checkpoint = Manifest(stage="train", key="k", kind="checkpoint", path=str(tmp_path / "ckpt"), sha256="s",
                          bytes=7, files=files)
    assert output_damage(fs, checkpoint) is None
    (tmp_path / "ckpt" / "config.json").write_bytes(b"{ }")
    assert output_damage(fs, checkpoint) == f"{tmp_path}/ckpt/config.json has 3 bytes, its manifest says 2"
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    assert output_damage(fs, checkpoint) == f"{tmp_path}/ckpt/model.safetensors is missing"


def test_a_failed_local_write_names_its_destination_and_leaves_nothing(tmp_path: Path) -> None:
    from storage.fs import StorageWriteError

    (tmp_path / "blocker").write_text("a file where a folder should be")
    with pytest.raises(StorageWriteError, match=r"cannot write .*blocker/table.parquet"):
        atomic_write_bytes(filesystem(str(tmp_path)), str(tmp_path / "blocker" / "table.parquet"), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


@pytest.mark.parametrize("run_id", ["../outside", "a/b", "", ".hidden", "x" * 129])
def test_run_layout_refuses_a_run_id_that_is_not_one_path_segment(run_id: str) -> None:
    from schemas.config import InvalidRunId
    from storage.layout import RunLayout

    with pytest.raises(InvalidRunId, match="run_id"):
        RunLayout.create("/data", run_id)


def test_a_rollouts_v1_table_reads_as_single_turn_rollouts(tmp_path: Path) -> None:
    """Proves: a rollouts table written before the multi-turn columns (v1) is read with them filled in as a
    single-turn rollout: no mask (every token the model's), no spans, one turn, no tool calls."""
    v1_names = ["run_id", "iteration", "round", "prompt_id", "sample_idx", "policy_version", "prompt_token_ids",
                "response_token_ids", "response_logprobs", "response_text", "finish_reason", "truncated",
                "num_tokens", "seed", "backend"]
    v1 = pa.schema([ROLLOUTS.schema.field(name) for name in v1_names])
    row = {"run_id": "r", "iteration": 0, "round": 0, "prompt_id": "p", "sample_idx": 0, "policy_version": "h",
           "prompt_token_ids": [1], "response_token_ids": [2, 3], "response_logprobs": [-0.5, -1.0],
           "response_text": "x", "finish_reason": "stop", "truncated": False, "num_tokens": 2, "seed": 7,
           "backend": "hf"}
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=v1).replace_schema_metadata({b"rlpipe.schema": b"rollouts/v1"}),
                   path)
    read = read_table(filesystem(str(tmp_path)), str(path), ROLLOUTS).to_pylist()[0]
    assert {k: read[k] for k in ("loss_mask", "turn_spans", "turn_rewards", "num_turns", "tool_calls",
                                 "tool_errors", "tool_seconds", "conversation")} == {
        "loss_mask": None, "turn_spans": None, "turn_rewards": None, "num_turns": 1, "tool_calls": 0,
        "tool_errors": 0, "tool_seconds": 0.0, "conversation": None}
    assert read["response_token_ids"] == [2, 3]
