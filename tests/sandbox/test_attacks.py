"""Attack programs against the real sandbox: each is contained, scored as a failure, and leaves no
process behind. The function-test attacks target the judge (cheating the verdict); the others target
the machine (resources, file system, network, secrets, other processes)."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob, ScoreResult, view
from stages.sandbox import isolation as isolation_module
from stages.sandbox.isolation import BwrapIsolation, Isolation, Limits, nproc_limit
from stages.sandbox.sandbox import PROJECT_ROOT, IsolationRefused, missing_layers

from .conftest import SECRET

TEST = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(2, 5) == 7
    assert not candidate(0, 0)
    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9
"""
SPEC = {"kind": "code_tests", "entry_point": "add", "preamble": "", "test": TEST}
CORRECT = "def add(a, b):\n    return a + b"


def fenced(body: str) -> str:
    return f"```python\n{body}\n```"


@dataclass(frozen=True)
class Attack:
    """One attack program and what it is scored against: the function test SPEC when `expected` is
    None, else one stdin/stdout case whose expected output is what the program prints only if the
    attack worked (so a failing score means it did not). Its stdin is `stdin` with {pid} (the scoring
    process) and {port} (a local listener) filled in at run time."""

    body: str
    expected: str | None = None
    stdin: str = "{pid}\n"

    def job(self, pid: int | None = None, port: int = 0) -> ScoreJob:
        if self.expected is None:
            return ScoreJob(fenced(self.body), SPEC)
        given = self.stdin.format(pid=os.getpid() if pid is None else pid, port=port)
        return ScoreJob(fenced(self.body), {"kind": "code_stdio", "inputs": [given], "outputs": [self.expected]})


EXIT_TRICKS = {
    "sys.exit(0) on import": "import sys\nsys.exit(0)",
    "os._exit(0) on import": "import os\nos._exit(0)",
    "os._exit(0) in the call": "import os\ndef add(a, b):\n    os._exit(0)",
    "sys.exit(0) in the call": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "atexit exit code": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return -1",
}
# Paths a job must not be able to write; the project directory is named absolutely, so the list is the
# same in any process that imports it (test_unprivileged.py runs it in a child).
WRITE_TARGETS = [
    "/dev/shm/rlpipe-attack",
    "/var/tmp/rlpipe-attack",
    os.path.join(PROJECT_ROOT, "rlpipe-attack"),
    "/etc/rlpipe",
]

