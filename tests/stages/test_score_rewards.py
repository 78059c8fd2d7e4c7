"""The score stage under score.rewards, on the drills' one-iteration run (stand-in model stages, the real prompts
and score stages): user-function terms are summed into the scores table by hand-computable weights, a function
that raises marks only its rows `error` and its failed share is in the manifest, and the table passes its
contract with the rewards' bounds. A function that fails on every call (raises, returns NaN or a string, or
runs past score.timeout_s) stops the stage with exit code 2 and one line naming it, its file and line, and the
first error; nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from flows.cli.status import reward_function_table
from flows.trackers import iteration_scalars
from reports.html import collect, read_config, render
from schemas.errors import InputError
from storage.catalog import Catalog
from storage.layout import RunLayout, manifest_path_for
from storage.manifest import read_manifest
from storage.run import Run
from tests.reliability import helpers as h
from tests.support.stages import run_stage_at

GRADER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if "x - 100" in solution_str and "f1" in solution_str:
        raise RuntimeError("cannot grade f1")
    return {"score": 0.5 if "return x +" in solution_str else 0.0}
'''


def test_score_stage_sums_weighted_terms_and_isolates_a_failing_function(tmp_path: Path) -> None:
    (tmp_path / "grader.py").write_text(GRADER)
    rewards = f"score.rewards=[{{fn: code_tests}}, {{fn: {tmp_path}/grader.py:compute_score, weight: 2}}]"
    layout = h.start(str(tmp_path / "root"), tmp_path / "sources", rewards)
    h.build_run(layout, upto="advantage")
    path = layout.table_path("scores", 0)
    scores = pq.read_table(path).to_pylist()
    assert len(scores) == 2 * h.N_SAMPLES
    for row in scores:
        good = row["sample_idx"] % 2 == 0  # stand-in generate: even samples answer right (2 of 2 tests)
        problem = h.INDEX[row["prompt_id"]]
        if good:
            assert (row["status"], row["reward"]) == ("ok", 1.0 + 2 * 0.5)
        elif problem == 1:  # the grader raises on f1's wrong answers: error, its term counts 0
            assert (row["status"], row["reward"]) == ("error", 0.0)
            assert json.loads(row["tests"])[-1]["message"].startswith("RuntimeError: cannot grade f1")
        else:
            assert (row["status"], row["reward"]) == ("fail", 0.0)
    manifest = read_manifest(layout.fs, manifest_path_for(path, "table"))
    assert manifest.metrics["status_counts"] == {"ok": 4, "fail": 2, "error": 2}
    # Per function: code_tests passes the 4 good samples (1.0) and fails the 4 bad ones (0.0); compute_score
    # answers 0.5 on the 4 good ones and 0.0 on f0's 2 bad ones, and raises on f1's 2 bad ones.
    grader = f"{tmp_path}/grader.py"
    assert manifest.metrics["reward_functions"] == {
        "code_tests": {"fn": "code_tests", "weight": 1.0, "calls": 8, "errors": 0, "error_frac": 0.0, "values": 8,
                       "mean": 0.5, "first_error": ""},
        "compute_score": {"fn": f"{grader}:compute_score", "weight": 2.0, "calls": 8, "errors": 2,
                          "error_frac": 0.25, "values": 6, "mean": 2.0 / 6,
                          "first_error": f"RuntimeError: cannot grade f1 ({grader}:4)"},
    }
    check_views_of_the_shares(layout, grader)


def check_views_of_the_shares(layout: RunLayout, grader: str) -> None:
    """`rlpipe status`, the catalog, the trackers' numbers and the report show compute_score's 2 failed calls of
    8 (25%), its mean 2/6 and its first error; code_tests' mean 0.5 and none failed."""
    first = f"RuntimeError: cannot grade f1 ({grader}:4)"
    console = Console(width=400, record=True)
    console.print(reward_function_table(Run.open(layout.root, layout.run_id)))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.count("│") == 7]
    assert rows == [["0", "code_tests", "8", "0.500", "0", ""],
                    ["0", "compute_score", "8", "0.333", "2 (25%)", first]]
    with Catalog(layout.root) as catalog:
        shares = catalog.rows("SELECT function, sum(errors) / sum(calls) AS share, avg(mean) AS mean "
                              "FROM reward_functions WHERE stage = 'score' GROUP BY function ORDER BY function")
        assert shares == [{"function": "code_tests", "share": 0.0, "mean": 0.5},
                          {"function": "compute_score", "share": 0.25, "mean": pytest.approx(2 / 6)}]
        data = collect(catalog, layout.run_id, read_config(layout))
    scalars = iteration_scalars(data, 0)
    assert {k: v for k, v in scalars.items() if k.startswith("reward/")} == {
        "reward/code_tests/mean": 0.5, "reward/code_tests/error_frac": 0.0,
        "reward/compute_score/mean": pytest.approx(2 / 6), "reward/compute_score/error_frac": 0.25}
    html = render(data)
    note = f"reward function compute_score failed on 2 of 8 calls in iteration 0; first: {first}"
    assert f"<p class='note'>{note}</p>" in html
    assert 'id="chart-reward-functions"' in html and "<td>compute_score</td><td class='num'>8</td>" in html


