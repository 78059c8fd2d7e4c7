"""One warm sandbox shared by the tests that score through the local backend (starting workers costs
about a second each on this 2-core machine). A secret is put in the environment before it starts, so
the attack tests can check that no job ever sees it.

Where the machine gives no isolation that contains the attacks (no root, no working bubblewrap), start must
be refused (the attack programs include kill(-1) as the job's uid, which in `minimal` mode is the user
running the tests): that is asserted, and every test using the shared sandbox is skipped with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox
from stages.sandbox.sandbox import IsolationRefused

SECRET = "rlpipe-test-secret-6f1d2b"


@pytest.fixture(scope="session")
def sandbox_config() -> ScoreConfig:
    return ScoreConfig(workers=2, timeout_s=2.0, memory_mb=512, max_processes=16, output_limit_kb=64, scratch_mb=16)


@pytest.fixture(scope="session")
def sandbox(sandbox_config: ScoreConfig) -> Iterator[Sandbox]:
    os.environ["RLPIPE_SANDBOX_TEST_SECRET"] = SECRET
    try:
        started = Sandbox.from_config(sandbox_config).start()
    except IsolationRefused as refusal:
        assert "score.isolation=minimal" in str(refusal)  # refused, and the setting that would allow it named
        pytest.skip(f"no isolation that contains the attack programs on this machine: {refusal}")
    with started:
        yield started