# Every attack program of the issue, by name; the tests below run each against the shared (native, as
# root) sandbox with checks of their own, and test_unprivileged.py runs the whole list as a non-root
# user under bubblewrap. Each must be scored as a failure and leave no process behind.
ATTACKS: dict[str, Attack] = {
    # cheating the verdict
    **{name: Attack(body) for name, body in EXIT_TRICKS.items()},
    "always-equal object": Attack(
        "class Yes:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __bool__(self): return False\n"
        "    def __sub__(self, other): return 0\n"
        "    def __lt__(self, other): return True\n"
        "    def __abs__(self): return 0\n"
        "def add(a, b):\n    return Yes()"
    ),
    "int subclass with rigged eq": Attack(
        "class I(int):\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(0)"
    ),
    "patched builtins": Attack(
        "import builtins\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "def add(a, b):\n    return 100"
    ),
    # Everything reachable in the child: frames, globals of the runner, every object on the heap. There
    # is no test, expected value or pass marker there, and forging the reply gains nothing: the judge
    # decides from the value alone.
    "frame walk and heap search": Attack(
        "import gc, sys\n"
        "def add(a, b):\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        for name, value in list(frame.f_globals.items()):\n"
        "            if name in ('write_frame', '_reply'):\n"
        "                frame.f_globals[name] = lambda *args, **kwargs: None\n"
        "        frame = frame.f_back\n"
        "    strings = [o for o in gc.get_objects() if isinstance(o, str) and 'assert' in o]\n"
        "    return len(strings) + 100\n"
    ),
    # resources
    "infinite loop": Attack("def add(a, b):\n    while True:\n        pass"),
    "infinite loop on import": Attack("while True:\n    pass"),
    "fork bomb": Attack("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
    "background fork bomb after returning": Attack(
        "import os\n"
        "def add(a, b):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        while True:\n"
        "            try:\n"
        "                os.fork()\n"
        "            except OSError:\n"
        "                pass\n"
        "    return -1\n"
    ),
    "daemonized sleeper": Attack(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "def add(a, b):\n    return -1\n"
    ),
    "huge allocation": Attack("blob = bytearray(8 * 1024 ** 3)\ndef add(a, b):\n    return a + b"),
    "gradual allocation": Attack(
        "def add(a, b):\n    hoard = []\n    while True:\n        hoard.append(bytearray(16 * 1024 ** 2))"
    ),
    "printing gigabytes": Attack("while True:\n    print('x' * 65536)", expected="never\n"),
    "printing in function tests": Attack("def add(a, b):\n    while True:\n        print('x' * 65536)"),
    "big file in the job directory": Attack(
        "open('big', 'wb').write(b'x' * (64 * 1024 ** 2))\nprint('wrote')", expected="never\n"
    ),
    # file system, network, secrets, other processes
    "writes outside the job directory": Attack(
        "import os\n"
        f"for path in {WRITE_TARGETS!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as handle:\n"
        "            handle.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as error:\n"
        "        print('blocked', path, type(error).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n",
        expected="".join(f"blocked {path} X\n" for path in WRITE_TARGETS) + "fine\n",
    ),
    "network connect to a local listener": Attack(
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', int(input())), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as error:\n"
        "    print('blocked', type(error).__name__)\n",
        expected="connected\n",
        stdin="{port}\n",
    ),
    "reading the parent's environment": Attack(
        "import os\n"
        "seen = repr(dict(os.environ))\n"
        "for pid in [int(input()), os.getppid(), 1]:\n"
        "    try:\n"
        "        seen += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('leaked' if {SECRET!r} in seen else 'clean', sorted(os.environ))\n",
        expected="leaked\n",
    ),
    # The scoring process (pid on stdin), the job's parent and init, then kill(-1) as the job's user.
    "killing the parent": Attack(
        "import os, signal\n"
        "outcomes = []\n"
        "for pid in [int(input()), os.getppid(), 1]:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        outcomes.append('killed')\n"
        "    except OSError as error:\n"
        "        outcomes.append(type(error).__name__)\n"
        "print(outcomes, flush=True)\n"
        "os.kill(-1, signal.SIGKILL)\n",
        expected="killed\n",
    ),
}


# One harmless call per rule of the job's seccomp filter (stages/sandbox/seccomp.py), as an expression over
# `libc`: arguments the kernel rejects by itself (a missing path, a bad fd, an unknown command), so that
# without the filter the answer is anything but EPERM (test_seccomp.py checks that, per rule, in a child of
# the test), and under it EPERM. x86_64 system call numbers where the C library has no wrapper.
SECCOMP_PROBES = {
    "socket": "libc.socket(2, 1, 0)",  # AF_INET: made even in an empty network namespace
    "ptrace": "libc.ptrace(3, 0, 0, 0)",  # PTRACE_PEEKUSER of pid 0: ESRCH
    "mount": "libc.mount(b'none', b'/rlpipe-no-such-dir', b'tmpfs', 0, None)",  # ENOENT (before any privilege)
    "bpf": "libc.syscall(321, 9999, None, 0)",  # an unknown command: EINVAL as root
    "perf_event_open": "libc.syscall(298, None, 0, -1, -1, 0)",  # no attributes: EFAULT
    "keyctl": "libc.syscall(250, 9999, 0, 0, 0, 0)",  # an unknown operation: EOPNOTSUPP
    "namespaces": "libc.unshare(0)",  # nothing to unshare: succeeds
    "setns": "libc.setns(-1, 0)",  # EBADF
    "clone": "libc.syscall(56, 0x10000000 | 0x200, 0, 0, 0, 0)",  # CLONE_NEWUSER | CLONE_FS: EINVAL
    "kexec": "libc.syscall(246, 0, 0, None, 0xDEAD0000)",  # bad flags: EINVAL (ENOSYS without kexec)
    "modules": "libc.syscall(313, -1, b'', 0)",  # finit_module of no file: EBADF (ENOSYS without modules)
}


def seccomp_attack(rule: str) -> Attack:
    """A job that makes the rule's probe and prints its errno; it is scored against "allowed", never printed."""
    body = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"result = {SECCOMP_PROBES[rule]}\n"
        f"print({rule!r}, 'errno', ctypes.get_errno() if result == -1 else 'none')\n"
    )
    return Attack(body, expected="allowed\n")


ATTACKS.update({f"seccomp {rule}": seccomp_attack(rule) for rule in SECCOMP_PROBES})

