"""Attack programs against the real sandbox: each is contained, scored as a failure, and leaves no
process behind. The function-test attacks target the judge (cheating the verdict); the others target
the machine (resources, file system, network, secrets, other processes)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob

from .conftest import SECRET

TEST = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(2, 5) == 7
    assert not candidate(0, 0)
    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9
"""
SPEC = {"kind": "code_tests", "entry_point": "add", "preamble": "", "test": TEST}


def fenced(body: str) -> str:
    return f"```python\n{body}\n```"


def run_contained(sandbox: Sandbox, body: str, spec: dict = SPEC, limit_s: float = 8.0):
    started = time.monotonic()
    (result,) = sandbox.score([ScoreJob(fenced(body), spec)])
    assert time.monotonic() - started < limit_s
    assert result.status != "ok"
    assert result.reward == 0.0
    assert sandbox.leftover_processes() == 0
    return result


def stdio(expected: str = "never\n") -> dict:
    return {"kind": "code_stdio", "inputs": [str(os.getpid()) + "\n"], "outputs": [expected]}


def test_sandbox_reports_its_layers(sandbox: Sandbox):
    if os.geteuid() == 0:
        assert sandbox.isolation == "native"
        for layer in ("uid", "rlimits", "netns", "mountns", "cgroup_pids", "cgroup_memory", "clean_env"):
            assert layer in sandbox.layers


# -- cheating the verdict --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("import sys\nsys.exit(0)", id="sys.exit(0) on import"),
        pytest.param("import os\nos._exit(0)", id="os._exit(0) on import"),
        pytest.param("import os\ndef add(a, b):\n    os._exit(0)", id="os._exit(0) in the call"),
        pytest.param("import sys\ndef add(a, b):\n    sys.exit(0)", id="sys.exit(0) in the call"),
        pytest.param(
            "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return -1",
            id="atexit exit code",
        ),
    ],
)
def test_exit_code_tricks_pass_nothing(sandbox: Sandbox, body: str):
    result = run_contained(sandbox, body)
    assert result.passed == 0 and result.total == 4


def test_always_equal_object_is_refused(sandbox: Sandbox):
    body = (
        "class Yes:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __bool__(self): return False\n"
        "    def __sub__(self, other): return 0\n"
        "    def __lt__(self, other): return True\n"
        "    def __abs__(self): return 0\n"
        "def add(a, b):\n    return Yes()"
    )
    result = run_contained(sandbox, body)
    assert result.passed == 0
    assert "not a plain builtin value" in result.tests[0]["message"]


def test_int_subclass_with_rigged_eq_is_refused(sandbox: Sandbox):
    body = (
        "class I(int):\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(0)"
    )
    result = run_contained(sandbox, body)
    # only `assert not candidate(0, 0)` could hold for a real 0, and I(0) is refused before any compare
    assert result.passed == 0


def test_patched_builtins_stay_in_the_child(sandbox: Sandbox):
    body = (
        "import builtins\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "def add(a, b):\n    return 100"
    )
    result = run_contained(sandbox, body)
    assert [test["status"] for test in result.tests] == ["fail"] * 4


def test_frame_walk_and_heap_search_find_no_verdict(sandbox: Sandbox):
    # Everything reachable in the child: frames, globals of the runner, every object on the heap. There
    # is no test, expected value or pass marker there, and forging the reply gains nothing: the judge
    # decides from the value alone.
    body = (
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
    )
    result = run_contained(sandbox, body)
    assert result.passed == 0


def test_a_correct_answer_after_an_attack_still_passes(sandbox: Sandbox):
    (result,) = sandbox.score([ScoreJob(fenced("def add(a, b):\n    return a + b"), SPEC)])
    assert (result.status, result.passed) == ("ok", 4)


# -- resources -------------------------------------------------------------------------------------


def test_infinite_loop_times_out(sandbox: Sandbox, sandbox_config: ScoreConfig):
    result = run_contained(sandbox, "def add(a, b):\n    while True:\n        pass")
    assert result.status == "timeout"
    assert [test["status"] for test in result.tests] == ["timeout"] * 4
    assert sandbox_config.timeout_s <= result.seconds < sandbox_config.timeout_s + 2


def test_infinite_loop_on_import_times_out(sandbox: Sandbox):
    result = run_contained(sandbox, "while True:\n    pass")
    assert result.status == "timeout"


def test_fork_bomb_is_contained(sandbox: Sandbox):
    body = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_contained(sandbox, body)
    assert result.status in ("timeout", "error")


def test_background_fork_bomb_after_returning_is_killed(sandbox: Sandbox):
    body = (
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
    )
    run_contained(sandbox, body)


def test_daemonized_sleeper_is_killed(sandbox: Sandbox):
    body = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "def add(a, b):\n    return -1\n"
    )
    run_contained(sandbox, body)


def test_huge_allocation_fails(sandbox: Sandbox):
    result = run_contained(sandbox, "blob = bytearray(8 * 1024 ** 3)\ndef add(a, b):\n    return a + b")
    assert result.status == "error"
    assert "MemoryError" in result.tests[0]["message"]


def test_gradual_allocation_fails(sandbox: Sandbox):
    body = "def add(a, b):\n    hoard = []\n    while True:\n        hoard.append(bytearray(16 * 1024 ** 2))"
    result = run_contained(sandbox, body)
    assert result.passed == 0


