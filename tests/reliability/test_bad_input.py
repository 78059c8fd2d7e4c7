"""Bad-input drills: each bad input is refused with a message naming the file, row or field, and nothing that
was there before is overwritten or invalidated.

Every drill starts from a finished (stand-in) run, feeds one bad input to a real process (the `rlpipe`
command or a stage process) and compares every file of the run before and after.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.tables import ROLLOUT_KEY, TABLES
from stages.harness import StageContext
from stages.registry import Output
from storage.fs import atomic_write_bytes
from storage.layout import RunLayout
from storage.manifest import Manifest, config_hash
from storage.tables import SCHEMA_METADATA_KEY
from tests.support.stages import run_stage_at

from . import helpers as h

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture
def run(clone: RunLayout) -> RunLayout:
    return clone


def refused(result, *names: str, code: int = 2) -> str:  # noqa: ANN001 - a CompletedProcess
    """Assert the process exited with `code` and its output names every one of `names`; returns the output."""
    output = (result.stdout + result.stderr).replace("\n", "")
    assert result.returncode == code, output[-2500:]
    for name in names:
        assert name in output, f"{name!r} not named in: {output[-2500:]}"
    assert "Traceback" not in output, output[-2500:]
    return output


def unchanged(layout: RunLayout, before: dict[str, str], stale_manifest: str | None = None) -> None:
    """Every file of the run is as it was; only `stale_manifest` (the refusing stage's own manifest, stale
    already because its input changed) may have been removed."""
    after = h.snapshot(Path(layout.run_dir))
    # contract reports may be (re)written; a refusing stage records its refusal (storage/failure.py)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
               and ".validation." not in k and ".rejected." not in k and k != "failed.json"}
    assert changed <= ({stale_manifest} - after.keys() if stale_manifest else set()), changed


def write_raw(ctx: StageContext, name: str, table: pa.Table, tag: str, cast: bool = True) -> None:
    """Write `table` as output `name` with schema tag `tag`, past the schema and contract checks, with a manifest
    that vouches for it: what an older rlpipe, or another tool, would have left behind."""
    output = Output(name, ctx.iteration)
    if cast:
        table = table.cast(TABLES[name].schema)
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({SCHEMA_METADATA_KEY: tag.encode()}), sink)
    data = sink.getvalue()
    path = output.path(ctx.layout)
    atomic_write_bytes(ctx.fs, path, data)
    manifest = Manifest(stage=ctx.spec.name, key=ctx.key, kind="table", path=path,
                        sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=table.num_rows, schema=tag,
                        inputs={n: m.sha256 for n, m in ctx.inputs.items()},
                        config_hash=config_hash(ctx.spec.config_payload(ctx.config)))
    ctx.written.append((output, manifest))


def rollouts_table(ctx: StageContext, **kwargs) -> pa.Table:  # noqa: ANN003
    return pa.Table.from_pylist(h.rollout_rows(ctx.run_id, ctx.iteration, ctx.inputs["policy"].sha256, **kwargs))


# ---------------------------------------------------------------------------------------------------------
# Prompt sources and config


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("bad_json.jsonl", ["bad_json.jsonl line 3", "not valid JSON"]),
        ("bad_empty_inputs.jsonl", ["bad_empty_inputs.jsonl line 1", "test_cases.inputs"]),
        ("bad_unknown.jsonl", ["bad_unknown.jsonl line 4"]),
    ],
)
def test_bad_prompt_source_is_refused_and_the_run_is_untouched(run: RunLayout, source: str, named: list[str]) -> None:
    """Proves: pointing an existing run at a malformed JSONL line, or a prompt with no tests, or a row of no known
    format (`rlpipe resume --set data.train=...`) exits 2 naming the file, the line and the field, and leaves
    every file of the run, its config included, byte for byte as it was."""
    before = h.snapshot(Path(run.run_dir))
    result = h.run(h.rlpipe_command("resume", run.run_id, "--set", f"data.train={FIXTURES / source}"), run.root)
    refused(result, *named)
    unchanged(run, before)


def test_parquet_source_with_a_wrong_type_names_row_and_field(run: RunLayout, tmp_path: Path) -> None:
    """Proves: a Parquet prompt source whose `entry_point` column holds integers, and one whose second row has a
    null `test`, are refused naming the file, the row and the field; the run is untouched."""
    rows = [dict(p) for p in h.PROBLEMS]
    bad_type = tmp_path / "bad_type.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "entry_point": i} for i, r in enumerate(rows)]), bad_type)
    no_tests = tmp_path / "no_tests.parquet"
    pq.write_table(pa.Table.from_pylist([  # a mixed-format file: row 0 is a math row, row 1 has nothing to check
        {"messages": json.dumps([{"role": "user", "content": "1 + 1?"}]), "gt_answer": "2", "test": None},
        {"messages": json.dumps([{"role": "user", "content": "r"}]), "gt_answer": None, "test": None},
    ]), no_tests)
    before = h.snapshot(Path(run.run_dir))
    for source, named in [(bad_type, ["bad_type.parquet row 0", "'entry_point'"]),
                          (no_tests, ["no_tests.parquet row 1", "'test'"])]:
        result = h.run(h.rlpipe_command("resume", run.run_id, "--set", f"data.train={source}"), run.root)
        refused(result, *named)
    unchanged(run, before)


@pytest.mark.parametrize(("override", "field"), [("train.lrr=0.1", "train.lrr"), ("train.lr=fast", "train.lr"),
                                                 ("score", "score")])
def test_bad_config_override_names_the_field(run: RunLayout, override: str, field: str) -> None:
    """Proves: `rlpipe resume --set` with an unknown key, a value of the wrong type, or no value exits 2 naming
    the field, and the run's config.yaml and every output stay as they were."""
    before = h.snapshot(Path(run.run_dir))
    refused(h.run(h.rlpipe_command("resume", run.run_id, "--set", override), run.root), field)
    unchanged(run, before)


