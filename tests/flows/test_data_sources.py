"""Results per verl `data_source` in `rlpipe status`, the HTML report and the trackers, checked against figures
computed here from the run's Parquet files with pyarrow (not the catalog's SQL, not the status code).

A synthetic run whose prompts carry two data_sources (and a third of rows without one, grouped by their dataset,
as verl's reward functions and the catalog see them) shows training reward per source, held-out pass@1 and
greedy accuracy per source beside the per-dataset row, and logs `train/<source>/...` and `eval/<source>/...`. A
run with one source shows and logs nothing new; neither does one with one source per file (the per-dataset rows
already say it).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from flows.cli.status import status_table
from flows.trackers import iteration_scalars
from reports.html import collect, render
from schemas.config import load_config
from schemas.tables import BASELINE_SAMPLE_IDX
from stages.evaluation.metrics import splits_by_data_source
from storage.catalog import Catalog
from storage.layout import RunLayout, StageInstance
from storage.run import Run, read_run_config
from tests.support.synthetic_runs import prompt_id_for, write_synthetic_run

SOURCES = ("openai/gsm8k", "lighteval/MATH", None)  # prompt i's data_source: i % 3; None: a row without one
SEED = 5


def source_of(split: str, count: int) -> dict[str, str]:
    return {prompt_id_for(SEED, i, split): SOURCES[i % 3] or "synthetic" for i in range(count)}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("mixed")
    layout = write_synthetic_run(str(root), run_id="m", iterations=2, seed=SEED, test_prompts=6, data_sources=SOURCES)
    return Run(layout, read_run_config(layout))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("single")
    layout = write_synthetic_run(str(root), run_id="s", iterations=2, seed=SEED, test_prompts=6)
    return Run(layout, read_run_config(layout))


def training_by_source(run: Run) -> dict[tuple[int, str], tuple[int, float, float]]:
    """(iteration, source) -> (samples, mean reward, solve rate) from each iteration's scores.parquet."""
    groups: dict[tuple[int, str], list[dict]] = {}
    sources = source_of("train", 8)
    for path in sorted(Path(run.layout.run_dir).glob("iter=*/scores.parquet")):
        for row in pq.read_table(path).to_pylist():
            if row["sample_idx"] != BASELINE_SAMPLE_IDX:
                groups.setdefault((row["iteration"], sources[row["prompt_id"]]), []).append(row)
    return {key: (len(rows), sum(r["reward"] for r in rows) / len(rows),
                  sum(r["status"] == "ok" for r in rows) / len(rows)) for key, rows in groups.items()}


def held_out_by_source(run: Run) -> dict[tuple[int, str], tuple[float, float]]:
    """(iteration, source) -> (pass@1: the mean over problems of correct/sampled, greedy accuracy) per eval table."""
    result = {}
    sources = source_of("test", 6)
    for path in [Path(run.layout.run_dir) / "base/eval.parquet",
                 *sorted(Path(run.layout.run_dir).glob("iter=*/eval.parquet"))]:
        rows = pq.read_table(path).to_pylist()
        for source in set(sources.values()):
            mine = [r for r in rows if sources[r["prompt_id"]] == source]
            problems = {r["prompt_id"] for r in mine}
            pass1 = sum(sum(r["correct"] for r in mine if r["prompt_id"] == p and r["mode"] == "sampled")
                        / sum(r["prompt_id"] == p and r["mode"] == "sampled" for r in mine) for p in problems)
            greedy = [r["correct"] for r in mine if r["mode"] == "greedy"]
            result[(rows[0]["iteration"], source)] = (pass1 / len(problems), sum(greedy) / len(greedy))
    return result


def assert_close(got: dict, expected: dict, tolerance: float = 1e-9) -> None:
    """The same keys, each value (a tuple of numbers) within `tolerance` (a printed table rounds to 3 digits)."""
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, abs=tolerance), key


def status_text(run: Run, monkeypatch: pytest.MonkeyPatch) -> str:
    """`rlpipe status`'s text; a synthetic run's manifests carry made-up stage keys, so each stage whose outputs
    all have manifests counts as done here (only the keys are not checked); advantage's synthetic manifest has
    no group counts, so it reads missing."""
    import flows.cli.status
    from stages.registry import StageState, outputs_of
    from storage.manifest import read_manifest

    def present(run: Run, target: StageInstance) -> StageState:
        manifests = [read_manifest(run.fs, output.manifest_path(run.layout)) for output in outputs_of(target)]
        done = all(m is not None for m in manifests) and target.stage != "advantage"
        return StageState(done, "done" if done else "missing", [m for m in manifests if m is not None])

    monkeypatch.setattr(flows.cli.status, "stage_state", present)
    console = Console(width=250, record=True)
    console.print(status_table(run))
    return console.export_text()


def table_rows(text: str, title: str) -> list[list[str]]:
    """The cells of the rich table under `title` in `text`."""
    lines = text.split(title, 1)[1].splitlines()[1:]
    rows = []
    for line in lines:
        if line.startswith(("┃", "│")) and "│" in line:
            rows.append([cell.strip() for cell in line.split("│")[1:-1]])
        elif rows and not line.startswith(("┃", "│", "┡", "┏", "└", "┗", "├", "━", "─")):
            break
    return [row for row in rows if row and row[0]]