def test_printing_gigabytes_hits_the_output_cap(sandbox: Sandbox, sandbox_config: ScoreConfig):
    result = run_contained(sandbox, "while True:\n    print('x' * 65536)", spec=stdio())
    assert result.tests[0]["status"] == "error"
    assert result.tests[0]["message"] == f"output exceeded {sandbox_config.output_limit_kb * 1024} bytes"


def test_printing_in_function_tests_goes_nowhere_and_times_out(sandbox: Sandbox):
    result = run_contained(sandbox, "def add(a, b):\n    while True:\n        print('x' * 65536)")
    assert result.status == "timeout"


def test_big_file_in_job_directory_hits_the_file_size_limit(sandbox: Sandbox):
    body = "open('big', 'wb').write(b'x' * (64 * 1024 ** 2))\nprint('wrote')"
    result = run_contained(sandbox, body, spec=stdio())
    assert result.tests[0]["status"] == "error"


# -- file system, network, secrets, other processes ------------------------------------------------


def test_writes_outside_the_job_directory_fail(sandbox: Sandbox):
    targets = [
        "/dev/shm/rlpipe-attack",
        "/var/tmp/rlpipe-attack",
        os.path.abspath("rlpipe-attack"),
        "/etc/rlpipe",
    ]
    body = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as handle:\n"
        "            handle.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as error:\n"
        "        print('blocked', path, type(error).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    expected = "".join(f"blocked {path} X\n" for path in targets) + "fine\n"
    result = run_contained(sandbox, body, spec=stdio(expected))
    assert "wrote" not in result.tests[0]["message"]
    for path in targets:
        assert not os.path.exists(path)


def test_network_connect_to_a_local_listener_fails(sandbox: Sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    body = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as error:\n"
        "    print('blocked', type(error).__name__)\n"
    )
    result = run_contained(sandbox, body, spec=stdio("connected\n"))
    assert result.tests[0]["message"].startswith("expected 'connected\\n', got 'blocked")
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_parent_environment_is_not_visible(sandbox: Sandbox):
    assert os.environ["RLPIPE_SANDBOX_TEST_SECRET"] == SECRET
    body = (
        "import os\n"
        "seen = repr(dict(os.environ))\n"
        "for pid in [int(input()), os.getppid(), 1]:\n"
        "    try:\n"
        "        seen += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('leaked' if {SECRET!r} in seen else 'clean', sorted(os.environ))\n"
    )
    result = run_contained(sandbox, body, spec=stdio("leaked\n"))
    assert "clean" in result.tests[0]["message"]
    assert SECRET not in result.tests[0]["message"]


def test_killing_the_parent_fails_and_the_sandbox_keeps_working(sandbox: Sandbox):
    # The scoring process (pid on stdin), the fork server (ppid) and init: all refused. kill(-1) "succeeds"
    # (the kernel reports success when any process exists) but reaches only the job's own uid.
    body = (
        "import os, signal\n"
        "outcomes = []\n"
        "for pid in [int(input()), os.getppid(), 1]:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        outcomes.append('killed')\n"
        "    except OSError as error:\n"
        "        outcomes.append(type(error).__name__)\n"
        "print(outcomes, flush=True)\n"
        "os.kill(-1, signal.SIGKILL)\n"
    )
    result = run_contained(sandbox, body, spec=stdio("killed\n"))
    assert "['PermissionError', 'PermissionError', 'PermissionError']" in result.tests[0]["message"]
    workers = [worker.process for worker in sandbox.workers]
    assert all(process is not None and process.poll() is None for process in workers)
    (after,) = sandbox.score([ScoreJob(fenced("def add(a, b):\n    return a + b"), SPEC)])
    assert after.status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bwrap", "minimal"])
def test_fallback_modes_contain_the_same_attacks(mode: str):
    if mode == "bwrap" and not os.path.exists("/usr/bin/bwrap"):
        pytest.skip("bubblewrap is not installed")
    cfg = ScoreConfig(workers=1, timeout_s=2.0, isolation=mode, memory_mb=512, max_processes=16)
    with Sandbox.from_config(cfg) as fallback:
        assert fallback.isolation == mode
        assert "rlimits" in fallback.layers and "netns" not in fallback.layers
        run_contained(fallback, "def add(a, b):\n    while True:\n        pass")
        run_contained(
            fallback,
            "import os\ndef add(a, b):\n    if os.fork() == 0:\n        os.setsid()\n        while True:\n"
            "            try:\n                os.fork()\n            except OSError:\n                pass\n"
            "    return -1",
        )
        run_contained(
            fallback, "class Yes:\n    def __eq__(s, o): return True\ndef add(a, b):\n    return Yes()"
        )
        (good,) = fallback.score([ScoreJob(fenced("def add(a, b):\n    return a + b"), SPEC)])
        assert good.status == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker's own IPC namespace needs root")
def test_sysv_ipc_cannot_carry_data_between_jobs(sandbox: Sandbox):
    # SysV objects outlive processes; in the worker's namespace none can be created at all
    body = (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "print(libc.shmget(4242, 4096, 0o1666), libc.msgget(4242, 0o1666))"
    )
    result = run_contained(sandbox, body, spec=stdio())
    assert result.tests[0]["message"] == "expected 'never\\n', got '-1 -1\\n'"