# Fills the job's directory with 1 MiB files until a write fails. Only where the directory is a size-limited
# tmpfs (the scratch_tmpfs layer): elsewhere it would fill the host's disk, so it is not one of ATTACKS.
SCRATCH_FILL = Attack(
    "count = 0\n"
    "while True:\n"
    "    with open(f'fill-{count}', 'wb') as handle:\n"
    "        handle.write(b'x' * (1 << 20))\n"
    "    count += 1\n",
    expected="never\n",
)


def run_contained(sandbox: Sandbox, attack: Attack | str, limit_s: float = 8.0, port: int = 0) -> ScoreResult:
    """Score one attack (an Attack, or a function-test body); assert it failed, in time, leaving no process."""
    job = attack.job(port=port) if isinstance(attack, Attack) else ScoreJob(fenced(attack), SPEC)
    started = time.monotonic()
    (result,) = sandbox.score([job])
    assert time.monotonic() - started < limit_s
    assert result.status != "ok"
    assert result.reward == 0.0
    assert sandbox.leftover_processes() == 0
    return result


def test_sandbox_reports_its_layers(sandbox: Sandbox):
    """As root, "auto" picks native isolation with every layer of a full setup (no NOT-active warning)."""
    if os.geteuid() == 0:
        assert sandbox.isolation == "native"
        for layer in ("uid", "rlimits", "netns", "mountns", "cgroup_pids", "cgroup_memory", "clean_env", "seccomp",
                      "scratch_tmpfs"):
            assert layer in sandbox.layers
        assert missing_layers(sandbox.layers) == []


def _layers(mode: type[Isolation], monkeypatch: pytest.MonkeyPatch, euid: int) -> dict[str, str]:
    monkeypatch.setattr(isolation_module.os, "geteuid", lambda: euid)
    cfg = ScoreConfig(max_processes=16)
    return mode(cfg, Limits.from_config(cfg), 0, os.getpid()).layers()


@pytest.mark.parametrize("euid", [0, 65534], ids=["root", "non-root"])
def test_bwrap_mode_reports_the_namespaces_it_gives(monkeypatch: pytest.MonkeyPatch, euid: int):
    """bwrap mode names the network, mount, pid, IPC/UTS and user namespaces bubblewrap gives each job and
    its seccomp filter, says RLIMIT_NPROC is set and what it counts (the job uid as root, the whole shared
    uid otherwise), and that the pid namespace is no count limit. Before its worker starts it has no cgroup
    and no scratch tmpfs yet: only those (and, as a non-root user, the job uid) are warned about, never netns
    or mountns."""
    if not os.access("/usr/bin/bwrap", os.X_OK):
        pytest.skip("bubblewrap is not installed")
    layers = _layers(BwrapIsolation, monkeypatch, euid)
    for layer in ("netns", "mountns", "pidns", "ipc_uts_ns", "userns", "rlimits", "clean_env", "wall_timeout",
                  "seccomp"):
        assert layer in layers
    assert "not a count limit" in layers["pidns"]
    assert "cgroup_pids" not in layers and "cgroup_memory" not in layers
    if euid == 0:
        assert "NPROC=16 (the job's own uid" in layers["rlimits"]
        assert missing_layers(layers) == ["cgroup_pids", "cgroup_memory", "scratch_tmpfs"]
    else:
        assert "NPROC=tasks of uid 65534 at job start + 16" in layers["rlimits"]
        assert "uid" not in layers and "non-root uid 65534" in layers["user"]
        assert missing_layers(layers) == ["uid", "cgroup_pids", "cgroup_memory", "scratch_tmpfs"]


@pytest.mark.parametrize("euid", [0, 65534], ids=["root", "non-root"])
def test_minimal_mode_reports_no_namespaces(monkeypatch: pytest.MonkeyPatch, euid: int):
    """minimal mode claims no namespace and warns about each; RLIMIT_NPROC is reported in both cases
    (setup_params always sets it), as root with the job's own uid."""
    layers = _layers(Isolation, monkeypatch, euid)
    assert "NPROC" in layers["rlimits"]
    assert not {"netns", "mountns", "pidns", "userns"} & set(layers)
    assert {"netns", "mountns", "cgroup_pids", "cgroup_memory"} <= set(missing_layers(layers))
    assert ("uid" in layers) == (euid == 0)


