"""The seccomp filter every job runs under, as a classic BPF program (no libseccomp: the filter is small).

Defence in depth on top of the namespaces: whatever mode a job runs in, it cannot create a socket outside
AF_UNIX (no network even where there is no network namespace), ptrace or read another process's memory,
mount anything, load BPF programs, open perf events, use the kernel keyring, enter or create namespaces
(unshare, setns, clone with CLONE_NEW* flags), kexec, or load kernel modules; io_uring is refused too,
since its socket operations bypass a system-call filter. A refused call fails with EPERM, the errno
Docker's profile uses, so programs see an ordinary permission error. clone3 passes its flags in memory a
filter cannot read: it fails with ENOSYS and the C library falls back to clone, whose flags it can read.
A system call of another ABI (x32, a 32-bit compat call) kills the process: its numbers differ.

`job_filter()` builds the program; `_runner.install_seccomp` applies it (in the job's own process, right
before the candidate's code or the exec that starts it), and bubblewrap takes the same bytes with
`--seccomp FD`. `program()` also builds other filters from the same parts (the tests' Docker-like profile).
"""

from __future__ import annotations

import errno
import platform
import struct

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k} in native byte order.
INSTRUCTION = struct.Struct("=HBBI")
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ALLOW = 0x80000000, 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# struct seccomp_data: nr (u32), arch (u32), instruction pointer (u64), args[6] (u64, low half first).
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME is clone3/unshare only).
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# System call numbers of the two architectures we run on (x86_64's table; aarch64's is asm-generic's).
ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "socket": 41, "socketpair": 53, "clone": 56, "ptrace": 101, "pivot_root": 155, "mount": 165,
            "umount2": 166, "init_module": 175, "delete_module": 176, "kexec_load": 246, "add_key": 248,
            "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
            "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
            "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "io_uring_setup": 425,
            "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
            "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438,
            "mount_setattr": 442,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "umount2": 39, "mount": 40, "pivot_root": 41, "unshare": 97, "kexec_load": 104, "init_module": 105,
            "delete_module": 106, "ptrace": 117, "socket": 198, "socketpair": 199, "add_key": 217,
            "request_key": 218, "keyctl": 219, "clone": 220, "perf_event_open": 241, "open_by_handle_at": 265,
            "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "finit_module": 273, "bpf": 280,
            "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442,
        },
    ),
}

# What a job may not do, by rule: each rule's system calls fail with EPERM.
JOB_RULES: dict[str, tuple[str, ...]] = {
    "ptrace": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"),
    "mount": ("mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
              "fspick", "mount_setattr", "open_by_handle_at"),
    "bpf": ("bpf",),
    "perf_event_open": ("perf_event_open",),
    "keyctl": ("keyctl", "add_key", "request_key"),
    "namespaces": ("unshare", "setns"),
    "kexec": ("kexec_load", "kexec_file_load"),
    "modules": ("init_module", "finit_module", "delete_module"),
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
}


class SeccompUnsupported(OSError):
    """No filter for this machine's architecture."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return INSTRUCTION.pack(code, jt, jf, k)


def _errno(number: int) -> int:
    return SECCOMP_RET_ERRNO | number


def program(denied: tuple[str, ...], unix_sockets_only: bool, clone_namespaces: bool,
            arch: str | None = None) -> bytes:
    """A filter program (the bytes of a sock_filter array): `denied` system calls fail with EPERM;
    socket/socketpair of any family but AF_UNIX too when `unix_sockets_only`; clone with a namespace flag
    too when `clone_namespaces`, and clone3 with ENOSYS; everything else is allowed. Every check is a
    compare and a return, so no jump is longer than one instruction."""
    arch = arch or platform.machine()
    if arch not in ARCHES:
        raise SeccompUnsupported(f"no seccomp filter for architecture {arch!r}")
    audit_arch, numbers = ARCHES[arch]
    code = [
        _op(LD_W_ABS, OFFSET_ARCH),
        _op(JEQ_K, audit_arch, jt=1),
        _op(RET_K, RET_KILL_PROCESS),
        _op(LD_W_ABS, OFFSET_NR),
    ]
    if arch == "x86_64":  # the x32 ABI shares the architecture value; its numbers carry this bit
        code += [_op(JGE_K, X32_SYSCALL_BIT, jf=1), _op(RET_K, RET_KILL_PROCESS)]
    for name in denied:
        code += [_op(JEQ_K, numbers[name], jf=1), _op(RET_K, _errno(errno.EPERM))]
    if unix_sockets_only:
        for name in ("socket", "socketpair"):
            code += [
                _op(JEQ_K, numbers[name], jf=4),
                _op(LD_W_ABS, OFFSET_ARG0),  # the address family (an int: the low half)
                _op(JEQ_K, AF_UNIX, jf=1),
                _op(RET_K, RET_ALLOW),
                _op(RET_K, _errno(errno.EPERM)),
            ]
    if clone_namespaces:
        code += [
            _op(JEQ_K, numbers["clone3"], jf=1),
            _op(RET_K, _errno(errno.ENOSYS)),
            _op(JEQ_K, numbers["clone"], jf=4),
            _op(LD_W_ABS, OFFSET_ARG0),  # clone's flags, on both architectures
            _op(JSET_K, CLONE_NAMESPACE_FLAGS, jf=1),
            _op(RET_K, _errno(errno.EPERM)),
            _op(RET_K, RET_ALLOW),
        ]
    code.append(_op(RET_K, RET_ALLOW))
    return b"".join(code)


def job_filter(arch: str | None = None) -> bytes:
    """The filter of every job (see the module docstring)."""
    denied = tuple(name for names in JOB_RULES.values() for name in names)
    return program(denied, unix_sockets_only=True, clone_namespaces=True, arch=arch)