def start_with(tmp_path: Path, grader: str, *overrides: str) -> RunLayout:
    """The drill run up to its score stage, scored by `grader`'s compute_score alone."""
    (tmp_path / "grader.py").write_text(grader)
    layout = h.start(str(tmp_path / "root"), tmp_path / "sources",
                     f"score.rewards=[{{fn: {tmp_path}/grader.py:compute_score}}]", *overrides)
    h.build_run(layout, upto="score")
    return layout


def test_a_function_that_raises_on_every_call_stops_the_stage_with_exit_2(tmp_path: Path) -> None:
    layout = start_with(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                  "    raise KeyError('answer')\n")
    result = h.run(h.stage_command(layout, "score"), layout.root, timeout=300)
    grader = f"{tmp_path}/grader.py"
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2, lines[-20:]
    first = f"KeyError: 'answer' ({grader}:2)"
    assert f"  reward compute_score: no value over 8 calls, 8 failed (100%), first: {first}" in lines
    assert lines[-1] == (f"✗ score: reward function compute_score ({grader}:compute_score) failed on 8 of 8 calls "
                         f"(score.max_reward_error_fraction = 1); first: {first}")
    assert "Traceback" not in result.stdout + result.stderr
    assert not Path(layout.table_path("scores", 0)).exists()


@pytest.mark.parametrize(("body", "first_error"), [
    ("    return float('nan')", "returned a non-finite value nan ({grader}:1)"),
    ("    return 'high'", "returned str 'high', not a number ({grader}:1)"),
    ("    import time\n    time.sleep(30)", "no result within score.timeout_s = 0.5 s ({grader}:1)"),
])
def test_nan_a_string_and_a_timeout_on_every_call_stop_the_stage(tmp_path: Path, body: str, first_error: str) -> None:
    """In the test process (the exit code is the harness's for every InputError, above): the one-line cause
    names the user's file and the function's first line, never rlpipe's own file."""
    grader = f"{tmp_path}/grader.py"
    layout = start_with(tmp_path, f"def compute_score(data_source, solution_str, ground_truth, extra_info):\n{body}\n",
                        "score.timeout_s=0.5")
    with pytest.raises(InputError) as stopped:
        run_stage_at("score", layout, 0, h.real_stage("score"))
    assert str(stopped.value) == (f"reward function compute_score ({grader}:compute_score) failed on 8 of 8 calls "
                                  f"(score.max_reward_error_fraction = 1); first: {first_error.format(grader=grader)}")
    assert not Path(layout.table_path("scores", 0)).exists()