def test_nproc_limit_counts_the_shared_uid(monkeypatch: pytest.MonkeyPatch):
    """RLIMIT_NPROC is `max_processes` for a job uid of its own (root); for a non-root user, whose jobs
    share its uid, it is what the uid already runs (threads included) plus `max_processes`."""
    assert nproc_limit(16, is_root=True) == 16
    monkeypatch.setattr(isolation_module, "uid_tasks", lambda uid, userns: 40)
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    assert nproc_limit(16, is_root=False) == (56 if hard == resource.RLIM_INFINITY else min(56, hard))


# -- cheating the verdict --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXIT_TRICKS))
def test_exit_code_tricks_pass_nothing(sandbox: Sandbox, name: str):
    result = run_contained(sandbox, ATTACKS[name])
    assert result.passed == 0 and result.total == 4


def test_always_equal_object_is_refused(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["always-equal object"])
    assert result.passed == 0
    assert "not a plain builtin value" in result.tests[0]["message"]


def test_int_subclass_with_rigged_eq_is_refused(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["int subclass with rigged eq"])
    # only `assert not candidate(0, 0)` could hold for a real 0, and I(0) is refused before any compare
    assert result.passed == 0


def test_patched_builtins_stay_in_the_child(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["patched builtins"])
    assert [test["status"] for test in result.tests] == ["fail"] * 4


def test_frame_walk_and_heap_search_find_no_verdict(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["frame walk and heap search"])
    assert result.passed == 0


def test_a_correct_answer_after_an_attack_still_passes(sandbox: Sandbox):
    (result,) = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])
    assert (result.status, result.passed) == ("ok", 4)


# -- resources -------------------------------------------------------------------------------------


def test_infinite_loop_times_out(sandbox: Sandbox, sandbox_config: ScoreConfig):
    result = run_contained(sandbox, ATTACKS["infinite loop"])
    assert result.status == "timeout"
    assert [test["status"] for test in result.tests] == ["timeout"] * 4
    assert sandbox_config.timeout_s <= result.seconds < sandbox_config.timeout_s + 2


def test_infinite_loop_on_import_times_out(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["infinite loop on import"])
    assert result.status == "timeout"


def test_fork_bomb_is_contained(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["fork bomb"])
    assert result.status in ("timeout", "error")


def test_background_fork_bomb_after_returning_is_killed(sandbox: Sandbox):
    run_contained(sandbox, ATTACKS["background fork bomb after returning"])


def test_daemonized_sleeper_is_killed(sandbox: Sandbox):
    run_contained(sandbox, ATTACKS["daemonized sleeper"])


def test_huge_allocation_fails(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["huge allocation"])
    assert result.status == "error"
    assert "MemoryError" in result.tests[0]["message"]


def test_gradual_allocation_fails(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["gradual allocation"])
    assert result.passed == 0


def test_printing_gigabytes_hits_the_output_cap(sandbox: Sandbox, sandbox_config: ScoreConfig):
    result = run_contained(sandbox, ATTACKS["printing gigabytes"])
    assert result.tests[0]["status"] == "error"
    assert result.tests[0]["message"] == f"output exceeded {sandbox_config.output_limit_kb * 1024} bytes"


def test_printing_in_function_tests_goes_nowhere_and_times_out(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["printing in function tests"])
    assert result.status == "timeout"


def test_big_file_in_job_directory_hits_the_file_size_limit(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["big file in the job directory"])
    assert result.tests[0]["status"] == "error"


def test_filling_the_scratch_tmpfs_is_a_job_error(sandbox: Sandbox):
    """The job's only writable directory is a tmpfs of score.scratch_mb: filling it fails the job with ENOSPC
    (after about scratch_mb MiB), and the host's disk does not see the bytes."""
    if "scratch_tmpfs" not in sandbox.layers:
        pytest.skip(f"isolation {sandbox.isolation!r} has no scratch tmpfs here: the fill would reach the disk")
    free_before = shutil.disk_usage(tempfile.gettempdir()).free
    result = run_contained(sandbox, SCRATCH_FILL, limit_s=15.0)
    assert result.tests[0]["status"] == "error"
    assert "No space left on device" in result.tests[0]["message"]
    # scratch_mb (16 MiB here) went to the tmpfs, not to the host's /tmp (others may write a little meanwhile)
    assert free_before - shutil.disk_usage(tempfile.gettempdir()).free < (32 << 20)


