"""A warm scoring worker: one long-lived process that scores jobs one at a time for the pool.

Started by the pool (`python -m stages.sandbox.worker`) with a clean environment. It reads the config,
sets up its isolation once (namespaces, cgroups: isolation.py), reports the active layers, then answers
job frames with result frames on its stdin/stdout. Each job's untrusted code runs in a fresh child of
this process; the worker itself only ever runs trusted code (the judge and the dataset's test code).

The isolation mode is the configured one, or for `auto` the first of native, bwrap and uid that works here,
each proved by running a probe job in it (bubblewrap may be installed and still fail: a container's seccomp
profile refuses its namespaces); when none works the worker says why for each and the sandbox refuses.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from schemas.config import ScoreConfig

from ._runner import read_frame, write_frame
from .isolation import Isolation, SpawnError, candidate_modes, make_isolation
from .process import probe_interpreter, run_probe
from .scoring import run_code_request, score_job
from .zygote import ZygoteError


class NoIsolation(RuntimeError):
    """No isolation mode the config allows works on this machine; the message says why for each."""


def start_mode(mode: str, cfg: ScoreConfig, slot: int, owner_pid: int) -> Isolation:
    """Set up `mode` in this worker and prove it by running probe jobs (exec'd, and from the fork server)."""
    isolation = make_isolation(mode, cfg, slot, owner_pid)
    try:
        isolation.start_worker()
        isolation.python = probe_interpreter(isolation, cfg.python)
        isolation.start_zygote()
        if isolation.zygote is not None:
            status, message = run_probe(isolation, exec_=False)
            if status != 0:
                raise SpawnError(f"the fork server's children do not start: exit {status} {message}")
    except BaseException:
        isolation.close()
        raise
    return isolation


def start_isolation(cfg: ScoreConfig, slot: int, owner_pid: int) -> tuple[Isolation, list[str]]:
    """The first mode of `candidate_modes(cfg)` that works, and why each one before it did not; NoIsolation
    naming each failure when none works."""
    failures = []
    for mode in candidate_modes(cfg):
        try:
            return start_mode(mode, cfg, slot, owner_pid), failures
        except (OSError, SpawnError, ZygoteError) as error:
            failures.append(f"{mode}: {error}")
    raise NoIsolation("; ".join(failures))


def main() -> None:
    # The protocol owns the original stdin/stdout; anything else printing (a library warning) goes to
    # stderr instead of corrupting a frame.
    requests = os.dup(0)
    replies = os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    hello = json.loads(read_frame(requests) or b"{}")
    cfg = ScoreConfig.model_validate(hello["config"])
    try:
        isolation, passed_over = start_isolation(cfg, hello["slot"], hello["owner_pid"])
    except NoIsolation as error:
        write_frame(replies, json.dumps({"fatal": str(error), "refused": True}).encode())
        return
    except Exception as error:
        write_frame(replies, json.dumps({"fatal": f"{type(error).__name__}: {error}"}).encode())
        return
    ready = {"isolation": isolation.name, "layers": isolation.layers(), "passed_over": passed_over}
    write_frame(replies, json.dumps(ready).encode())
    try:
        while (raw := read_frame(requests)) is not None:
            job = json.loads(raw)
            try:
                if job.get("op") == "run":
                    result = run_code_request(job, cfg, isolation)
                else:
                    result = score_job(job, cfg, isolation)
            except Exception:  # a harness bug must not take the worker down with the whole batch
                result = {"harness_error": traceback.format_exc()[-2000:]}
            write_frame(replies, json.dumps(result).encode())
    finally:
        isolation.close()


if __name__ == "__main__":
    sys.exit(main())
