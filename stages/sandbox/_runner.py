"""The program that runs inside the sandbox, and the value format it shares with the trusted side.

Both a script and a module. As a script (`python -I -S _runner.py MODE`) it is what every sandboxed child
executes, so it imports only the standard library (no site packages, never rlpipe); as a module it gives the
trusted side `encode_value` / `decode_value`, so both ends agree on the wire format by construction. Modes:
`script` (run the candidate's source from fd 3 as `__main__`: stdin/stdout cases), `serve` (load it as a
module, then answer call requests with return values or raised exceptions; the candidate never sees a test or
an expected value), `zygote` (a warm interpreter that only forks a child per job, which isolates itself and
runs `script` or `serve`; it never receives job data, so a child inherits nothing of another job), `probe`
(the interpreter works inside the sandbox).

Nothing this process says is trusted beyond "these are plain values": the candidate can replace any of this
code, so the trusted side decodes replies into exact builtin types only and draws every verdict itself. The
wire format is ours, not JSON, because importing `json` doubled a child's start-up time (its layout:
docs/architecture.md, "The sandbox").
"""

from __future__ import annotations

import os
import struct
import sys

HEADER = struct.Struct(">I")
_COUNT = struct.Struct(">I")
_DOUBLE = struct.Struct(">d")
# Deeper values are refused on both sides before they can exhaust a stack.
MAX_DEPTH = 100


class ValueFormatError(ValueError):
    """A value that is not made of plain builtin types (or bytes that do not decode into one)."""


_SEQUENCE_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z"}