# -- seccomp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(SECCOMP_PROBES))
def test_the_seccomp_filter_refuses_each_rule_in_a_job(sandbox: Sandbox, rule: str):
    """Each rule's probe, made by a job's own code, fails with EPERM (1); test_seccomp.py shows that the
    kernel answers otherwise without the filter."""
    result = run_contained(sandbox, ATTACKS[f"seccomp {rule}"])
    assert f"got '{rule} errno 1\\n'" in result.tests[0]["message"]


# -- file system, network, secrets, other processes ------------------------------------------------


def test_writes_outside_the_job_directory_fail(sandbox: Sandbox):
    result = run_contained(sandbox, ATTACKS["writes outside the job directory"])
    assert "wrote" not in result.tests[0]["message"]
    for path in WRITE_TARGETS:
        assert not os.path.exists(path)


def local_listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    return listener


def test_network_connect_to_a_local_listener_fails(sandbox: Sandbox):
    listener = local_listener()
    result = run_contained(sandbox, ATTACKS["network connect to a local listener"], port=listener.getsockname()[1])
    assert result.tests[0]["message"].startswith("expected 'connected\\n', got 'blocked")
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_parent_environment_is_not_visible(sandbox: Sandbox):
    assert os.environ["RLPIPE_SANDBOX_TEST_SECRET"] == SECRET
    result = run_contained(sandbox, ATTACKS["reading the parent's environment"])
    assert "clean" in result.tests[0]["message"]
    assert SECRET not in result.tests[0]["message"]


def test_killing_the_parent_fails_and_the_sandbox_keeps_working(sandbox: Sandbox):
    # The scoring process (pid on stdin), the fork server (ppid) and init: all refused. kill(-1) "succeeds"
    # (the kernel reports success when any process exists) but reaches only the job's own uid.
    result = run_contained(sandbox, ATTACKS["killing the parent"])
    assert "['PermissionError', 'PermissionError', 'PermissionError']" in result.tests[0]["message"]
    workers = [worker.process for worker in sandbox.workers]
    assert all(process is not None and process.poll() is None for process in workers)
    (after,) = sandbox.score([ScoreJob(fenced(CORRECT), SPEC)])
    assert after.status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bwrap", "uid", "minimal"])
def test_fallback_modes_contain_the_same_attacks(mode: str):
    """bwrap, uid and minimal modes named explicitly (here as root, so jobs get a uid of their own) contain
    every attack of ATTACKS, seccomp probes included, leave no process behind, and still score a correct
    answer; test_unprivileged.py runs bwrap as a non-root user. Without a mount or network namespace, writes
    and network are held by Landlock and seccomp; a kernel without those would show it in the layers, and
    those two attacks are then not run."""
    if mode == "bwrap" and not os.path.exists("/usr/bin/bwrap"):
        pytest.skip("bubblewrap is not installed")
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("uid mode needs root")
    cfg = ScoreConfig(workers=1, timeout_s=2.0, isolation=mode, memory_mb=512, max_processes=16, output_limit_kb=64)
    if mode == "minimal" and os.geteuid() != 0:
        # jobs would share this user's uid: kill(-1) would reach the test runner. Start must refuse by default.
        with pytest.raises(IsolationRefused, match="separate_uid"):
            Sandbox.from_config(cfg).start()
        pytest.skip("minimal mode as a user: refused by default, and its attacks would reach this user's processes")
    with Sandbox.from_config(cfg) as fallback:
        layers = fallback.layers
        assert fallback.isolation == mode
        assert {"rlimits", "seccomp"} <= set(layers) and ("netns" in layers) == (mode == "bwrap")
        not_held = set()
        if not {"mountns", "landlock"} & set(layers):
            not_held.add("writes outside the job directory")
        if not {"netns", "seccomp"} & set(layers):
            not_held.add("network connect to a local listener")
        listener = local_listener()
        for name, attack in ATTACKS.items():
            if name not in not_held:
                result = run_contained(fallback, attack, port=listener.getsockname()[1])
                if name.startswith("seccomp "):
                    assert "errno 1\\n'" in result.tests[0]["message"], (name, result.tests[0]["message"])
        with pytest.raises(TimeoutError):
            listener.accept()
        listener.close()
        (good,) = fallback.score([ScoreJob(fenced(CORRECT), SPEC)])
        assert good.status == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker's own IPC namespace needs root")
def test_sysv_ipc_cannot_carry_data_between_jobs(sandbox: Sandbox):
    # SysV objects outlive processes; in the worker's namespace none can be created at all
    body = "import ctypes\nlibc = ctypes.CDLL(None)\nprint(libc.shmget(4242, 4096, 0o1666), libc.msgget(4242, 0o1666))"
    result = run_contained(sandbox, Attack(body, expected="never\n"))
    assert result.tests[0]["message"] == "expected 'never\\n', got '-1 -1\\n'"


