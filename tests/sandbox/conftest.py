"""One warm sandbox shared by the tests that score through the local backend (starting workers costs
about a second each on this 2-core machine). A secret is put in the environment before it starts, so
the attack tests can check that no job ever sees it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox

SECRET = "rlpipe-test-secret-6f1d2b"


@pytest.fixture(scope="session")
def sandbox_config() -> ScoreConfig:
    return ScoreConfig(workers=2, timeout_s=2.0, memory_mb=512, max_processes=16, output_limit_kb=64)


@pytest.fixture(scope="session")
def sandbox(sandbox_config: ScoreConfig) -> Iterator[Sandbox]:
    os.environ["RLPIPE_SANDBOX_TEST_SECRET"] = SECRET
    with Sandbox.from_config(sandbox_config) as started:
        yield started