def test_status_shows_training_and_held_out_results_per_data_source(mixed: Run,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    text = status_text(mixed, monkeypatch)
    expected = training_by_source(mixed)
    assert_close({(int(r[0]), r[1]): (int(r[2]), float(r[3]), float(r[4]))
                  for r in table_rows(text, "training reward by data_source")}, expected, 5e-4)
    assert {source for _, source in expected} == {"openai/gsm8k", "lighteval/MATH", "synthetic"}
    held = table_rows(text, "held-out evaluation")
    by_source = {(-1 if r[0] == "base" else int(r[0].split()[1]), r[1].removesuffix(" (data_source)")):
                 (float(r[4].split()[0]), float(r[3])) for r in held if r[1].endswith("(data_source)")}
    assert_close(by_source, held_out_by_source(mixed), 5e-4)
    assert [r[2] for r in held if r[1] == "openai/gsm8k (data_source)"] == ["2", "2", "2"]  # test prompts 0 and 3
    gains = table_rows(text, "gain over the base model")
    assert {r[1] for r in gains} == {"synthetic", "openai/gsm8k (data_source)", "lighteval/MATH (data_source)",
                                     "synthetic (data_source)"}


def test_report_and_trackers_carry_results_per_data_source(mixed: Run) -> None:
    with Catalog(mixed.root, ["m"]) as catalog:
        data = collect(catalog, "m", mixed.config)
    expected = training_by_source(mixed)
    assert_close({(r["iteration"], r["data_source"]): (r["rows"], r["mean_reward"], r["solve_rate"])
                  for r in data.reward_by_source}, expected)
    held = held_out_by_source(mixed)
    assert_close({(r["iteration"], r["data_source"]): (r["pass@1"], r["greedy"])
                  for r in data.evaluation if "data_source" in r}, held)
    scalars = iteration_scalars(data, 1)
    assert scalars["eval/openai_gsm8k/pass_at_1"] == pytest.approx(held[(1, "openai/gsm8k")][0])
    assert scalars["eval/lighteval_MATH/greedy_accuracy"] == pytest.approx(held[(1, "lighteval/MATH")][1])
    assert "eval/openai_gsm8k/pass_at_1_ci_low" in scalars  # the evaluate stage's interval for the source
    assert scalars["train/openai_gsm8k/reward_mean"] == pytest.approx(expected[(1, "openai/gsm8k")][1])
    assert iteration_scalars(data, 0)["eval_base/lighteval_MATH/pass_at_1"] == pytest.approx(
        held[(-1, "lighteval/MATH")][0])
    html = render(data)
    assert "Training reward by data_source" in html and "openai/gsm8k (data_source)" in html


def test_a_run_with_one_source_shows_and_logs_nothing_new(single: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    text = status_text(single, monkeypatch)
    assert "data_source" not in text and "held-out evaluation" in text
    with Catalog(single.root, ["s"]) as catalog:
        data = collect(catalog, "s", single.config)
    assert data.reward_by_source == [] and all("data_source" not in r for r in data.evaluation)
    assert {name.split("/")[1] for name in iteration_scalars(data, 1) if name.startswith("eval")} == {"synthetic"}
    assert "data_source" not in render(data)


def prompt(i: int, dataset: str, source: str | None) -> dict:
    return {"prompt_id": f"p{i}", "dataset": dataset, "metadata": "{}" if source is None else
            f'{{"data_source": "{source}"}}'}


@pytest.mark.parametrize(("prompts", "split"), [
    ([prompt(0, "pytasks", None), prompt(1, "humaneval", None)], False),  # a source per file: the datasets
    ([prompt(0, "test", "openai/gsm8k"), prompt(1, "test", "openai/gsm8k")], False),  # one source
    ([prompt(0, "a", "openai/gsm8k"), prompt(1, "b", "lighteval/MATH")], False),  # one per file, other names
    ([prompt(0, "test", "openai/gsm8k"), prompt(1, "test", "lighteval/MATH")], True),  # a file mixing two
    ([prompt(0, "a", "openai/gsm8k"), prompt(1, "b", "openai/gsm8k"), prompt(2, "b", None)], True),
])
def test_results_are_split_by_data_source_only_where_that_differs_from_datasets(prompts: list[dict],
                                                                               split: bool) -> None:
    sources = splits_by_data_source(prompts)
    assert (sources is not None) is split
    if split:
        assert sources == {p["prompt_id"]: p["dataset"] if p["metadata"] == "{}" else p["metadata"].split('"')[3]
                           for p in prompts}


def test_a_status_of_a_run_with_no_prompts_yet_has_no_source_table(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.stages import start_run

    config = load_config(None, ["run_id=e"])
    layout: RunLayout = start_run(config, str(tmp_path))
    assert "data_source" not in status_text(Run(layout, config), monkeypatch)
