"""Every `RLPIPE_*` environment variable rlpipe reads, in one place, each with its default and meaning.

The run's own settings are the config (schemas/config.py); these are the machine's: where a storage root is
when no argument names one, where caches go, how a flow dispatches its stages. Each is read when asked for,
not at import, so a test or a worker that sets one sees it. `rlpipe` documents them (docs/configuration.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = "./rlpipe-data"  # the storage root when no --root, $RLPIPE_ROOT or config `root:` names one


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None
    meaning: str

    def get(self) -> str | None:
        return os.environ.get(self.name) or self.default


ROOT = Variable("RLPIPE_ROOT", None, "storage root when no --root is given: a folder or s3://bucket/prefix")
CACHE = Variable("RLPIPE_CACHE", "~/.cache/rlpipe",
                 "this machine's cache: converted models, fetched checkpoints, scratch, compiled templates")
S3_ENDPOINT_URL = Variable("RLPIPE_S3_ENDPOINT_URL", None, "endpoint of an S3-compatible server (MinIO, moto)")
DISPATCH = Variable("RLPIPE_DISPATCH", "local",
                    "where a flow runs its stages: `local` (child processes) or `deployments` (workers)")
DISPATCH_POLL_S = Variable("RLPIPE_DISPATCH_POLL_S", "2", "seconds between polls of a dispatched stage's flow run")
STAGE_LOCK_WAIT_S = Variable("RLPIPE_STAGE_LOCK_WAIT_S", str(6 * 3600),
                             "seconds a flow's stage waits for another process running the same stage")
STAGE_FORK = Variable("RLPIPE_STAGE_FORK", "1", "0: start each local stage as a fresh interpreter, not a fork")
HOME = Variable("RLPIPE_HOME", None, "the rlpipe checkout a Prefect worker runs flows from")
LANE_CPUS = Variable("RLPIPE_LANE_CPUS", None,
                     "CPU cores per lane for local stages, e.g. `rollout=0;train=1` or `rollout=0-3;train=4,5` "
                     "(taskset's pinning: a stand-in for two machines); unset: no pinning")
VERBOSE = Variable("RLPIPE_VERBOSE", "0", "1: libraries' own log lines (vLLM's) on the console too, not only in each "
                   "stage's log file (`rlpipe run --verbose` sets it)")
# Set by the train stage for its DeepSpeed ranks, never by a person: "<pid>:<start time>" of the stage.
DS_STAGE = Variable("RLPIPE_DS_STAGE", None, "set by the train stage for its DeepSpeed ranks (internal)")

VARIABLES = (ROOT, CACHE, S3_ENDPOINT_URL, DISPATCH, DISPATCH_POLL_S, STAGE_LOCK_WAIT_S, STAGE_FORK, HOME, LANE_CPUS,
             VERBOSE, DS_STAGE)


def cache_dir() -> Path:
    """This machine's cache root: never part of a run, so deleting it costs only time."""
    return Path(str(CACHE.get())).expanduser()


def stage_fork_enabled() -> bool:
    return STAGE_FORK.get() != "0"


def lane_cpus() -> dict[str, set[int]]:
    """`RLPIPE_LANE_CPUS` parsed: lane -> the cores its stages may run on ({} when unset). Lanes are separated
    by `;`, cores listed as taskset -c does (`0`, `0-3`, `0,2`); raises ValueError naming the variable."""
    text = LANE_CPUS.get()
    lanes: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        lane, _, cores = part.partition("=")
        try:
            cpus = set()
            for span in cores.split(","):
                first, _, last = span.strip().partition("-")
                cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            cpus = set()
        if not lane.strip() or not cpus:
            raise ValueError(f"{LANE_CPUS.name}={text!r}: {part!r} is not `lane=cores` (e.g. `rollout=0;train=1`)")
        lanes[lane.strip()] = cpus
    return lanes


def seconds(variable: Variable) -> float:
    return float(str(variable.get()))


def set_environment(values: dict[str, str]) -> Callable[[], None]:
    """Put `values` in os.environ (which every process started from now on copies); returns what puts each
    variable back as it was (unset again if it was unset). A function, not a generator, so that nothing is
    put back before it is called."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return restore


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs (`set_environment`), then as before."""
    restore = set_environment(values)
    try:
        yield
    finally:
        restore()
