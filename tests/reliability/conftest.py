"""Fixtures of the reliability drills: a moto S3 server that survives its own restart, small tmpfs mounts,
and CPU accounting.

Every drill's CPU time (this process plus the processes it waited for) is printed at the end of the session:
on a shared machine the wall time says little about what the drills cost on an idle one, the CPU time does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import spawn_tied

BUCKET = "rlpipe-drill"
_CPU: dict[str, tuple[float, float]] = {}


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@pytest.fixture(autouse=True)
def _account_cpu(request: pytest.FixtureRequest) -> Iterator[None]:
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    _CPU[request.node.nodeid] = (_cpu_seconds() - cpu, time.monotonic() - wall)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's reporter
    if not _CPU:
        return
    terminalreporter.section("reliability drills: CPU seconds (this process + waited-for children) / wall")
    for nodeid, (cpu, wall) in sorted(_CPU.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"{cpu:8.1f} cpu {wall:8.1f} wall  {nodeid}")
    total_cpu = sum(cpu for cpu, _ in _CPU.values())
    total_wall = sum(wall for _, wall in _CPU.values())
    load = os.getloadavg()[0]
    terminalreporter.write_line(f"{total_cpu:8.1f} cpu {total_wall:8.1f} wall  total (load average now {load:.1f})")


# ---------------------------------------------------------------------------------------------------------
# Runs


@pytest.fixture(scope="session")
def pristine_run(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a RunLayout
    """One finished stand-in run (tests/reliability/helpers.py), built once; drills work on clones of it."""
    from . import helpers as h

    base = tmp_path_factory.mktemp("pristine")
    layout = h.start(str(base / "root"), base / "sources")
    h.build_run(layout)
    return layout


@pytest.fixture
def clone(pristine_run, tmp_path: Path):  # noqa: ANN001, ANN201 - RunLayout in and out
    """A fresh copy of the pristine run under this test's tmp_path."""
    from . import helpers as h

    return h.clone_run(pristine_run, tmp_path / "root")


# ---------------------------------------------------------------------------------------------------------
# tmpfs


@contextlib.contextmanager
def tmpfs(directory: Path, size: str, options: str = "") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `directory` (root only); unmounted on the way out, even after a failure."""
    directory.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",{options}" if options else ""), "tmpfs",
               str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount permission): {result.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def remount(directory: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(directory)], check=True)


# ---------------------------------------------------------------------------------------------------------
# moto


@dataclass
class Moto:
    """moto's S3 server on 127.0.0.1 with its recorder on: `stop()` kills the server (SIGKILL), `start()` starts
    a new one on the same port and replays every request the old one received, so the bucket comes back as
    it was, as a real S3 server's disk would (moto keeps its state in memory only)."""

    port: int
    log_dir: Path
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def recording(self) -> Path:
        return self.log_dir / "moto-recording.jsonl"

    def _client(self):  # noqa: ANN202 - a botocore client
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
            aws_secret_access_key="testing", config=Config(retries={"max_attempts": 1}),
        )

    def start(self, replay: bool = False) -> None:
        import httpx

        env = {**os.environ, "MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(self.recording)}
        command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.log_dir / "moto.log", "ab") as log:
            self.process = spawn_tied(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(self.endpoint, timeout=2)
                break
            except httpx.HTTPError:
                assert self.process.poll() is None, (self.log_dir / "moto.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "moto did not start"
                time.sleep(0.2)
        if replay:
            # A request cut off by the kill may have left half a line: drop it (the client saw no answer).
            lines = self.recording.read_text().splitlines(keepends=True)
            if lines and not lines[-1].endswith("\n"):
                lines = lines[:-1]
            self.recording.write_text("".join(lines))
            httpx.post(f"{self.endpoint}/moto-api/recorder/replay-recording", timeout=300).raise_for_status()
        else:
            self.recording.write_text("")
            self._client().create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    from tests.support.ports import free_port

    server = Moto(port=free_port(), log_dir=tmp_path_factory.mktemp("moto"))
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "RLPIPE_S3_ENDPOINT_URL": server.endpoint}.items():
            patch.setenv(name, value)
        try:
            yield server
        finally:
            server.stop()
