"""Progress on a pipe: plain lines now and then and one at the end, with the figures the bar would show."""

from __future__ import annotations

import pytest

import storage.progress
from storage.progress import progress_bar


def test_piped_progress_prints_a_line_per_interval_and_one_at_the_end(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage.progress, "PIPED_INTERVAL_S", 0.0)  # every advance is past the interval
    with progress_bar("generate", 5) as advance:
        advance(2, "40 tok, 10 tok/s")
        advance()
        advance(2)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["generate: 2/5 0:00:00 40 tok, 10 tok/s", "generate: 3/5 0:00:00 40 tok, 10 tok/s",
                     "generate: 5/5 0:00:00 40 tok, 10 tok/s", "generate: 5/5 0:00:00 40 tok, 10 tok/s"]


def test_piped_progress_within_the_interval_prints_only_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar("score", 3) as advance:
        for _ in range(3):
            advance()
    assert capsys.readouterr().out == "score: 3/3 0:00:00\n"


def test_work_that_fails_prints_no_final_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError), progress_bar("train", 4) as advance:
        advance()
        raise RuntimeError("stage failed")
    assert capsys.readouterr().out == ""
