"""Scratch folders for module-scoped fixtures, removed when their module ends.

pytest keeps every `tmp_path_factory` folder until the session ends, and a few of this suite's fixtures hold
real checkpoints (540 MB each); CI's disk is shared, so the suite keeps at most one module's worth at a time.
Function-scoped `tmp_path` folders of passing tests go at teardown (`tmp_path_retention_policy = "failed"`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def scratch_dir(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    path = factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