def test_hand_edited_config_with_a_wrong_type_stops_a_stage(run: RunLayout) -> None:
    """Proves: a run whose config.yaml was edited by hand to hold a wrong type makes a stage exit 2 naming the
    config file and the field, before it touches its outputs."""
    config = Path(run.config_path)
    config.write_text(config.read_text().replace("timeout_s: 5.0", "timeout_s: soon"))
    before = h.snapshot(Path(run.run_dir))
    refused(h.run(h.stage_command(run, "score"), run.root), str(config), "score.timeout_s")
    unchanged(run, before)


def test_run_id_with_path_separators_is_refused_everywhere(run: RunLayout, tmp_path: Path) -> None:
    """Proves: a run id with path separators is refused by `rlpipe run`, `rlpipe stage` and a stage process,
    naming the run id rule, even when a valid-looking run sits at the place it points to; nothing is written
    outside `<root>/runs/`."""
    outside = Path(run.root) / "outside"
    outside.mkdir()
    (outside / "config.yaml").write_text(Path(run.config_path).read_text().replace("run_id: drill", "run_id: x"))
    before = h.snapshot(Path(run.root))
    refused(h.run(h.rlpipe_command("run", "--run-id", "../outside"), run.root), "run_id")
    refused(h.run(h.rlpipe_command("stage", "prompts", "--run", "../outside"), run.root), "run_id")
    refused(h.run([h.PYTHON, "-m", "stages.prompts", "--root", run.root, "--run", "../outside"], run.root), "run_id")
    after = h.snapshot(Path(run.root))
    assert {k for k in after if after[k] != before.get(k)} == set()


def test_a_stage_that_finds_bad_input_keeps_its_previous_output_valid(run: RunLayout, tmp_path: Path) -> None:
    """Proves: when a finished stage is run again by hand (`rlpipe stage prompts`) and finds its source broken in
    the meantime, it exits 2 naming the file and line, and its previous table stays valid: the run still
    reads its prompts from the run's own table (the reason that table exists) and a resume redoes nothing."""
    from storage.run import read_run_config

    source = Path(read_run_config(run).data.train)
    good = source.read_text()
    source.write_text(good + '{"prompt": "broken",,}\n')  # the sources are shared with other drills: restored below
    try:
        before = h.snapshot(Path(run.run_dir))
        result = h.run(h.rlpipe_command("stage", "prompts", "--run", run.run_id), run.root)
    finally:
        source.write_text(good)
    refused(result, f"{source} line 3")
    unchanged(run, before)
    h.assert_run_done(run)


# ---------------------------------------------------------------------------------------------------------
# Pipeline tables and checkpoints


def test_table_with_an_old_schema_version_is_refused(run: RunLayout) -> None:
    """Proves: a rollouts table that carries another schema version (written by an older rlpipe, manifest and
    all) makes the score stage exit 2 naming the file and both versions; the old scores table is untouched."""

    def old_generate(ctx: StageContext) -> None:
        write_raw(ctx, "rollouts", rollouts_table(ctx), "rollouts/v0")  # same columns, older tag

    run_stage_at("generate", run, 0, old_generate)
    before = h.snapshot(Path(run.run_dir))
    refused(h.run(h.stage_command(run, "score"), run.root), run.table_path("rollouts", 0), "rollouts/v0",
            "rollouts/v3")
    unchanged(run, before, stale_manifest="iter=0000/scores.parquet.manifest.json")


