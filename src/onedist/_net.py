"""Small network helpers shared by the backends and the launcher (no torch import)."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it).

    Binding to port 0 and closing leaves a short window in which another program could take the
    port; torchrun's ``--standalone`` has the same window. Callers that cannot tolerate it retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
