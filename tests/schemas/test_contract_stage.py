"""Data contracts on the stage path: a real stage whose output breaks its contract fails, and nothing is lost.

tests/schemas/test_contracts.py checks the suites; these drills check what the harness (`main` ->
`run_stage` -> `StageContext.write_table`) does with a violation on a real one-iteration run: exit code 1
(its own output is wrong, not bad input) with a message naming the expectation, its rule, the bad-row count
and sample rows; the bad table kept as `<table>.rejected.parquet` with exactly the rows written; nothing under
the output's name and no manifest (the old output's bytes stay, its manifest is gone: a stage run again is
not done until it finishes again); the validation JSON and GX page beside the output; and a rerun with good
output succeeds and removes the rejected table.

Bad outputs come from real stage code where a stage runs without a model (score and advantage, the table
corrupted on its way into `ctx.write_table`), else from the drills' model-free generate stand-in. Stages run
through `stages.harness.main` in this process (a subprocess would pay seconds of imports); one case reruns on
a changed config (`--if-needed`, as a resume does), the others by hand, the two ways a finished stage reruns.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from rich.console import Console

import stages.harness as common
from schemas.contracts import rejected_path, validation_path
from stages.harness import StageContext
from stages.registry import instance, stage_state
from storage.layout import RunLayout
from storage.manifest import Manifest, read_manifest, sha256_file
from storage.run import Run, read_run_config
from tests.reliability import helpers as h

Work = Callable[[StageContext], None]
TIMING = ("sandbox_seconds",)  # score's measured time per program: the one column a rerun does not reproduce


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """The drills' one-iteration run, finished up to and including `advantage` (train and evaluate need none)."""
    base = tmp_path_factory.mktemp("contract-stage")
    layout = h.start(str(base / "root"), base / "sources")
    h.build_run(layout, upto="train")
    return layout


