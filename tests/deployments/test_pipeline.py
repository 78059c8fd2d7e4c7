"""The `loop` deployment starts a run from a config file given as a parameter, as `rlpipe run --config` does."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.pipeline import start_from_config
from flows.runner.process import next_iteration
from schemas.config import ConfigError
from storage.run import read_run_config

CONFIG = Path(__file__).with_name("tiny.yaml")


def test_a_run_starts_from_a_config_path_with_overrides(tmp_path: Path) -> None:
    run = start_from_config(str(CONFIG), str(tmp_path), "exp1", 3)
    config = read_run_config(run.layout)
    assert (run.run_id, config.iterations, config.generate.backend) == ("exp1", 3, "hf")
    assert next_iteration(run) == 0  # nothing has run yet
    # The same config again is the same run; another one under the same id is refused, naming the way out.
    assert start_from_config(str(CONFIG), str(tmp_path), "exp1", 3) == run
    with pytest.raises(ConfigError, match="rlpipe resume exp1"):
        start_from_config(str(CONFIG), str(tmp_path), "exp1", 4)


def test_root_comes_from_the_parameter_then_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_ROOT", str(tmp_path / "env-root"))
    layout = start_from_config(str(CONFIG), None, None, None).layout
    assert layout.root == str(tmp_path / "env-root") and layout.run_id == "tiny"
