"""How an rlpipe process ends: Python's exit work, then `os._exit`, so no C++ static destructor runs.

A library's thread still joinable when the interpreter tears down (Gloo's, vLLM's, DeepSpeed's) makes a C++
destructor call std::terminate ("terminate called without an active exception", SIGABRT): a process that had
already written its work and decided its exit code then dies by a signal. Seen in stages (exit code 2 turned
into -6) and in a DeepSpeed rank after its checkpoint was written. Standard library only: the stage server
(flows/runner/forkserver.py) imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


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
