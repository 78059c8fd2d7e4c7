"""docs/your-own-job.md works as written: its files, built from the page, pass the checks `rlpipe run` makes before
its first stage, and its reward mix scores responses as the page says (in the real sandbox)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli.commands import _validate_data
from schemas.config import load_config
from stages.data.sources import load_splits
from stages.sandbox import Sandbox, ScoreJob, rewards

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-own-job.md"


def page_files() -> dict[str, str]:
    """name -> text of each block the page marks `<!-- file: NAME -->`."""
    blocks = re.findall(r"<!-- file: (\S+) -->\n(`{3,})\w*\n(.*?\n)\2\n", PAGE.read_text(), re.S)
    return {name: text for name, _, text in blocks}


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    files = page_files()
    assert sorted(files) == ["make_data.py", "my-job.yaml", "rewards/concise.py"]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    made = subprocess.run([sys.executable, "make_data.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.split() == ["data/train.parquet:", "32", "rows", "data/test.parquet:", "16", "rows"]
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where `rlpipe run` starts
    return tmp_path


def test_the_worked_example_passes_the_checks_before_the_first_stage(job_dir: Path) -> None:
    config = load_config(job_dir / "my-job.yaml")
    _validate_data(config)  # rows, reward entries (imported), tracker libraries
    train, test = load_splits(config.data)
    assert (train.num_rows, test.num_rows) == (32, 16)
    kinds = {json.loads(spec)["kind"] for spec in train.column("reward_spec").to_pylist()}
    assert kinds == {"code_stdio"}
    held_out = {json.loads(m)["extra_info"]["kind"] if "extra_info" in json.loads(m) else None
                for m in test.column("metadata").to_pylist()}
    assert held_out == {"minimum", "distance"}


def test_the_reward_mix_scores_as_the_page_says(job_dir: Path) -> None:
    """code_stdio (fraction of the 4 hidden cases) + 0.1 x concise (a response of at most 400 characters)."""
    config = load_config(job_dir / "my-job.yaml")
    _, test = load_splits(config.data)
    prompt = next(p for p in test.to_pylist() if "smaller one" in p["messages"])
    correct = "```python\na, b = map(int, input().split())\nprint(min(a, b))\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(max(a, b))\n```"
    responses = [correct, correct + "\n" + "This program reads two numbers and prints the smaller. " * 8, wrong]
    jobs = [ScoreJob(response_text=text, reward_spec=json.loads(prompt["reward_spec"])) for text in responses]
    rows = [rewards.RewardInput.of_prompt(prompt)] * len(jobs)
    truth = json.loads(json.loads(prompt["metadata"])["ground_truth"])
    wrong_passes = sum(int(out) == max(map(int, case.split())) for case, out in zip(truth["inputs"], truth["outputs"],
                                                                                    strict=True))
    with Sandbox.from_config(config.score) as sandbox:
        results = rewards.score(sandbox, config.score, jobs, rows)
    assert [r.reward for r in results] == pytest.approx([1.1, 1.0, wrong_passes / 4 + 0.1])
