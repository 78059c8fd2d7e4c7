"""The sandbox works wherever the project is checked out, /tmp included.

A job's /tmp is its own (a fresh tmpfs in native mode, the job directory in bubblewrap), which hides a
checkout under /tmp; and the job's uid may not be able to read the project at all. A job started by exec
(the interpreter probe, and every bubblewrap job) therefore runs a read-only copy of the runner placed in
its own directory. Here a copy of the project under /tmp scores a right and a wrong answer in every
isolation mode this machine has, from a fresh interpreter whose working directory is that copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.sandbox.isolation import _probe_native

REPO = Path(__file__).resolve().parents[2]

SCORE = """
import json, sys
from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob
test = "def check(candidate):\\n    assert candidate(1, 2) == 3\\n"
spec = {"kind": "code_tests", "entry_point": "add", "test": test}
jobs = [ScoreJob(f"```python\\ndef add(a, b):\\n    return {body}\\n```", spec) for body in ("a + b", "a - b")]
# minimal mode run by a user (not root) has no separate uid: allowed here, the point is the checkout's place
allowed = [name for name in ScoreConfig().require if name != "separate_uid"]
with Sandbox.from_config(ScoreConfig(workers=1, isolation=sys.argv[1], require=allowed)) as sandbox:
    results = sandbox.score(jobs)
import stages.sandbox.isolation as isolation
print(json.dumps({"statuses": [r.status for r in results], "runner": isolation.RUNNER}))
"""


def available_modes() -> list[str]:
    modes = ["minimal"]
    if _probe_native() is None:
        modes += ["native", "uid"]
    if shutil.which("bwrap"):
        modes.append("bwrap")
    return modes


@pytest.fixture(scope="module")
def checkout_under_tmp() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="rlpipe-checkout-", dir="/tmp"))
    for package in ("stages", "schemas", "storage"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    # Readable by a job's own uid, as a checkout made with the usual umask is.
    root.chmod(0o755)
    (root / "score_probe.py").write_text(SCORE)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", available_modes())
def test_a_checkout_under_tmp_scores_in_every_mode(checkout_under_tmp: Path, mode: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(checkout_under_tmp))
    done = subprocess.run([sys.executable, "score_probe.py", mode], cwd=checkout_under_tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["runner"].startswith(str(checkout_under_tmp))  # the copy's sandbox, not the repository's
    assert report["statuses"] == ["ok", "fail"]
