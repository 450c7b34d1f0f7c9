"""The control room: the daemon's Unix-socket API, its guard, and the peer check.

Names are loaded on first use, so that ``mlxctl`` (which needs only the client)
does not pay for importing uvicorn and starlette on every command.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PeerCredentials": "peercred", "is_authorized": "peercred", "peer_credentials": "peercred",
    "PEER_EXTENSION": "server", "SOCKET_PATH_LIMIT": "server", "ControlServer": "server",
    "SocketServer": "server",
    "bind_control_socket": "server", "check_socket_path": "server", "peer_guard": "server",
    "remove_socket_file": "server", "build_app": "app", "ControlClient": "client",
    "BlockingClient": "blocking", "DaemonView": "view",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
