"""The stage fork server (stages/forkserver.py): a forked stage behaves like `subprocess.run([python, "-m", ...])`
(exit status, signals, the caller's descriptors, directory, environment and command line), starts with the
heavy libraries imported but rlpipe's own code fresh, and the server ends when its caller does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stages import forkserver

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

PROBE = textwrap.dedent("""
    import json, os, sys
    report = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "probe": os.environ.get("PROBE"),
        "preloaded": [m for m in ("torch", "great_expectations", "pyarrow") if m in sys.modules],
        "rlpipe_loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("storage", "schemas", "flows")
                                or m in ("stages.common", "stages.registry")),
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode(),
        "name": __name__,
    }
    print(json.dumps(report))
    print("on stderr", file=sys.stderr)
    action = sys.argv[1] if len(sys.argv) > 1 else "0"
    if action == "kill":
        os.kill(os.getpid(), 9)
    if action == "raise":
        raise ValueError("boom")
    if action == "sleep":
        import time
        time.sleep(float(sys.argv[2]))
    sys.exit(int(action) if action.isdigit() else 0)
""")


@pytest.fixture(scope="module")
def server() -> forkserver.ForkServer:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = forkserver.start(env)
    assert started is not None
    yield started
    forkserver.stop()


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "probe_stage.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_captured(server: forkserver.ForkServer, args: list[str], out: Path, **env: str) -> tuple[int, str, str]:
    """Run the probe with this process's stdout/stderr pointed at files, as a terminal or log would be."""
    command = [sys.executable, "-m", "probe_stage", *args]
    request_env = dict(server.env, **env)
    saved = os.dup(1), os.dup(2)
    with open(out.with_suffix(".out"), "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
        sys.stdout.flush()
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        try:
            returncode = forkserver.run(command, request_env)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return returncode, out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()


def test_a_forked_stage_runs_like_python_dash_m(server: forkserver.ForkServer, probe_dir: Path) -> None:
    import json

    returncode, stdout, stderr = run_captured(server, ["7", "--root", "/data/x"], probe_dir / "a", PROBE="yes")
    assert returncode == 7
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["argv"] == ["7", "--root", "/data/x"]
    assert report["cwd"] == str(probe_dir)
    assert report["probe"] == "yes"
    assert report["name"] == "__main__"
    assert report["cmdline"] == f"{sys.executable} -m probe_stage 7 --root /data/x"
    # The point of the server: the heavy libraries are imported already; rlpipe's own code is not.
    assert report["preloaded"] == ["torch", "great_expectations", "pyarrow"]
    assert report["rlpipe_loaded"] == []
    assert "on stderr" in stderr


def test_exit_statuses_match_subprocess(server: forkserver.ForkServer, probe_dir: Path) -> None:
    assert run_captured(server, ["0"], probe_dir / "ok")[0] == 0
    assert run_captured(server, ["kill"], probe_dir / "killed")[0] == -signal.SIGKILL
    returncode, _, stderr = run_captured(server, ["raise"], probe_dir / "raised")
    assert returncode == 1
    assert "ValueError: boom" in stderr
    # The same command as a fresh interpreter, for comparison.
    plain = subprocess.run([sys.executable, "-m", "probe_stage", "kill"], cwd=probe_dir, capture_output=True)
    assert plain.returncode == -signal.SIGKILL


def test_concurrent_requests_each_get_their_own_status(server: forkserver.ForkServer, probe_dir: Path) -> None:
    results: dict[int, int] = {}

    def one(code: int) -> None:
        results[code] = forkserver.run([sys.executable, "-m", "probe_stage", str(code)], server.env)

    threads = [threading.Thread(target=one, args=(code,)) for code in (3, 4, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {3: 3, 4: 4, 5: 5}


def test_other_import_time_variables_are_not_served(server: forkserver.ForkServer) -> None:
    assert server.serves(dict(server.env, PREFECT_API_URL="http://elsewhere"))  # read at run time: same server
    assert not server.serves(dict(server.env, OMP_NUM_THREADS="4"))  # thread pools are sized at import


def test_the_server_ends_when_its_caller_is_killed(tmp_path: Path) -> None:
    """A flow process killed with SIGKILL leaves no stage server behind (its running stages, if any, finish)."""
    pid_file = tmp_path / "server.pid"
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from stages import forkserver
        server = forkserver.start(dict(os.environ))
        open({str(pid_file)!r}, "w").write(str(server.process.pid))
        time.sleep(600)
    """)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the caller did not start a server"
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 120  # it finishes its imports first
        while Path(f"/proc/{server_pid}").exists() and _state(server_pid) != "Z":
            assert time.monotonic() < deadline, "the stage server outlived its caller"
            time.sleep(0.2)
    finally:
        caller.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_off_switch_starts_no_server(probe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_STAGE_FORK", "0")
    assert not forkserver.fork_enabled()
    assert forkserver.start(dict(os.environ)) is None