@pytest.fixture
def run(finished_run: RunLayout, tmp_path: Path) -> RunLayout:
    return h.clone_run(finished_run, tmp_path / "root")


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What the stage prints, unwrapped (the harness's console wraps at the terminal's width otherwise)."""
    out = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=out, width=100_000, color_system=None))
    yield out


def corrupting(work: Work, table_name: str, corrupt: Callable[[pa.Table], pa.Table]) -> Work:
    """`work` (a stage's run(ctx)) with its `table_name` table changed by `corrupt` on its way to
    `ctx.write_table`: the harness, the contract and everything after them are the real ones."""

    def run(ctx: StageContext) -> None:
        write = ctx.write_table

        def write_corrupted(name: str, table: pa.Table, metrics: dict | None = None) -> Manifest:
            return write(name, corrupt(table) if name == table_name else table, metrics)

        ctx.write_table = write_corrupted  # type: ignore[method-assign] - this context only
        work(ctx)

    return run


def set_cell(table: pa.Table, column: str, row: int, value: object) -> pa.Table:
    index = table.schema.get_field_index(column)
    values = table.column(column).to_pylist()
    values[row] = value
    return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))


def positive_logprob(table: pa.Table) -> pa.Table:
    return set_cell(table, "response_logprobs", 1, [0.5, -0.25])


def duplicate_first_row(table: pa.Table) -> pa.Table:
    return pa.concat_tables([table, table.slice(0, 1)])


def nan_advantage(table: pa.Table) -> pa.Table:
    return set_cell(table, "advantage", 2, math.nan)


@dataclass(frozen=True)
class Case:
    stage: str
    table: str
    work: Work  # the stage's good work: the real stage, or the drills' stand-in for a model stage
    corrupt: Callable[[pa.Table], pa.Table]  # what breaks the contract in the table it writes
    expectation: str  # GX expectation type and column, as the message names it
    rule: str
    bad_rows: int
    sample: dict  # a column -> value that the failure's first sample row shows

    @property
    def bad(self) -> Work:
        return corrupting(self.work, self.table, self.corrupt)


CASES = {
    "generate: positive logprob": Case(
        "generate", "rollouts", h.standin_generate, positive_logprob,
        "expect_column_values_to_be_between(_logprob_max)", "every response logprob <= 0", 1,
        {"sample_idx": 1, "_logprob_max": 0.5},
    ),
    "score: duplicate rollout key": Case(
        "score", "scores", h.real_stage("score"), duplicate_first_row,
        "expect_compound_columns_to_be_unique(run_id, iteration, round, prompt_id, sample_idx)",
        "one row per key (run_id, iteration, round, prompt_id, sample_idx)", 2, {"sample_idx": 0},
    ),
    "advantage: NaN advantage": Case(
        "advantage", "batch", h.real_stage("advantage"), nan_advantage,
        "expect_column_values_to_be_between(advantage)", "advantage is finite (not NaN or inf)", 1,
        {"sample_idx": 2, "advantage": "nan"},
    ),
}


def rows_of(table: pa.Table, leave_out: tuple[str, ...] = ()) -> str:
    """A table's rows as JSON (NaN written as NaN, so that equal tables with a NaN compare equal)."""
    columns = [c for c in table.column_names if c not in leave_out]
    return json.dumps(table.select(columns).to_pylist(), default=str)


def change_config(run: RunLayout, section: str, field: str, value: object) -> None:
    """Edit the run's config.yaml as a person would, which changes the stage key of `section`'s stage."""
    path = Path(run.config_path)
    config = yaml.safe_load(path.read_text())
    assert config[section][field] != value
    config[section][field] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def page_text(page: str) -> str:
    """The words of an HTML page, tags and runs of white space collapsed."""
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", page).split()))


def argv(run: RunLayout, *extra: str) -> list[str]:
    return ["--root", run.root, "--run", run.run_id, "--iter", "0", *extra]


@pytest.mark.parametrize("name", list(CASES))
def test_output_that_breaks_its_contract_fails_the_stage_and_is_kept_beside(
    name: str, run: RunLayout, console: io.StringIO
) -> None:
    """Proves: a finished stage run again whose output breaks its table's contract exits 1 naming the expectation,
    its rule, the bad-row count and a sample row; the table it wrote is kept, row for row, as
    `<table>.rejected.parquet`; the output path still holds the previous valid table's bytes and no manifest
    vouches for anything, so the stage and its readers are not done and a resume runs it again; the failing
    validation is stored as JSON and as GX's HTML page. Then the same stage with good output succeeds, its
    manifest vouches for the new table, and the rejected table is gone."""
    case = CASES[name]
    output = run.table_path(case.table, 0)
    manifest_path = output + ".manifest.json"
    before = read_manifest(run.fs, manifest_path)
    assert before is not None and sha256_file(run.fs, output) == before.sha256
    assert json.loads(Path(validation_path(output)).read_text())["success"] is True  # the valid run's record

    if case.stage == "generate":  # rerun because the config changed: what a resume does (`--if-needed`)
        assert common.main("generate", case.bad, argv(run, "--if-needed")) == 0  # done already: not rerun
        assert read_manifest(run.fs, manifest_path) == before
        change_config(run, "generate", "temperature", 0.5)
        code = common.main(case.stage, case.bad, argv(run, "--if-needed"))
    else:  # rerun by hand: `rlpipe stage <stage>` on a finished stage
        code = common.main(case.stage, case.bad, argv(run))
    message = " ".join(console.getvalue().split())
    assert code == 1, message

    # The failure is named: expectation, rule, bad rows, a sample row, and where the table was kept.
    rejected = rejected_path(output)
    assert f"✗ {case.stage}: {output}: contract {case.table}/v" in message
    assert f"{case.expectation} — {case.rule}: {case.bad_rows} bad row" in message
    assert f"(the table is kept at {rejected}, not as the output)" in message
    assert "e.g. {" in message and all(f'"{k}": {json.dumps(v)}' in message for k, v in case.sample.items()), message

    # The bad table is kept beside, exactly as written; the output is the previous one; no manifest.
    kept = pq.read_table(rejected)
    previous = pq.read_table(output)
    assert sha256_file(run.fs, output) == before.sha256  # not a byte of the bad table under the output's name
    # The stages are deterministic but for score's timing column: the kept table is the valid one, corrupted.
    assert rows_of(kept, TIMING) == rows_of(case.corrupt(previous), TIMING)
    assert read_manifest(run.fs, manifest_path) is None and not Path(manifest_path).exists()
    assert h.temporary_files(Path(run.run_dir)) == []
    config = read_run_config(run)
    run.fs.invalidate_cache()
    assert stage_state(Run(run, config), instance(case.stage, 0)).reason == "missing"
    downstream = {"generate": "score", "score": "advantage", "advantage": "train"}[case.stage]
    assert not stage_state(Run(run, config), instance(downstream, 0)).done

    # The validation result is stored with the run: JSON (the failure and its sample rows) and GX's HTML.
    record = json.loads(Path(validation_path(output)).read_text())
    assert record["success"] is False and record["rows"] == kept.num_rows
    failures = {f"{f['expectation']}({f['column']})": f for f in record["failures"]}
    failure = failures[case.expectation]
    assert failure["rule"] == case.rule and failure["unexpected_count"] == case.bad_rows
    assert all(failure["sample_rows"][0][k] == v for k, v in case.sample.items()), failure["sample_rows"]
    assert record["gx_result"]["success"] is False
    page = Path(validation_path(output, "html")).read_text()
    text = page_text(page)
    assert "<html" in page[:200].lower() and f"Expectation Suite: {record['schema']}" in text
    assert "Status: Failed" in text and f"Unsuccessful Expectations {len(record['failures'])} " in text

    # Good output again: the stage succeeds, vouches for the new table, and the rejected table goes away.
    console.seek(0)
    console.truncate()
    assert common.main(case.stage, case.work, argv(run)) == 0, console.getvalue()
    after = read_manifest(run.fs, manifest_path)
    assert after is not None and after.sha256 == sha256_file(run.fs, output) and after.rows == previous.num_rows
    assert not Path(rejected).exists()
    assert json.loads(Path(validation_path(output)).read_text())["success"] is True
