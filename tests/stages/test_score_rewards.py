"""The score stage under score.rewards, on the drills' one-iteration run (stand-in model stages, the real prompts
and score stages): user-function terms are summed into the scores table by hand-computable weights, a function
that raises marks only its rows `error`, and the table passes its contract with the rewards' bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from storage.layout import manifest_path_for
from storage.manifest import read_manifest
from tests.reliability import helpers as h

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
