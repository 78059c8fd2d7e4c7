"""A free TCP port for a server a test starts (Prefect, moto's S3, SandboxFusion's API): the kernel picks it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
