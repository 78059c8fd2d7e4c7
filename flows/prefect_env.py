"""Prefect settings rlpipe sets before Prefect is imported.

With no `PREFECT_API_URL`, the flow process starts a temporary local server (~15 s) and stops it at exit;
users with a server or Prefect Cloud set `PREFECT_API_URL` and these defaults step aside. Telemetry is off.
Only the flow process imports Prefect: stage processes never do, so they never start a server.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_UI_ENABLED": "false",
}


def configure_prefect() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
