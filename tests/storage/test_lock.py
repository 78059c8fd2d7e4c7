"""Run and stage leases, on a local root (flock) and an s3:// root (moto's S3 server on 127.0.0.1).

Every contender is a separate process, as in production (a process may nest its own lock). Faults are made
to happen for real: a holder is SIGKILLed (its lease must expire on S3, and be released at once locally),
SIGSTOPped past its ttl (its lease is taken over, and when it wakes it must notice and must not delete the
new holder's lease), and several processes race for a free or an expired lease (exactly one wins).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.deploy import stop_processes
from stages.registry import instance
from storage.layout import RunLayout
from storage.lock import RunLocked, S3Lease, StageLocked, lease_state, run_lock, stage_lock, stage_lock_path
from tests.support.ports import free_port
from tests.support.processes import spawn_tied

BUCKET = "rlpipe-locks"

# A process that takes a lock, says so, holds it, and reports how it ended.
HOLDER = """
import sys, time
from stages.registry import instance
from storage.layout import RunLayout
from storage.lock import LeaseLost, run_lock, stage_lock
root, kind, ttl, hold = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
layout = RunLayout.create(root, "r")
lock = run_lock(layout, ttl_s=ttl) if kind == "run" else stage_lock(layout, instance("generate", 0), ttl_s=ttl)
try:
    with lock:
        print("acquired", flush=True)
        time.sleep(hold)
except LeaseLost as error:
    print("lost", error, flush=True)
    sys.exit(4)
print("released", flush=True)
"""

# A trigger: waits for the go file, then runs "generate" of iteration 0 at most once (as a stage process
# does: under the stage's lease, asking whether it is done only once it holds the lease), logging
# start/end of the work to a local file. With check_done=0 it always works, to test mutual exclusion alone.
TRIGGER = """
import os, sys, time
from stages.registry import instance
from storage.layout import RunLayout
from storage.lock import stage_lock
root, log_path, go, check_done, ttl = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", float(sys.argv[5])
layout = RunLayout.create(root, "r")
fs = layout.fs
marker = layout.table_path("rollouts", 0)

def is_done():
    fs.invalidate_cache()
    return check_done and fs.exists(marker)

def work():
    with open(log_path, "a") as log:
        log.write(f"start {os.getpid()} {time.time()}\\n")
    time.sleep(1.0)
    fs.pipe_file(marker, b"done")
    with open(log_path, "a") as log:
        log.write(f"end {os.getpid()} {time.time()}\\n")

print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
with stage_lock(layout, instance("generate", 0), ttl_s=ttl, wait_s=300):
    ran = not is_done()
    if ran:
        work()
