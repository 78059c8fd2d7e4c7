"""The sandbox's public records: what to score (ScoreJob) and what came out (ScoreResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "fail", "timeout", "error", "no_code")


@dataclass
class ScoreJob:
    response_text: str  # the model's full response (markdown); the code is its last complete ```python block
    reward_spec: dict[str, Any]  # {"kind": "code_tests" | "code_stdio" | "math", ...}

    def as_dict(self) -> dict[str, Any]:
        return {"response_text": self.response_text, "reward_spec": self.reward_spec}


@dataclass
class ScoreResult:
    reward: float
    passed: int
    total: int
    status: str  # ok | fail | timeout | error | no_code
    tests: list[dict[str, Any]] = field(default_factory=list)  # {"name", "passed", "status", "message"}
    code: str | None = None
    seconds: float = 0.0
    # One per score.rewards term that applied (rewards.py): {"name" (its short name), "value", "error"}.
    terms: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ScoreResult:
        return cls(**{key: values[key] for key in cls.__dataclass_fields__ if key in values})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