def _encode(value: object, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueFormatError("value nested too deeply")
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif value is True:
        out.append(b"T")
    elif value is False:
        out.append(b"F")
    elif kind is int:
        digits = format(value, "x").encode()
        out.append(b"i" + _COUNT.pack(len(digits)) + digits)
    elif kind is float:
        out.append(b"f" + _DOUBLE.pack(value))
    elif kind is complex:
        out.append(b"c" + _DOUBLE.pack(value.real) + _DOUBLE.pack(value.imag))
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s" + _COUNT.pack(len(data)) + data)
    elif kind is bytes:
        out.append(b"b" + _COUNT.pack(len(value)) + value)
    elif kind in _SEQUENCE_TAGS:
        out.append(_SEQUENCE_TAGS[kind] + _COUNT.pack(len(value)))
        for item in value:
            _encode(item, out, depth + 1)
    elif kind is dict:
        out.append(b"d" + _COUNT.pack(len(value)))
        for key, item in value.items():
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    else:
        raise ValueFormatError(f"a {kind.__name__} object is not a plain builtin value")


def encode_value(value: object) -> bytes:
    """Plain builtin value -> bytes; refuses anything else (subclasses of builtins included)."""
    out: list = []
    try:
        _encode(value, out, 0)
    except RecursionError:
        raise ValueFormatError("value nested too deeply") from None
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0

    def take(self, size: int) -> bytes:
        end = self.position + size
        if end > len(self.data):
            raise ValueFormatError("truncated value")
        chunk = self.data[self.position : end]
        self.position = end
        return chunk

    def count(self) -> int:
        return _COUNT.unpack(self.take(4))[0]

    def value(self, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise ValueFormatError("value nested too deeply")
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            try:
                return int(self.take(self.count()).decode("ascii"), 16)
            except (UnicodeDecodeError, ValueError):
                raise ValueFormatError("bad int") from None
        if tag == b"f":
            return _DOUBLE.unpack(self.take(8))[0]
        if tag == b"c":
            return complex(_DOUBLE.unpack(self.take(8))[0], _DOUBLE.unpack(self.take(8))[0])
        if tag == b"s":
            try:
                return self.take(self.count()).decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise ValueFormatError("bad str") from None
        if tag == b"b":
            return self.take(self.count())
        if tag in (b"l", b"t", b"S", b"z"):
            # Each item takes at least one byte, so a count larger than what is left is a lie.
            size = self.count()
            if size > len(self.data) - self.position:
                raise ValueFormatError("truncated value")
            items = [self.value(depth + 1) for _ in range(size)]
            try:
                if tag == b"l":
                    return items
                if tag == b"t":
                    return tuple(items)
                return set(items) if tag == b"S" else frozenset(items)
            except TypeError as error:  # an unhashable member
                raise ValueFormatError(str(error)) from None
        if tag == b"d":
            size = self.count()
            if size > len(self.data) - self.position:
                raise ValueFormatError("truncated value")
            result = {}
            for _ in range(size):
                key = self.value(depth + 1)
                try:
                    result[key] = self.value(depth + 1)
                except TypeError as error:
                    raise ValueFormatError(str(error)) from None
            return result
        raise ValueFormatError(f"unknown tag {tag!r}")


def decode_value(data: bytes) -> object:
    """Bytes -> a value built from builtin types only (the trusted side's half); exactly one value."""
    reader = _Reader(data)
    value = reader.value(0)
    if reader.position != len(data):
        raise ValueFormatError("trailing bytes after the value")
    return value


def read_frame(fd: int) -> bytes | None:
    """One frame from a blocking fd; None at end of file."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    return _read_exact(fd, length) if length else b""


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, payload: bytes) -> None:
    data = HEADER.pack(len(payload)) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _reply(fd: int, *message: object) -> None:
    write_frame(fd, encode_value(message))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


CANDIDATE = "main.py"  # the file name the candidate's code runs under
_candidate_source = ""  # kept for the lines of its traceback


def _load(source: str, name: str) -> dict:
    global _candidate_source
    _candidate_source = source
    namespace: dict = {"__name__": name, "__builtins__": __builtins__}
    sys.argv = [CANDIDATE]
    exec(compile(source, CANDIDATE, "exec"), namespace)
    return namespace


def user_traceback(error: BaseException) -> str:
    """The candidate's traceback: its own frames (main.py) with their lines and the error line; none of this
    runner's frames, nor the standard library's, whose file names say where rlpipe and Python live on the host.
    (Imported here, on the error path only: a child's start-up stays without them.)"""
    import linecache
    import traceback

    linecache.cache[CANDIDATE] = (len(_candidate_source), None, _candidate_source.splitlines(True), CANDIDATE)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == CANDIDATE]
    head = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) if frames else ""
    return head + "".join(traceback.format_exception_only(type(error), error))


def _serve(requests: int, replies: int) -> None:
    """Protocol: ("load", source, entry_point) -> ("loaded",) | ("error", text); then each
    ("call", args, kwargs) -> ("value", v) | ("raised", type_name, text) | ("unencodable", text)."""
    raw = read_frame(requests)
    if raw is None:
        return
    _, source, entry_point = decode_value(raw)
    try:
        # Not "__main__": HumanEval's own harness executes the program in a dict whose __name__ resolves
        # to "builtins", so `if __name__ == "__main__":` blocks (doctest runs, input() prompts) stay off.
        namespace = _load(source, "__candidate__")
        function = namespace.get(entry_point)
        if not callable(function):
            _reply(replies, "error", f"NameError: entry point {entry_point!r} is not defined")
            return
    except BaseException as error:  # SystemExit included: a program that exits on import did not load
        _reply(replies, "error", _describe(error))
        return
    _reply(replies, "loaded")
    while True:
        raw = read_frame(requests)
        if raw is None:
            return
        _, args, kwargs = decode_value(raw)
        try:
            result = function(*args, **kwargs)
        except BaseException as error:
            _reply(replies, "raised", type(error).__name__, _describe(error))
            continue
        try:
            encoded = encode_value(result)
        except ValueFormatError as error:
            _reply(replies, "unencodable", str(error))
            continue
        write_frame(replies, b"t" + _COUNT.pack(2) + encode_value("value") + encoded)


def _script(requests: int) -> None:
    raw = read_frame(requests)
    os.close(requests)
    source = decode_value(raw)[1] if raw else ""
    _load(source, "__main__")


def _exit_code(error: SystemExit) -> int:
    code = error.code
    if code is None:
        return 0
    if type(code) is int:
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:
        pass
    return 1


def _finish(code: int) -> None:
    """Leave like an interpreter would (threads joined, atexit run, buffers flushed), then _exit: a
    forked child must never unwind into the zygote's loop."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        if "atexit" in sys.modules:
            sys.modules["atexit"]._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def run_mode(mode: str) -> None:
    """Run the job in this process and exit with its status (never returns)."""
    code = 0
    try:
        if mode == "serve":
            _serve(3, 4)
        elif mode == "script":
            _script(3)
        elif mode == "probe":
            import json  # noqa: F401 - proves the standard library is readable from inside the sandbox
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException as error:
        try:
            sys.stderr.write(user_traceback(error))
        except BaseException:
            pass
        code = 1
    _finish(code)


# -- isolation applied by the job's own process (exec path and zygote path alike) -------------------


def isolate(setup: dict, cpu_budget_s: float, workdir: str) -> None:
    """Join the job's cgroups, enter its file view, lower the rlimits, drop to the job's uid, then restrict
    what it may open (Landlock) and call (seccomp): in that order, because joining a root-owned cgroup,
    chroot and changing uid need root, the rlimits are meant for the job only, and the two restrictions
    would refuse the steps before them. `workdir` is the job's directory as it sees it."""
    import resource

    pid = str(os.getpid()).encode()
    for path in setup.get("procs_files", ()):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)
    if setup.get("setsid"):
        os.setsid()
    if setup.get("root"):
        os.chroot(setup["root"])
        os.chdir("/")
    limits = setup["limits"]
    cpu = max(1, int(cpu_budget_s + 0.999)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for name in ("RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_NPROC"):
        resource.setrlimit(getattr(resource, name), (limits[name], limits[name]))
    uid = setup.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if setup.get("landlock"):
        restrict_files(setup["landlock"], workdir)
    if setup.get("seccomp"):
        install_seccomp(setup["seccomp"])


# -- Landlock and seccomp, applied by the job's process to itself (the numbers are the kernel's ABI) -------

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
ACCESS_EXECUTE, ACCESS_WRITE_FILE, ACCESS_READ_FILE, ACCESS_READ_DIR = 1, 2, 4, 8
ACCESS_TRUNCATE = 1 << 14
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


_CTYPES: tuple | None = None


def _libc():  # noqa: ANN202 - (ctypes, the C library, struct sock_fprog)
    """ctypes, loaded on first use so that an exec'd job's start stays lean, and once: the fork server loads it
    before its first fork, so its children only make the system calls."""
    global _CTYPES
    if _CTYPES is None:
        import ctypes

        class Program(ctypes.Structure):  # struct sock_fprog
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

        _CTYPES = (ctypes, ctypes.CDLL(None, use_errno=True), Program)
    return _CTYPES


def _no_new_privs(libc) -> None:  # noqa: ANN001
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")


def install_seccomp(program: bytes) -> None:
    """Apply a seccomp filter (a sock_filter array) to this process and everything it starts."""
    ctypes, libc, Program = _libc()
    _no_new_privs(libc)
    code = Program(len(program) // 8, program)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(code), 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"seccomp filter not installed: {os.strerror(error)}")


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers (0: none, or refused by a filter)."""
    ctypes, libc, _ = _libc()
    version = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(0, version)


def restrict_files(view: dict, workdir: str) -> None:
    """Landlock: from here on this process (and all it starts) may read and execute below `view["read"]`,
    read and write the files `view["devices"]`, do anything below `workdir`, and open nothing else.
    With ABI 4 it may not bind or connect TCP; with ABI 6 it may not signal processes outside its own
    domain nor connect to abstract UNIX sockets made outside it."""
    ctypes, libc, _ = _libc()
    abi = int(view["abi"])
    handled_fs = (1 << 13) - 1  # ABI 1: execute ... make_sym
    handled_fs |= (1 << 13) if abi >= 2 else 0  # refer
    handled_fs |= ACCESS_TRUNCATE if abi >= 3 else 0
    handled_fs |= (1 << 15) if abi >= 5 else 0  # ioctl on devices
    attr = [handled_fs]
    if abi >= 4:
        attr.append(1 | 2)  # bind and connect TCP
    if abi >= 6:
        attr.append(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    packed = b"".join(value.to_bytes(8, sys.byteorder) for value in attr)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, packed, ctypes.c_size_t(len(packed)), ctypes.c_uint32(0))
    if ruleset < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"landlock_create_ruleset: {os.strerror(error)}")
    file_rw = ACCESS_READ_FILE | ACCESS_WRITE_FILE | (ACCESS_TRUNCATE if abi >= 3 else 0)
    rules = [(path, ACCESS_EXECUTE | ACCESS_READ_FILE | ACCESS_READ_DIR) for path in view["read"]]
    rules += [(path, file_rw) for path in view["devices"]] + [(workdir, handled_fs)]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent, or not reachable by this uid: nothing to allow
            try:
                # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} (packed)
                rule = access.to_bytes(8, sys.byteorder) + fd.to_bytes(4, sys.byteorder, signed=True)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
                    error = ctypes.get_errno()
                    raise OSError(error, f"landlock_add_rule {path}: {os.strerror(error)}")
            finally:
                os.close(fd)
        _no_new_privs(libc)
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"landlock_restrict_self: {os.strerror(error)}")
    finally:
        os.close(ruleset)


# -- the fork server ------------------------------------------------------------------------------


# Modules most candidate programs import (HumanEval prompts start with `from typing import List`);
# importing them once in the zygote instead of in every child cut a job's CPU by about a third. They hold
# no job data. `random` reseeds itself in every forked child (os.register_at_fork).
PRELOAD = ("typing", "math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string")
PRELOAD += ("random", "hashlib")


def _preload() -> None:
    import gc

    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:
            pass
    # Pre-fork servers freeze the heap they share: a child's collections then never walk (and so never
    # copy-on-write) the zygote's objects.
    gc.collect()
    gc.freeze()


def _zygote(control_fd: int) -> None:
    """Protocol on a SOCK_SEQPACKET socket: first ("setup", dict) -> ("ready",); then each
    ("fork", mode, cpu_budget_s, workdir) with the job's fds attached -> ("pid", pid) at once and
    ("exit", pid, code) when that child has been reaped. End of input ends the zygote."""
    import ctypes
    import select
    import signal
    import socket

    libc = ctypes.CDLL(None)
    # Orphans of a job (a daemonized grandchild) become ours, so their zombies are reaped here too.
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL: a killed worker takes its fork server along
    control = socket.socket(fileno=control_fd)
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    message, _, _, _ = socket.recv_fds(control, 1 << 16, 0)
    _, setup = decode_value(message)
    _libc()  # for the children's Landlock and seccomp calls; before _preload freezes the heap
    _preload()
    control.send(encode_value(("ready",)))
    jobs: set[int] = set()
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    while True:
        events = dict(poller.poll())
        if wake_read in events:
            while True:
                try:
                    if not os.read(wake_read, 4096):
                        break
                except BlockingIOError:
                    break
        # Reap on every wake-up: zombies count against the pids cgroup until reaped.
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in jobs:
                jobs.discard(pid)
                control.send(encode_value(("exit", pid, os.waitstatus_to_exitcode(status))))
        if control.fileno() in events:
            message, fds, _, _ = socket.recv_fds(control, 1 << 16, 8)
            if not message:
                return
            _, mode, cpu_budget_s, workdir = decode_value(message)
            pid = os.fork()
            if pid == 0:
                _zygote_child(
                    mode, fds, setup, cpu_budget_s, workdir, (control.fileno(), wake_read, wake_write)
                )
            for fd in fds:
                os.close(fd)
            jobs.add(pid)
            control.send(encode_value(("pid", pid)))


def _zygote_child(
    mode: str, fds: list, setup: dict, cpu_budget_s: float, workdir: str, private: tuple
) -> None:
    import signal

    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in private:
            os.close(fd)
        zygote = os.getppid()
        isolate(setup, cpu_budget_s, workdir)
        # Changing uid cleared any parent-death signal; a job whose fork server dies is killed with it.
        sys.modules["ctypes"].CDLL(None).prctl(1, 9, 0, 0, 0)
        if os.getppid() != zygote:
            os._exit(126)
        # The job's fds become 0..n; move them out of that range first so dup2 never clobbers one.
        high = [os.dup(fd) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(len(high), 65536)
        os.chdir(workdir)
    except BaseException as error:
        try:
            os.write(2, f"sandbox child setup failed: {error!r}\n".encode())
        finally:
            os._exit(126)
    run_mode(mode)


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.argv = sys.argv[:1]
    if mode == "zygote":
        _zygote(3)
    else:
        run_mode(mode)
