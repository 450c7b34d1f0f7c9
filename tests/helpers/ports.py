"""Free TCP ports for the daemons, routers and stages a test starts."""

from __future__ import annotations

import socket


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port free on ``host`` now (the default: on every address, as a user's is)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
