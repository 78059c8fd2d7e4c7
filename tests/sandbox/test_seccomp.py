"""The job seccomp filter (stages/sandbox/seccomp.py), checked two ways that do not rely on its own code:

- its BPF program is run by a small interpreter written here from the classic-BPF spec, on system call
  numbers written here from the kernel's tables, for both architectures: what it returns for each rule;
- in a forked child of the test (as root, nothing else affected), each rule's system call is made with
  arguments the kernel rejects harmlessly, first without the filter (the kernel's own answer: anything but
  EPERM, or the case is skipped as unprovable here) and then under it (EPERM). The same probes run as
  attack programs inside the sandbox in test_attacks.py.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

import pytest

from stages.sandbox import _runner
from stages.sandbox.seccomp import JOB_RULES, job_filter

from .test_attacks import SECCOMP_PROBES

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
SECCOMP_DATA = struct.Struct("=iIQ6Q")
ALLOW, KILL_PROCESS = 0x7FFF0000, 0x80000000


def errno_return(number: int) -> int:
    return 0x00050000 | number


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = (0,) * 6) -> int:
    """Classic BPF as seccomp runs it: accumulator A, absolute word loads from seccomp_data, conditional
    jumps relative to the next instruction, a return ends the program."""
    data = SECCOMP_DATA.pack(nr, arch, 0, *args)
    code = [struct.unpack_from("=HBBI", program, offset) for offset in range(0, len(program), 8)]
    accumulator, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif op == 0x15:  # BPF_JMP | BPF_JEQ | BPF_K
            pc += 1 + (jt if accumulator == k else jf)
        elif op == 0x35:  # BPF_JGE
            pc += 1 + (jt if accumulator >= k else jf)
        elif op == 0x45:  # BPF_JSET
            pc += 1 + (jt if accumulator & k else jf)
        elif op == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {op:#x} at {pc}")


# From arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
X86_64 = (0xC000003E, {"read": 0, "socket": 41, "socketpair": 53, "clone": 56, "ptrace": 101, "mount": 165,
                       "umount2": 166, "pivot_root": 155, "bpf": 321, "perf_event_open": 298, "keyctl": 250,
                       "add_key": 248, "unshare": 272, "setns": 308, "kexec_load": 246, "init_module": 175,
                       "finit_module": 313, "io_uring_setup": 425, "clone3": 435, "process_vm_readv": 310,
                       "fsopen": 430, "getpid": 39})
AARCH64 = (0xC00000B7, {"read": 63, "socket": 198, "socketpair": 199, "clone": 220, "ptrace": 117, "mount": 40,
                        "umount2": 39, "pivot_root": 41, "bpf": 280, "perf_event_open": 241, "keyctl": 219,
                        "add_key": 217, "unshare": 97, "setns": 268, "kexec_load": 104, "init_module": 105,
                        "finit_module": 273, "io_uring_setup": 425, "clone3": 435, "process_vm_readv": 270,
                        "fsopen": 430, "getpid": 172})
DENIED = ("ptrace", "mount", "umount2", "pivot_root", "bpf", "perf_event_open", "keyctl", "add_key", "unshare",
          "setns", "kexec_load", "init_module", "finit_module", "io_uring_setup", "process_vm_readv", "fsopen")
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
SIGCHLD, CLONE_VM, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 17, 0x100, 0x10000000, 0x40000000, 0x20000


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_program_denies_each_rule_and_allows_the_rest(arch: str) -> None:
    audit_arch, numbers = X86_64 if arch == "x86_64" else AARCH64
    program = job_filter(arch)

    def verdict(name: str, *args: int) -> int:
        return run_bpf(program, numbers[name], audit_arch, (*args, *(0,) * (6 - len(args))))

    for name in DENIED:
        assert verdict(name) == errno_return(errno.EPERM), name
    assert verdict("read") == ALLOW and verdict("getpid") == ALLOW
    for call in ("socket", "socketpair"):
        assert verdict(call, AF_UNIX, 1) == ALLOW
        for family in (AF_INET, AF_INET6, AF_NETLINK, AF_PACKET):
            assert verdict(call, family, 1) == errno_return(errno.EPERM), (call, family)
        # only the low 32 bits are the family (an int): high garbage must not turn AF_INET into something else
        assert verdict(call, (1 << 32) | AF_INET, 1) == errno_return(errno.EPERM)
    assert verdict("clone", SIGCHLD) == ALLOW  # fork
    assert verdict("clone", CLONE_VM | SIGCHLD) == ALLOW  # threads, vfork
    for flag in (CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS):
        assert verdict("clone", flag | SIGCHLD) == errno_return(errno.EPERM)
    assert verdict("clone3") == errno_return(errno.ENOSYS)  # the C library falls back to clone
    # another ABI: the other architecture's value, and x86_64's x32 numbers
    other = AARCH64[0] if arch == "x86_64" else X86_64[0]
    assert run_bpf(program, numbers["read"], other) == KILL_PROCESS
    if arch == "x86_64":
        assert run_bpf(program, 0x40000000 | numbers["read"], audit_arch) == KILL_PROCESS


def test_every_rule_of_the_issue_has_a_probe() -> None:
    assert set(JOB_RULES) - {"io_uring"} <= set(SECCOMP_PROBES)
    assert {"socket", "clone"} <= set(SECCOMP_PROBES)


def probe_errno(expression: str, filtered: bool) -> int:
    """Evaluate a probe in a forked child (under the job filter when `filtered`): 0 for success, else errno."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            if filtered:
                _runner.install_seccomp(job_filter())
            libc = ctypes.CDLL(None, use_errno=True)
            ctypes.set_errno(0)
            result = eval(expression, {"libc": libc})
            os.write(write_end, str(ctypes.get_errno() if result == -1 else 0).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    return int(text)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probes name x86_64 system call numbers")
@pytest.mark.skipif(os.geteuid() != 0, reason="as root the kernel's own answer to these calls is not EPERM")
@pytest.mark.parametrize("rule", list(SECCOMP_PROBES))
def test_the_kernel_refuses_each_rule_only_under_the_filter(rule: str) -> None:
    expression = SECCOMP_PROBES[rule]
    unfiltered = probe_errno(expression, filtered=False)
    if unfiltered == errno.EPERM:
        pytest.skip(f"{rule}: this kernel refuses the probe with EPERM by itself, so the filter cannot be told apart")
    assert probe_errno(expression, filtered=True) == errno.EPERM, rule


def test_unix_sockets_and_processes_still_work_under_the_filter() -> None:
    assert probe_errno("libc.socket(1, 1, 0)", filtered=True) == 0
    # clone3 fails with ENOSYS, and the C library's fork falls back to clone: a subprocess still starts
    assert probe_errno("__import__('subprocess').run(['true']).returncode", filtered=True) == 0
    if platform.machine() == "x86_64":
        assert probe_errno("libc.syscall(435, None, 0)", filtered=True) == errno.ENOSYS
