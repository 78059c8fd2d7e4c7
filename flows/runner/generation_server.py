"""The run's generation server as the flow sees it: it ends when the flow that drives the run ends.

The server (stages/generation/server.py) is started by the first stage that needs the warm engine, not by the
flow: a run that never generates with vLLM (the HF backend, the stand-in drills) then never pays for importing
vLLM in one more process (6-8 s of a core here), and the stage that starts it is also what brings back a killed
one. The `loop` flow stops it when the run ends (done, failed or interrupted), so its memory comes back at once
rather than after `generate.warm_engine_idle_s`. With deployments the server lives on the gpu pool's machine,
which this process cannot reach: there the idle timeout ends it, or the run lease once its holder died (the
server follows the run's driver, server.py `RunDriverWatch`; so does a local one whose flow was killed). No
Prefect here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from stages.generation.client import server_address, stop_server
from storage.run import Run


def stop_run_server(run: Run) -> bool:
    """End the run's generation server on this machine; False when none was running."""
    return stop_server(server_address(run.layout.run_dir, run.config.generate, run.config.device))


@contextlib.contextmanager
def generation_server(run: Run) -> Iterator[None]:
    """The run's generation server may serve the stages run inside this block, and ends with it."""
    try:
        yield
    finally:
        stop_run_server(run)