# Run in a job of a mode with a mount namespace: what of the host it can see. Filled in with the paths the job
# must not see (each readable by the job's uid outside the sandbox) and the top-level entries its root may have.
SEES_ONLY = """
import os, decimal, fractions  # the interpreter's standard library works
seen = [path for path in {hidden!r} if os.path.exists(path)]
extra = sorted(set(os.listdir("/")) - set({allowed!r}))
try:
    open("/planted", "w")
    seen.append("/ is writable")
except OSError:
    pass
print("contained" if not seen and not extra else f"saw {{seen}} extra {{extra}}")
"""

# The same under Landlock (uid and minimal modes): the paths exist, but none can be opened or listed, nor
# the root; the system's files can be read, and only the job's own directory written.
OPENS_ONLY = """
import os, decimal, fractions
opened = []
for path in {hidden!r} + ["/"]:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).close()
        opened.append(path)
    except PermissionError:
        pass
for path in ["/planted", "/var/tmp/rlpipe-planted", "/dev/shm/rlpipe-planted"]:
    try:
        open(path, "w").close()
        opened.append(path)
    except OSError:
        pass
open("/etc/passwd").read()
open("inside", "w").write("fine")
print("contained" if not opened else f"opened {{opened}}")
"""


def hidden_paths(interpreter: tuple[str, ...]) -> tuple[list[str], str]:
    """Paths readable by any uid outside the sandbox that a job must not reach (a world-readable file made
    here, the checkout unless the interpreter lives in it, /home), and the made file to delete after."""
    fd, readable = tempfile.mkstemp(prefix="rlpipe-readable-", dir="/var/tmp")
    os.close(fd)
    os.chmod(readable, 0o644)
    hidden = [readable, os.path.join(PROJECT_ROOT, "README.md"), os.path.join(PROJECT_ROOT, "stages"), "/home"]
    return [path for path in hidden if not any(path.startswith(kept + "/") for kept in interpreter)], readable


@pytest.mark.parametrize("mode", ["native", "bwrap", "uid"])
def test_a_job_sees_the_system_and_its_interpreter_only(mode: str) -> None:
    """Proves, in each mode this machine has: a job (which in bwrap and minimal modes has the sandbox user's uid
    and could read their keys, credentials, checkout and storage root) reaches nothing of the host but the
    system's directories and its interpreter's: not the checkout, not a world-readable file elsewhere, not
    /home. With a mount namespace (native, bwrap) they are absent and the root holds only the top-level entries
    of those directories plus /tmp, /proc and /dev, read-only; under Landlock (uid) they exist but cannot be
    opened or listed, nor the root, and nothing outside the job's directory can be written. The interpreter
    still runs its standard library."""
    if mode == "bwrap" and not os.path.exists("/usr/bin/bwrap"):
        pytest.skip("bubblewrap is not installed")
    if mode in ("native", "uid") and os.geteuid() != 0:
        pytest.skip(f"{mode} mode needs root")
    cfg = ScoreConfig(workers=1, timeout_s=10.0, isolation=mode)
    isolation = Isolation(cfg, Limits.from_config(cfg), 0, os.getpid())
    interpreter = view.view_dirs([isolation.interpreter_for(python) for python in view.interpreter_candidates(None)])
    assert interpreter and all(os.path.isdir(path) for path in interpreter)
    tops = {path.split("/")[1] for path in (*view.SYSTEM_DIRS, *interpreter)}
    allowed = sorted({top for top in tops if os.path.lexists("/" + top)} | {"tmp", "proc", "dev"})
    hidden, readable = hidden_paths(interpreter)
    try:
        with Sandbox.from_config(cfg) as sandbox:
            if mode == "uid" and "landlock" not in sandbox.layers:
                pytest.skip("this kernel has no Landlock")
            program = OPENS_ONLY if mode == "uid" else SEES_ONLY
            spec = {"kind": "code_stdio", "inputs": [""], "outputs": ["contained\n"]}
            (result,) = sandbox.score([ScoreJob(fenced(program.format(hidden=hidden, allowed=allowed)), spec)])
    finally:
        os.unlink(readable)
    assert result.status == "ok", result.tests
    assert len(hidden) >= 3  # the readable file, and the checkout unless the interpreter lives in it