def test_table_with_a_wrong_schema_is_refused(run: RunLayout) -> None:
    """Proves: a rollouts table without its `response_text` column, and one whose `num_tokens` are strings, make
    the score stage exit 2 naming the file and the column; the scores table is not rewritten."""
    for broken, column in [(lambda t: t.drop_columns(["response_text"]), "response_text"),
                           (lambda t: t.set_column(t.schema.get_field_index("num_tokens"), "num_tokens",
                                                   pa.array(["two"] * t.num_rows)), "num_tokens")]:
        def bad_generate(ctx: StageContext, broken=broken) -> None:  # noqa: ANN001
            write_raw(ctx, "rollouts", broken(rollouts_table(ctx)), "rollouts/v3", cast=False)

        run_stage_at("generate", run, 0, bad_generate)
        before = h.snapshot(Path(run.run_dir))
        refused(h.run(h.stage_command(run, "score"), run.root), run.table_path("rollouts", 0), column)
        unchanged(run, before, stale_manifest="iter=0000/scores.parquet.manifest.json")


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(run: RunLayout, reward: float) -> None:
    """Proves: a scores table with a NaN or infinite reward makes the advantage stage exit 2 naming the scores
    file, the field and the rollout; the batch table is not rewritten."""
    victim = {"prompt_id": h.TRAIN_IDS[1], "sample_idx": 2}

    def bad_score(ctx: StageContext) -> None:
        rows = h.table_rows(ctx.layout, "scores")
        for row in rows:
            if row["prompt_id"] == victim["prompt_id"] and row["sample_idx"] == victim["sample_idx"]:
                row["reward"] = reward
        # Past the contract check (which would refuse it at write time): a table from elsewhere.
        write_raw(ctx, "scores", pa.Table.from_pylist(rows, schema=TABLES["scores"].schema), "scores/v1")

    run_stage_at("score", run, 0, bad_score)
    before = h.snapshot(Path(run.run_dir))
    refused(h.run(h.stage_command(run, "advantage"), run.root), run.table_path("scores", 0), "reward",
            victim["prompt_id"], "'sample_idx': 2")
    unchanged(run, before, stale_manifest="iter=0000/batch.parquet.manifest.json")


def test_group_smaller_than_n_samples_is_refused(run: RunLayout) -> None:
    """Proves: rollouts (and their scores) where one prompt has 3 samples although `generate.n_samples` is 4 (a
    lost sample) make the advantage stage exit 2 (bad input) naming the input table, the prompt and n_samples,
    instead of computing advantages over a short group; the batch table is not rewritten."""
    short = {h.TRAIN_IDS[0]: h.N_SAMPLES, h.TRAIN_IDS[1]: h.N_SAMPLES - 1}

    def short_generate(ctx: StageContext) -> None:
        write_raw(ctx, "rollouts", rollouts_table(ctx, groups=short), "rollouts/v3")

    def short_score(ctx: StageContext) -> None:
        rows = [{**{k: r[k] for k in ROLLOUT_KEY}, "reward": float(r["sample_idx"] % 2 == 0), "passed": 1,
                 "total": 2, "status": "ok", "tests": "[]", "code": None, "sandbox_seconds": 0.0}
                for r in ctx.read_input("rollouts").to_pylist()]
        write_raw(ctx, "scores", pa.Table.from_pylist(rows, schema=TABLES["scores"].schema), "scores/v1")

    # Past the contract checks (which refuse short groups at write time): tables from elsewhere.
    run_stage_at("generate", run, 0, short_generate)
    run_stage_at("score", run, 0, short_score)
    before = h.snapshot(Path(run.run_dir))
    result = h.run(h.stage_command(run, "advantage"), run.root)
    assert run.table_path("rollouts", 0) in result.stderr.replace("\n", "") or \
        run.table_path("scores", 0) in result.stderr.replace("\n", ""), result.stderr[-2500:]
    refused(result, h.TRAIN_IDS[1], "n_samples")
    unchanged(run, before, stale_manifest="iter=0000/batch.parquet.manifest.json")


def test_checkpoint_missing_a_file_is_named(run: RunLayout) -> None:
    """Proves: a checkpoint directory that lost a file (its weights) makes the stage that reads it (evaluate)
    exit 2 naming the checkpoint and the missing file; the eval table is untouched."""
    weights = Path(run.checkpoint_dir(0)) / "model.safetensors"
    weights.unlink()
    before = h.snapshot(Path(run.run_dir))
    refused(h.run(h.standin_command(run, "evaluate"), run.root), run.checkpoint_dir(0), "model.safetensors")
    unchanged(run, before)
