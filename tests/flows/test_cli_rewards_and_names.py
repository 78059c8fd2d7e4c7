"""`rlpipe run` refuses, with exit code 2 and before anything is written: a TRL or verl key (naming rlpipe's
field), a reward function that does not import (naming the entry), and prompts that nothing in score.rewards
scores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def rlpipe(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLPIPE_ROOT": str(root), "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(root))


def test_a_trl_name_is_refused_with_rlpipes_field(tmp_path: Path) -> None:
    result = rlpipe(tmp_path, "run", "--set", "num_generations=8")
    assert result.returncode == 2
    assert "did you mean generate.n_samples?" in result.stdout.replace("\n", " ")
    assert not (tmp_path / "runs").exists()


def test_a_reward_function_that_does_not_import_is_refused_naming_the_entry(tmp_path: Path) -> None:
    (tmp_path / "grader.py").write_text("import no_such_package_xyz\n\ndef score(data_source, solution_str, "
                                        "ground_truth, extra_info): return 1.0\n")
    config = tmp_path / "job.yaml"
    config.write_text("score:\n  rewards:\n    - {fn: code_tests}\n    - {fn: grader.py:score, weight: 0.5}\n")
    result = rlpipe(tmp_path, "run", "--config", str(config), "--run-id", "r")
    text = result.stdout.replace("\n", "")
    assert result.returncode == 2
    assert "score.rewards[1] 'grader.py:score': ModuleNotFoundError: No module named 'no_such_package_xyz'" in text
    assert not (tmp_path / "runs").exists()


def test_prompts_nothing_scores_are_refused(tmp_path: Path) -> None:
    trl = f"{{path: {FIXTURES / 'trl_prompts.jsonl'}, format: trl}}"
    result = rlpipe(tmp_path, "run", "--set", f"data.train={trl}", "--run-id", "r")
    assert result.returncode == 2
    assert "prompts of kind custom have no reward: name a reward function for them in score.rewards" in (
        result.stdout.replace("\n", "")
    )
    assert not (tmp_path / "runs").exists()
