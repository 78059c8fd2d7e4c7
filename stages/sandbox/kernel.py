"""The kernel calls the sandbox makes that Python 3.11's os module lacks (ctypes): unshare, mount, umount2,
mount_setattr. Each raises OSError naming the call and the path on failure."""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share this number


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    result = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(result, f"mount {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def set_mount_attr(path: str, attr_set: int, attr_clr: int) -> None:
    """mount_setattr(2) on `path` and every mount below it, in one system call."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")