print("ran" if ran else "skipped", flush=True)
"""


def spawn(script: str, *args: str) -> subprocess.Popen:
    return spawn_tied([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)


def expect_line(process: subprocess.Popen, expected: str, timeout_s: float = 120) -> None:
    """Read the process's next stdout line (the processes print one word per step)."""
    line = process.stdout.readline().strip()
    if not line.startswith(expected):
        process.kill()
        raise AssertionError(f"expected {expected!r}, got {line!r}; stderr: {process.stderr.read()[-3000:]}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    stop_processes(started, grace_s=2)


def start_moto(log_dir: Path) -> tuple[subprocess.Popen, str]:
    import botocore.session
    import httpx

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with open(log_dir / "moto.log", "ab") as log:
        process = spawn_tied(command, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(240):
        try:
            httpx.get(endpoint, timeout=2)
            break
        except httpx.HTTPError:
            assert process.poll() is None, (log_dir / "moto.log").read_text()
            time.sleep(0.5)
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    return process, endpoint


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, endpoint = start_moto(tmp_path_factory.mktemp("moto"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "RLPIPE_S3_ENDPOINT_URL": endpoint}.items():
            patch.setenv(name, value)
        try:
            yield endpoint
        finally:
            stop_processes([process], grace_s=5)


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    request.getfixturevalue("s3_endpoint")
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture
def s3_root(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    return f"s3://{BUCKET}/{request.node.name}"


def test_second_driver_is_refused_with_the_holder_named(root: str, processes: list) -> None:
    holder = spawn(HOLDER, root, "run", "30", "60")
    processes.append(holder)
    expect_line(holder, "acquired")
    layout = RunLayout.create(root, "r")
    with pytest.raises(RunLocked, match=rf"run r is being driven by .*{holder.pid}"):
        with run_lock(layout, ttl_s=30):
            pass
    # Another run, or a stage lock of this run, is not blocked by it.
    with run_lock(RunLayout.create(root, "other"), ttl_s=30), stage_lock(layout, instance("generate", 0), ttl_s=30):
        pass


def test_a_holder_caught_before_it_records_itself_is_still_named(tmp_path: Path) -> None:
    """Proves: a refusal that looks at the lock file between the holder's flock and its record (truncated,
    not yet written: a busy machine can pause the holder there) waits for the record and names the holder;
    a holder that never records itself is named as unknown. CI once saw "another process (unknown)" here."""
    layout = RunLayout.create(str(tmp_path / "root"), "r")
    path = layout.lock_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as held:  # a second open file description: flock conflicts even in this process
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        record = json.dumps({"host": "node-7", "pid": 4242, "since": "2026-11-23T00:00:00+00:00"})
        writer = threading.Timer(0.5, lambda: (held.write(record), held.flush()))
        writer.start()
        with pytest.raises(RunLocked, match=r"driven by another process \(node-7:4242 since 2026-11-23"):
            with run_lock(layout):
                pass
        writer.join()
        held.truncate(0)
        held.flush()
        with pytest.raises(RunLocked, match=r"another process \(an unknown holder\)"):
            with run_lock(layout):
                pass


def test_one_process_may_nest_its_own_lock(root: str, processes: list) -> None:
    layout = RunLayout.create(root, "r")
    with run_lock(layout, ttl_s=30):
        with run_lock(layout, ttl_s=30):  # a second hold in the same process is counted, not refused
            pass
        contender = spawn(HOLDER, root, "run", "30", "0")
        processes.append(contender)
        assert contender.wait(timeout=120) == 1 and "RunLocked" in contender.stderr.read()  # still held here
    contender = spawn(HOLDER, root, "run", "30", "0")
    processes.append(contender)
    expect_line(contender, "acquired")
    expect_line(contender, "released")


def test_waiting_for_a_stage_lock_gets_it_when_released(root: str, processes: list) -> None:
    holder = spawn(HOLDER, root, "stage", "30", "3")
    processes.append(holder)
    expect_line(holder, "acquired")
    layout = RunLayout.create(root, "r")
    with pytest.raises(StageLocked, match=r"stage generate \(iter=0000\) of run r is run by"):
        with stage_lock(layout, instance("generate", 0), ttl_s=30):
            pass
    with stage_lock(layout, instance("generate", 0), ttl_s=30, wait_s=120):
        expect_line(holder, "released")  # we hold it only once the holder has let go


def test_local_lock_is_free_as_soon_as_its_holder_is_killed(tmp_path: Path, processes: list) -> None:
    root = str(tmp_path)
    holder = spawn(HOLDER, root, "run", "3600", "3600")
    processes.append(holder)
    expect_line(holder, "acquired")
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    with run_lock(RunLayout.create(root, "r")):
        pass


def test_s3_lease_of_a_killed_holder_expires_after_its_ttl(s3_root: str, processes: list) -> None:
    ttl = 4.0
    holder = spawn(HOLDER, s3_root, "run", str(ttl), "3600")
    processes.append(holder)
    expect_line(holder, "acquired")
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    layout = RunLayout.create(s3_root, "r")
    killed_at = time.monotonic()
    with pytest.raises(RunLocked, match=str(holder.pid)):  # not expired yet: still refused
        with run_lock(layout, ttl_s=ttl):
            pass
    with run_lock(layout, ttl_s=ttl, wait_s=60):  # taken over once the server's clock says it expired
        waited = time.monotonic() - killed_at
    assert ttl - 1.5 <= waited <= ttl + 30  # Last-Modified has one-second resolution
    with run_lock(layout, ttl_s=ttl):  # and released again: no lease object left behind
        pass


def test_s3_lease_is_renewed_while_held(s3_root: str, processes: list) -> None:
    # Renewed every ttl/3 and judged on Last-Modified's whole seconds: a 6 s ttl leaves ~3 s of slack for a
    # loaded machine (a 3 s ttl once expired under load).
    ttl = 6.0
    holder = spawn(HOLDER, s3_root, "stage", str(ttl), "20")
    processes.append(holder)
    expect_line(holder, "acquired")
    layout = RunLayout.create(s3_root, "r")
    for _ in range(3):  # well past the ttl: renewals keep it
        time.sleep(ttl)
        if holder.poll() is not None:
            break
        with pytest.raises(StageLocked):
            with stage_lock(layout, instance("generate", 0), ttl_s=ttl):
                pass
    expect_line(holder, "released")
    assert holder.wait(timeout=60) == 0


def test_a_frozen_holder_loses_its_lease_and_leaves_the_new_one_alone(s3_root: str, processes: list) -> None:
    ttl = 3.0
    holder = spawn(HOLDER, s3_root, "stage", str(ttl), "12")
    processes.append(holder)
    expect_line(holder, "acquired")
    os.kill(holder.pid, signal.SIGSTOP)  # a holder that stops renewing (a frozen VM, a long GC pause)
    layout = RunLayout.create(s3_root, "r")
    url = stage_lock_path(layout, instance("generate", 0))
    try:
        with stage_lock(layout, instance("generate", 0), ttl_s=60, wait_s=60):
            mine = S3Lease(url, 60).read()
            os.kill(holder.pid, signal.SIGCONT)
            # It wakes, its next renewal fails, and leaving its block it reports the loss...
            expect_line(holder, "lost")
            assert holder.wait(timeout=60) == 4
            # ...without having deleted or overwritten the lease we hold now.
            now = S3Lease(url, 60).read()
            assert now is not None and now.etag == mine.etag and now.holder["pid"] == os.getpid()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
    assert S3Lease(url, 60).read() is None  # we released ours


def race(root: str, tmp_path: Path, processes: list, count: int, check_done: bool, ttl: float = 30) -> list[str]:
    """`count` triggers released at the same instant; returns each one's outcome (ran / skipped)."""
    log, go = tmp_path / "work.log", tmp_path / "go"
    triggers = [spawn(TRIGGER, root, str(log), str(go), "1" if check_done else "0", str(ttl)) for _ in range(count)]
    processes.extend(triggers)
    for trigger in triggers:
        expect_line(trigger, "ready")
    go.touch()
    outcomes = []
    for trigger in triggers:
        out, err = trigger.communicate(timeout=600)
        assert trigger.returncode == 0, err[-3000:]
        outcomes.append(out.strip())
    return outcomes


def work_intervals(log: Path) -> list[tuple[float, float]]:
    events = [line.split() for line in log.read_text().splitlines()]
    starts = {pid: float(t) for kind, pid, t in events if kind == "start"}
    ends = {pid: float(t) for kind, pid, t in events if kind == "end"}
    assert starts.keys() == ends.keys()
    return sorted((starts[pid], ends[pid]) for pid in starts)


def test_overlapping_triggers_run_a_stage_once(root: str, tmp_path: Path, processes: list) -> None:
    outcomes = race(root, tmp_path, processes, count=4, check_done=True)
    assert sorted(outcomes) == ["ran", "skipped", "skipped", "skipped"]
    assert len(work_intervals(tmp_path / "work.log")) == 1


def test_triggers_that_all_must_work_never_overlap(root: str, tmp_path: Path, processes: list) -> None:
    outcomes = race(root, tmp_path, processes, count=3, check_done=False)
    assert outcomes == ["ran"] * 3
    intervals = work_intervals(tmp_path / "work.log")
    assert len(intervals) == 3
    for (_, end), (next_start, _) in zip(intervals, intervals[1:], strict=False):
        assert end <= next_start, intervals


def test_racing_for_an_expired_s3_lease_has_one_winner(s3_root: str, tmp_path: Path, processes: list) -> None:
    ttl = 2.0
    holder = spawn(HOLDER, s3_root, "stage", str(ttl), "3600")
    processes.append(holder)
    expect_line(holder, "acquired")
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    time.sleep(ttl + 2)  # expired: every trigger below sees a stale lease and tries to take it over at once
    outcomes = race(s3_root, tmp_path, processes, count=4, check_done=True, ttl=ttl)
    assert sorted(outcomes) == ["ran", "skipped", "skipped", "skipped"]


def test_lease_state_tells_a_held_a_released_and_an_abandoned_lease_apart(root: str, processes: list) -> None:
    """What the generation server reads to follow its run's driver: a lease released as a `with` block ends is
    free as one never taken; one held by a live process is held, and abandoned once that was SIGKILLed (on S3
    at once, before expiry: the holder is a dead process of this host)."""
    layout = RunLayout.create(root, "r")
    path = layout.lock_path()
    assert lease_state(path) == "free"
    with run_lock(layout):
        assert lease_state(path) == "held"
    assert lease_state(path) == "free"
    holder = spawn(HOLDER, root, "run", "3600", "3600")
    processes.append(holder)
    expect_line(holder, "acquired")
    assert lease_state(path) == "held"
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lease_state(path) == "abandoned"


def test_lease_state_of_records_it_cannot_check_by_pid(tmp_path: Path, s3_root: str) -> None:
    """A local record of another host is held as far as this host can tell; one naming this process but taken
    before it started is a pid reused, so its holder died; an S3 lease of another host counts until it expires."""
    path = tmp_path / "run.lock"
    since = datetime.now(UTC).isoformat()
    path.write_text(json.dumps({"host": "elsewhere", "pid": os.getpid(), "since": since}))
    assert lease_state(str(path)) == "held"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}))
    assert lease_state(str(path)) == "held"
    before_this_process = "2000-01-01T00:00:00+00:00"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": before_this_process}))
    assert lease_state(str(path)) == "abandoned"
    url = RunLayout.create(s3_root, "r").lock_path()
    elsewhere = {"host": "elsewhere", "pid": 1, "since": since, "token": "t", "ttl_s": 1.0}
    assert S3Lease(url, ttl_s=1.0, me=elsewhere).try_acquire() is None
    assert lease_state(url) == "held"
    time.sleep(2.5)  # Last-Modified has one-second resolution
    assert lease_state(url) == "abandoned"
