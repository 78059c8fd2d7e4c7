"""How an rlpipe process ends: Python's exit work, then `os._exit`, so no C++ static destructor runs; and how a
child is made to end with the process that started it (`die_with_parent`).

A library's thread still joinable when the interpreter tears down (Gloo's, vLLM's, DeepSpeed's) makes a C++
destructor call std::terminate ("terminate called without an active exception", SIGABRT): a process that had
already written its work and decided its exit code then dies by a signal. Seen in stages (exit code 2 turned
into -6) and in a DeepSpeed rank after its checkpoint was written. Standard library only: the stage server
(flows/runner/forkserver.py) imports it.

A child started with `preexec_fn=die_with_parent(os.getpid())` gets the kernel's parent-death signal (SIGKILL),
set before it runs anything: it ends with its starter whatever ends that (SIGTERM, SIGINT, SIGKILL, an exception),
also when it leads a process group or session of its own (which a terminal's Ctrl-C or a group kill does not
reach). What it starts in turn is its own business (flows/deploy.py's `GroupReaper` for `rlpipe server`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1
# Looked up once, here: between fork and exec a child only calls it (a dlopen there could wait forever on a lock
# another thread of the parent held when it forked). Linux only: elsewhere children get no parent-death signal.
_prctl = getattr(ctypes.CDLL(None), "prctl", None)
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's


def release_freed_memory() -> None:
    """Give the heap memory that freed objects left behind back to the OS (glibc's `malloc_trim`; elsewhere a
    no-op). Frees of sizes below glibc's mmap threshold stay in the heap, fragmented, and count in the process's
    RSS: a backward's activations, ~1 GB of the train stage's peak on SmolLM2-135M (benchmarks/train.py), and
    each weight reload of the warm engine, whose RSS grew ~2.9 MiB per iteration without it (docs/measurements.md,
    soak). A few milliseconds per call."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def end_process(code: int) -> NoReturn:
    """Wait for non-daemon threads and run the atexit handlers as the interpreter does at exit, flush the
    standard streams, and leave with `code` whatever those raise."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does first at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def die_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn` for a child of process `parent` (the caller's `os.getpid()`): SIGKILL when the thread that
    started it ends (the kernel's parent-death signal), or at once if that already happened."""

    def arm() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm
