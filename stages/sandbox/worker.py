"""A warm scoring worker: one long-lived process that scores jobs one at a time for the pool.

Started by the pool (`python -m stages.sandbox.worker`) with a clean environment. It reads the config,
sets up its isolation once (namespaces, cgroups: isolation.py), reports the active layers, then answers
job frames with result frames on its stdin/stdout. Each job's untrusted code runs in a fresh child of
this process; the worker itself only ever runs trusted code (the judge and the dataset's test code).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from schemas.config import ScoreConfig

from ._runner import read_frame, write_frame
from .isolation import SpawnError, choose_isolation
from .process import probe_interpreter, run_probe
from .scoring import run_code_request, score_job


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
        isolation = choose_isolation(cfg, hello["slot"], hello["owner_pid"])
        isolation.start_worker()
        isolation.python = probe_interpreter(isolation, cfg.python)
        isolation.start_zygote()
        if isolation.zygote is not None:
            status, message = run_probe(isolation, exec_=False)
            if status != 0:
                raise SpawnError(f"the fork server's children do not start: exit {status} {message}")
    except Exception as error:
        write_frame(replies, json.dumps({"fatal": f"{type(error).__name__}: {error}"}).encode())
        return
    write_frame(replies, json.dumps({"isolation": isolation.name, "layers": isolation.layers()}).encode())
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
