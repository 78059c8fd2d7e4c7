"""The stage fork server (flows/runner/forkserver.py): a forked stage behaves like `subprocess.run([python, "-m", ...])`
(exit status, signals, the caller's descriptors, directory, environment and command line), starts with the
heavy libraries imported, keeps rlpipe's preloaded code only while it is what a fresh import would give, runs
its own finalizers but not the server's, and the server ends when its caller does, its running stages too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.runner import forkserver
from tests.support.processes import spawn_tied

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

PROBE = textwrap.dedent("""
    import json, os, sys, weakref
    inherited_finalizers = sum(f.atexit for f in weakref.finalize._registry)

    class Resource:
        pass

    resource = Resource()  # alive until exit: its finalizer is one the child made, and must run
    weakref.finalize(resource, lambda: open("own-finalizer-ran", "w").close())
    report = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "probe": os.environ.get("PROBE"),
        "preloaded": [m for m in ("torch", "great_expectations", "pyarrow") if m in sys.modules],
        "rlpipe_loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("storage", "schemas", "flows")
                                or m in ("stages.harness", "stages.registry")),
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode(),
        "name": __name__,
        "inherited_finalizers_at_exit": inherited_finalizers,
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
    # The point of the server: the heavy libraries are imported already. rlpipe's own modules are too, but
    # this request comes from another directory and environment, so the child imports them afresh.
    assert report["preloaded"] == ["torch", "great_expectations", "pyarrow"]
    assert report["rlpipe_loaded"] == []
    assert "on stderr" in stderr
    # Its own finalizers ran at exit; the server's (vLLM's torch op libraries among them) did not.
    assert report["inherited_finalizers_at_exit"] == 0
    assert (probe_dir / "own-finalizer-ran").exists()


REUSE_PROBE = textwrap.dedent("""
    import json, sys
    preloaded = "stages.harness" in sys.modules
    import storage.layout
    print(json.dumps({"preloaded": preloaded, "marker": getattr(storage.layout, "PROBE_MARKER", None)}))
""")


@contextlib.contextmanager
def output_to(stdout: Path, stderr: Path) -> Iterator[None]:
    """This process's fd 1 and 2 on these files (appended) for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def test_preloaded_rlpipe_code_is_reused_only_while_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server imports rlpipe's stage modules once. A child keeps them when its directory, environment,
    stdout/stderr and every source file are as the server saw them; when any differs it imports afresh, so a
    stage always runs the code on disk. Run on a copy of the tree, whose source is then edited."""
    repo = Path(__file__).resolve().parents[2]
    project = tmp_path / "project"
    for package in ("stages", "schemas", "storage", "reports"):
        shutil.copytree(repo / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))
    (project / "reuse_probe.py").write_text(REUSE_PROBE)
    monkeypatch.chdir(project)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "reuse_probe"]

    def probe(request_env: dict[str, str], stdout: Path = out) -> dict:
        with output_to(stdout, err):
            assert server.run(command, request_env) == 0
        return json.loads(stdout.read_text().strip().splitlines()[-1])

    with output_to(out, err):
        server = forkserver.ForkServer(env)
    try:
        server.wait_ready()
        assert probe(env) == {"preloaded": True, "marker": None}
        assert probe(dict(env, OTHER="1"))["preloaded"] is False  # another environment
        assert probe(env, stdout=tmp_path / "elsewhere")["preloaded"] is False  # another stdout
        assert probe(env)["preloaded"] is True  # the server's copy is untouched by those
        layout = project / "storage" / "layout.py"
        layout.write_text(layout.read_text() + "\nPROBE_MARKER = 2\n")
        assert probe(env) == {"preloaded": False, "marker": 2}  # the code on disk, not the server's
    finally:
        server.close()


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


def test_the_server_and_its_running_stage_end_when_its_caller_is_killed(probe_dir: Path) -> None:
    """A flow process killed with SIGKILL while a stage runs leaves neither the stage server nor the stage
    behind: the stage gets SIGTERM at once (the probe dies of it), and both are gone within 10 s."""
    pid_file = probe_dir / "server.pid"
    caller = spawn_tied([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from flows.runner import forkserver
        server = forkserver.start(dict(os.environ))
        open({str(pid_file)!r}, "w").write(str(server.process.pid))
        forkserver.run([sys.executable, "-m", "probe_stage", "sleep", "600"], dict(os.environ))
    """)], cwd=probe_dir, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # the server's imports come first
        while not pid_file.exists() or not pid_file.read_text() or not (stages := _children(int(pid_file.read_text()))):
            assert time.monotonic() < deadline, "the caller did not start a stage"
            time.sleep(0.2)
        server_pid, (stage_pid,) = int(pid_file.read_text()), stages
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in (server_pid, stage_pid)):
            states = {"server": _state(server_pid), "stage": _state(stage_pid)}
            assert time.monotonic() < deadline, f"outlived the caller by 10 s: {states}"
            time.sleep(0.2)
    finally:
        caller.kill()


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_off_switch_starts_no_server(probe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_STAGE_FORK", "0")
    assert not forkserver.fork_enabled()
    assert forkserver.start(dict(os.environ)) is None


def test_what_vllm_logs_while_imported_goes_to_the_callers_log_not_the_console(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """`rlpipe run`'s console began with vLLM's import-time warning (`Triton is installed, but doesn't include CPU
    backend`): vLLM applies VLLM_LOGGING_CONFIG_PATH only when it starts an engine, and the stage server imports it
    long before. The server applies the config first; a line logged as vLLM logs at import lands in the file."""
    import logging

    from stages.generation.vllm_backend import vllm_logging_config

    log = tmp_path / "logs" / "stage-server.log"
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(vllm_logging_config(log)))
    vllm_logger = logging.getLogger("vllm")
    saved = list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate
    try:
        forkserver._apply_vllm_logging_config()
        logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but no CPU backend.")
    finally:
        for handler in list(vllm_logger.handlers):
            handler.close()
            vllm_logger.removeHandler(handler)
        for handler in saved[0]:
            vllm_logger.addHandler(handler)
        vllm_logger.setLevel(saved[1])
        vllm_logger.propagate = saved[2]
    assert "Triton" not in capfd.readouterr().err
    assert log.read_text().splitlines()[-1].endswith("Triton is installed, but no CPU backend.")
