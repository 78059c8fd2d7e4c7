"""vLLM's own log lines go to the stage's log file, not the console, unless `--verbose`.

`route_vllm_logs` is checked without an engine: a line logged under the `vllm` logger after it lands in the file
and not on the console, and the logging config it names in VLLM_LOGGING_CONFIG_PATH (what vLLM applies when it
starts an engine, here or in an engine process of its own) sends lines to the same file. `rlpipe run` and
`resume` take `--verbose`, which sets RLPIPE_VERBOSE for the stages instead of routing anything.
"""

from __future__ import annotations

import json
import logging
import logging.config
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.cli.commands import _library_log_environment, build_parser
from schemas.config import load_config
from stages.generation.vllm_backend import route_vllm_logs
from storage.run import Run
from tests.support.stages import start_run


@pytest.fixture
def vllm_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The `vllm` logger and the variables vLLM reads, put back as they were after the test."""
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "")
    logger = logging.getLogger("vllm")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    console = logging.StreamHandler()  # as vLLM's default config: a console handler
    logger.handlers = [console]
    yield logger
    for handler in logger.handlers:
        handler.close()
    logger.handlers, logger.level, logger.propagate = saved


def test_vllm_lines_go_to_the_stage_log_not_the_console(tmp_path: Path, vllm_logger: logging.Logger,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    log_path = tmp_path / "logs" / "generate@iter=0000.log"
    route_vllm_logs(log_path)
    assert not log_path.exists()  # created at the first line: a stage that starts no engine leaves no file
    logging.getLogger("vllm.v1.engine.core").info("KV cache of 1.0 GiB")
    captured = capsys.readouterr()
    assert "KV cache" not in captured.out + captured.err
    assert log_path.read_text().splitlines()[-1].endswith("KV cache of 1.0 GiB")


def test_the_logging_config_vllm_applies_writes_to_the_same_file(tmp_path: Path, vllm_logger: logging.Logger,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import os

    log_path = tmp_path / "logs" / "evaluate@base.log"
    route_vllm_logs(log_path)
    config_path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    logging.config.dictConfig(json.loads(config_path.read_text()))  # what vLLM does when an engine starts
    logging.getLogger("vllm.worker").warning("using a slow tokenizer")
    logging.getLogger("vllm.worker").debug("below INFO: left out")
    captured = capsys.readouterr()
    assert "slow tokenizer" not in captured.out + captured.err
    assert [line.split(" ", 1)[0] for line in log_path.read_text().splitlines()] == ["WARNING"]


def test_run_and_resume_take_verbose(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["run", "--verbose"]).verbose and not parser.parse_args(["run"]).verbose
    assert parser.parse_args(["resume", "r", "--verbose"]).verbose
    config = load_config(None, ["run_id=v"])
    run = Run(start_run(config, str(tmp_path)), config)
    assert _library_log_environment(run, verbose=True) == {"RLPIPE_VERBOSE": "1"}
    quiet = _library_log_environment(run, verbose=False)
    handler = json.loads(Path(quiet["VLLM_LOGGING_CONFIG_PATH"]).read_text())["handlers"]["vllm"]
    assert handler["filename"] == str(tmp_path / "runs/v/logs/stage-server.log")
