"""A run's failure record, `runs/<run_id>/failed.json`: which stage instance failed last, how, and why.

A failed stage leaves no manifest, and its message went to a terminal or a worker's log: nothing durable said
that the run stopped, where, or why. So the stage process writes this record when it fails (its exit code and
one-line reason; stages/harness.py), the driver writes it when a stage died without writing one (killed by a
signal; flows/runner/process.py), and a later success of the same stage instance removes it. One record per
run, the latest failure: a run stops at its first failed stage, so that is the one to fix. `rlpipe status` and
the reports read it (a run with a record is marked failed, naming the stage and the reason).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from storage.fs import atomic_write_bytes, join
from storage.layout import RunLayout, StageInstance


@dataclass(frozen=True)
class StageFailure:
    label: str  # the stage instance, as logs name it: `train iter=2`
    stage: str
    iteration: int
    round_idx: int
    exit_code: int
    reason: str
    at: str  # UTC, ISO 8601

    def describe(self) -> str:
        return f"failed at {self.label} (exit code {self.exit_code}): {self.reason}"


def failure_path(layout: RunLayout) -> str:
    return join(layout.run_dir, "failed.json")


def record_failure(layout: RunLayout, target: StageInstance, exit_code: int, reason: str) -> StageFailure:
    failure = StageFailure(target.label, target.stage, target.iteration, target.round_idx, exit_code,
                           " ".join(reason.split()) or f"exit code {exit_code}", datetime.now(UTC).isoformat())
    atomic_write_bytes(layout.fs, failure_path(layout), json.dumps(asdict(failure), indent=1).encode())
    return failure


def read_failure(layout: RunLayout) -> StageFailure | None:
    """The run's failure record, or None when its last stage attempts succeeded (or the record is unreadable)."""
    try:
        return StageFailure(**json.loads(layout.fs.cat_file(failure_path(layout))))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # written by another version, or damaged: not a failure to show
        return None


def clear_failure(layout: RunLayout, target: StageInstance) -> None:
    """Remove the record when it names `target` (which has now succeeded); another instance's stays."""
    failure = read_failure(layout)
    if failure is not None and failure.label == target.label:
        layout.fs.rm_file(failure_path(layout))
