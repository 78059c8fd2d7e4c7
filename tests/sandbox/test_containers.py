"""The sandbox in a container: the scorer runs under a seccomp filter that refuses what Docker's default profile
refuses (unshare, setns, mount and the new mount calls, pivot_root, clone with a namespace flag; clone3 gets
ENOSYS), built here with stages/sandbox/seccomp.py's `program` and checked by its effect (unshare fails).

As root, `auto` must pass over native (no namespaces) and bubblewrap (installed, but its probe job fails) and
run in `uid` mode, which still contains every attack. As a user, nothing that meets score.require is left:
start is refused, naming each mode's reason and the setting that allows `minimal`; named with that setting,
`minimal` runs and contains the attacks that cannot reach the user's own processes. A refusal is a config
error: the stage that starts the sandbox exits with code 2.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from schemas.config import RunConfig, ScoreConfig
from stages.harness import main as stage_main
from stages.sandbox import Sandbox, ScoreJob, _runner
from stages.sandbox.sandbox import PROJECT_ROOT, IsolationRefused
from stages.sandbox.seccomp import program
from tests.support.stages import start_run

from .test_attacks import ATTACKS, CORRECT, SPEC, fenced, local_listener
from .test_unprivileged import NOBODY, _others_can_reach, _python_for_nobody

DOCKER_DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
                 "fsmount", "fspick", "mount_setattr")
# Attacks that reach every process of the job's uid: not run where jobs share the scorer's uid (minimal).
OWN_UID_ATTACKS = {"killing the parent", "fork bomb", "background fork bomb after returning"}
DEFAULT_REQUIRE = ScoreConfig().require


def docker_profile() -> bytes:
    return program(DOCKER_DENIED, unix_sockets_only=False, clone_namespaces=True)


def child_main() -> None:
    """In the child: enter the Docker-like filter, start a Sandbox with the score settings of
    $RLPIPE_TEST_SCORE, run the attacks its mode contains, print one JSON report."""
    _runner.install_seccomp(docker_profile())
    libc = ctypes.CDLL(None, use_errno=True)
    report: dict = {"euid": os.geteuid(), "attacks": {}}
    report["unshare_errno"] = ctypes.get_errno() if libc.unshare(0x10000000) == -1 else 0  # CLONE_NEWUSER
    settings = json.loads(os.environ["RLPIPE_TEST_SCORE"])
    cfg = ScoreConfig(workers=1, timeout_s=2.0, memory_mb=512, max_processes=16, output_limit_kb=64, **settings)
    try:
        sandbox = Sandbox.from_config(cfg).start()
    except IsolationRefused as refusal:
        report["refused"] = str(refusal)
        print(json.dumps(report))
        return
    listener = local_listener()
    with sandbox:
        report.update(isolation=sandbox.isolation, layers=sandbox.layers, passed_over=sandbox.workers[0].passed_over)
        for name, attack in ATTACKS.items():
            if report["euid"] != 0 and name in OWN_UID_ATTACKS:
                continue
            (result,) = sandbox.score([attack.job(port=listener.getsockname()[1])])
            report["attacks"][name] = {"status": result.status, "message": result.tests[0]["message"],
                                       "leftover": sandbox.leftover_processes()}
        (correct,) = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])
        report["correct"] = correct.status
    try:
        listener.accept()
        report["listener_accepted"] = True
    except TimeoutError:
        report["listener_accepted"] = False
    print(json.dumps(report))


def run_child(settings: dict, as_nobody: bool) -> dict:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": PROJECT_ROOT,
           "PYTHONDONTWRITEBYTECODE": "1", "RLPIPE_TEST_SCORE": json.dumps(settings)}
    code = "from tests.sandbox.test_containers import child_main; child_main()"
    scratch = tempfile.mkdtemp(prefix="rlpipe-container-")
    try:
        python = sys.executable
        user: dict = {}
        if as_nobody:
            if not _others_can_reach(PROJECT_ROOT):
                pytest.skip(f"{PROJECT_ROOT} is not readable by an unprivileged user")
            python = _python_for_nobody(scratch)
            if python is None:
                pytest.skip("no Python with rlpipe's dependencies that an unprivileged user can run")
            user = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        done = subprocess.run([python, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, timeout=300,
                              **user)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def assert_contained(report: dict) -> None:
    for name, outcome in report["attacks"].items():
        assert outcome["status"] != "ok", (name, outcome)
        assert outcome["leftover"] == 0, (name, outcome)
        if name.startswith("seccomp "):
            assert "errno 1\\n'" in outcome["message"], (name, outcome)
    assert report["correct"] == "ok"
    assert report["listener_accepted"] is False


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode needs root")
def test_as_root_auto_falls_back_to_uid_and_contains_every_attack() -> None:
    report = run_child({"isolation": "auto"}, as_nobody=False)
    assert report["unshare_errno"] == errno.EPERM  # the profile is in force
    assert "refused" not in report, report.get("refused")
    assert report["isolation"] == "uid"
    (native, bwrap) = report["passed_over"]
    assert native.startswith("native: ") and "namespaces" in native
    if shutil.which("bwrap"):
        assert bwrap.startswith("bwrap: ") and "no interpreter runs inside the sandbox" in bwrap  # its probe job
    assert {"uid", "seccomp", "landlock", "rlimits", "wall_timeout"} <= set(report["layers"])
    assert set(report["attacks"]) == set(ATTACKS)
    assert_contained(report)


@pytest.mark.slow
def test_as_a_user_start_is_refused_and_minimal_runs_only_when_allowed() -> None:
    refused = run_child({"isolation": "auto"}, as_nobody=True)
    assert refused["euid"] == NOBODY and refused["unshare_errno"] == errno.EPERM
    message = refused["refused"]
    for reason in ("native: isolation 'native' needs root", "bwrap: ", "uid: isolation 'uid' needs root"):
        assert reason in message
    assert "score.isolation=minimal" in message and "separate_uid" in message

    named = run_child({"isolation": "minimal"}, as_nobody=True)
    assert "separate_uid" in named["refused"] and "score.require=" in named["refused"]

    allowed = [name for name in DEFAULT_REQUIRE if name != "separate_uid"]
    ran = run_child({"isolation": "minimal", "require": allowed}, as_nobody=True)
    assert "refused" not in ran, ran.get("refused")
    assert ran["isolation"] == "minimal" and {"seccomp", "landlock"} <= set(ran["layers"])
    assert "uid" not in ran["layers"]
    assert set(ran["attacks"]) == set(ATTACKS) - OWN_UID_ATTACKS
    assert_contained(ran)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode needs root")
def test_a_refused_sandbox_fails_its_stage_with_exit_code_2(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """uid mode has no scratch tmpfs: asked for one, the stage that starts the sandbox exits with 2 and says
    what is missing and which setting runs without it."""
    score = ScoreConfig(isolation="uid", workers=1, require=[*DEFAULT_REQUIRE, "scratch_limit"])
    start_run(RunConfig(run_id="refused", score=score), str(tmp_path))
    code = stage_main("prompts", lambda ctx: Sandbox.from_config(ctx.config.score).start().close(),
                      ["--root", str(tmp_path), "--run", "refused"])
    assert code == 2
    said = capsys.readouterr().err
    assert "scratch_limit" in said and "scratch_tmpfs" in said and "score.require=" in said
